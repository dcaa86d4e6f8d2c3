"""The cpu backend: workers are OS processes, each running the kernel under the Triton interpreter.

The interpreter runs a launch's programs one after another, so a program waiting on another program
of the same launch would hang; each worker is therefore its own process running a grid of one, with
its worker id as an argument, and all workers share the heap through shared memory.

Starting a process that imports torch and triton costs seconds, so workers live in a pool that
outlives kernels: a kernel maps its heap into the pool's first ``workers`` processes once, and every
run sends each of them one message. Every message carries a number that its reply repeats, so a
reply can never be taken for another's; a pool serves one kernel at a time (its lock), so kernels
may run from several threads; and a run interrupted in the host (Ctrl-C) stops its workers before
the interrupt goes on: no worker is left running on a heap that the next run will use.

A worker runs the kernel under the interpreter unless a run names another loop (``Launch.loop``: the
torch backend's), which the worker imports by that name: this module knows no other backend.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..codegen import load_kernel
from ..errors import BackendError, GraphError
from ..heap import SHM_DIR, Heaps, RankHeap, SharedHeap

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds this megakernel package
PR_SET_PDEATHSIG = 1
_spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megakernel-spawner")
# glibc's malloc in a worker (each setting unless the caller's environment has it): a tile's temporaries of
# more than 128 KiB came from fresh mappings (the threshold rises only to the largest block freed), and freed
# memory at the heap's top went back to the kernel, so each step faulted those pages in again: an eight-row
# attention tile at 200 positions (two 1.3 MB key and value copies a layer) took ~1.9 ms, 0.6 with these
# (SmolLM2, one core). Blocks below 32 MiB (glibc's largest threshold) come from the heap, which keeps up to
# 256 MiB freed at its top.
MALLOC_SETTINGS = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(256 << 20)}


@dataclass
class Launch:
    """One worker's share of a run."""

    heap: str                  # key of the kernel's heap mapping in the worker (see ``Part.key``)
    kernel: str                # path of the generated kernel module
    worker: int
    rank: int
    args: dict[str, int]       # the kernel's integer arguments, ROW and TRACE included
    loop: str | None = None    # what runs the worker, "module:function" (``run_loop``); None: the kernel, interpreted
    extras: dict = field(default_factory=dict)  # what the loop takes besides (torch: specs, threads)


@dataclass(frozen=True)
class Part:
    """Where a rank's heap lies: ``size`` bytes at ``offset`` of segment ``name`` (virtual ranks share one)."""

    name: str
    segment_size: int
    offset: int
    size: int

    @property
    def key(self) -> str:
        return f"{self.name}@{self.offset}"


def die_with_parent() -> None:
    """Ask Linux to kill this process (a worker, a rank) when the process that started it dies, even mid-kernel."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # not Linux: the worker still exits when its socket closes, after its current run
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def _worker_main(fd: int) -> None:
    """A worker's life: map heaps, run kernels, until the pool closes the connection."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the process that runs the kernel: it stops us
    conn = Connection(fd)
    heaps: dict[str, list[SharedHeap]] = {}   # by the kernel's own heap key: the segments it maps
    bases: dict[str, torch.Tensor] = {}       # by the same key: every rank's heap address here, in rank order
    wholes: dict[str, list[torch.Tensor]] = {}  # by the same key: every rank's whole heap, in rank order
    programs: dict[str, dict] = {}  # by the same key: what a named loop made of the kernel's tables
    conn.send((0, "ok", os.getpid()))
    while True:
        try:
            number, command, payload = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if command == "map":
                parts, rank = payload
                mapped = {p.name: SharedHeap(p.name, p.segment_size) for p in parts}
                heaps[parts[rank].key] = list(mapped.values())
                # every rank's heap here: with each comm area right after its data area, the kernel's bases
                # (``heap.kernel_bases``: every comm area less delta = data_size) are the heaps' starts
                bases[parts[rank].key] = torch.tensor([mapped[p.name].address + p.offset for p in parts],
                                                      dtype=torch.int64)
                wholes[parts[rank].key] = [mapped[p.name].tensor[p.offset:p.offset + p.size] for p in parts]
                conn.send((number, "ok", None))
            elif command == "unmap":
                bases.pop(payload, None)
                wholes.pop(payload, None)
                programs.pop(payload, None)
                for heap in heaps.pop(payload, []):
                    heap.close()
                conn.send((number, "ok", None))
            elif command == "run":
                launch: Launch = payload
                start = time.perf_counter()
                if launch.loop is not None:
                    run_loop(launch.loop)(wholes[launch.heap], launch.rank, launch.worker, launch.args,
                                          programs.setdefault(launch.heap, {}), **launch.extras)
                else:
                    kernel = load_kernel(launch.kernel)
                    args = dict(launch.args)
                    constexprs = {name: args.pop(name) for name in ("ROW", "TRACE")}
                    kernel[(1,)](bases[launch.heap].data_ptr(), launch.rank, launch.worker, **args, **constexprs)
                conn.send((number, "ok", time.perf_counter() - start))
            else:
                conn.send((number, "error", f"unknown command {command!r}"))
        except Exception:
            conn.send((number, "error", traceback.format_exc()))


def run_loop(name: str) -> Callable[..., None]:
    """The worker loop named ``name``, "module:function" (``Launch.loop``), imported on its first run."""
    module, function = name.split(":")
    return getattr(importlib.import_module(module), function)


class _Worker:
    """A worker process started with ``python -c`` (no re-import of the user's main module, unlike
    multiprocessing's spawn), talking over a socket pair; it exits when its end of the socket closes."""

    def __init__(self):
        parent, child = socket.socketpair()
        # TRITON_INTERPRET is read by triton at import; the package's own folder first, so that the worker
        # imports the megakernel its parent did (a checkout that is not installed, run from anywhere)
        env = dict({**MALLOC_SETTINGS, **os.environ}, TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join(filter(None, (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")))))
        command = [sys.executable, "-c", f"from megakernel.backends.cpu import _worker_main; _worker_main({child.fileno()})"]
        # Linux sends the parent-death signal when the *thread* that started the child ends: a virtual
        # rank's thread ends with its launch, but its pool lives on. Start workers from one thread that
        # lives as long as the process.
        self.process = _spawner.submit(subprocess.Popen, command, pass_fds=(child.fileno(),), env=env,
                                       stdin=subprocess.DEVNULL).result()
        child.close()
        self.conn = Connection(parent.detach())
        self.sent = 0     # messages numbered so far; the worker's first message (ready) answers number 0
        self.inbox = {}   # replies read while waiting for another: number -> (status, value)

    def send(self, command: str, payload) -> int:
        """Send a message; its number, which its reply repeats (numbered before it goes: an interrupt
        after the send cannot leave the next message the same number)."""
        self.sent += 1
        try:
            self.conn.send((self.sent, command, payload))
        except OSError:
            raise BackendError(f"worker process {self.process.pid} died "
                               f"(exit code {self.process.poll()})") from None
        return self.sent

    def request(self, command: str, payload, timeout: float | None = None):
        return self.reply(self.send(command, payload), timeout)

    def reply(self, number: int, timeout: float | None = None):
        """The reply to message ``number``; replies to other messages read meanwhile are kept for them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while number not in self.inbox:
            while not self.conn.poll(0.05):
                if self.process.poll() is not None:
                    raise BackendError(f"worker process {self.process.pid} died (exit code {self.process.returncode})")
                if deadline is not None and time.monotonic() > deadline:
                    raise BackendError(f"worker process {self.process.pid} did not answer within {timeout} s")
            try:
                answered, status, value = self.conn.recv()
            except (EOFError, OSError):
                raise BackendError(f"worker process {self.process.pid} closed its pipe "
                                   f"(exit code {self.process.poll()})") from None
            self.inbox[answered] = (status, value)
        status, value = self.inbox.pop(number)
        if status == "error":
            raise BackendError(f"worker process {self.process.pid} failed:\n{value}")
        return value

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        self.conn.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


class WorkerPool:
    """Interpreter worker processes, started on demand and reused by every kernel that uses this pool."""

    START_TIMEOUT = 120.0

    def __init__(self):
        self.workers: list[_Worker] = []
        self.lock = threading.RLock()  # one kernel's requests at a time: kernels of several threads share a pool

    def ensure(self, count: int) -> list[_Worker]:
        """The first ``count`` workers, started now if the pool has fewer (all at once: they import in parallel)."""
        for worker in self.workers:
            if not worker.alive():
                worker.stop()
        self.workers = [w for w in self.workers if w.alive()]
        fresh = [_Worker() for _ in range(count - len(self.workers))]
        for worker in fresh:
            worker.reply(0, self.START_TIMEOUT)
        self.workers.extend(fresh)
        return self.workers[:count]

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers = []


_default_pools: dict[int, WorkerPool] = {}
_default_pools_lock = threading.Lock()


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a server such as vLLM pins its workers), which its
    worker processes inherit."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch on one thread in the calling thread meanwhile. After a parallel op torch's other OpenMP threads
    spin for milliseconds before they sleep (GNU OpenMP's spin count), on the cores a launch's workers
    run on: a launch's first step of SmolLM2 on two torch workers took ~15 ms more when the host had just
    copied the last launch's logits on two threads. (OpenMP's thread count is the calling thread's:
    another thread of the process keeps its own.)"""
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def default_pool(slot: int = 0) -> WorkerPool:
    """The pool kernels share unless given one, one per virtual rank (``slot``: a rank's workers must
    not be another rank's); ``shutdown()`` stops them (a later kernel starts new ones)."""
    with _default_pools_lock:
        return _default_pools.setdefault(slot, WorkerPool())


def default_pool_pids() -> set[int]:
    """The processes of every default pool of this process (one pool per virtual rank that ran)."""
    return {w.process.pid for pool in _default_pools.values() for w in pool.workers}


def shutdown() -> None:
    with _default_pools_lock:
        pools = list(_default_pools.values())
        _default_pools.clear()
    for pool in pools:
        with pool.lock:
            pool.close()


class CpuBackend:
    """Workers are processes of a pool; the heap is shared memory that every worker maps."""

    name = "cpu"
    loop: str | None = None  # what runs each worker (``Launch.loop``): the kernel, interpreted
    DEFAULT_WORKERS = 2
    MAX_WORKERS = 256
    STOP_SECONDS = 10.0  # how long an interrupted run's workers get to stop at their next wait

    def __init__(self, group, kernel_path: Path, workers: int | None, pool: WorkerPool | None):
        self.group, self.kernel_path = group, kernel_path
        self.workers = self.DEFAULT_WORKERS if workers is None else workers
        if self.workers > self.MAX_WORKERS:  # before the scheduler sizes anything by it
            raise GraphError(f"workers={self.workers:,}: the {self.name} backend runs at most {self.MAX_WORKERS} (each a "
                             f"process of ~300 MB)")
        cores = usable_cores()
        if self.workers > 2 * cores:
            warnings.warn(f"{self.workers} {self.name} workers on {cores} cores: each is a process that spins while it waits, "
                          f"so they take turns and a run slows down; each also takes ~2 s and ~300 MB to start",
                          stacklevel=4)  # the caller of Megakernel
        self.pool = pool or default_pool(group.slot)
        self.processes: list[_Worker] = []
        self.segments: dict[int, SharedHeap] = {}  # mapped here, by rank: this rank's and its node's (or the one shared)
        self.key = ""
        self.lost_workers = False  # an interrupted run had to kill some: the heap is mapped in no others

    def _launch_extras(self) -> dict:
        return {}

    def free_memory(self) -> int:
        shm = os.statvfs(SHM_DIR)
        return shm.f_bavail * shm.f_frsize

    def allocate(self, data_size: int, comm_size: int) -> Heaps:
        group, rank = self.group, self.group.rank
        topology = group.topology
        far = [r for r in range(group.world_size) if not topology.same_node(r, rank)]
        # one segment: the data area, the comm area, then a shadow comm area per peer on another node
        size = data_size + comm_size * (1 + len(far))
        if group.virtual:  # rank 0 makes one segment; each rank's heap is a slice of it (one node)
            created = SharedHeap.create(group.world_size * size) if rank == 0 else None
            segment = group.all_gather(created)[0]
            self.segments = {0: segment}  # made by rank 0
            parts = [Part(segment.name, segment.size, r * size, size) for r in range(group.world_size)]
            tensors = {r: segment.tensor[r * size:(r + 1) * size] for r in range(group.world_size)}
        else:
            created = SharedHeap.create(size)
            names = group.all_gather(created.name)
            self.segments = {r: created if r == rank else SharedHeap(name, size)
                             for r, name in enumerate(names) if r not in far}
            parts = [Part(name, size, 0, size) for name in names]
            tensors = {r: heap.tensor for r, heap in self.segments.items()}
        shadows = {}
        for k, peer in enumerate(far):
            # the worker's bases: peer's comm area less delta (= data_size) lands on the shadow's start
            at = comm_size * (1 + k)
            parts[peer] = Part(created.name, size, at, data_size + comm_size)
            shadows[peer] = created.tensor[data_size + at:data_size + at + comm_size]
        self.key = parts[rank].key
        try:
            with self.pool.lock:
                self.processes = self.pool.ensure(self.workers)
                for worker in self.processes:
                    worker.request("map", (parts, rank), timeout=60)
            group.barrier(timeout=120, why="map every heap")
        finally:
            if created is not None:
                created.unlink()  # mapped by every process that needs it: the name can go now
        heaps = {r: RankHeap.split(tensor[:data_size + comm_size], data_size) for r, tensor in tensors.items()}
        return Heaps(heaps.pop(rank), heaps, delta=data_size, shadows=shadows)

    def settle(self) -> None:
        pass  # host writes to shared memory are visible at once

    def host_work(self) -> contextlib.AbstractContextManager:
        return one_torch_thread()  # the workers have the cores

    def launch(self, args: dict[str, int], abort: torch.Tensor) -> float:
        with self.pool.lock:
            start = time.perf_counter()
            failure, running = None, {}  # worker -> its run message's number, until answered
            try:
                extras = self._launch_extras()
                for w, worker in enumerate(self.processes):
                    running[w] = worker.sent + 1  # before the send: an interrupt after it still waits for it
                    try:
                        worker.send("run", Launch(self.key, str(self.kernel_path), w, self.group.rank, args,
                                                  self.loop, extras))
                    except BackendError as error:
                        failure = failure or BackendError(f"worker {w}: {error}")
                        del running[w]
                for w in list(running):
                    if failure is not None:
                        abort.fill_(1)  # the other workers stop at their next wait
                    try:
                        self.processes[w].reply(running[w])
                    except BackendError as error:
                        failure = failure or BackendError(f"worker {w}: {error}")
                    del running[w]
            except BaseException:  # an interrupt: stop the run before it goes on
                abort.fill_(1)
                self._stop({self.processes[w]: number for w, number in running.items()})
                raise
            if failure is not None:
                raise failure
            return time.perf_counter() - start

    def capture(self, args: dict[str, int], abort: torch.Tensor) -> Callable[[], None]:
        return functools.partial(self.launch, dict(args), abort)  # no graphs to record: the same launch again

    def synchronize(self, launches: int) -> None:
        pass  # a launch returns when its workers have finished

    def _stop(self, running: dict) -> None:
        """Wait a little for the ``running`` workers (told to abort) to answer their run message; kill
        those that do not (the pool replaces them for new kernels; this one then refuses to run)."""
        deadline = time.monotonic() + self.STOP_SECONDS
        for worker, number in running.items():
            try:
                worker.reply(number, max(deadline - time.monotonic(), 0.0))
            except BaseException:  # no answer in time, a second interrupt, a dead worker
                worker.kill()
                self.lost_workers = True

    def close(self) -> None:
        with self.pool.lock:
            for worker in self.processes:
                try:
                    worker.request("unmap", self.key, timeout=30)
                except Exception:
                    pass  # a dead worker holds no mapping
        if not self.group.virtual:  # a virtual segment is shared: it goes with its last user
            self.segments[self.group.rank].unlink()
            for segment in self.segments.values():
                segment.close()
        self.segments, self.processes = {}, []


atexit.register(shutdown)
