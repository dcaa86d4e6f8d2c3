"""Placement of tasks on workers.

The global order is program order: the key is fixed when the graph is built, the same on every rank,
and it is topological (a task only depends on earlier ones). Every worker runs its tasks in that
order, which is the progress guarantee of the device protocol: the earliest unfinished task in the
global order can always run. Policies only choose each task's worker.
"""
from __future__ import annotations

import heapq
from array import array
from dataclasses import dataclass
from itertools import chain

import numpy as np

from ..errors import GraphError
from .task import Tasks

POLICIES = ("round_robin", "critical_path")


@dataclass
class Placement:
    order: list[int]   # task ids in global order (program order)
    worker: list[int]  # worker of each task id


def place(tasks: Tasks, producers: list[tuple[int, ...]], workers: int, policy: str) -> Placement:
    if workers < 1:
        raise GraphError(f"a kernel needs at least one worker, got workers={workers}")
    if policy == "round_robin":
        return Placement(list(range(len(tasks))), [i % workers for i in range(len(tasks))])
    if policy == "critical_path":
        return _critical_path(tasks, producers, workers)
    raise GraphError(f"unknown placement policy {policy!r}; expected one of {', '.join(POLICIES)}")


def bottom_levels(tasks: Tasks, producers: list[tuple[int, ...]]) -> list[float]:
    """Length (in cost) of the longest path from each task to the end of the graph, itself included.

    Tasks are in program order, which is topological, so one backward sweep is enough.
    """
    cost = tasks.cost.tolist()  # the loop reads it once per edge: a list indexes faster than the array
    level = cost.copy()
    for tid in range(len(tasks) - 1, -1, -1):
        reach = level[tid]
        for p in producers[tid]:
            through = cost[p] + reach
            if through > level[p]:
                level[p] = through
    return level


def _critical_path(tasks: Tasks, producers: list[tuple[int, ...]], workers: int) -> Placement:
    """Workers by list scheduling: the ready task with the longest path to the end goes first, to the
    worker where it can start earliest; among equally early workers, the one that ran its last
    producer (so the wait disappears). The simulated start times only guide the choice of worker:
    each worker then runs its tasks in program order."""
    n = len(tasks)
    level = bottom_levels(tasks, producers)
    # The ready heap holds each task's rank in the order (-level, task id), computed once by a stable
    # sort: plain ints are cheaper to push and compare than (-level, task id) tuples, and the loop
    # below runs once per task.
    by_rank = np.argsort(-np.asarray(level, dtype=np.float64), kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[by_rank] = np.arange(n)
    cost = tasks.cost
    # Each task's consumers, one array cut by ``first_consumer``. The loop's int columns are typed
    # arrays, not lists: at 1M tasks, lists would be millions of int objects to allocate.
    missing = np.fromiter(map(len, producers), np.int64, n)
    flat = np.fromiter(chain.from_iterable(producers), np.int64, int(missing.sum()))
    consumers = _ints(np.repeat(np.arange(n), missing)[np.argsort(flat, kind="stable")])
    first_consumer = _ints(np.concatenate([[0], np.cumsum(np.bincount(flat, minlength=n))]))
    by_rank, rank, missing = _ints(by_rank), _ints(rank), _ints(missing)
    ready = [rank[t] for t in range(n) if not missing[t]]
    heapq.heapify(ready)
    free_at = [0.0] * workers
    idle = [(0.0, w) for w in range(workers)]  # (free time, worker); stale entries are skipped
    finish = array("d", bytes(8 * n))  # raw doubles: a million float objects would be new memory to fault in
    worker = [0] * n
    scheduled = 0
    heappush, heappop = heapq.heappush, heapq.heappop
    while ready:
        tid = by_rank[heappop(ready)]
        data_ready, last = 0.0, -1
        for p in producers[tid]:
            if finish[p] >= data_ready:
                data_ready, last = finish[p], p
        while idle[0][0] != free_at[idle[0][1]]:
            heappop(idle)
        w = idle[0][1]
        start = free_at[w] if free_at[w] > data_ready else data_ready
        if last >= 0 and free_at[worker[last]] <= start and data_ready <= start:
            w = worker[last]
        end = (free_at[w] if free_at[w] > data_ready else data_ready) + cost[tid]
        finish[tid] = free_at[w] = end
        heappush(idle, (end, w))
        worker[tid] = w
        scheduled += 1
        for c in consumers[first_consumer[tid]:first_consumer[tid + 1]]:
            missing[c] -= 1
            if not missing[c]:
                heappush(ready, rank[c])
    if scheduled != n:
        raise GraphError("the task graph has a cycle; run scheduler.checks.find_cycle for the tasks on it")
    return Placement(list(range(n)), worker)


def _ints(values: np.ndarray) -> array[int]:
    """A numpy int column as a typed array, for a Python loop that reads it an element at a time."""
    return array("q", values.astype(np.int64).tobytes())


DISPATCH_COST = 512.0   # a task's fixed cost, in bytes moved
FLOPS_PER_BYTE = 64.0   # the machine balance that turns flops into bytes' worth of time


def task_cost(bytes_moved: int, flops: int) -> float:
    """A task's time in the scheduler's unit (bytes moved at memory bandwidth): roofline plus dispatch."""
    return max(float(bytes_moved), flops / FLOPS_PER_BYTE) + DISPATCH_COST
