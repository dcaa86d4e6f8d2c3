"""The cuda and hip backends: every worker of a rank is a program of one persistent launch on its GPU,
and the heap is device memory.

Process ranks (one GPU each) share their heaps by IPC: torch exports each rank's heap as an IPC
handle (``cudaIpcGetMemHandle``; on ROCm torch's HIP build calls ``hipIpcGetMemHandle``), the ranks
exchange handles over the host group, and each opens its peers' (peer access is enabled when a handle
is opened), so a store through a peer's base lands in that GPU's memory. Virtual ranks (threads of one
process) carve their heaps from one allocation on one GPU and launch on streams of their own, each
rank with its share of the programs that can be resident at once.

A persistent kernel whose programs wait on each other deadlocks if one of them is not resident, so
the grid is checked against the compiled kernel's registers and shared memory before any launch.
"""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from . import codegen, occupancy
from .backend import Heaps
from .errors import BackendError

NUM_WARPS = 4              # threads per program: 128 (NVIDIA) / 256 (AMD, wave64)
# The kernel inlines every tile; its register count is the heaviest tile's. On NVIDIA it is capped
# so that 4 programs fit per SM (65536 registers / (4 x 128 threads)): the GEMV tiles need about 4
# programs' loads in flight per SM to stream weights at full bandwidth (tasks/linear.py).
MAX_REGISTERS = 128


def launch_options(vendor: str) -> dict[str, int]:
    """Compile options of every megakernel launch on ``vendor`` ("cuda" or "hip"); AOT checks use them too."""
    return dict(num_warps=NUM_WARPS, **({"maxnreg": MAX_REGISTERS} if vendor == "cuda" else {}))
_compile_lock = threading.Lock()  # virtual ranks build the same kernel: compile it once, not racing


def ipc_export(heap: torch.Tensor):
    """A picklable handle that another process opens with ``ipc_open`` (the heap must outlive it)."""
    from torch.multiprocessing.reductions import reduce_tensor
    return reduce_tensor(heap)


def ipc_open(handle) -> torch.Tensor:
    rebuild, args = handle
    return rebuild(*args)


class GpuBackend:
    """One persistent launch per run on this process's current GPU; see the module docstring."""

    def __init__(self, name: str, group, kernel_path: Path, row_words: int, trace: bool, workers: int | None,
                 timeout_ns: int):
        self.name, self.group, self.kernel_path = name, group, kernel_path
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.kernel = codegen.load_kernel(kernel_path)
        # Triton types an int argument by its value (int32 or int64): compile with values of the types
        # the launches will have, addresses and the timeout above 2**31, offsets and counters below.
        typical = dict.fromkeys(codegen.KERNEL_ARGS, 0) | dict(bases_addr=1 << 40, epoch=1, timeout_ns=timeout_ns,
                                                               ROW=row_words, TRACE=trace)
        self.compiled = self._compile(typical, grid=1)
        self.limits = occupancy.device_limits(self.device.index)
        self.share = group.world_size if group.virtual else 1  # virtual ranks: R kernels resident together
        capacity = occupancy.max_grid(self.limits, occupancy.kernel_resources(self.compiled, NUM_WARPS))
        self.workers = capacity // self.share if workers is None else workers
        self._check(self.compiled)
        self.stream = torch.cuda.Stream(self.device)
        self.heaps: list[torch.Tensor] = []
        self.bases: torch.Tensor | None = None

    def _compile(self, args: dict[str, int], grid: int):
        """The compiled kernel these arguments (ROW and TRACE included) launch: compiled now if new,
        once for all virtual ranks."""
        with _compile_lock:
            return self.kernel.warmup(**args, **launch_options(self.name), grid=(grid,))

    def _check(self, compiled) -> None:
        """Refuse a grid that the device cannot hold at once, with the numbers."""
        try:
            occupancy.check_grid(self.workers * self.share, self.limits, occupancy.kernel_resources(compiled, NUM_WARPS))
        except BackendError as error:
            ranks = f" ({self.share} virtual ranks of {self.workers} workers)" if self.share > 1 else ""
            raise BackendError(f"rank {self.group.rank}{ranks}: {error}") from None

    def allocate(self, size: int) -> Heaps:
        group, rank = self.group, self.group.rank
        if group.virtual:  # rank 0 allocates for everyone; each rank's heap is a slice
            whole = torch.zeros(group.world_size * size, dtype=torch.uint8, device=self.device) if rank == 0 else None
            whole = group.all_gather(whole)[0]
            self.heaps = [whole[r * size:(r + 1) * size] for r in range(group.world_size)]
        else:
            own = torch.zeros(size, dtype=torch.uint8, device=self.device)
            try:
                handles = group.all_gather(ipc_export(own))
                self.heaps = [own if r == rank else ipc_open(h) for r, h in enumerate(handles)]
            except RuntimeError as error:
                raise BackendError(f"rank {rank}: could not share heaps by IPC on {self.device}: {error}") from None
        self.bases = torch.tensor([h.data_ptr() for h in self.heaps], dtype=torch.int64, device=self.device)
        torch.cuda.synchronize(self.device)
        group.barrier(timeout=120, why="map every heap")
        return Heaps(self.heaps[rank], {r: h for r, h in enumerate(self.heaps) if r != rank})

    def settle(self) -> None:
        # This thread's stream only: a virtual peer's kernel may be running on the same device.
        torch.cuda.current_stream(self.device).synchronize()

    def launch(self, args: dict[str, int], abort: torch.Tensor) -> float:
        # ``abort`` is for workers the host must stop; a launch either runs every program or none,
        # and the device watchdog ends every wait, so there is nothing to stop from here.
        args = dict(bases_addr=self.bases.data_ptr(), rank=self.group.rank, worker=0, **args)
        if args["epoch"] == 1:  # the arguments' types are fixed from now on: check what they compile to
            compiled = self._compile(args, grid=self.workers)
            if compiled is not self.compiled:
                self._check(compiled)
                self.compiled = compiled
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        try:
            with torch.cuda.stream(self.stream):
                start.record()
                self.kernel[(self.workers,)](**args, **launch_options(self.name))
                end.record()
            self.stream.synchronize()
        except Exception as error:  # a fault makes the CUDA/HIP context unusable: say where it happened
            raise BackendError(f"rank {self.group.rank}: the {self.name} launch of {self.workers} programs on "
                               f"{self.device} failed: {type(error).__name__}: {error}") from None
        current.wait_stream(self.stream)
        return start.elapsed_time(end) / 1e3

    def close(self) -> None:
        self.heaps, self.bases = [], None  # torch frees the memory and closes IPC mappings
