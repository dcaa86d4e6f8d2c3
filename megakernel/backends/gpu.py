"""The cuda and hip backends: every worker of a rank is a program of one persistent launch on its GPU,
and the heap is device memory.

Process ranks (one GPU each) share their heaps by IPC: each rank exports what peers write as an IPC
handle (on cuda the whole heap, through torch's ``cudaIpcGetMemHandle``; on hip the comm area, a
fine-grained allocation of its own: ``finegrained``), the ranks exchange handles over the host
group, and each opens its peers' and enables peer access to their GPUs, so a store through a peer's
base lands in that GPU's memory. Virtual ranks (threads of one process) carve their heaps from
allocations rank 0 makes on one GPU and launch on streams of their own, each rank with its share of
the programs that can be resident at once.

A persistent kernel whose programs wait on each other deadlocks if one of them is not resident, so
the grid is checked against the compiled kernel's registers and shared memory before any launch, and
a process rank launches cooperatively where Triton can (the driver then refuses a grid that cannot be
resident at once, e.g. because another process holds SMs, instead of a hang). Virtual ranks' R
kernels must run at once: each stream needs a hardware queue of its own (``check_queues``).

The host path of a launch is short: the compiled kernel is launched through its own launcher
(``_enqueue``; none of the JIT's argument binding and cache lookup), its arguments are the same for
every launch (the epoch lives on the device), and nothing synchronises until ``run`` waits for the
end. So a launch can be recorded in a CUDA (HIP) graph (``capture``) and replayed with no host
work; the runtime reads two words of status back after a run, the records only when they say so.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Callable

import torch

from .. import codegen, finegrained, occupancy
from ..errors import BackendError
from ..heap import Heaps, RankHeap, kernel_bases

NUM_WARPS = 4              # threads per program: 128 (NVIDIA) / 256 (AMD, wave64)
# The kernel inlines every tile; its register count is the heaviest tile's. On NVIDIA it is capped
# so that 4 programs fit per SM (65536 registers / (4 x 128 threads)): the GEMV tiles need about 4
# programs' loads in flight per SM to stream weights at full bandwidth (tasks/linear.py).
MAX_REGISTERS = 128
MAX_NETWORK_REGISTERS = 168  # 3 programs per SM: what NVSHMEM's device calls need (``launch_options``)


# Hardware queues streams map to, and their defaults: two kernels on streams that share a queue run
# one after the other, and a persistent kernel waiting on the other never ends.
QUEUES_ENV = {"cuda": ("CUDA_DEVICE_MAX_CONNECTIONS", 8), "hip": ("GPU_MAX_HW_QUEUES", 4)}


def launch_options(vendor: str, cooperative: bool = True, transport: str = "memory") -> dict[str, int]:
    """Compile options of every megakernel launch on ``vendor`` ("cuda" or "hip"); AOT checks use them too.
    ``cooperative``: launched as a cooperative grid, where this Triton supports it. A kernel of the nvshmem
    transport (``shmem``) takes more registers: with NVSHMEM 3.4's device library the collectives across
    nodes spill 16 bytes a thread at 128 and none at 168 (157 used: 3 programs per SM); 3.8's spills ~1 kB
    at 128, 376 bytes at 168 and none at 255 (bench/RESULTS.md)."""
    registers = MAX_REGISTERS if transport == "memory" else MAX_NETWORK_REGISTERS
    options = dict(num_warps=NUM_WARPS, **({"maxnreg": registers} if vendor == "cuda" else {}))
    if cooperative and "launch_cooperative_grid" in _backend_options(vendor):
        options["launch_cooperative_grid"] = True
    return options


def _backend_options(vendor: str) -> set[str]:
    if vendor == "cuda":
        from triton.backends.nvidia.compiler import CUDAOptions as Options
    else:
        from triton.backends.amd.compiler import HIPOptions as Options
    return {f.name for f in fields(Options)}


def check_queues(vendor: str, streams: int) -> None:
    """Refuse ``streams`` concurrent persistent kernels (virtual ranks) that the device's hardware queues
    would run one after the other."""
    name, default = QUEUES_ENV[vendor]
    queues = int(os.environ.get(name, default))
    if streams > queues:
        raise BackendError(f"{streams} virtual ranks need {streams} hardware queues to run their kernels at once; "
                           f"{name}={queues}{' (the default)' if name not in os.environ else ''}: set {name}="
                           f"{streams} or more before the process first uses the GPU")


_compile_lock = threading.Lock()  # virtual ranks build the same kernel: compile it once, not racing


def ipc_export(heap: torch.Tensor):
    """A picklable handle that another process opens with ``ipc_open`` (the heap must outlive it)."""
    from torch.multiprocessing.reductions import reduce_tensor
    return reduce_tensor(heap)


def ipc_open(handle) -> torch.Tensor:
    rebuild, args = handle
    return rebuild(*args)


def enable_peer_access(device: torch.device, peer: torch.device) -> None:
    """Let kernels on ``device`` load and store ``peer``'s memory. Opening an IPC handle enables access
    only for the exporting device's context; torch enables it for a pair on their first copy."""
    if peer != device:
        if not torch.cuda.can_device_access_peer(device.index, peer.index):
            raise BackendError(f"{device} cannot access {peer}'s memory (no peer-to-peer path between them)")
        torch.empty(1, device=peer).copy_(torch.empty(1, device=device))


def driver_programs_per_unit(compiled) -> int | None:
    """What the CUDA driver says fits per SM for this loaded kernel (its shared-memory carveout
    included); None on ROCm."""
    if torch.version.hip:
        return None
    import ctypes
    blocks = ctypes.c_int()
    libcuda = ctypes.CDLL("libcuda.so.1")
    result = libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(compiled.function), NUM_WARPS * 32, ctypes.c_size_t(compiled.metadata.shared))
    return blocks.value if result == 0 else None


class GpuBackend:
    """One persistent launch per run on this process's current GPU; see the module docstring."""

    def __init__(self, name: str, group, kernel_path: Path, row_words: int, trace: bool, workers: int | None,
                 timeout: float):
        self.name, self.group, self.kernel_path = name, group, kernel_path
        self.device = torch.device("cuda", torch.cuda.current_device())
        if not group.virtual and group.world_size > torch.cuda.device_count():
            # kernels of different processes take turns on a GPU: ranks sharing one would wait forever
            raise BackendError(f"{group.world_size} process ranks need a GPU each; this machine has "
                               f"{torch.cuda.device_count()}: use launch(..., virtual=True) to share one")
        # A launch that outlives this is stuck outside any wait (each wait ends within ``timeout``).
        self.launch_limit = 10 * timeout + 60
        if group.virtual:
            check_queues(name, group.world_size)
        self.kernel = codegen.load_kernel(kernel_path)
        # Cooperative launches of virtual ranks' concurrent kernels are untried: those launch plainly.
        self.options = launch_options(name, cooperative=not group.virtual)
        # The arguments are all int64 and unspecialised (codegen): any values compile the one kernel.
        self.constants = (row_words, trace)  # ROW and TRACE: the compiled kernel's constexprs
        self.compiled = self._compile(dict.fromkeys(codegen.KERNEL_ARGS, 0) | dict(ROW=row_words, TRACE=trace))
        self.limits = occupancy.device_limits(self.device.index)
        self.resources = occupancy.kernel_resources(self.compiled, NUM_WARPS)
        per_unit = occupancy.programs_per_unit(self.limits, self.resources)
        driver = driver_programs_per_unit(self.compiled)
        if driver is not None and driver < per_unit:  # trust the stricter: a non-resident program deadlocks
            self.limits = replace(self.limits, max_programs_per_unit=driver)
        self.share = group.world_size if group.virtual else 1  # virtual ranks: R kernels resident together
        self.workers = occupancy.max_grid(self.limits, self.resources) // self.share if workers is None else workers
        self._check()
        self.stream = torch.cuda.Stream(self.device)
        self.heaps: list[RankHeap] = []
        self.bases: torch.Tensor | None = None
        self.lost_workers = False  # an interrupted launch is waited for: it ends by the device watchdog

    def _compile(self, args: dict[str, int]):
        """The compiled kernel these arguments (ROW and TRACE included) launch, loaded: compiled now if
        new, once for all virtual ranks."""
        with _compile_lock:
            compiled = self.kernel.warmup(**args, **self.options, grid=(1,))
            compiled._init_handles()
            return compiled

    def _check(self) -> None:
        """Refuse a grid that the device cannot hold at once, with the numbers."""
        try:
            occupancy.check_grid(self.workers * self.share, self.limits, self.resources)
        except BackendError as error:
            ranks = f" ({self.share} virtual ranks of {self.workers} workers)" if self.share > 1 else ""
            raise BackendError(f"rank {self.group.rank}{ranks}: {error}") from None

    def allocate(self, data_size: int, comm_size: int) -> Heaps:
        """The heaps: on cuda each rank's data and comm areas in one allocation (the comm area right after
        the data); on hip the comm area fine-grained (``finegrained``), a peer's data area not mapped
        (nothing reads it). Virtual ranks' areas are slices of allocations rank 0 makes."""
        group, rank, world = self.group, self.group.rank, self.group.world_size
        if group.topology.node_count > 1:
            raise BackendError(f"ranks on {group.topology.node_count} nodes: the {self.name} backend maps its peers' "
                               f"memory by IPC within a node; across nodes its puts are NVSHMEM's "
                               f"(compiled only: megakernel aot --transport nvshmem), not run yet")
        split = self.name == "hip"
        size = data_size if split else data_size + comm_size  # of the data allocation

        def heap_of(memory: torch.Tensor, comm: torch.Tensor | None) -> RankHeap:
            return RankHeap(memory, comm) if split else RankHeap.split(memory, data_size)

        if group.virtual:  # rank 0 allocates for everyone; each rank's areas are slices
            made = (torch.zeros(world * size, dtype=torch.uint8, device=self.device),
                    finegrained.allocate(world * comm_size, self.device) if split else None) if rank == 0 else None
            whole, comm = group.all_gather(made)[0]
            heaps = [heap_of(whole[r * size:(r + 1) * size], comm[r * comm_size:(r + 1) * comm_size] if split else None)
                     for r in range(world)]
        else:
            own = torch.zeros(size, dtype=torch.uint8, device=self.device)
            own_comm = finegrained.allocate(comm_size, self.device) if split else None

            def peer(handle) -> RankHeap:  # on hip only its comm area: nothing reads a peer's data
                if split:
                    return RankHeap(own[:0], finegrained.open_handle(handle, comm_size, self.device))
                return heap_of(ipc_open(handle), None)

            try:
                handles = group.all_gather(finegrained.export(own_comm) if split else ipc_export(own))
                heaps = [heap_of(own, own_comm) if r == rank else peer(h) for r, h in enumerate(handles)]
                for heap in heaps:
                    enable_peer_access(self.device, heap.comm.device)
            except RuntimeError as error:
                raise BackendError(f"rank {rank}: could not share heaps by IPC on {self.device}: {error}") from None
        self.heaps = heaps
        bases, delta = kernel_bases(heaps, rank)
        self.bases = torch.tensor(bases, dtype=torch.int64, device=self.device)
        torch.cuda.synchronize(self.device)
        group.barrier(timeout=120, why="map every heap")
        return Heaps(heaps[rank], {r: h for r, h in enumerate(heaps) if r != rank}, delta)

    def free_memory(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def host_work(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def settle(self) -> None:
        # This thread's stream only: a virtual peer's kernel may be running on the same device.
        torch.cuda.current_stream(self.device).synchronize()

    def launch(self, args: dict[str, int], abort: torch.Tensor) -> float:
        # ``abort`` is for workers the host must stop; a launch either runs every program or none,
        # and the device watchdog ends every wait, so there is nothing to stop from here.
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        try:
            start.record(self.stream)
            self._enqueue(args)
            end.record(self.stream)
            self._wait(end, self.launch_limit)
        except KeyboardInterrupt:  # the programs' waits time out by themselves: let them end before going on
            try:
                self.stream.synchronize()
            except BaseException:  # interrupted again: the launch may still be running on this heap
                self.lost_workers = True
                raise
            raise
        except Exception as error:  # a fault makes the CUDA/HIP context unusable: say where it happened
            raise self._failed("launch", error) from None
        current.wait_stream(self.stream)
        return start.elapsed_time(end) / 1e3

    def _enqueue(self, args: dict[str, int]) -> None:
        """Launch every worker on ``self.stream`` through the compiled kernel's own launcher: no argument
        binding or cache lookup of the JIT path, nothing that synchronises (a graph may record it)."""
        args = dict(bases_addr=self.bases.data_ptr(), rank=self.group.rank, worker=0, **args)
        if (args["ROW"], args["TRACE"]) != self.constants:
            raise BackendError(f"the kernel was compiled for (ROW, TRACE) = {self.constants}, launched with "
                               f"{(args['ROW'], args['TRACE'])}")
        values = [args[name] for name in codegen.KERNEL_ARGS] + [args["ROW"], args["TRACE"]]
        self.compiled[(self.workers, 1, 1)](*values, stream=self.stream.cuda_stream)

    def capture(self, args: dict[str, int], abort: torch.Tensor) -> Callable[[], None]:
        graph = torch.cuda.CUDAGraph()
        try:  # thread-local capture: virtual ranks (threads) record theirs at the same time
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                self._enqueue(args)
        except Exception as error:
            raise self._failed("recording of the launch in a graph", error) from None

        def replay() -> None:
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):  # a stream of this rank's own: virtual ranks run at once
                graph.replay()
            current.wait_stream(self.stream)
        return replay

    def synchronize(self, launches: int) -> None:
        end = torch.cuda.Event()
        try:
            end.record(self.stream)
            self._wait(end, max(launches, 1) * self.launch_limit)
        except Exception as error:
            raise self._failed("launch", error) from None

    def _failed(self, what: str, error: Exception) -> BackendError:
        if isinstance(error, BackendError):
            return error
        return BackendError(f"rank {self.group.rank}: the {self.name} {what} of {self.workers} programs on "
                            f"{self.device} failed: {type(error).__name__}: {error}")

    def _wait(self, end: torch.cuda.Event, limit: float) -> None:
        """Until ``end`` (recorded after the launches) is reached: spin briefly (a decode step takes
        microseconds), then poll with sleeps, up to ``limit`` seconds."""
        started = time.monotonic()
        while not end.query():
            waited = time.monotonic() - started
            if waited > limit:
                raise BackendError(f"still running after {limit:.0f} s although every wait ends within "
                                   f"the timeout: a program is stuck outside a wait (not resident, or a fault)")
            if waited > 1e-3:
                time.sleep(min(waited / 10, 0.01))

    def close(self) -> None:
        self.heaps, self.bases = [], None  # torch (a hip comm area: finegrained) frees the memory, closes mappings
