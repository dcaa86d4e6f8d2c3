"""Pre-launch checks: a graph that would hang or overflow is rejected before the kernel starts."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import GraphError
from .events import NO_EVENT
from .tables import ARG0, FAN_IN, OPCODE, SIGNAL_COUNT, SIGNAL_START, WAIT_EVENT, QueueTables


def find_cycle(producers: list[tuple[int, ...]]) -> list[int] | None:
    """A cycle of task ids in the dependency graph (each depends on the next), or None."""
    state = [0] * len(producers)  # 0 unseen, 1 on the stack, 2 done
    for root in range(len(producers)):
        if state[root]:
            continue
        stack = [(root, iter(producers[root]))]
        state[root] = 1
        while stack:
            node, it = stack[-1]
            for p in it:
                if state[p] == 1:
                    path = [n for n, _ in stack]
                    return path[path.index(p):]
                if state[p] == 0:
                    state[p] = 1
                    stack.append((p, iter(producers[p])))
                    break
            else:
                state[node] = 2
                stack.pop()
    return None


def check_acyclic(producers: list[tuple[int, ...]], describe=str) -> None:
    cycle = find_cycle(producers)
    if cycle is not None:
        names = " -> ".join(describe(t) for t in cycle + cycle[:1])
        raise GraphError(f"the task graph has a cycle: {names}")


@dataclass(frozen=True)
class Capacity:
    """What one kernel can hold: table sizes the device-side indices can address."""

    max_tasks: int = 2**31 - 1
    max_events: int = 2**31 - 1
    max_signals: int = 2**31 - 1
    max_args: int = 64
    max_heap_bytes: int = 2**40


def check_tables(t: QueueTables, capacity: Capacity = Capacity()) -> None:
    """Tables within capacity and self-consistent: every wait can be met by the signals that exist."""
    n = len(t.rows)
    for what, have, limit in [("tasks", n, capacity.max_tasks), ("events", t.num_events, capacity.max_events),
                              ("signals", len(t.signals), capacity.max_signals),
                              ("argument words per task", t.row_words - ARG0, capacity.max_args)]:
        if have > limit:
            raise GraphError(f"the graph needs {have} {what}; one kernel holds at most {limit}")
    if n and (t.rows[:, OPCODE].min() < 0 or t.rows[:, OPCODE].max() >= len(t.specs)):
        raise GraphError("a task has an opcode with no spec")
    if not np.array_equal(np.sort(t.queue), np.arange(n)):
        raise GraphError("the worker queues do not hold every task exactly once")
    for w in range(t.workers):
        if np.any(np.diff(t.worker_queue(w)) <= 0):
            raise GraphError(f"worker {w}'s queue is not in global order: the progress guarantee is lost")
    ends = t.rows[:, SIGNAL_START] + t.rows[:, SIGNAL_COUNT]
    if n and (t.rows[:, SIGNAL_START].min() < 0 or ends.max() > len(t.signals)):
        raise GraphError("a task's signal list lies outside the signal table")
    local = t.signals[t.signals[:, 0] == t.rank]
    raised = np.zeros(t.num_events, dtype=np.int64)
    np.add.at(raised, local[:, 1], local[:, 2])
    waits = t.rows[t.rows[:, WAIT_EVENT] != NO_EVENT]
    if t.world_size == 1 and len(waits):
        short = waits[raised[waits[:, WAIT_EVENT]] < waits[:, FAN_IN]]
        if len(short):
            ev = int(short[0, WAIT_EVENT])
            raise GraphError(f"event {ev} is raised by {int(raised[ev])} per run but a task waits for "
                             f"{int(short[0, FAN_IN])}: the kernel would hang")
