"""Pure host-side scheduling: dependencies, placement, events, the queue format, pre-launch checks.

Nothing here imports Triton or the task library: the scheduler sees tasks only as opcodes, argument
words, regions and costs.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from .checks import Capacity, check_acyclic, check_tables, find_cycle
from .deps import infer_dependencies
from .events import NO_EVENT, Events, encode_events, queue_positions
from .remote import Exchange, RemoteWrite, incoming_writes, split_producers, with_remote_producers
from .placement import POLICIES, Placement, bottom_levels, place, task_cost
from .tables import (ARG0, FAN_IN, OPCODE, SIGNAL_COUNT, SIGNAL_START, VERSION, WAIT_EVENT, FormatError,
                     QueueTables, Spec, build_tables, deserialize, disassemble, serialize)
from .task import Region, Task, Tasks


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector, restoring its previous state on exit.

    Scheduling a large graph allocates millions of small containers (dependency tuples, cell entries,
    heap items) that form no reference cycles. Their number triggers full collections, and each one
    walks every live object, the graph's columns of tasks included, to find nothing: for a million
    tasks that costs as much as the scheduling itself. Reference counting still frees everything as
    usual.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def schedule(tasks: Tasks, shapes: dict[int, tuple[int, int]], *, specs: list[Spec], op_names: list[str],
             workers: int, policy: str = "critical_path", rank: int = 0, world_size: int = 1,
             describe=str, exchange: Exchange | None = None) -> QueueTables:
    """Tasks in program order -> checked queue tables for ``workers`` workers.

    With ``world_size > 1``, ``exchange`` (an all-gather over the ranks) carries the cross-rank
    edges: every rank must call ``schedule`` at the same point, with graphs that agree.
    """
    # The intermediate results (dependencies, placement, events) die when _schedule returns, inside
    # the pause: alive when the collector resumed, its first collection would walk all of them.
    with _collector_paused():
        tables = _schedule(tasks, shapes, specs=specs, op_names=op_names, workers=workers, policy=policy,
                           rank=rank, world_size=world_size, describe=describe, exchange=exchange)
    check_tables(tables)
    return tables


def _schedule(tasks: Tasks, shapes: dict[int, tuple[int, int]], *, specs: list[Spec], op_names: list[str],
              workers: int, policy: str, rank: int, world_size: int, describe, exchange: Exchange | None
              ) -> QueueTables:
    if world_size > 1:
        incoming = incoming_writes(tasks, rank, exchange)
        merged, origin = with_remote_producers(tasks, incoming)
        producers, remote = split_producers(infer_dependencies(merged, shapes), origin, incoming, describe)
    else:
        incoming, producers, remote = [], infer_dependencies(tasks, shapes), None
    check_acyclic(producers, describe)
    placement = place(tasks, producers, workers, policy)
    events = encode_events(placement, producers, workers, rank, remote)
    remote_producers = {}
    if world_size > 1:
        remote_producers = _connect_ranks(tasks, placement, events, incoming, rank, exchange)
    return build_tables(tasks, placement, events, specs=specs, op_names=op_names, workers=workers,
                        rank=rank, world_size=world_size, remote_producers=remote_producers)


def _connect_ranks(tasks: Tasks, placement: Placement, events: Events, incoming: list[RemoteWrite], rank: int,
                   exchange: Exchange) -> dict[int, list[tuple[int, int, int, int]]]:
    """Second exchange: tell each remote writer which of this rank's events to raise, and learn where
    this rank's remote producers run. Appends the remote signals to ``events.signals``."""
    position = queue_positions(placement)
    requests = [(incoming[j].src_rank, incoming[j].src_task, evs) for j, evs in events.remote_signals.items()]
    writers = {tid: (placement.worker[tid], position[tid]) for tid, remote in enumerate(tasks.remote) if remote}
    every = exchange((requests, writers))
    for dst, (asks, _) in enumerate(every):
        for src, task, evs in asks:
            if src == rank:
                events.signals[task].extend((dst, event, 1) for event in evs)
    remote_producers: dict[int, list[tuple[int, int, int, int]]] = {}
    for j, evs in events.remote_signals.items():
        w = incoming[j]
        worker, pos = every[w.src_rank][1][w.src_task]
        for event in evs:
            remote_producers.setdefault(event, []).append((w.src_rank, w.src_task, worker, pos))
    return remote_producers


__all__ = [
    "ARG0", "FAN_IN", "NO_EVENT", "OPCODE", "POLICIES", "SIGNAL_COUNT", "SIGNAL_START", "VERSION", "WAIT_EVENT",
    "Capacity", "Events", "FormatError", "Placement", "QueueTables", "Region", "Spec", "Task", "Tasks", "bottom_levels",
    "build_tables", "check_acyclic", "check_tables", "deserialize", "disassemble", "encode_events", "find_cycle",
    "infer_dependencies", "place", "schedule", "serialize", "task_cost",
]
