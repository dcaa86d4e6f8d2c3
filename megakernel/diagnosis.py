"""Hang diagnosis: what each worker was doing when a run stopped, and who should have signalled.

Pure functions over a rank's tables and the status records the kernel wrote (``layout``), like
``trace.rank_trace`` (the runtime reads the records off the heaps), and the writing of a hang's files.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np

from .errors import BackendError
from .files import reports_dir, write_new
from .layout import (DONE, EPOCH, EVENT, EXPECTED, FAULT, FAULT_AT, FAULT_BOUND, FAULT_KIND, FAULT_VALUE, INDEX,
                     NOT_FINITE, OBSERVED, RUNNING, STATE, STATUS_WORDS, TASK, TIMED_OUT)
from .scheduler import CARRY_EVENT, OPCODE, WAIT_EVENT, QueueTables
from .trace import Trace, rank_trace


def status_records(words: np.ndarray) -> np.ndarray:
    """The status region's words -> one record per worker, [workers, STATUS_WORDS] (the rank's header record
    dropped)."""
    return words.reshape(-1, STATUS_WORDS)[1:]


def stalled(status: np.ndarray) -> bool:
    """Whether any worker of these records timed out or was stopped."""
    return bool((status[:, STATE] != RUNNING).any())


def task_label(t: QueueTables, task: int) -> str:
    op = int(t.task_op[task])
    return f"{t.op_names[op]} op {op}, {t.specs[int(t.rows[task, OPCODE])].task_type}"


@dataclass(frozen=True)
class Fault:
    """What a worker's tile met in a step (``device.record_fault``): ``kind`` INDEX (``value`` outside
    [0, ``bound``)) or NOT_FINITE (the logits of batch row ``value``, sampling position ``bound``); the
    task when this rank's tables can name it, else its queue position."""

    rank: int
    worker: int
    step: int
    kind: int
    value: int
    bound: int
    task: int | None
    queue_position: int
    label: str = ""

    def __str__(self) -> str:
        where = f"rank {self.rank} worker {self.worker} step {self.step}"
        where += (f" task {self.task} ({self.label})" if self.task is not None
                  else f" queue position {self.queue_position}")
        if self.kind == NOT_FINITE:
            return f"{where}: the logits of batch row {self.value} sampling position {self.bound} are not finite"
        return f"{where}: index {self.value} is outside [0, {self.bound})"


def faults(t: QueueTables, status: np.ndarray, since: int, rank: int | None = None) -> list[Fault]:
    """The faults of the workers whose tiles met data they cannot use (``device.record_fault``) in step
    ``since`` or later: of this rank (``t``'s), or of peer ``rank`` (whose tasks ``t`` cannot name)."""
    found = []
    for w in np.flatnonzero(status[:, FAULT] >= since).tolist():
        record = status[w]
        task = int(t.worker_queue(w)[record[FAULT_AT]]) if rank is None else None
        found.append(Fault(t.rank if rank is None else rank, w, int(record[FAULT]), int(record[FAULT_KIND]),
                           int(record[FAULT_VALUE]), int(record[FAULT_BOUND]), task, int(record[FAULT_AT]),
                           "" if task is None else task_label(t, task)))
    return found


def deadlock_report(t: QueueTables, status: np.ndarray, peer_status: Mapping[int, np.ndarray],
                    arrival: Callable[[int, int, int], str] | None = None) -> str:
    """The report of a stopped launch from this rank's records ``status`` and the records of the peers
    (``peer_status[rank]``) whose tasks raise this rank's events: per worker, the step (epoch) it was in.
    A producer on another node has no record here: ``arrival(rank, event, step)`` says whether its message
    came (``transport.Transport.arrival``)."""
    owner, position = t.worker_of(), t.queue_position()
    done = status[:, DONE]
    lines = []
    for w, record in enumerate(status):
        step = int(record[EPOCH])
        if record[STATE] == RUNNING:
            lines.append(f"rank {t.rank} worker {w}: step {step}: finished {int(done[w])} of {len(t.worker_queue(w))} "
                         f"tasks")
            continue
        task, event = int(record[TASK]), int(record[EVENT])
        why = "timed out" if record[STATE] == TIMED_OUT else "stopped (another worker timed out)"
        lines.append(f"rank {t.rank} worker {w}: step {step}: {why} at task {task} ({task_label(t, task)}), queue position "
                     f"{int(position[task])}: event {event} observed {int(record[OBSERVED])}, "
                     f"expected {int(record[EXPECTED])}")
        carried = t.rows[task, CARRY_EVENT] == event and t.rows[task, WAIT_EVENT] != event
        if carried:
            lines[-1] += f" (a wait on step {step - 1}'s producers)"
        wanted = step - carried  # the step whose signals the wait counts
        local = t.producers_of(event)
        for p in local:
            ran = _ran(status[owner[p]], wanted, position[p])
            lines.append(f"    producer task {p} ({task_label(t, p)}) on rank {t.rank} worker {int(owner[p])} "
                         f"queue position {int(position[p])}: {'ran' if ran else 'did not run'}")
        for rank, task_id, worker, pos, op in t.remote_producers.get(event, []):
            if rank not in peer_status:
                lines.append(f"    producer task {task_id} ({t.op_names[op]} op {op}) on rank {rank} (another node) "
                             f"worker {worker} queue position {pos}: {arrival(rank, event, wanted)}")
                continue
            peer = peer_status[rank][worker]
            progress = f"rank {rank} worker {worker} finished {int(peer[DONE])} tasks of step {int(peer[EPOCH])}"
            lines.append(f"    producer task {task_id} ({t.op_names[op]} op {op}) on rank {rank} worker {worker} "
                         f"queue position {pos}: {'ran' if _ran(peer, wanted, pos) else 'did not run'} ({progress})")
        if not local and event not in t.remote_producers:
            lines.append("    no task signals this event")
    return "\n".join(lines)


def _ran(record: np.ndarray, step: int, position: int) -> bool:
    """Whether the worker of status ``record`` finished its task at queue ``position`` of ``step``."""
    return bool(record[EPOCH] > step or (record[EPOCH] == step and position < record[DONE]))


def save_hang_report(report: str, t: QueueTables, epoch: int, stamps: np.ndarray | None) -> str:
    """Where the report went, for the ``DeadlockError``'s message: its files, or why none could be
    written (the report itself is in the error either way: a hostile reports folder loses no diagnosis)."""
    try:
        return f"report: {', '.join(map(str, write_hang_files(report, t, epoch, stamps)))}"
    except (BackendError, OSError) as error:
        return f"the report could not be written to a file: {error}"


def write_hang_files(report: str, t: QueueTables, epoch: int, stamps: np.ndarray | None) -> list[Path]:
    """The report, and with tracing (``stamps``) the partial trace of what finished, as new files of this
    user's reports folder (``files.reports_dir``); ``epoch``: the launch's last step."""
    folder, prefix = reports_dir(), f"hang-rank{t.rank}-pid{os.getpid()}-run{epoch}-"
    files = [write_new(folder, prefix, ".txt", report + "\n")]
    if stamps is not None:
        files.append(write_new(folder, prefix, ".json", json.dumps(Trace(*rank_trace(t, stamps)).chrome())))
    return files
