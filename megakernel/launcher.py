"""``launch``: run a function on every rank of a fresh process group (or of ``torchrun``'s), or on
virtual ranks: threads of this process.

Process ranks: the process group uses gloo on the cpu backend and NCCL/RCCL on GPUs (rank ``r`` on
GPU ``r mod devices``). Each rank is a process; on the cpu backend its kernels' workers are processes
of its own. Virtual ranks (``virtual=True``) run ``fn`` in one thread per rank; their kernels share
one heap allocation and, on a GPU, the one device: R persistent kernels resident at once on R
streams, each with its share of the SMs, so the multi-rank protocol meets real GPU memory semantics
with a single GPU. An exception in any rank is re-raised in the caller, naming the rank, and the
other ranks are stopped; shared-memory segments of the launch are removed whatever happened.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import secrets
import tempfile
import time
import threading
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable

from . import bootstrap
from .backends import KINDS, cpu, resolve
from .errors import BackendError, MegakernelError, check_timeout, is_count
from .heap import LAUNCH_ENV, remove_segments, sweep_orphans

TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
STORE_PREFIX = "megakernel-launch-"  # a launch's rendezvous folder: <prefix><launcher pid>-<random>


FAILED_GRACE = 10.0  # seconds the other virtual ranks get to end once one failed


class RankError(MegakernelError):
    """An exception raised in one rank of a launch; ``rank`` and ``error`` (the original) say which and what."""

    def __init__(self, rank: int, error: BaseException | None, remote_traceback: str):
        super().__init__(rank, error, remote_traceback)
        self.rank, self.error, self.remote_traceback = rank, error, remote_traceback

    def __str__(self) -> str:
        return f"rank {self.rank} raised {type(self.error).__name__}: {self.error}\n{self.remote_traceback}"


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE")) and any(k in os.environ for k in TORCHRUN_ENV)


def _init_group(rank: int, world_size: int, init_method: str, timeout: float, backend: str) -> None:
    import torch
    import torch.distributed as dist
    bootstrap.set_process_backend(backend)
    if KINDS[backend].gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group("nccl" if KINDS[backend].gpu else "gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))


def _rank_main(fn, rank: int, world_size: int, ranks_per_node: int, init_method: str, timeout: float, backend: str,
               conn) -> None:
    cpu.die_with_parent()  # a launcher killed outright takes its ranks (and their workers) along
    # torchrun's variables, which ``bootstrap.current_topology`` reads: ranks numbered node by node
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % ranks_per_node),
                      LOCAL_WORLD_SIZE=str(ranks_per_node), GROUP_RANK=str(rank // ranks_per_node))
    import torch.distributed as dist
    try:
        _init_group(rank, world_size, init_method, timeout, backend)
        result = fn()
        conn.send(("ok", pickle.dumps(result)))
    except BaseException as error:  # report everything, KeyboardInterrupt included
        try:
            payload = pickle.dumps(error)
        except Exception:
            payload = pickle.dumps(RuntimeError(repr(error)))
        conn.send(("error", (payload, traceback.format_exc())))
    finally:
        cpu.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[[], Any], world_size: int, backend: str = "auto", timeout: float = 600.0,
           virtual: bool = False, ranks_per_node: int | None = None) -> list[Any]:
    """Run ``fn()`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``backend`` ("auto": the GPU if there is one, else "cpu") is what kernels built with backend "auto"
    use. Process ranks: ``fn`` must be importable by name (a module-level function), as with
    ``torch.multiprocessing``; under ``torchrun`` the current process is one rank of the job: ``fn``
    runs here and the results of every rank are gathered. ``virtual=True``: the ranks are threads of
    this process sharing its device (any callable will do). ``ranks_per_node``: the ranks are on nodes
    of that many (None: one node; under torchrun, its nodes), ranks numbered node by node: ranks of one
    node map each other's heaps, the others share no memory and meet through the transport
    (``Megakernel.links``), as they would on machines of their own.
    """
    backend = resolve(backend)
    if not is_count(world_size):
        raise BackendError(f"world_size must be a positive integer, got {world_size!r}")
    timeout = check_timeout(timeout)
    bootstrap.Topology.uniform(world_size, ranks_per_node)  # refuses a count that does not divide the world
    per_node = ranks_per_node or world_size
    if virtual:
        if per_node != world_size:
            raise BackendError("virtual ranks are threads of one process, one node: ranks_per_node needs process "
                               "ranks (virtual=False)")
        return _launch_virtual(fn, world_size, backend, timeout)
    if _under_torchrun():
        if ranks_per_node is not None and str(ranks_per_node) != os.environ.get("LOCAL_WORLD_SIZE"):
            raise BackendError(f"launch(ranks_per_node={ranks_per_node}) under torchrun, whose nodes have "
                               f"LOCAL_WORLD_SIZE={os.environ.get('LOCAL_WORLD_SIZE')} ranks")
        return _launch_in_torchrun(fn, world_size, timeout, backend)
    context = mp.get_context("spawn")
    launch_id = secrets.token_hex(6)
    sweep_orphans(tempfile.gettempdir(), STORE_PREFIX)  # the stores of launchers that were killed outright
    with tempfile.TemporaryDirectory(prefix=f"{STORE_PREFIX}{os.getpid()}-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'store')}"
        ranks, conns = [], []
        with _environment(LAUNCH_ENV, launch_id):  # inherited by the ranks: names their heap segments
            for rank in range(world_size):
                parent, child = context.Pipe(duplex=False)
                process = context.Process(target=_rank_main,
                                          args=(fn, rank, world_size, per_node, init_method, timeout, backend, child),
                                          name=f"megakernel-rank-{rank}")
                process.start()
                child.close()
                ranks.append(process)
                conns.append(parent)
        try:
            return _collect(ranks, conns, timeout)
        finally:
            for process in ranks:
                if process.is_alive():
                    process.kill()
                process.join()
            remove_segments(launch_id)


@contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    """``os.environ[name] = value`` inside (for the ranks started meanwhile, processes or threads), as it was after."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def _collect(ranks, conns, timeout: float) -> list[Any]:
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    pending = {conn: rank for rank, conn in enumerate(conns)}
    sentinels = {ranks[rank].sentinel: rank for rank in range(len(ranks))}
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BackendError(f"launch timed out after {timeout} s; ranks still running: "
                               f"{sorted(pending.values())}")
        for ready in wait([*pending, *(s for s, r in sentinels.items() if r in pending.values())], timeout=left):
            if ready in pending:
                rank = pending.pop(ready)
                try:
                    status, payload = ready.recv()
                except EOFError:
                    raise BackendError(f"rank {rank} died (exit code {ranks[rank].exitcode})") from None
                if status == "error":
                    error, remote_traceback = payload
                    raise RankError(rank, pickle.loads(error), remote_traceback)
                results[rank] = pickle.loads(payload)
            else:
                rank = sentinels[ready]
                if rank in pending.values():
                    conn = next(c for c, r in pending.items() if r == rank)
                    if not conn.poll():
                        ranks[rank].join()
                        raise BackendError(f"rank {rank} died (exit code {ranks[rank].exitcode}) before "
                                           f"returning; the other ranks were stopped")
    return [results[r] for r in range(len(ranks))]


def _launch_virtual(fn, world_size: int, backend: str, timeout: float) -> list[Any]:
    """One thread per rank. The rank that failed first is reported (the others' errors follow from
    it: their waits are released at once, with an error naming it). A thread cannot be killed: once a
    rank failed, the others get FAILED_GRACE seconds to end, and a rank still running then (stuck in
    code of its own) is left behind as a daemon thread, named in the error, rather than waited for."""
    world = bootstrap.VirtualWorld(world_size, backend)
    results: list[Any] = [None] * world_size
    errors: dict[int, tuple[BaseException, str]] = {}
    ended = threading.Condition()
    done: set[int] = set()
    gpu = None
    if KINDS[backend].gpu:
        import torch
        gpu = torch.cuda.current_device()  # the caller's: a new thread would start on device 0

    def rank_main(rank: int) -> None:
        bootstrap.enter_virtual(world, rank)
        try:
            if gpu is not None:
                torch.cuda.set_device(gpu)
            results[rank] = fn()
        except BaseException as error:
            errors[rank] = (error, traceback.format_exc())
            world.fail(rank)
        finally:
            bootstrap.leave_virtual()
            with ended:
                done.add(rank)
                ended.notify_all()

    launch_id = secrets.token_hex(6)
    threads = [threading.Thread(target=rank_main, args=(r,), name=f"megakernel-rank-{r}", daemon=True)
               for r in range(world_size)]
    try:
        with _environment(LAUNCH_ENV, launch_id):  # the ranks' heaps, made while they run, carry it
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + timeout
            with ended:
                ended.wait_for(lambda: len(done) == world_size or errors, timeout=timeout)
                ended.wait_for(lambda: len(done) == world_size,
                               timeout=max(0.0, min(FAILED_GRACE, deadline - time.monotonic())))
                running = sorted(set(range(world_size)) - done)
        if running:
            world.fail(-1)
            if not errors:
                raise BackendError(f"launch timed out after {timeout} s; virtual ranks still running: {running}")
    finally:
        remove_segments(launch_id)
    if errors:
        rank = next(r for r in world.failed if r in errors)  # the first to fail; the others followed it
        error, remote_traceback = errors[rank]
        if running:
            remote_traceback += (f"(virtual ranks {running} were still running {FAILED_GRACE:g} s after it, "
                                 f"left behind as daemon threads)\n")
        raise RankError(rank, error, remote_traceback)
    return results


def _launch_in_torchrun(fn, world_size: int, timeout: float, backend: str) -> list[Any]:
    import torch.distributed as dist
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if size != world_size:
        raise BackendError(f"launch(world_size={world_size}) under torchrun with WORLD_SIZE={size}")
    _init_group(rank, size, "env://", timeout, backend)
    result = fn()
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, result)
    return gathered
