"""Placement of tasks on workers and the global order they run in.

Every policy returns one global order (a topological order of the task DAG) and a worker per task;
each worker runs its tasks in that global order. That is the progress guarantee of the device
protocol: the earliest unfinished task in the global order can always run.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..errors import GraphError
from .task import Task

POLICIES = ("round_robin", "critical_path")


@dataclass
class Placement:
    order: list[int]   # task ids in global order
    worker: list[int]  # worker of each task id


def place(tasks: list[Task], producers: list[tuple[int, ...]], workers: int, policy: str) -> Placement:
    if workers < 1:
        raise GraphError(f"a kernel needs at least one worker, got workers={workers}")
    if policy == "round_robin":
        return Placement(list(range(len(tasks))), [i % workers for i in range(len(tasks))])
    if policy == "critical_path":
        return _critical_path(tasks, producers, workers)
    raise GraphError(f"unknown placement policy {policy!r}; expected one of {', '.join(POLICIES)}")


def bottom_levels(tasks: list[Task], producers: list[tuple[int, ...]]) -> list[float]:
    """Length (in cost) of the longest path from each task to the end of the graph, itself included.

    Tasks are in program order, which is topological, so one backward sweep is enough.
    """
    level = [t.cost for t in tasks]
    for tid in range(len(tasks) - 1, -1, -1):
        reach = level[tid]
        for p in producers[tid]:
            through = tasks[p].cost + reach
            if through > level[p]:
                level[p] = through
    return level


def _critical_path(tasks: list[Task], producers: list[tuple[int, ...]], workers: int) -> Placement:
    """List scheduling: the ready task with the longest path to the end goes first, to the worker
    where it can start earliest; among equally early workers, the one that ran its last producer
    (so the wait disappears)."""
    n = len(tasks)
    level = bottom_levels(tasks, producers)
    consumers: list[list[int]] = [[] for _ in range(n)]
    missing = [0] * n
    for tid, ps in enumerate(producers):
        missing[tid] = len(ps)
        for p in ps:
            consumers[p].append(tid)
    ready = [(-level[t], t) for t in range(n) if not missing[t]]
    heapq.heapify(ready)
    free_at = [0.0] * workers
    idle = [(0.0, w) for w in range(workers)]
    finish = [0.0] * n
    worker = [0] * n
    order: list[int] = []
    while ready:
        _, tid = heapq.heappop(ready)
        data_ready, last = 0.0, -1
        for p in producers[tid]:
            if finish[p] >= data_ready:
                data_ready, last = finish[p], p
        while idle[0][0] != free_at[idle[0][1]]:
            heapq.heappop(idle)
        w = idle[0][1]
        start = max(free_at[w], data_ready)
        if last >= 0 and max(free_at[worker[last]], data_ready) <= start:
            w = worker[last]
        end = max(free_at[w], data_ready) + tasks[tid].cost
        finish[tid] = free_at[w] = end
        heapq.heappush(idle, (end, w))
        worker[tid] = w
        order.append(tid)
        for c in consumers[tid]:
            missing[c] -= 1
            if not missing[c]:
                heapq.heappush(ready, (-level[c], c))
    if len(order) != n:
        raise GraphError("the task graph has a cycle; run scheduler.checks.find_cycle for the tasks on it")
    return Placement(order, worker)


DISPATCH_COST = 512.0   # a task's fixed cost, in bytes moved
FLOPS_PER_BYTE = 64.0   # the machine balance that turns flops into bytes' worth of time


def task_cost(bytes_moved: int, flops: int) -> float:
    """A task's time in the scheduler's unit (bytes moved at memory bandwidth): roofline plus dispatch."""
    return max(float(bytes_moved), flops / FLOPS_PER_BYTE) + DISPATCH_COST
