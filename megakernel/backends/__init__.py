"""What a backend gives the runtime: a symmetric heap shared by the ranks, and a way to run every
worker of this rank once.

The runtime (``Megakernel``) owns the protocol: layout, tables, epochs, barriers, reports. A backend
owns the memory and the processors:

| backend | heap | workers |
| --- | --- | --- |
| ``cpu`` | POSIX shared memory | interpreter processes (``backends.cpu``) |
| ``torch`` | the same | the same processes, each tile its task type's torch reference (``backends.torch_loop``) |
| ``cuda`` | device memory, shared by IPC | programs of one persistent launch (``backends.gpu``) |
| ``hip`` | the same; the comm area fine-grained (``finegrained``) | the same |

Virtual ranks (threads of one process) carve their heaps from allocations rank 0 makes (one; on hip
one for the data areas and one for the comm areas).

``KINDS`` is the factory: one entry per backend, what its kernel is generated for and how it is
made, so the runtime never asks which backend it runs on. The backend modules never import this
registry (what they share lies below it: ``heap.Heaps``; the torch backend builds on the cpu one), so it
imports them all at its top.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from ..bootstrap import Group, default_backend
from ..errors import BackendError
from ..heap import SHM_DIR, Heaps, HostWrites
from ..scheduler import Spec
from .cpu import CpuBackend, WorkerPool
from .gpu import GpuBackend
from .torch_loop import TorchBackend


class Backend(Protocol):
    name: str
    workers: int          # persistent programs of this rank
    lost_workers: bool    # an interrupted launch had to kill workers: the heap is no longer theirs

    def free_memory(self) -> int:
        """Bytes a heap can take on this backend now."""

    def allocate(self, data_size: int, comm_size: int) -> Heaps:
        """Collective over the ranks: every rank's heap (a data area of ``data_size`` bytes, a comm area of
        ``comm_size``), mapped where workers see it; the comm area where peers' stores and atomics stay
        coherent."""

    def host_work(self) -> contextlib.AbstractContextManager:
        """What the host thread's own work around a launch (binding inputs, copying outputs) runs in: on the
        cpu backends one torch thread, leaving the cores to the workers (``cpu.one_torch_thread``)."""

    def settle(self) -> None:
        """Finish this process's pending writes to the heap (inputs, poison) before the ranks meet."""

    def launch(self, args: dict[str, int], abort: torch.Tensor) -> float:
        """Run every worker once with the kernel arguments ``args``; return the seconds the launch took
        (GPU: device time). On a failure, set ``abort`` (the rank's abort word) so the other workers
        stop, and raise ``BackendError``. Interrupted (KeyboardInterrupt), return only when no worker
        runs any more (or set ``lost_workers``), then re-raise."""

    def capture(self, args: dict[str, int], abort: torch.Tensor) -> Callable[[], None]:
        """The launch with ``args`` recorded once: a function that enqueues it again with no host work (GPU:
        a CUDA/HIP graph replayed on the current stream; cpu: the launch, run again)."""

    def synchronize(self, launches: int) -> None:
        """Return when this rank's ``launches`` launches enqueued since the last wait have ended
        (``BackendError`` if one failed or does not end in time)."""

    def close(self) -> None:
        """Release the heap and the workers' mappings of it."""


@dataclass(frozen=True)
class BackendRequest:
    """What a kernel asks of its backend; each backend takes the part it needs."""

    name: str                   # the concrete backend, a key of ``KINDS``
    group: Group                # this rank's host group
    kernel_path: Path           # the generated kernel module
    row_words: int              # words per task row: the kernel's ROW
    trace: bool                 # the kernel records spans: its TRACE
    workers: int | None         # persistent programs of this rank; None: as many as the backend likes
    timeout: float              # seconds any single wait may take
    pool: WorkerPool | None     # the worker processes of a host backend; None: the shared pool
    specs: list[Spec]           # what each opcode runs (the torch backend runs the task types' references)
    host_writes: HostWrites     # the host's writes of the kernel's inputs, kept up to date by the kernel


@dataclass(frozen=True)
class BackendKind:
    """A backend as the factory knows it."""

    target: str                                 # what ``codegen`` generates its kernel for
    gpu: bool                                   # runs on a GPU of its name's flavour (``gpu_flavour``)
    make: Callable[[BackendRequest], Backend]
    # The workers a model's tiles are best sized for (``Graph.parallelism``), given the workers asked for
    # (None: the backend's default); None: the kernel's own, known once it is built (a GPU's resident programs)
    tile_parallelism: Callable[[int | None], int | None]
    few_tiles: bool = False  # a tile costs a host call here: ops cut into few tiles that loop (``Graph.few_tiles``)
    prefill_rows: bool = True  # a model has prefill rows by default (``ServingConfig.prefill_chunk``)


def _make_cpu(request: BackendRequest) -> Backend:
    return CpuBackend(request.group, request.kernel_path, request.workers, request.pool)


def _make_torch(request: BackendRequest) -> Backend:
    return TorchBackend(request.group, request.kernel_path, request.workers, request.pool, request.specs,
                        request.host_writes)


def _make_gpu(request: BackendRequest) -> Backend:
    return GpuBackend(request.name, request.group, request.kernel_path, request.row_words, request.trace,
                      request.workers, request.timeout)


# The interpreter runs a few tiles of each op best (parallelism 1: 32-row GEMV tiles); torch pays ~10-30 us a
# task, so each op is about one tile per worker there (few tiles, each a torch call over all its blocks).
KINDS: dict[str, BackendKind] = {
    "cpu": BackendKind(target="interpreter", gpu=False, make=_make_cpu, tile_parallelism=lambda workers: 1,
                       prefill_rows=False),
    "torch": BackendKind(target="interpreter", gpu=False, make=_make_torch,
                         tile_parallelism=lambda workers: workers or 2, few_tiles=True),
    "cuda": BackendKind(target="cuda", gpu=True, make=_make_gpu, tile_parallelism=lambda workers: workers),
    "hip": BackendKind(target="hip", gpu=True, make=_make_gpu, tile_parallelism=lambda workers: workers),
}
BACKENDS = ("auto", *KINDS)


@functools.cache
def largest_heap() -> int:
    """The most bytes a heap could take on any backend of this machine: the shared-memory folder's size
    (cpu) or the largest GPU's memory. A graph past it can never run, so it is refused as it is built."""
    shm = os.statvfs(SHM_DIR)
    gpus = [torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())]
    return max([shm.f_blocks * shm.f_frsize, *gpus])


def gpu_flavour() -> str | None:
    """"hip" on a ROCm build of torch with a device, "cuda" on a CUDA build with one, else None."""
    if not torch.cuda.is_available():
        return None
    return "hip" if torch.version.hip else "cuda"


def resolve(backend: str) -> str:
    """The concrete backend for ``backend``: "auto" is what ``launch`` chose, else the GPU if there is one."""
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = default_backend()
    if backend == "auto":
        return gpu_flavour() or "cpu"
    if KINDS[backend].gpu and gpu_flavour() != backend:
        found = gpu_flavour()
        raise BackendError(f"backend {backend!r} needs a {'ROCm' if backend == 'hip' else 'CUDA'} build of torch "
                           f"and a visible GPU; this process has "
                           f"{f'a {found} device' if found else 'no GPU'} (torch {torch.__version__})")
    return backend
