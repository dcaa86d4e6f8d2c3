"""The cpu backend: workers are OS processes, each running the kernel under the Triton interpreter.

The interpreter runs a launch's programs one after another, so a program waiting on another program
of the same launch would hang; each worker is therefore its own process running a grid of one, with
its worker id as an argument, and all workers share the heap through shared memory.

Starting a process that imports torch and triton costs seconds, so workers live in a pool that
outlives kernels: a kernel maps its heap into the pool's first ``workers`` processes once, and every
run sends each of them one message.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from .errors import BackendError
from .heap import SharedHeap

PR_SET_PDEATHSIG = 1


@dataclass
class Launch:
    """One worker's share of a run."""

    heap: str                  # name of the kernel's heap segment (already mapped by the worker)
    kernel: str                # path of the generated kernel module
    worker: int
    rank: int
    args: dict[str, int]       # the kernel's integer arguments, ROW included


def _die_with_parent() -> None:
    """Ask Linux to kill this worker when the process that started it dies, even mid-kernel."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return  # not Linux: the worker still exits when its socket closes, after its current run
    if os.getppid() == 1:  # the parent died before the request took effect
        os._exit(1)


def _worker_main(fd: int) -> None:
    """A worker's life: map heaps, run kernels, until the pool closes the connection."""
    from .codegen import load_kernel

    _die_with_parent()
    conn = Connection(fd)
    heaps: dict[str, list[SharedHeap]] = {}   # by the kernel's own heap name: every rank's heap
    bases: dict[str, torch.Tensor] = {}       # by the same name: their addresses here, in rank order
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        command, payload = message
        try:
            if command == "map":
                names, rank, size = payload
                mapped = [SharedHeap(name, size) for name in names]
                heaps[names[rank]] = mapped
                bases[names[rank]] = torch.tensor([heap.address for heap in mapped], dtype=torch.int64)
                conn.send(("ok", None))
            elif command == "unmap":
                bases.pop(payload, None)
                for heap in heaps.pop(payload, []):
                    heap.close()
                conn.send(("ok", None))
            elif command == "run":
                launch: Launch = payload
                kernel = load_kernel(launch.kernel)
                args = dict(launch.args)
                constexprs = {name: args.pop(name) for name in ("ROW", "TRACE")}
                start = time.perf_counter()
                kernel[(1,)](bases[launch.heap].data_ptr(), launch.rank, launch.worker, **args, **constexprs)
                conn.send(("ok", time.perf_counter() - start))
            else:
                conn.send(("error", f"unknown command {command!r}"))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class _Worker:
    """A worker process started with ``python -m`` (no re-import of the user's main module, unlike
    multiprocessing's spawn), talking over a socket pair; it exits when its end of the socket closes."""

    def __init__(self):
        parent, child = socket.socketpair()
        env = dict(os.environ, TRITON_INTERPRET="1")  # read by triton at import
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from megakernel.cpu_backend import _worker_main; _worker_main({child.fileno()})"],
            pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL)
        child.close()
        self.conn = Connection(parent.detach())

    def send(self, command: str, payload) -> None:
        try:
            self.conn.send((command, payload))
        except OSError:
            raise BackendError(f"worker process {self.process.pid} died "
                               f"(exit code {self.process.poll()})") from None

    def request(self, command: str, payload, timeout: float | None = None):
        self.send(command, payload)
        return self.reply(timeout)

    def reply(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.conn.poll(0.05):
            if self.process.poll() is not None:
                raise BackendError(f"worker process {self.process.pid} died (exit code {self.process.returncode})")
            if deadline is not None and time.monotonic() > deadline:
                raise BackendError(f"worker process {self.process.pid} did not answer within {timeout} s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise BackendError(f"worker process {self.process.pid} closed its pipe") from None
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
            self.process.kill()
            self.process.wait()


class WorkerPool:
    """Interpreter worker processes, started on demand and reused by every kernel that uses this pool."""

    START_TIMEOUT = 120.0

    def __init__(self):
        self.workers: list[_Worker] = []

    def ensure(self, count: int) -> list[_Worker]:
        """The first ``count`` workers, started now if the pool has fewer (all at once: they import in parallel)."""
        for worker in self.workers:
            if not worker.alive():
                worker.stop()
        self.workers = [w for w in self.workers if w.alive()]
        fresh = [_Worker() for _ in range(count - len(self.workers))]
        for worker in fresh:
            worker.reply(self.START_TIMEOUT)
        self.workers.extend(fresh)
        return self.workers[:count]

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers = []


_default_pool: WorkerPool | None = None


def default_pool() -> WorkerPool:
    """The pool kernels share unless given one; ``shutdown()`` stops it (a later kernel starts a new one)."""
    global _default_pool
    if _default_pool is None:
        _default_pool = WorkerPool()
    return _default_pool


def shutdown() -> None:
    global _default_pool
    if _default_pool is not None:
        _default_pool.close()
        _default_pool = None


atexit.register(shutdown)
