"""``touch``: an empty task ordered like a writer of a tensor.

It waits for the tensor's earlier writers and readers, and its later readers and writers wait for
it, but it moves no data: a join point in a graph, and the unit of the dispatch benchmarks (what a
task costs when its tile does nothing).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl  # noqa: F401 (a jit function's module must have it)

from .common import TaskType


@triton.jit
def touch_tile(base):
    """Nothing: the wait and signals around it are the whole task."""
    pass


def _reference(heap, task) -> None:
    pass


def touch(g, t):
    """One empty task that writes ``t`` as far as dependencies go; returns ``t``."""
    g.add_task(g.opcode(TOUCH), reads=(), writes=(t.region(0, t.rows, 0, t.cols),), bytes=0, flops=0)
    return t


def _example(g):
    return (g.touch(g.input("touch.t", (2, 8), torch.float32)),)


TOUCH = TaskType("touch", touch_tile, _reference, _example)
TASK_TYPES = (TOUCH,)
OPS = {"touch": touch}
