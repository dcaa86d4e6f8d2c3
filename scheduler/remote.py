"""Cross-rank edges: remote writes become producers on the rank they land on.

A task may write regions of other ranks' heaps (a put). Ranks exchange those writes before launch;
each receiving rank inserts every incoming write into its own program as a *remote producer* that
lands after all its local tasks of the same op (the op index is the global order key, the same on
every rank). Local tasks that read or overwrite the region afterwards wait for it; a second exchange
tells each writer which of the receiver's events to raise, and tells the receiver where the writer
runs (for hang reports).

All cross-rank edges thus point forward in op order, so one global order, (op, rank, position), is
a topological order that every worker's queue follows: the multi-rank progress certificate. A remote
write into a region the receiver accessed earlier in the same run (a cross-rank write-after-read)
would need the writer to wait for the receiver; it is rejected instead.
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


def split_producers(merged_producers: list[tuple[int, ...]], origin: list[int | None], incoming: list[RemoteWrite],
                    describe) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Per local task: its local producers and its remote producers (indices into ``incoming``)."""
    local_id = {}
    for m, o in enumerate(origin):
        if o is None:
            local_id[m] = len(local_id)
    local: list[tuple[int, ...]] = []
    remote: list[tuple[int, ...]] = []
    for m, deps in enumerate(merged_producers):
        o = origin[m]
        if o is not None:
            if deps:
                w, first = incoming[o], deps[0]
                earlier = (describe(local_id[first]) if origin[first] is None
                           else f"rank {incoming[origin[first]].src_rank}'s remote write")
                raise GraphError(
                    f"rank {w.src_rank}'s task {w.src_task} (op {w.op}) writes a region of this rank's buffer "
                    f"{w.region[0]} that {earlier} accessed earlier in the same run; a remote write may "
                    f"only target a region nothing else has used before it in the run")
            continue
        local.append(tuple(local_id[d] for d in deps if origin[d] is None))
        remote.append(tuple(origin[d] for d in deps if origin[d] is not None))
    return local, remote
