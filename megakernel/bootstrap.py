"""The ranks of a kernel, over an existing ``torch.distributed`` process group (gloo on cpu).

Everything ranks agree on before a launch goes through here: op lists, heap layouts, segment
names, cross-rank edges. After that the kernel itself needs no host communication.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

from .errors import BackendError, GraphError


class Group:
    """This process's rank in a world of ``world_size``; a world of one needs no process group."""

    def __init__(self, world_size: int, rank: int):
        self.world_size, self.rank = world_size, rank
        if world_size > 1:
            import torch.distributed as dist
            if not (dist.is_available() and dist.is_initialized()):
                raise BackendError(f"a graph of world size {world_size} needs an initialized torch.distributed "
                                   f"process group: use megakernel.launch or torchrun")
            if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
                raise BackendError(f"the graph was built for rank {rank} of {world_size}, but this process is "
                                   f"rank {dist.get_rank()} of {dist.get_world_size()}")

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        if self.world_size == 1:
            return [value]
        import torch.distributed as dist
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, value)
        return gathered

    def barrier(self, timeout: float, why: str = "launch") -> None:
        """Wait for every rank; a rank that does not arrive within ``timeout`` s is named in the error."""
        if self.world_size == 1:
            return
        import torch.distributed as dist
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        except RuntimeError as error:
            raise BackendError(f"rank {self.rank}: the ranks did not all arrive to {why}: {error}") from None


def check_agreement(group: Group, what: str, items: list[str]) -> None:
    """Raise ``GraphError`` naming the first item of ``items`` (ops, buffers, ...) on which ranks differ."""
    every = group.all_gather(items)
    for index in range(max(len(i) for i in every)):
        seen = [i[index] if index < len(i) else "nothing" for i in every]
        if len(set(seen)) > 1:
            detail = "; ".join(f"rank {r} has {s}" for r, s in enumerate(seen))
            raise GraphError(f"the ranks' graphs diverge at {what} {index}: {detail}")
