"""Cross-rank edges: remote writes become producers on the rank they land on.

A task may write regions of other ranks' heaps (a put). Ranks exchange those writes before launch;
each receiving rank inserts every incoming write into its own program as a *remote producer* that
lands after all its local tasks of the same op (the op index is the global order key, the same on
every rank). Local tasks that read or overwrite the region afterwards wait for it; a second exchange
tells each writer which of the receiver's events to raise, and tells the receiver where the writer
runs (for hang reports).

All cross-rank edges thus point forward in op order, so one global order, (op, rank, position), is
a topological order that every worker's queue follows: the multi-rank progress certificate. A remote
write into a region the receiver accessed earlier (a cross-rank write-after-read or -after-write)
makes the receiver's task signal an event of the writer's rank that the writer waits on (a credit);
it must come from an earlier op, so that the edge points forward in the global order too. Across the
wrap of a periodic schedule (the next step's puts into a buffer the receiver read in this step) the
same credits carry over to the next step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..errors import GraphError
from .task import Region, Tasks

Exchange = Callable[[Any], list[Any]]  # all-gather of a picklable value over the ranks


@dataclass(frozen=True)
class RemoteWrite:
    src_rank: int
    src_task: int
    op: int
    region: Region


def incoming_writes(tasks: Tasks, rank: int, exchange: Exchange) -> list[RemoteWrite]:
    """Every rank's remote writes, exchanged; those that land on ``rank``, in (op, source rank) order."""
    mine = [(dst, tid, op, region)
            for tid, (op, remote) in enumerate(zip(tasks.op, tasks.remote)) for dst, region in remote]
    every = exchange(mine)
    incoming = [RemoteWrite(src, tid, op, region)
                for src, writes in enumerate(every) for dst, tid, op, region in writes if dst == rank]
    return sorted(incoming, key=lambda w: (w.op, w.src_rank, w.src_task))


def with_remote_producers(tasks: Tasks, incoming: list[RemoteWrite]) -> tuple[Tasks, list[int | None]]:
    """The local program with each incoming write as a pseudo-task after the local tasks of its op.

    Returns the merged tasks and, for each merged task, the index of the incoming write it stands
    for (None for local tasks). A pseudo-task runs nothing and only writes the incoming region.
    """
    merged = Tasks()
    origin: list[int | None] = []

    def land(j: int) -> None:
        merged.append(-1, (), (), (incoming[j].region,), 0.0, incoming[j].op)
        origin.append(j)

    j = 0
    for tid, op in enumerate(tasks.op):
        while j < len(incoming) and incoming[j].op < op:
            land(j)
            j += 1
        merged.append(*tasks[tid])
        origin.append(None)
    for k in range(j, len(incoming)):
        land(k)
    return merged, origin


@dataclass
class Dependencies:
    """One rank's dependencies, local and cross-rank. Remote tasks are named ``(rank, task)``.

    ``credits`` are the edges that point the other way: a remote write (a put of rank ``src_rank``'s
    task ``src_task``) that must wait for a local task of this rank that reads or writes its target
    earlier (``carried``: in the previous step). The writer's rank learns them in an exchange.
    """

    local: list[tuple[int, ...]]                    # per local task: its local producers in the step
    carried: list[tuple[int, ...]]                  # ... and in the previous step
    remote: list[tuple[tuple[int, int], ...]]       # per local task: the remote writes it waits for
    remote_carried: list[tuple[tuple[int, int], ...]]
    credits: list[tuple[int, int, int, bool]]       # (src_rank, src_task, local task, carried)


def rank_dependencies(deps: list[tuple[int, ...]], carried: list[tuple[int, ...]], origin: list[int | None],
                      incoming: list[RemoteWrite], op: list[int], describe) -> Dependencies:
    """Per local task of the merged program: its local producers and its remote ones, in the step and
    across the wrap; and the credits remote writes need (``Dependencies``)."""
    local_id = {}
    for m, o in enumerate(origin):
        if o is None:
            local_id[m] = len(local_id)
    writer = lambda m: (incoming[origin[m]].src_rank, incoming[origin[m]].src_task)  # noqa: E731
    dependencies = Dependencies([], [], [], [], [])
    for m, o in enumerate(origin):
        if o is None:
            for producers, into, remote_into in ((deps[m], dependencies.local, dependencies.remote),
                                                 (carried[m], dependencies.carried, dependencies.remote_carried)):
                into.append(tuple(local_id[d] for d in producers if origin[d] is None))
                remote_into.append(tuple(sorted({writer(d) for d in producers if origin[d] is not None})))
            continue
        w = incoming[o]
        for producers, is_carried in ((deps[m], False), (carried[m], True)):
            for d in producers:
                if origin[d] is not None:
                    if writer(d) != writer(m):  # one writer's own puts are ordered by its queue
                        raise GraphError(
                            f"rank {w.src_rank}'s task {w.src_task} (op {w.op}) and rank {incoming[origin[d]].src_rank}'s "
                            f"task {incoming[origin[d]].src_task} write overlapping regions of this rank's buffer "
                            f"{w.region[0]}: nothing orders two remote writes into one region")
                elif not is_carried and op[local_id[d]] >= w.op:
                    raise GraphError(
                        f"rank {w.src_rank}'s task {w.src_task} (op {w.op}) writes a region of this rank's buffer "
                        f"{w.region[0]} that {describe(local_id[d])} uses in the same op; a remote write may only "
                        f"follow this rank's accesses to its target from earlier ops")
                else:
                    dependencies.credits.append((w.src_rank, w.src_task, local_id[d], is_carried))
    return dependencies
