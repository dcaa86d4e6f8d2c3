"""``Megakernel``: schedule a graph once, lay out its heap, generate its kernel, and run it many times."""
from __future__ import annotations

import json
import os
import tempfile
import weakref
from pathlib import Path
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from . import codegen, device
from .backend import Backend, resolve
from .bootstrap import Group, check_agreement
from .cpu_backend import CpuBackend, WorkerPool
from .errors import BackendError, DeadlockError, GraphError
from .graph import HEAP_ALIGN, Graph, Tensor
from .scheduler import ARG0, QueueTables, schedule, serialize
from .tasks import HeapView
from .trace import Trace, rank_trace


def _align(n: int) -> int:
    return -(-n // HEAP_ALIGN) * HEAP_ALIGN


@dataclass(frozen=True)
class HeapLayout:
    """Byte offsets of the kernel's regions: graph buffers first, then events, status and tables.

    Buffers, events and status are at the same offsets on every rank (peers write them); the region
    sizes are the largest any rank needs, so the whole layout is symmetric.
    """

    events: int
    status: int
    tasks: int
    signals: int
    queue: int
    index: int
    trace: int
    size: int

    @staticmethod
    def sizes(tables: QueueTables, trace: bool) -> list[int]:
        return [8 * max(tables.events, 1), 8 * int(device.STATUS_WORDS) * (tables.workers + 1),
                tables.tasks.nbytes, tables.signals.nbytes, tables.queue.nbytes, tables.queue_index.nbytes,
                8 * int(device.TRACE_WORDS) * len(tables.tasks) if trace else 8]

    @classmethod
    def of(cls, buffers_bytes: int, sizes: list[int]) -> "HeapLayout":
        offsets, at = [], _align(buffers_bytes)
        for size in sizes:
            offsets.append(at)
            at = _align(at + max(size, 8))
        return cls(*offsets, size=at)


class Megakernel:
    """A scheduled graph bound to a heap and a persistent kernel; ``run`` launches it once per call.

    ``workers``: persistent programs per rank (cpu: processes, 2 by default; GPU: as many as can be
    resident at once, by default all of them, shared among virtual ranks); ``policy``:
    ``"critical_path"`` or ``"round_robin"``; ``backend``: ``"auto"`` (the GPU when there is one, or what
    ``launch`` chose), ``"cpu"``, ``"cuda"``, ``"hip"``; ``timeout``: seconds any single wait may take before
    the watchdog stops the run; ``trace``: record every task's wait, start and end (``kernel.trace``
    after each run). With a world size above one, every rank builds its kernel at the same point of
    its program: the ranks check that their graphs agree, exchange cross-rank edges and map each
    other's heaps.
    """

    def __init__(self, graph: Graph, workers: int | None = None, policy: str = "critical_path",
                 backend: str = "auto", timeout: float = 60.0, trace: bool = False, pool: WorkerPool | None = None):
        if not isinstance(graph, Graph):
            raise GraphError(f"Megakernel needs a Graph, got {type(graph).__name__}")
        if not graph.tasks:
            raise GraphError("the graph has no tasks: add ops before building a kernel")
        if not graph.outputs:
            raise GraphError("the graph has no outputs: mark results with graph.output(name, tensor)")
        if workers is not None and not (isinstance(workers, int) and workers >= 1):
            raise GraphError(f"workers must be a positive integer, got {workers!r}")
        self.graph = graph
        self.timeout = float(timeout)
        self.tracing = bool(trace)
        self.trace: Trace | None = None  # of the last run, every rank's tasks
        self.launch_seconds = 0.0          # of the last run: the launch alone (GPU: device time)
        self.group = Group(graph.world_size, graph.rank)
        check_agreement(self.group, "op", graph.op_calls)
        check_agreement(self.group, "buffer", graph.buffer_layout())
        self.backend: Backend = _make_backend(resolve(backend), self.group, graph, workers, trace, self.timeout,
                                              pool)
        self.workers = self.backend.workers
        self.kernel_path = self.backend.kernel_path  # the generated kernel module
        self.tables = schedule(graph.tasks, graph.buffer_shapes(), specs=graph.specs, op_names=graph.op_names,
                               workers=self.workers, policy=policy, rank=graph.rank,
                               world_size=graph.world_size, describe=graph.describe_task,
                               exchange=self.group.all_gather)
        sizes = [max(column) for column in zip(*self.group.all_gather(HeapLayout.sizes(self.tables, self.tracing)))]
        self.layout = HeapLayout.of(graph.heap_bytes, sizes)
        self.epoch = 0
        self._broken = False
        self._bound: set[str] = set()
        self._finalizer = weakref.finalize(self, self.backend.close)
        heaps = self.backend.allocate(self.layout.size)
        self.heap, self.peers = heaps.local, heaps.peers
        self.view = HeapView(self.heap)
        self.upload_tables()

    # -- heap access ------------------------------------------------------------------------------
    def words(self, offset: int, count: int, heap: torch.Tensor | None = None) -> torch.Tensor:
        """``count`` int64 words at byte ``offset`` of this rank's heap (or of ``heap``), a view."""
        heap = self.heap if heap is None else heap
        return heap[offset:offset + 8 * count].view(torch.int64)

    def upload_tables(self) -> None:
        """Copy ``self.tables`` into the heap (again, if a test or tool edited them) and clear events."""
        t, lay = self.tables, self.layout
        for offset, array in [(lay.tasks, t.tasks), (lay.signals, t.signals), (lay.queue, t.queue),
                              (lay.index, t.queue_index)]:
            if array.size:
                self.words(offset, array.size).copy_(torch.from_numpy(np.ascontiguousarray(array).reshape(-1)))
        self._reset_events()

    def _reset_events(self) -> None:
        self.words(self.layout.events, max(self.tables.events, 1)).zero_()
        self.words(self.layout.status, int(device.STATUS_WORDS) * (self.workers + 1)).zero_()
        self.epoch = 0

    def tensor(self, t: Tensor) -> torch.Tensor:
        """The heap memory under graph tensor ``t`` (a view: writes go to the heap)."""
        view = self.view.tensor(t.addr(0, 0), t.dtype, t.rows, t.cols, t.row_stride)
        return view.reshape(t.shape) if t.ndim == 1 else view

    def poison(self, value: float = float("nan")) -> None:
        """Fill every buffer that is not an input, so that an element no task wrote stands out
        (integer buffers get the most negative value)."""
        inputs = {t.buffer.index for t in self.graph.inputs.values()}
        for b in self.graph.buffers:
            if b.index not in inputs:
                fill = value if b.dtype.is_floating_point else torch.iinfo(b.dtype).min
                self.view.tensor(b.offset, b.dtype, b.rows, b.cols, b.cols).fill_(fill)

    # -- running ----------------------------------------------------------------------------------
    def bind(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Copy input values into their heap buffers; they stay bound for later runs."""
        for name, value in inputs.items():
            t = self.graph.inputs.get(name)
            if t is None:
                raise GraphError(f"input {name!r} is not an input of the graph; inputs: "
                                 f"{', '.join(self.graph.inputs) or 'none'}")
            if not isinstance(value, torch.Tensor):
                raise GraphError(f"input {name!r} must be a torch.Tensor, got {type(value).__name__}")
            if tuple(value.shape) != t.shape:
                raise GraphError(f"input {name!r} has shape {tuple(value.shape)}; the graph declares {t.shape}")
            if value.dtype != t.dtype:
                raise GraphError(f"input {name!r} has dtype {value.dtype}; the graph declares {t.dtype}")
        for name, value in inputs.items():
            self.tensor(self.graph.inputs[name]).copy_(value.detach())
            self._bound.add(name)

    def run(self, inputs: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Bind ``inputs``, launch once (one message per worker), return copies of the outputs.

        With several ranks, the ranks wait for each other before launching (a peer's remote stores
        must not land in a buffer this rank is still reading from its previous run, or writing from
        the host: inputs, ``poison``) and after (a peer's stores into this rank's outputs, which no
        task here waits for, must have landed before they are copied). A rank that does not arrive
        within ``timeout`` is named.
        """
        if self._broken:
            raise BackendError("an earlier run of this multi-rank kernel failed; its ranks' event counters no "
                               "longer agree: build a new kernel")
        self.bind(inputs or {})
        missing = [name for name in self.graph.inputs if name not in self._bound]
        if missing:
            raise GraphError(f"input {missing[0]!r} was never bound: pass it to run(); "
                             f"unbound: {', '.join(missing)}")
        lay = self.layout
        if self.tracing:
            self.words(lay.trace, int(device.TRACE_WORDS) * len(self.tables.tasks)).zero_()
        self.backend.settle()
        self.group.barrier(timeout=self.timeout)
        self.epoch += 1
        args = dict(epoch=self.epoch, timeout_ns=int(self.timeout * 1e9), tasks_off=lay.tasks,
                    signals_off=lay.signals, queue_off=lay.queue, index_off=lay.index, events_off=lay.events,
                    status_off=lay.status, trace_off=lay.trace, ROW=self.tables.row_words, TRACE=self.tracing)
        failure = None
        try:
            self.launch_seconds = self.backend.launch(args, self.words(lay.status, 1))
        except BackendError as error:
            failure = error
        if failure is None and self._status()[:, int(device.STATE)].any():
            report = self.deadlock_report()
            files = self._write_hang_files(report)
            failure = DeadlockError(f"rank {self.graph.rank}: the watchdog stopped run {self.epoch}: a wait "
                                    f"exceeded {self.timeout} s (report: {', '.join(map(str, files))})", report)
        if failure is not None:
            if self.graph.world_size == 1:
                self._reset_events()  # one rank: a clean slate makes the kernel usable again
            else:
                self._broken = True
            raise failure
        self.group.barrier(timeout=max(self.timeout, 60.0), why="finish the run")
        if self.tracing:
            every = self.group.all_gather(rank_trace(self.tables, self._stamps()))
            self.trace = Trace([s for spans, _ in every for s in spans], [e for _, edges in every for e in edges])
        return {name: self.tensor(t).clone() for name, t in self.graph.outputs.items()}

    def _stamps(self) -> np.ndarray:
        """This rank's trace buffer on the heap, [tasks, TRACE_WORDS] (a copy)."""
        words = int(device.TRACE_WORDS)
        return self.words(self.layout.trace, words * len(self.tables.tasks)).cpu().numpy().reshape(-1, words).copy()

    def _write_hang_files(self, report: str) -> list[Path]:
        """The report, and with tracing the partial trace of what finished, in the temp folder."""
        stem = Path(tempfile.gettempdir()) / f"megakernel-hang-rank{self.graph.rank}-{os.getpid()}-run{self.epoch}"
        files = [stem.with_suffix(".txt")]
        files[0].write_text(report + "\n")
        if self.tracing:
            spans, edges = rank_trace(self.tables, self._stamps())
            files.append(Trace(spans, edges).save(stem.with_suffix(".json")))
        return files

    def save_image(self, path) -> None:
        """Write the tables and the heap as it is now (inputs bound), for ``megakernel disasm --execute``."""
        outputs = {name: [t.addr(0, 0), str(t.dtype).removeprefix("torch."), t.rows, t.cols, t.row_stride]
                   for name, t in self.graph.outputs.items()}
        np.savez(path, tables=np.frombuffer(serialize(self.tables), dtype=np.uint8),
                 heap=self.heap.cpu().numpy(), outputs=np.frombuffer(json.dumps(outputs).encode(), dtype=np.uint8))

    # -- diagnosis --------------------------------------------------------------------------------
    def _status(self, heap: torch.Tensor | None = None) -> np.ndarray:
        """Per-worker status records [workers, STATUS_WORDS] of this rank's heap, or of a peer's (a copy)."""
        words = int(device.STATUS_WORDS)
        raw = self.words(self.layout.status, words * (self.workers + 1), heap)
        return raw.cpu().numpy().reshape(-1, words)[1:].copy()

    def deadlock_report(self) -> str:
        """What each worker was doing when the run stopped; for a stalled wait, who should have signalled."""
        t = self.tables
        status = self._status()
        owner = t.worker_of()
        position = np.empty(len(t.queue), dtype=np.int64)
        for w in range(t.workers):
            position[t.worker_queue(w)] = np.arange(len(t.worker_queue(w)))
        done = status[:, int(device.DONE)]
        lines = []
        for w, record in enumerate(status):
            state = int(record[int(device.STATE)])
            if state == int(device.RUNNING):
                lines.append(f"rank {t.rank} worker {w}: finished {int(done[w])} of {len(t.worker_queue(w))} tasks")
                continue
            task, event = int(record[int(device.TASK)]), int(record[int(device.EVENT)])
            why = "timed out" if state == int(device.TIMED_OUT) else "stopped (another worker timed out)"
            lines.append(f"rank {t.rank} worker {w}: {why} at task {task} ({self._label(task)}), queue position "
                         f"{int(position[task])}: event {event} observed {int(record[int(device.OBSERVED)])}, "
                         f"expected {int(record[int(device.EXPECTED)])}")
            local = t.producers_of(event)
            for p in local:
                ran = position[p] < done[owner[p]]
                lines.append(f"    producer task {p} ({self._label(p)}) on rank {t.rank} worker {int(owner[p])} "
                             f"queue position {int(position[p])}: {'ran' if ran else 'did not run'}")
            for rank, task_id, worker, pos in t.remote_producers.get(event, []):
                peer = self._status(self.peers[rank])[worker]
                if int(peer[int(device.EPOCH)]) < self.epoch:
                    ran, progress = False, f"rank {rank} worker {worker} has not started run {self.epoch}"
                else:
                    peer_done = int(peer[int(device.DONE)])
                    ran, progress = pos < peer_done, f"rank {rank} worker {worker} finished {peer_done} tasks"
                lines.append(f"    producer task {task_id} ({t.op_names[int(t.task_op[task_id])]}) on rank {rank} "
                             f"worker {worker} queue position {pos}: {'ran' if ran else 'did not run'} ({progress})")
            if not local and event not in t.remote_producers:
                lines.append("    no task signals this event")
        return "\n".join(lines)

    def _label(self, task: int) -> str:
        t = self.tables
        spec = t.specs[int(t.tasks[task, 0])]
        return f"{t.op_names[int(t.task_op[task])]} op {int(t.task_op[task])}, {spec.task_type}"

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap the heap from the workers and release it; the kernel cannot run afterwards."""
        self._finalizer()

    def __enter__(self) -> "Megakernel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _make_backend(name: str, group: Group, graph: Graph, workers: int | None, trace: bool, timeout: float,
                  pool: WorkerPool | None) -> Backend:
    if name == "cpu":
        return CpuBackend(group, codegen.kernel_path(graph.specs, "interpreter"), workers, pool)
    from .gpu_backend import GpuBackend
    row_words = ARG0 + max(map(len, graph.tasks.args))
    return GpuBackend(name, group, codegen.kernel_path(graph.specs, name), row_words, trace, workers, timeout)
