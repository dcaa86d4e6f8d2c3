"""``Megakernel``: schedule a graph once, lay out its heap, generate its kernel, and run it many times."""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from . import codegen, device
from .cpu_backend import Launch, WorkerPool, default_pool
from .errors import BackendError, DeadlockError, GraphError
from .graph import HEAP_ALIGN, Graph, Tensor
from .heap import SharedHeap
from .scheduler import QueueTables, schedule, serialize
from .tasks import HeapView

BACKENDS = ("auto", "cpu")
DEFAULT_CPU_WORKERS = 2


def _align(n: int) -> int:
    return -(-n // HEAP_ALIGN) * HEAP_ALIGN


@dataclass(frozen=True)
class HeapLayout:
    """Byte offsets of the kernel's regions: graph buffers first, then events, status and tables."""

    events: int
    status: int
    tasks: int
    signals: int
    queue: int
    index: int
    size: int

    @classmethod
    def of(cls, buffers_bytes: int, tables: QueueTables) -> "HeapLayout":
        sizes = [8 * max(tables.events, 1),
                 8 * int(device.STATUS_WORDS) * (tables.workers + 1),
                 tables.tasks.nbytes, tables.signals.nbytes, tables.queue.nbytes, tables.queue_index.nbytes]
        offsets, at = [], _align(buffers_bytes)
        for size in sizes:
            offsets.append(at)
            at = _align(at + max(size, 8))
        return cls(*offsets, size=at)


def _resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; available: {', '.join(BACKENDS)}")
    return "cpu"


class Megakernel:
    """A scheduled graph bound to a heap and a persistent kernel; ``run`` launches it once per call.

    ``workers``: persistent programs (cpu: processes); ``policy``: "critical_path" or "round_robin";
    ``timeout``: seconds any single wait may take before the watchdog stops the run.
    """

    def __init__(self, graph: Graph, workers: int | None = None, policy: str = "critical_path",
                 backend: str = "auto", timeout: float = 60.0, pool: WorkerPool | None = None):
        if not isinstance(graph, Graph):
            raise GraphError(f"Megakernel needs a Graph, got {type(graph).__name__}")
        if not graph.tasks:
            raise GraphError("the graph has no tasks: add ops before building a kernel")
        if not graph.outputs:
            raise GraphError("the graph has no outputs: mark results with graph.output(name, tensor)")
        self.backend = _resolve_backend(backend)
        self.graph = graph
        self.workers = DEFAULT_CPU_WORKERS if workers is None else int(workers)
        self.timeout = float(timeout)
        self.tables = schedule(graph.tasks, graph.buffer_shapes(), specs=graph.specs, op_names=graph.op_names,
                               workers=self.workers, policy=policy, rank=graph.rank,
                               world_size=graph.world_size, describe=graph.describe_task)
        self.layout = HeapLayout.of(graph.heap_bytes, self.tables)
        self.kernel_path = codegen.kernel_path(graph.specs, "interpreter")
        self.epoch = 0
        self._bound: set[str] = set()
        self.heap = SharedHeap.create(self.layout.size)
        self._finalizer = weakref.finalize(self, _release, self.heap, [])
        self.view = HeapView(self.heap.tensor)
        self.upload_tables()
        self._pool = pool or default_pool()
        self._workers = self._pool.ensure(self.workers)
        try:
            for worker in self._workers:
                worker.request("map", (self.heap.name, self.heap.size), timeout=60)
        finally:
            self.heap.unlink()  # every process that needs it has it mapped: the name can go now
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _release, self.heap, list(self._workers))

    # -- heap access ------------------------------------------------------------------------------
    def words(self, offset: int, count: int) -> torch.Tensor:
        return self.heap.tensor[offset:offset + 8 * count].view(torch.int64)

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
        """Fill every buffer that is not an input, so that an element no task wrote stands out."""
        inputs = {t.buffer.index for t in self.graph.inputs.values()}
        for b in self.graph.buffers:
            if b.index not in inputs:
                self.view.tensor(b.offset, b.dtype, b.rows, b.cols, b.cols).fill_(value)

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
            self.tensor(self.graph.inputs[name]).copy_(value.detach().cpu())
            self._bound.add(name)

    def run(self, inputs: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Bind ``inputs``, launch once (one message per worker), return copies of the outputs."""
        self.bind(inputs or {})
        missing = [name for name in self.graph.inputs if name not in self._bound]
        if missing:
            raise GraphError(f"input {missing[0]!r} was never bound: pass it to run(); "
                             f"unbound: {', '.join(missing)}")
        self.epoch += 1
        lay = self.layout
        args = dict(epoch=self.epoch, timeout_ns=int(self.timeout * 1e9), tasks_off=lay.tasks,
                    signals_off=lay.signals, queue_off=lay.queue, index_off=lay.index, events_off=lay.events,
                    status_off=lay.status, ROW=self.tables.row_words)
        launches = [Launch(self.heap.name, str(self.kernel_path), w, 0, args) for w in range(self.workers)]
        failure, running = None, []
        for w, (worker, launch) in enumerate(zip(self._workers, launches)):
            try:
                worker.send("run", launch)
                running.append((w, worker))
            except BackendError as error:
                failure = failure or BackendError(f"worker {w}: {error}")
        for w, worker in running:
            if failure is not None:
                self.words(lay.status, 1).fill_(1)  # abort: the other workers stop at their next wait
            try:
                worker.reply()
            except BackendError as error:
                failure = failure or BackendError(f"worker {w}: {error}")
        if failure is not None:
            self._reset_events()
            raise failure
        stalled = self._status()
        if stalled:
            report = self.deadlock_report(stalled)
            self._reset_events()
            raise DeadlockError(f"the watchdog stopped run {self.epoch}: a wait exceeded {self.timeout} s", report)
        return {name: self.tensor(t).clone() for name, t in self.graph.outputs.items()}

    def save_image(self, path) -> None:
        """Write the tables and the heap as it is now (inputs bound), for ``megakernel disasm --execute``."""
        outputs = {name: [t.addr(0, 0), str(t.dtype).removeprefix("torch."), t.rows, t.cols, t.row_stride]
                   for name, t in self.graph.outputs.items()}
        np.savez(path, tables=np.frombuffer(serialize(self.tables), dtype=np.uint8),
                 heap=self.heap.tensor.numpy(), outputs=np.frombuffer(json.dumps(outputs).encode(), dtype=np.uint8))

    # -- diagnosis --------------------------------------------------------------------------------
    def _status(self) -> list[np.ndarray]:
        words = int(device.STATUS_WORDS)
        status = self.words(self.layout.status, words * (self.workers + 1)).numpy().reshape(-1, words)[1:]
        return [status] if status[:, int(device.STATE)].any() else []

    def deadlock_report(self, stalled: list[np.ndarray]) -> str:
        status = stalled[0]
        t = self.tables
        owner = t.worker_of()
        position = np.empty(len(t.queue), dtype=np.int64)
        for w in range(t.workers):
            position[t.worker_queue(w)] = np.arange(len(t.worker_queue(w)))
        done = status[:, int(device.DONE)]
        lines = []
        for w, record in enumerate(status):
            state = int(record[int(device.STATE)])
            if state == int(device.RUNNING):
                lines.append(f"worker {w}: finished {int(done[w])} of {len(t.worker_queue(w))} tasks")
                continue
            task, event = int(record[int(device.TASK)]), int(record[int(device.EVENT)])
            why = "timed out" if state == int(device.TIMED_OUT) else "stopped (another worker timed out)"
            lines.append(f"worker {w}: {why} at task {task} ({self._label(task)}), queue position "
                         f"{int(position[task])}: event {event} observed {int(record[int(device.OBSERVED)])}, "
                         f"expected {int(record[int(device.EXPECTED)])}")
            for p in t.producers_of(event):
                ran = position[p] < done[owner[p]]
                lines.append(f"    producer task {p} ({self._label(p)}) on rank {t.rank} worker {int(owner[p])} "
                             f"queue position {int(position[p])}: {'ran' if ran else 'did not run'}")
            if not t.producers_of(event):
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


def _release(heap: SharedHeap, workers: list) -> None:
    for worker in workers:
        try:
            worker.request("unmap", heap.name, timeout=30)
        except Exception:
            pass  # a dead worker holds no mapping
    heap.unlink()
    heap.close()
