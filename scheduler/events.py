"""Dependency encoding: the event each task waits on, and the signals each task sends.

A task waits on at most one event, a counter that its producers raise. In run number ``e`` (1, 2, ...)
the wait is satisfied when the counter reaches ``e * fan_in``, so nothing is reset between runs.
A task waits only for the last of its producers on each other worker (the others are implied), and
consumers with the same set of producers share one event.

Waits already implied by program order are dropped: a worker runs its queue in order, so once a
worker has waited for task ``p`` of worker ``v`` (or ran it itself), every earlier task of ``v`` is
known finished too. Each worker keeps, per other worker, the queue position it knows finished.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .placement import Placement

NO_EVENT = -1


@dataclass
class Events:
    wait_event: list[int]                        # per task id; NO_EVENT when the task need not wait
    fan_in: list[int]                            # per task id; 0 when the task need not wait
    signals: list[list[tuple[int, int, int]]]    # per task id: (rank, event, increment) it raises when done
    count: int                                   # number of events
    remote_signals: dict[int, list[int]] = field(default_factory=dict)  # remote producer -> events it raises


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
                  remote: list[tuple[int, ...]] | None = None) -> Events:
    """``remote[t]``: ids of the remote producers (writes from other ranks) task ``t`` must wait for.
    Nothing is known of their order, so none of them is implied by another."""
    n = len(producers)
    position = queue_positions(placement)

    known_done = [[-1] * workers for _ in range(workers)]
    event_of: dict[tuple[int, ...], int] = {}
    wait_event = [NO_EVENT] * n
    fan_in = [0] * n
    signals: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    remote_signals: dict[int, list[int]] = {}
    for tid in placement.order:
        w = placement.worker[tid]
        seen = known_done[w]
        latest: dict[int, int] = {}  # producer worker -> its last producer not yet known done
        for p in producers[tid]:
            pw = placement.worker[p]
            if position[p] > seen[pw] and (pw not in latest or position[p] > position[latest[pw]]):
                latest[pw] = p
        for pw, p in latest.items():
            seen[pw] = position[p]
        seen[w] = position[tid]
        far = remote[tid] if remote else ()
        if not latest and not far:
            continue
        needed = sorted(latest.values())
        key = (*needed, *(-1 - r for r in far))
        event = event_of.get(key)
        if event is None:
            event = event_of[key] = len(event_of)
            for p in needed:
                signals[p].append((rank, event, 1))
            for r in far:
                remote_signals.setdefault(r, []).append(event)
        wait_event[tid] = event
        fan_in[tid] = len(needed) + len(far)
    return Events(wait_event, fan_in, signals, len(event_of), remote_signals)
