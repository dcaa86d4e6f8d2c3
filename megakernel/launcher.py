"""``launch``: run a function on every rank of a fresh process group (or of ``torchrun``'s).

On the cpu backend the process group uses gloo. Each rank is a process; its kernels' workers are
processes of its own. An exception in any rank is re-raised in the caller, naming the rank, and the
other ranks are torn down; shared-memory segments of the launch are removed whatever happened.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import secrets
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable

from .errors import BackendError, MegakernelError
from .heap import LAUNCH_ENV, remove_segments

TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")


class RankError(MegakernelError):
    """An exception raised in one rank of a launch; ``rank`` and ``error`` (the original) say which and what."""

    def __init__(self, rank: int, error: BaseException | None, remote_traceback: str):
        super().__init__(rank, error, remote_traceback)
        self.rank, self.error, self.remote_traceback = rank, error, remote_traceback

    def __str__(self) -> str:
        return f"rank {self.rank} raised {type(self.error).__name__}: {self.error}\n{self.remote_traceback}"


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE")) and any(k in os.environ for k in TORCHRUN_ENV)


def _init_group(rank: int, world_size: int, init_method: str, timeout: float) -> None:
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))


def _rank_main(fn, rank: int, world_size: int, init_method: str, timeout: float, conn) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    from . import cpu_backend
    import torch.distributed as dist
    try:
        _init_group(rank, world_size, init_method, timeout)
        result = fn()
        conn.send(("ok", pickle.dumps(result)))
    except BaseException as error:  # report everything, KeyboardInterrupt included
        try:
            payload = pickle.dumps(error)
        except Exception:
            payload = pickle.dumps(RuntimeError(repr(error)))
        conn.send(("error", (payload, traceback.format_exc())))
    finally:
        cpu_backend.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[[], Any], world_size: int, backend: str = "auto", timeout: float = 600.0) -> list[Any]:
    """Run ``fn()`` on ``world_size`` ranks; return the per-rank results in rank order.

    ``fn`` must be importable by name (a module-level function), as with ``torch.multiprocessing``.
    Under ``torchrun`` the current process is one rank of the job: ``fn`` runs here and the results
    of every rank are gathered.
    """
    if backend not in ("auto", "cpu"):
        raise BackendError(f"unknown backend {backend!r} for launch; available: auto, cpu")
    if _under_torchrun():
        return _launch_in_torchrun(fn, world_size, timeout)
    if world_size < 1:
        raise BackendError(f"world_size must be at least 1, got {world_size}")
    context = mp.get_context("spawn")
    launch_id = secrets.token_hex(6)
    with tempfile.TemporaryDirectory(prefix="megakernel-launch-") as tmp:
        init_method = f"file://{os.path.join(tmp, 'store')}"
        ranks, conns = [], []
        saved = os.environ.get(LAUNCH_ENV)
        os.environ[LAUNCH_ENV] = launch_id  # inherited by the ranks: names their heap segments
        try:
            for rank in range(world_size):
                parent, child = context.Pipe(duplex=False)
                process = context.Process(target=_rank_main, args=(fn, rank, world_size, init_method, timeout, child),
                                          name=f"megakernel-rank-{rank}")
                process.start()
                child.close()
                ranks.append(process)
                conns.append(parent)
        finally:
            if saved is None:
                del os.environ[LAUNCH_ENV]
            else:
                os.environ[LAUNCH_ENV] = saved
        try:
            return _collect(ranks, conns, timeout)
        finally:
            for process in ranks:
                if process.is_alive():
                    process.kill()
                process.join()
            remove_segments(launch_id)


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


def _launch_in_torchrun(fn, world_size: int, timeout: float) -> list[Any]:
    import torch.distributed as dist
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if size != world_size:
        raise BackendError(f"launch(world_size={world_size}) under torchrun with WORLD_SIZE={size}")
    _init_group(rank, size, "env://", timeout)
    result = fn()
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, result)
    return gathered
