"""The ranks of a kernel: a ``torch.distributed`` process group, or virtual ranks (threads of one process).

Everything ranks agree on before a launch goes through here: op lists, heap layouts, heap handles,
cross-rank edges. After that the kernel itself needs no host communication.

Virtual ranks (``launch(..., virtual=True)``) are threads of one process, one per rank, sharing a
``VirtualWorld``: exchanges pass Python objects by reference, so rank 0 can allocate one heap for all
ranks and hand the others their slices.

The ranks live on nodes (``Topology``): ranks of one node map each other's heaps, ranks of different
nodes share no memory and reach each other through a transport (``transport``). The node of a process
rank comes from torchrun's variables, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` (which ``launch`` sets too);
virtual ranks are one node.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .errors import BackendError, GraphError

_thread = threading.local()  # .world and .rank while this thread is a virtual rank; .backend its default


class VirtualWorld:
    """The meeting point of ``world_size`` virtual ranks: exchanges and barriers with timeouts."""

    def __init__(self, world_size: int, backend: str = "auto"):
        self.world_size, self.backend = world_size, backend
        self._barrier = threading.Barrier(world_size)
        self._slots: list[Any] = [None] * world_size
        self._arrivals = [0] * world_size  # barriers each rank has reached: who is missing on a timeout
        self.failed: list[int] = []        # ranks that raised, first first; the others' waits end at once

    def barrier(self, rank: int, timeout: float, why: str) -> None:
        self._arrivals[rank] += 1
        try:
            self._barrier.wait(timeout)
        except threading.BrokenBarrierError:
            if self.failed:
                raise BackendError(f"rank {rank}: rank {self.failed[0]} failed before the ranks met to {why}") from None
            missing = [r for r, n in enumerate(self._arrivals) if n < self._arrivals[rank]]
            raise BackendError(f"rank {rank}: the ranks did not all arrive to {why} within {timeout} s; "
                               f"missing: rank {', '.join(map(str, missing)) or '?'}") from None

    def all_gather(self, rank: int, value: Any, timeout: float) -> list[Any]:
        self.barrier(rank, timeout, "exchange")  # nobody still reads the previous exchange's slots
        self._slots[rank] = value
        self.barrier(rank, timeout, "exchange")
        return list(self._slots)

    def fail(self, rank: int) -> None:
        """Rank ``rank`` raised: release every rank waiting in a barrier, now and later."""
        self.failed.append(rank)
        self._barrier.abort()


def current_world() -> tuple[int, int]:
    """(world size, rank) of the calling thread: its virtual rank, else the process group, else (1, 0)."""
    world = getattr(_thread, "world", None)
    if world is not None:
        return world.world_size, _thread.rank
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


@dataclass(frozen=True)
class Topology:
    """The node of each rank (``nodes[r]``), nodes numbered from 0 in rank order: torchrun's layout, a
    node's ranks consecutive."""

    nodes: tuple[int, ...]

    @classmethod
    def uniform(cls, world_size: int, ranks_per_node: int | None = None) -> "Topology":
        """``world_size`` ranks, ``ranks_per_node`` to a node (None: one node); it must divide the world."""
        per_node = world_size if ranks_per_node is None else ranks_per_node
        if not (isinstance(per_node, int) and not isinstance(per_node, bool) and per_node > 0
                and world_size % per_node == 0):
            raise BackendError(f"ranks_per_node must be a positive integer that divides the world size "
                               f"{world_size}, got {ranks_per_node!r}")
        return cls(tuple(r // per_node for r in range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    @property
    def node_count(self) -> int:
        return self.nodes[-1] + 1

    def same_node(self, a: int, b: int) -> bool:
        return self.nodes[a] == self.nodes[b]

    def node_ranks(self, node: int) -> list[int]:
        """The ranks of ``node``, in rank order."""
        return [r for r, n in enumerate(self.nodes) if n == node]


def current_topology() -> Topology:
    """The nodes of the calling thread's world (``current_world``): one node for virtual ranks and a
    single process; else torchrun's ``LOCAL_WORLD_SIZE`` ranks to a node (this process's node being
    ``GROUP_RANK``, when set, which must agree)."""
    world_size, rank = current_world()
    if getattr(_thread, "world", None) is not None or world_size == 1 or "LOCAL_WORLD_SIZE" not in os.environ:
        return Topology.uniform(world_size)
    try:
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        node = int(os.environ.get("GROUP_RANK", rank // per_node)) if per_node > 0 else -1
    except ValueError:
        raise BackendError(f"LOCAL_WORLD_SIZE={os.environ['LOCAL_WORLD_SIZE']!r} / "
                           f"GROUP_RANK={os.environ.get('GROUP_RANK')!r} are not integers") from None
    if per_node <= 0 or world_size % per_node or node != rank // per_node:
        raise BackendError(f"LOCAL_WORLD_SIZE={per_node} and GROUP_RANK={os.environ.get('GROUP_RANK')} do not describe "
                           f"rank {rank} of {world_size} on nodes of equal size, ranks numbered node by node")
    return Topology.uniform(world_size, per_node)


def default_backend() -> str:
    """The backend ``"auto"`` means here: what ``launch`` asked for, else the best one available."""
    world = getattr(_thread, "world", None)
    return world.backend if world is not None else _process_backend


_process_backend = "auto"  # set by launch in each rank process
_gloo_group = None         # a gloo group for host barriers when the default group is not gloo (NCCL)


def set_process_backend(backend: str) -> None:
    global _process_backend
    _process_backend = backend


def enter_virtual(world: VirtualWorld, rank: int) -> None:
    _thread.world, _thread.rank = world, rank


def leave_virtual() -> None:
    _thread.world = None


class Group:
    """This rank in a world of ``world_size``; a world of one needs no process group.

    ``virtual``: the ranks are threads of this process; ``slot`` tells this rank's resources apart
    from the other virtual ranks' (0 for a process rank).
    """

    EXCHANGE_TIMEOUT = 600.0

    def __init__(self, world_size: int, rank: int, topology: Topology | None = None):
        self.world_size, self.rank = world_size, rank
        self.topology = topology  # None: the process's (``current_topology``), once the world is checked
        self.meetings = 0  # barriers and exchanges with the other ranks so far
        self.world: VirtualWorld | None = getattr(_thread, "world", None)
        self.virtual = self.world is not None
        self.slot = rank if self.virtual else 0
        if self.virtual:
            if (self.world.world_size, _thread.rank) != (world_size, rank):
                raise BackendError(f"the graph was built for rank {rank} of {world_size}, but this thread is "
                                   f"virtual rank {_thread.rank} of {self.world.world_size}")
        elif world_size > 1:
            import torch.distributed as dist
            if not (dist.is_available() and dist.is_initialized()):
                raise BackendError(f"a graph of world size {world_size} needs an initialized torch.distributed "
                                   f"process group: use megakernel.launch or torchrun")
            if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
                raise BackendError(f"the graph was built for rank {rank} of {world_size}, but this process is "
                                   f"rank {dist.get_rank()} of {dist.get_world_size()}")
        real = current_topology() if world_size > 1 and not self.virtual else Topology.uniform(world_size)
        self.topology = real if self.topology is None else self.topology
        if self.topology.world_size != world_size:
            raise BackendError(f"a topology of {self.topology.world_size} ranks for a world of {world_size}")
        split = [(a, b) for a in range(world_size) for b in range(a) if self.topology.same_node(a, b)
                 and not real.same_node(a, b)]
        if split:  # a graph may see more nodes than there are (each a transport's test), never fewer
            raise BackendError(f"the graph puts ranks {split[0][1]} and {split[0][0]} on one node, but they are on "
                               f"nodes {real.nodes[split[0][1]]} and {real.nodes[split[0][0]]} "
                               f"(LOCAL_WORLD_SIZE / GROUP_RANK): they share no memory")
        if self.virtual and self.topology.node_count > 1:
            raise BackendError("virtual ranks are threads of one process: they cannot be on several nodes "
                               "(launch process ranks with ranks_per_node)")

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (virtual ranks: the objects themselves, not copies)."""
        if self.world_size == 1:
            return [value]
        self.meetings += 1
        if self.virtual:
            return self.world.all_gather(self.rank, value, self.EXCHANGE_TIMEOUT)
        import torch.distributed as dist
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value, group=_host_group())
        return gathered

    def barrier(self, timeout: float, why: str = "launch") -> None:
        """Wait for every rank; a rank that does not arrive within ``timeout`` s is named in the error."""
        if self.world_size == 1:
            return
        self.meetings += 1
        if self.virtual:
            return self.world.barrier(self.rank, timeout, why)
        import torch.distributed as dist
        try:
            dist.monitored_barrier(group=_host_group(), timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        except RuntimeError as error:
            raise BackendError(f"rank {self.rank}: the ranks did not all arrive to {why}: {error}") from None


def _host_group():
    """The group for host exchanges and monitored barriers: the default one when it is gloo, else a
    gloo group made once (monitored barriers exist only in gloo; NCCL bootstraps the GPU ranks)."""
    global _gloo_group
    import torch.distributed as dist
    if dist.get_backend() == "gloo":
        return None
    if _gloo_group is None:
        _gloo_group = dist.new_group(backend="gloo")
    return _gloo_group


def check_agreement(group: Group, what: str, items: list[str]) -> None:
    """Raise ``GraphError`` naming the first item of ``items`` (ops, buffers, ...) on which ranks differ."""
    every = group.all_gather(items)
    for index in range(max(len(i) for i in every)):
        seen = [i[index] if index < len(i) else "nothing" for i in every]
        if len(set(seen)) > 1:
            detail = "; ".join(f"rank {r} has {s}" for r, s in enumerate(seen))
            raise GraphError(f"the ranks' graphs diverge at {what} {index}: {detail}")
