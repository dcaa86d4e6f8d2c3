"""Pre-launch checks: a graph that would hang or overflow is rejected before the kernel starts."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import GraphError
from .events import NO_EVENT
from .tables import (ARG0, CARRY_EVENT, CARRY_FAN_IN, FAN_IN, OPCODE, SIGNAL_COUNT, SIGNAL_EVENT, SIGNAL_INCREMENT,
                     SIGNAL_RANK, SIGNAL_START, WAIT_EVENT, QueueTables, read_signals)


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
    """Refuse a dependency cycle, naming its tasks. Where every task waits only for earlier ones (as
    inferred dependencies do), program order is topological: there is no cycle to look for."""
    if all(max(ps) < tid for tid, ps in enumerate(producers) if ps):
        return
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
    local = t.signals[t.signals[:, SIGNAL_RANK] == t.rank]
    raised = np.zeros(t.num_events, dtype=np.int64)
    np.add.at(raised, local[:, SIGNAL_EVENT], local[:, SIGNAL_INCREMENT])
    for event_word, fan_in_word in ((WAIT_EVENT, FAN_IN), (CARRY_EVENT, CARRY_FAN_IN)):
        waits = t.rows[t.rows[:, event_word] != NO_EVENT]
        if t.world_size == 1 and len(waits):
            short = waits[raised[waits[:, event_word]] < waits[:, fan_in_word]]
            if len(short):
                ev = int(short[0, event_word])
                raise GraphError(f"event {ev} is raised by {int(raised[ev])} per step but a task waits for "
                                 f"{int(short[0, fan_in_word])}: the kernel would hang")


def check_periodic(every: list[QueueTables]) -> None:
    """Verify over two consecutive steps, on the tables of every rank (``every[r]`` is rank r's), what the
    periodic schedule promises (``scheduler.events``); two steps are enough, because every later pair
    of steps repeats the same waits and signals:

    - progress: every wait is met by the signals of tasks before it in the global order (step, op,
      rank, row), which every worker's queue follows;
    - no lapping: a producer raises an event for step e + 1 only after every task that waits for the
      event's step-e count has finished, so that a count, once it reaches a wait's target, stays there
      until the waiter has seen it (``wait_polled`` polls for equality), and a producer that runs ahead
      can never stand in for one of step e that has not signalled.

    Happens-before is tracked with vector clocks: per worker of every rank, the number of tasks of each
    worker (both steps in a row) known finished.
    """
    first = np.cumsum([0] + [t.workers for t in every])
    length = np.concatenate([np.diff(t.queue_index) for t in every]).astype(np.int64)
    owner = [first[r] + t.worker_of() for r, t in enumerate(every)]
    position = [t.queue_position() for t in every]
    # What each event's waiters need known before a producer raises the event for the next step: per
    # worker, the count at which its last waiter (step 1 for a wait in the step, step 2 for a carried one) ends.
    ends: dict[tuple[int, int], dict[int, int]] = {}  # (rank, event) -> {worker: count}
    for r, t in enumerate(every):
        for event_word, carried in ((WAIT_EVENT, 0), (CARRY_EVENT, 1)):
            waiters = np.flatnonzero(t.rows[:, event_word] != NO_EVENT)
            counts = carried * length[owner[r][waiters]] + position[r][waiters] + 1
            for event, worker, count in zip(t.rows[waiters, event_word].tolist(), owner[r][waiters].tolist(),
                                            counts.tolist()):
                at = ends.setdefault((r, event), {})
                at[worker] = max(at.get(worker, 0), count)
    need = {key: (np.fromiter(at, dtype=np.int64), np.fromiter(at.values(), dtype=np.int32)) for key, at in ends.items()}
    clock = np.zeros((first[-1], first[-1]), dtype=np.int32)
    known: dict[tuple[int, int, int], np.ndarray] = {}   # (rank, event, step) -> what its signals tell
    raised: dict[tuple[int, int, int], int] = {}
    order = sorted((int(op), r, row) for r, t in enumerate(every) for row, op in enumerate(t.task_op.tolist()))
    for step in (1, 2):
        for _, r, row in order:
            t, w = every[r], owner[r][row]
            words = t.rows[row].tolist()
            for event, fan_in, target_step in ((words[WAIT_EVENT], words[FAN_IN], step),
                                               (words[CARRY_EVENT], words[CARRY_FAN_IN], step - 1)):
                if event == NO_EVENT or target_step < 1:
                    continue
                if raised.get((r, event, target_step), 0) < fan_in:
                    raise GraphError(f"rank {r} task {row} waits for event {event} in step {step}, but the tasks "
                                     f"before it in the global order raise it only "
                                     f"{raised.get((r, event, target_step), 0)} of {fan_in} times: the progress "
                                     f"guarantee is lost")
                np.maximum(clock[w], known[r, event, target_step], out=clock[w])
            clock[w, w] = (step - 1) * length[w] + position[r][row] + 1
            start = words[SIGNAL_START]
            for signal in read_signals(t.signals[start:start + words[SIGNAL_COUNT]]):
                target = (signal.rank, signal.event)
                key = (*target, step)
                raised[key] = raised.get(key, 0) + signal.increment
                known[key] = np.maximum(known[key], clock[w]) if key in known else clock[w].copy()
                if step == 2 and target in need:
                    workers, counts = need[target]
                    short = workers[clock[w][workers] < counts]
                    if len(short):
                        waiter_rank = int(np.searchsorted(first, short[0], side="right")) - 1
                        raise GraphError(f"rank {r} task {row} raises event {signal.event} of rank {signal.rank} for "
                                         f"the next step before the waiters of the event on rank {waiter_rank} worker "
                                         f"{int(short[0] - first[waiter_rank])} have finished: the event's count "
                                         f"could be lapped")
