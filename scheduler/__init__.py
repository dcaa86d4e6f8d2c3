"""Pure host-side scheduling: dependencies, placement, events, the queue format, pre-launch checks.

Nothing here imports Triton or the task library: the scheduler sees tasks only as opcodes, argument
words, regions and costs.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from .checks import Capacity, check_acyclic, check_periodic, check_tables, find_cycle
from .deps import infer_dependencies, infer_periodic
from .events import NO_EVENT, Events, Signal, encode_events, queue_positions
from .remote import Dependencies, Exchange, incoming_writes, rank_dependencies, with_remote_producers
from .placement import POLICIES, Placement, bottom_levels, place, task_cost
from .tables import (ARG0, CARRY_EVENT, CARRY_FAN_IN, FAN_IN, GUARD, NO_GUARD, OPCODE, SIGNAL_COUNT, SIGNAL_EVENT,
                     SIGNAL_INCREMENT, SIGNAL_RANK, SIGNAL_START, VERSION, WAIT_EVENT, FormatError, QueueTables, Spec,
                     build_tables, deserialize, disassemble, read_signals, serialize)
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
        dependencies = rank_dependencies(*infer_periodic(merged, shapes), origin, incoming, tasks.op, describe)
        _receive_credits(dependencies, rank, exchange)
        producers, carried = dependencies.local, dependencies.carried
    else:
        producers, carried = infer_periodic(tasks, shapes)
        dependencies = None
    check_acyclic(producers, describe)
    placement = place(tasks, producers, workers, policy)
    events = encode_events(placement, producers, workers, rank, dependencies and dependencies.remote, carried,
                           dependencies and dependencies.remote_carried)
    remote_producers = {}
    if world_size > 1:
        remote_producers = _connect_ranks(tasks, placement, events, dependencies, rank, exchange)
    return build_tables(tasks, placement, events, specs=specs, op_names=op_names, workers=workers,
                        rank=rank, world_size=world_size, remote_producers=remote_producers)


def _receive_credits(dependencies: Dependencies, rank: int, exchange: Exchange) -> None:
    """Exchange the credits: each writer's task learns the remote tasks it waits for (``dependencies.remote``)."""
    remote = [list(r) for r in dependencies.remote]
    remote_carried = [list(r) for r in dependencies.remote_carried]
    for reader, asks in enumerate(exchange(dependencies.credits)):
        for writer, task, local, is_carried in asks:
            if writer == rank:
                (remote_carried if is_carried else remote)[task].append((reader, local))
    dependencies.remote = [tuple(sorted(r)) for r in remote]
    dependencies.remote_carried = [tuple(sorted(r)) for r in remote_carried]


def _connect_ranks(tasks: Tasks, placement: Placement, events: Events, dependencies: Dependencies, rank: int,
                   exchange: Exchange) -> dict[int, list[tuple[int, int, int, int, int]]]:
    """Last exchange: tell each remote producer which of this rank's events to raise, and learn where
    it runs. Appends the remote signals to ``events.signals``."""
    position = queue_positions(placement)
    signalling = {tid for tid, remote in enumerate(tasks.remote) if remote}  # puts, and readers owing credits
    signalling.update(local for _, _, local, _ in dependencies.credits)
    where = {tid: (placement.worker[tid], position[tid], tasks.op[tid]) for tid in signalling}
    every = exchange((events.remote_signals, where))
    for dst, (asks, _) in enumerate(every):
        for (src, task), evs in asks.items():
            if src == rank:
                events.signals[task].extend(Signal(dst, event, 1) for event in evs)
    remote_producers: dict[int, list[tuple[int, int, int, int, int]]] = {}
    for (src, task), evs in events.remote_signals.items():
        worker, pos, op = every[src][1][task]
        for event in evs:
            remote_producers.setdefault(event, []).append((src, task, worker, pos, op))
    return remote_producers


__all__ = [
    "ARG0", "CARRY_EVENT", "CARRY_FAN_IN", "FAN_IN", "GUARD", "NO_EVENT", "NO_GUARD", "OPCODE", "POLICIES", "SIGNAL_COUNT", "SIGNAL_EVENT",
    "SIGNAL_INCREMENT", "SIGNAL_RANK", "SIGNAL_START", "VERSION", "WAIT_EVENT",
    "Capacity", "Events", "FormatError", "Placement", "QueueTables", "Region", "Signal", "Spec", "Task", "Tasks", "bottom_levels",
    "build_tables", "check_acyclic", "check_periodic", "check_tables", "deserialize", "disassemble", "encode_events", "find_cycle",
    "infer_dependencies", "infer_periodic", "place", "read_signals", "schedule", "serialize", "task_cost",
]
