"""Dependency encoding: the events each task waits on, and the signals each task sends.

A task waits on at most two events, counters that its producers raise, one add each per step: its
producers of the same step (``wait_event``: in step ``e`` (1, 2, ... over every launch) it waits for
``e * fan_in``) and those of the previous step (``carry_event``: ``(e - 1) * carry_fan_in``; nothing
in step 1). Nothing is reset between steps or launches. A task waits only for the last of its
producers on each other worker (the others are implied), and consumers with the same set of
producers share one event.

Waits already implied by program order are dropped: a worker runs its queue in order, so once a
worker has waited for task ``p`` of worker ``v`` (or ran it itself), every earlier task of ``v`` is
known finished too; across the wrap, every task of the previous step of the worker itself, and of a
worker of which it saw any task of this step finished.

Periodic schedules: why no counter is ever lapped. A count must reach its target only when every
producer has signalled for that step, and (``wait_polled`` polls for equality) must stay there until
every waiter has seen it. Both hold if no producer signals for step e + 1 before every waiter of
step e's count has finished. Every producer ``p`` of an event and every waiter ``c`` of it touch one
region in conflicting ways (the event was made from region dependencies, ``deps.py``, and merges only
direct producers). For a wait in the step (``p`` before ``c`` in program order), the same conflict
makes ``p`` of step e + 1 depend on ``c`` of step e across the wrap (``infer_periodic``: directly or
through the writes between them); for a carried wait (``p`` after ``c``), it makes ``p`` depend on
``c`` within step e + 1. Every dependency is enforced, here or by program order, so ``c`` finishes
before ``p`` signals again: a counter is raised at most one step ahead of its slowest waiter, never
lapped. Remote producers (puts into this rank) are covered by the same argument through credits
(``remote.py``). ``checks.check_periodic`` verifies the property on the tables of every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .placement import Placement

NO_EVENT = -1

RemoteTask = tuple[int, int]  # (rank, task id on that rank)


class Signal(NamedTuple):
    """What a task does when done: add ``increment`` to ``event`` of rank ``rank`` (a row of the signal table:
    its fields are the words ``layout.SIGNAL_RANK``, ``SIGNAL_EVENT``, ``SIGNAL_INCREMENT``, in order)."""

    rank: int
    event: int
    increment: int


@dataclass
class Events:
    wait_event: list[int]                        # per task id; NO_EVENT when the task need not wait
    fan_in: list[int]                            # per task id; 0 when the task need not wait
    carry_event: list[int]                       # per task id: the wait on the previous step's signals
    carry_fan_in: list[int]
    signals: list[list[Signal]]                  # per task id: what it raises when done
    count: int                                   # number of events
    remote_signals: dict[RemoteTask, list[int]] = field(default_factory=dict)  # remote producer -> events it raises


def queue_positions(placement: Placement) -> list[int]:
    """Each task's position in its worker's queue."""
    position = [0] * len(placement.worker)
    next_position: dict[int, int] = {}
    for tid in placement.order:
        w = placement.worker[tid]
        position[tid] = next_position.get(w, 0)
        next_position[w] = position[tid] + 1
    return position


def encode_events(placement: Placement, producers: list[tuple[int, ...]], workers: int, rank: int = 0,
                  remote: list[tuple[RemoteTask, ...]] | None = None, carried: list[tuple[int, ...]] | None = None,
                  remote_carried: list[tuple[RemoteTask, ...]] | None = None) -> Events:
    """``producers[t]``: the local tasks ``t`` waits for in its step; ``carried[t]``: those of the previous
    step; ``remote[t]``, ``remote_carried[t]``: the tasks of other ranks (nothing is known of their
    order, so none of them is implied by another)."""
    n = len(producers)
    position = queue_positions(placement)
    carried = carried or [()] * n
    event_of: dict[tuple, int] = {}
    signals: list[list[Signal]] = [[] for _ in range(n)]
    remote_signals: dict[RemoteTask, list[int]] = {}

    def event(key: tuple, needed: list[int], far: tuple[RemoteTask, ...]) -> int:
        found = event_of.get(key)
        if found is None:
            found = event_of[key] = len(event_of)
            for p in needed:
                signals[p].append(Signal(rank, found, 1))
            for r in far:
                remote_signals.setdefault(r, []).append(found)
        return found

    # The step: each worker knows, per worker, the last queue position it saw finished (-1: none).
    known = [[-1] * workers for _ in range(workers)]
    wait_event, fan_in = [NO_EVENT] * n, [0] * n
    for tid in placement.order:
        w = placement.worker[tid]
        needed = _latest(producers[tid], known[w], placement.worker, position)
        known[w][w] = position[tid]
        far = remote[tid] if remote else ()
        if needed or far:
            wait_event[tid] = event((False, *needed, *far), needed, far)
            fan_in[tid] = len(needed) + len(far)

    # Across the wrap: at the start of step e + 1 a worker knows what it knew at the end of step e
    # (``known`` now) about step e; during step e + 1, having seen any task of worker v finished
    # tells it all of v's step e finished too (v ran its queue in order), as does its own progress.
    whole_step = len(placement.worker)  # a position past every queue's end: all of that worker's step e
    for w in range(workers):
        known[w][w] = whole_step
    carry_event, carry_fan_in = [NO_EVENT] * n, [0] * n
    for tid in placement.order:
        w = placement.worker[tid]
        seen = known[w]
        for p in producers[tid]:
            seen[placement.worker[p]] = whole_step
        needed = _latest(carried[tid], seen, placement.worker, position)
        far = remote_carried[tid] if remote_carried else ()
        if needed or far:
            carry_event[tid] = event((True, *needed, *far), needed, far)
            carry_fan_in[tid] = len(needed) + len(far)
    return Events(wait_event, fan_in, carry_event, carry_fan_in, signals, len(event_of), remote_signals)


def _latest(producers: tuple[int, ...], seen: list[int], worker: list[int], position: list[int]) -> list[int]:
    """Per other worker, the last of ``producers`` not yet ``seen`` finished, sorted; marks them seen."""
    if not producers:
        return []
    if len(producers) == 1:  # most tasks: no dictionary, no sort
        p = producers[0]
        if position[p] <= seen[worker[p]]:
            return []
        seen[worker[p]] = position[p]
        return [p]
    latest: dict[int, int] = {}
    for p in producers:
        pw = worker[p]
        if position[p] > seen[pw] and (pw not in latest or position[p] > position[latest[pw]]):
            latest[pw] = p
    for pw, p in latest.items():
        seen[pw] = position[p]
    return sorted(latest.values())
