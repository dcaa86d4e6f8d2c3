"""``Megakernel``: schedule a graph once, lay out its heap, generate its kernel, and run it many times."""
from __future__ import annotations

import json
import weakref
from typing import Mapping

import numpy as np
import torch

from . import codegen, diagnosis
from .backend import Backend, resolve
from .bootstrap import Group, check_agreement
from .cpu_backend import CpuBackend, WorkerPool
from .errors import BackendError, DeadlockError, GraphError
from .graph import Graph, Tensor
from .heap import HeapView
from .layout import STATUS_WORDS, TRACE_WORDS, HeapLayout
from .scheduler import ARG0, schedule, serialize
from .trace import Trace, rank_trace


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
        for offset, array in [(lay.tasks_off, t.rows), (lay.signals_off, t.signals), (lay.queue_off, t.queue),
                              (lay.index_off, t.queue_index)]:
            if array.size:
                self.words(offset, array.size).copy_(torch.from_numpy(np.ascontiguousarray(array).reshape(-1)))
        self._reset_events()

    def _reset_events(self) -> None:
        self.words(self.layout.events_off, max(self.tables.num_events, 1)).zero_()
        self.words(self.layout.status_off, STATUS_WORDS * (self.workers + 1)).zero_()
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
        if self.tracing:
            self.words(self.layout.trace_off, TRACE_WORDS * len(self.tables.rows)).zero_()
        self.backend.settle()
        self.group.barrier(timeout=self.timeout)
        self.epoch += 1
        args = dict(epoch=self.epoch, timeout_ns=int(self.timeout * 1e9), **self.layout.offsets(),
                    ROW=self.tables.row_words, TRACE=self.tracing)
        failure = None
        try:
            self.launch_seconds = self.backend.launch(args, self.words(self.layout.status_off, 1))
        except BackendError as error:
            failure = error
        if failure is None and diagnosis.stalled(self._status()):
            report = self.deadlock_report()
            files = diagnosis.write_hang_files(report, self.tables, self.epoch,
                                               self._stamps() if self.tracing else None)
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
        words = self.words(self.layout.trace_off, TRACE_WORDS * len(self.tables.rows))
        return words.cpu().numpy().reshape(-1, TRACE_WORDS).copy()

    def save_image(self, path) -> None:
        """Write the tables and the heap as it is now (inputs bound), for ``megakernel disasm --execute``."""
        outputs = {name: [t.addr(0, 0), str(t.dtype).removeprefix("torch."), t.rows, t.cols, t.row_stride]
                   for name, t in self.graph.outputs.items()}
        np.savez(path, tables=np.frombuffer(serialize(self.tables), dtype=np.uint8),
                 heap=self.heap.cpu().numpy(), outputs=np.frombuffer(json.dumps(outputs).encode(), dtype=np.uint8))

    # -- diagnosis --------------------------------------------------------------------------------
    def _status(self, heap: torch.Tensor | None = None) -> np.ndarray:
        """Per-worker status records [workers, STATUS_WORDS] of this rank's heap, or of a peer's (a copy)."""
        words = self.words(self.layout.status_off, STATUS_WORDS * (self.workers + 1), heap)
        return diagnosis.status_records(words.cpu().numpy().copy())

    def deadlock_report(self) -> str:
        """What each worker was doing when the run stopped; for a stalled wait, who should have signalled."""
        peers = {rank: self._status(heap) for rank, heap in self.peers.items()}
        return diagnosis.deadlock_report(self.tables, self._status(), self.epoch, peers)

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
