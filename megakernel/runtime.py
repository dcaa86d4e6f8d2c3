"""``Megakernel``: schedule a graph once, lay out its heap, generate its kernel, and run it many times."""
from __future__ import annotations

import json
import threading
import weakref
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np
import torch

from . import codegen, diagnosis
from .backends import KINDS, Backend, BackendRequest, resolve
from .bootstrap import Group, check_agreement
from .backends.cpu import WorkerPool
from .errors import BackendError, DeadlockError, FaultError, GraphError, check_timeout, is_count
from .graph import Graph, Tensor
from .heap import HeapView, HostWrites, RankHeap
from .layout import (ABORT, COMM, FAULTED, INDEX, LOST, LOST_BY, NOT_FINITE, STATUS_WORDS, TRACE_WORDS, HeapLayout,
                     device_words)
from .scheduler import ARG0, CARRY_FAN_IN, FAN_IN, QueueTables, check_periodic, schedule, serialize
from .trace import Trace, rank_trace
from .transport import Transport, outgoing_channels


MAX_STEPS = 2**32  # of one launch: ample for any run, and the epochs stay far from int64's end
TELL_SECONDS = 5.0  # at most, for the news of a lost rank to leave before this rank reports it


class Megakernel:
    """A scheduled graph bound to a heap and a persistent kernel; ``run`` launches it once per call.

    ``workers``: persistent programs per rank (cpu: processes, 2 by default; GPU: as many as can be
    resident at once, by default all of them, shared among virtual ranks); ``policy``:
    ``"critical_path"`` or ``"round_robin"``; ``backend``: ``"auto"`` (the GPU when there is one, or what
    ``launch`` chose), ``"cpu"``, ``"cuda"``, ``"hip"``; ``timeout``: seconds any single wait may take before
    the watchdog stops the run; ``trace``: record every task's wait, start and end (``kernel.trace``
    after each run). With a world size above one, every rank builds its kernel at the same point of
    its program: the ranks check that their graphs agree, exchange cross-rank edges and map each
    other's heaps. ``graph`` is the graph the kernel runs: a sealed copy of the one it was built from
    (``Graph.sealed``), whose ``outputs`` are where ``run`` reads them.
    """

    def __init__(self, graph: Graph, workers: int | None = None, policy: str = "critical_path",
                 backend: str = "auto", timeout: float = 60.0, trace: bool = False, pool: WorkerPool | None = None):
        _check_buildable(graph, workers)
        self.timeout = check_timeout(timeout)
        self.tracing = bool(trace)
        self.group = Group(graph.world_size, graph.rank, graph.topology)
        name = resolve(backend)
        # The build, stage by stage. The backend comes before the schedule: the scheduler places tasks
        # on its workers (on a GPU, as many as the compiled kernel lets be resident at once).
        self.graph = _seal(graph, self.group, self.timeout)  # the graph this kernel runs
        self.kernel_path = codegen.kernel_path(self.graph.specs, KINDS[name].target)
        self.host_writes = _host_writes(self.graph)  # what a torch backend's workers may keep derived values of
        self.backend: Backend = KINDS[name].make(BackendRequest(
            name=name, group=self.group, kernel_path=self.kernel_path,
            row_words=ARG0 + int(self.graph.tasks.args.counts().max(initial=0)), trace=self.tracing, workers=workers,
            timeout=self.timeout, pool=pool, specs=self.graph.specs, host_writes=self.host_writes))
        self.workers = self.backend.workers
        self.tables = _schedule(self.graph, self.group, self.backend, policy)
        self._max_fan_in = int(self.tables.rows[:, [FAN_IN, CARRY_FAN_IN]].max(initial=1))  # bounds the epochs
        self.layout = _lay_out_heap(self.graph, self.group, self.tables, self.tracing)
        self._finalizer = weakref.finalize(self, self.backend.close)
        heaps = self.backend.allocate(self.layout.data_size, self.layout.comm_size)
        self.heap, self.peers, self.delta = heaps.local, heaps.peers, heaps.delta
        self.view = HeapView(self.heap)
        # What the runs keep track of
        self.trace: Trace | None = None  # of the last run, every rank's tasks
        self.launch_seconds = 0.0          # of the last run: the launch alone (GPU: device time)
        self.epoch = 0          # steps run so far: the last step's epoch
        self._checked = self._checked_launches = 0  # the last step (launch) whose faults and stalls were checked
        self.launches = 0       # launches so far (each runs one or more steps)
        self._broken: str | None = None  # why this kernel can run no more
        self._bound: set[str] = set()
        self._meet = graph.world_size > 1  # before the first launch, and after a collective poison
        self._lock = threading.Lock()      # one run at a time, whichever thread calls
        self.transport: Transport | None = None  # what reaches the peers of other nodes (``transport``)
        self.upload_tables()
        if self.group.topology.node_count > 1:
            self.transport = _connect_nodes(self, heaps.shadows)
            self._finalizer.detach()
            self._finalizer = weakref.finalize(self, _release, self.backend, self.transport, self.timeout)

    # -- heap access ------------------------------------------------------------------------------
    def words(self, offset: int, count: int, heap: RankHeap | None = None) -> torch.Tensor:
        """``count`` int64 words at heap ``offset`` of this rank's heap (or of ``heap``), a view."""
        self._require_open()
        return (self.heap if heap is None else heap).bytes(offset, 8 * count).view(torch.int64)

    def upload_tables(self) -> None:
        """Copy ``self.tables`` into the heap (again, if a test or tool edited them) and clear events. The
        task rows' comm-area offsets go as the kernel reads them (``layout.device_words``)."""
        if self.transport is not None:
            raise BackendError("a kernel whose ranks span nodes keeps the tables it was built with (its transport "
                               "was planned from them): build a new kernel")
        t, lay = self.tables, self.layout
        rows = device_words(t.rows, self.delta)
        for offset, array in [(lay.tasks_off, rows), (lay.signals_off, t.signals), (lay.queue_off, t.queue),
                              (lay.index_off, t.queue_index)]:
            if array.size:
                self.words(offset, array.size).copy_(torch.from_numpy(np.ascontiguousarray(array).reshape(-1)))
        self._reset_events()

    def _reset_events(self) -> None:
        self.words(self.layout.events_off, max(self.tables.num_events, 1)).zero_()
        self.words(self.layout.status_off, STATUS_WORDS * (self.workers + 1)).zero_()
        self.epoch = self._checked = 0
        self._checked_launches = self.launches

    def tensor(self, t: Tensor) -> torch.Tensor:
        """The heap memory under graph tensor ``t`` (a view: writes go to the heap, between runs; it keeps the
        memory alive after ``close``)."""
        self._require_open()
        self.host_writes.handed_out(t.buffer.index)  # the host may write it through the view at any time
        return self._view(t)

    def _view(self, t: Tensor) -> torch.Tensor:
        view = self.view.tensor(t.addr(0, 0), t.dtype, t.rows, t.cols, t.row_stride)
        return view.reshape(t.shape) if t.ndim == 1 else view

    def poison(self, value: float = float("nan")) -> None:
        """Fill every buffer that is not an input, so that an element no task wrote stands out
        (integer buffers get the most negative value).

        With several ranks after the first run, a collective: peers may already be writing this rank's
        buffers for the next run, so the ranks meet before (a host barrier) and again at the next run.
        """
        self._require_open()
        if self.launches and self.graph.world_size > 1:
            self.group.barrier(timeout=self.timeout, why="poison the buffers")
            self._meet = True
        inputs = {t.buffer.index for t in self.graph.inputs.values()}
        for b in self.graph.buffers:
            if b.index not in inputs:
                fill = value if b.dtype.is_floating_point else torch.iinfo(b.dtype).min
                self.view.tensor(b.offset, b.dtype, b.rows, b.cols, b.cols).fill_(fill)

    # -- running ----------------------------------------------------------------------------------
    def bind(self, inputs: Mapping[str, torch.Tensor]) -> None:
        """Copy input values into their heap buffers; they stay bound for later runs."""
        self._require_usable()
        if not isinstance(inputs, Mapping):
            raise GraphError(f"inputs must be a mapping of input names to tensors, got {type(inputs).__name__}")
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
            if value.is_meta:
                raise GraphError(f"input {name!r} is a meta tensor: it has no values to copy")
        for name, value in inputs.items():
            self._view(self.graph.inputs[name]).copy_(value.detach())
            self.host_writes.written(self.graph.inputs[name].buffer.index)
            self._bound.add(name)

    @property
    def links(self) -> dict[int, str]:
        """How this rank reaches each rank: "self", "memory" (a rank of its node, whose heap it maps) or the
        transport's name (a rank of another node: "gloo" on the cpu and torch backends)."""
        topology, me = self.group.topology, self.graph.rank
        return {r: "self" if r == me else "memory" if topology.same_node(r, me) else self.transport.name
                for r in range(self.graph.world_size)}

    @property
    def host_barriers(self) -> int:
        """Times this rank met the others on the host (barriers and exchanges), building included."""
        return self.group.meetings

    def run(self, inputs: Mapping[str, torch.Tensor] | None = None, steps: int = 1) -> dict[str, torch.Tensor]:
        """Bind ``inputs``, launch once (one message per worker) to run the graph ``steps`` times (the
        epoch advances on the device), return copies of the outputs of the last step.

        The steps of a launch, and successive launches, are separated by the device protocol alone
        (``scheduler.events``): every rank calls ``run`` with the same ``steps``, and no rank waits
        for another on the host, except before the first launch (a peer's stores must not land
        while this rank's host still writes its buffers: inputs, ``poison``). Outputs that peers
        write are read from copies of this rank alone (``Graph.sealed``). A rank that stops or hangs
        is named by the watchdog's report within ``timeout``. Runs from several threads take turns.
        A run interrupted in the host (KeyboardInterrupt) stops its workers first: a one-rank kernel
        stays usable, a multi-rank one refuses further runs.
        """
        if not (is_count(steps) and steps <= MAX_STEPS):
            raise GraphError(f"steps must be an int in [1, 2^32], got {steps!r}")
        with self._lock, self.backend.host_work():
            return self._run({} if inputs is None else inputs, steps)

    def _run(self, inputs: Mapping[str, torch.Tensor], steps: int) -> dict[str, torch.Tensor]:
        if (self.epoch + steps) * self._max_fan_in >= 2**63:  # an event's count, epoch x fan-in, is an int64
            raise GraphError(f"{steps} more steps after {self.epoch} would overflow the event counters (a fan-in "
                             f"of {self._max_fan_in}): build a new kernel")
        self._prepare(inputs)
        if self.tracing:
            self.words(self.layout.trace_off, TRACE_WORDS * len(self.tables.rows)).zero_()
        self._meet_peers()
        self.epoch += steps
        self.launches += 1
        failure = None
        try:
            self.launch_seconds = self.backend.launch(self._launch_args(steps), self.words(self.layout.status_off, 1))
        except BackendError as error:
            failure = error
        except BaseException:
            self._after_failure(f"launch {self.launches} was interrupted")
            raise
        try:
            self._check_launches(failure)
        except FaultError as fault:  # the run went to its end: its outputs are there, some of them not valid
            fault.outputs = self._outputs()
            raise
        if self.tracing:  # a debugging mode: the ranks exchange their spans (a host meeting per run)
            every = self.group.all_gather(rank_trace(self.tables, self._stamps()))
            self.trace = Trace([s for spans, _ in every for s in spans], [e for _, edges in every for e in edges])
        return self._outputs()

    def _outputs(self) -> dict[str, torch.Tensor]:
        return {name: self._view(t).clone() for name, t in self.graph.outputs.items()}

    def _prepare(self, inputs: Mapping[str, torch.Tensor]) -> None:
        self.bind(inputs)
        missing = [name for name in self.graph.inputs if name not in self._bound]
        if missing:
            raise GraphError(f"input {missing[0]!r} was never bound: pass it to run(); "
                             f"unbound: {', '.join(missing)}")

    def _meet_peers(self) -> None:
        """Before the first launch (and after a collective poison): this rank's host writes are done, and
        so are every peer's, before any peer's stores may land here."""
        if self._meet:
            self.backend.settle()
            self.group.barrier(timeout=self.timeout)
            self._meet = False

    def _launch_args(self, steps: int) -> dict[str, int]:
        """The kernel's arguments: the same for every launch of ``steps`` steps (the epoch is on the device)."""
        return dict(steps=steps, timeout_ns=int(self.timeout * 1e9), **self.layout.device_offsets(self.delta),
                    ROW=self.tables.row_words, TRACE=self.tracing)

    def _check_launches(self, failure: BackendError | None = None) -> None:
        """Raise what went wrong in the launches since the last check (they have ended): ``failure`` (the
        backend's), a stall (``DeadlockError``, report files written) or an index out of range. Reads the
        workers' records only when the rank's header says a wait stopped or a tile faulted."""
        since, self._checked = self._checked + 1, self.epoch
        first, self._checked_launches = self._checked_launches + 1, self.launches
        what = (f"launch {first}" if first == self.launches else f"launches {first} to {self.launches}") + (
            f" (steps {since} to {self.epoch})")
        if failure is None and self.transport is not None and self.transport.failures:
            failure = BackendError(f"rank {self.graph.rank}: {what} stopped: " + "; ".join(self.transport.failures))
        header = self._header() if failure is None else None
        if failure is None and header[LOST]:  # found by another rank's transport, and told here
            failure = BackendError(f"rank {self.graph.rank}: {what} stopped: rank {header[LOST] - 1} is gone (rank "
                                   f"{header[LOST_BY]}'s transport found it unreachable)")
        if failure is None and header[ABORT]:
            status = self._status()
            if diagnosis.stalled(status):
                report = self.deadlock_report()
                saved = diagnosis.save_hang_report(report, self.tables, self.epoch,
                                                   self._stamps() if self.tracing else None)
                failure = DeadlockError(f"rank {self.graph.rank}: the watchdog stopped {what}: a wait exceeded "
                                        f"{self.timeout} s ({saved})", report)
        if failure is not None:
            if self.transport is not None and self._header()[LOST]:  # a loss: every rank's news, sent first
                self.transport.wait_told(min(self.timeout, TELL_SECONDS))
            self._after_failure(f"{what} failed")
            raise failure
        # A fault anywhere counts: a peer's clamped data may be in this rank's outputs (a peer of this node;
        # one of another node, whose records are not mapped here, raises it on its own rank). Every task whose
        # results reach them finished before this launch did, its record written (a peer's record may
        # also tell of a fault in its next launch, which will raise there too).
        faults = diagnosis.faults(self.tables, self._status(), since) if header[FAULTED] >= since else []
        for rank, heap in sorted(self.peers.items()):
            if self._header(heap)[FAULTED] >= since:
                faults += diagnosis.faults(self.tables, self._status(heap), since, rank)
        if faults:  # the run finished (indices clamped): the kernel stays usable, its outputs are not valid
            kinds = {fault.kind for fault in faults}
            met = " and ".join(name for kind, name in ((INDEX, "read an index out of range (clamped)"),
                                                       (NOT_FINITE, "sampled logits that are not finite"))
                               if kind in kinds)
            raise FaultError(f"{what} {met}; the outputs are not valid:\n" + "\n".join(map(str, faults)), faults)

    # -- replaying without the host ---------------------------------------------------------------------
    def capture(self, steps: int = 1) -> "Captured":
        """Record one launch of ``steps`` steps, to replay with no host work at all: on a GPU a CUDA (HIP)
        graph of the launch, which ``Captured.replay`` enqueues on the current stream without waiting
        for it; on the cpu backend the same launch, run again. The kernel counts each replay's steps
        on the host, so replay through ``Captured.replay`` alone, not inside a graph of one's own.
        Every launch of a kernel has the same arguments (the epoch lives on the device), so the
        recording stays valid; inputs are rebound between replays by writing their heap memory
        (``bind``, ``tensor``) on the current stream, and outputs read from
        ``tensor(graph.outputs[name])``. A replay checks nothing: ``check()`` waits for the replays and
        raises what went wrong in any of them since the last check. A collective with several ranks
        (each rank replays its own recording, in the same order as its peers). Not with ``trace``."""
        if not (is_count(steps) and steps <= MAX_STEPS):
            raise GraphError(f"capture: steps must be an int in [1, 2^32], got {steps!r}")
        if self.tracing:
            raise GraphError("capture: a traced kernel reads its stamps back after every launch; build one with "
                             "trace=False to capture")
        with self._lock:
            self._prepare({})
            self._meet_peers()
            if self.graph.world_size > 1:  # no peer's kernel runs while this rank records (a device sync)
                self.group.barrier(timeout=self.timeout, why="capture the launch")
            launch = self.backend.capture(self._launch_args(steps), self.words(self.layout.status_off, 1))
            if self.graph.world_size > 1:
                self.group.barrier(timeout=self.timeout, why="capture the launch")
        return Captured(self, steps, launch)

    def _replay(self, captured: "Captured") -> None:
        with self._lock:
            self._require_usable()
            self._meet_peers()  # after a collective poison, as a run would
            self.epoch += captured.steps
            self.launches += 1
            try:
                captured.launch()
            except BaseException:
                self._after_failure(f"launch {self.launches} (a replay) failed")
                raise

    def check(self) -> None:
        """Wait until this rank's launches have ended; raise what went wrong in any of them since the last
        check (``run`` checks its own launch): a stall (``DeadlockError``) or an index out of range."""
        with self._lock:
            self._require_usable()
            failure = None
            try:
                self.backend.synchronize(self.launches - self._checked_launches)
            except BackendError as error:
                failure = error
            self._check_launches(failure)

    def _after_failure(self, what: str) -> None:
        """After a run that did not finish (no worker runs any more): one rank starts again from a clean
        slate; several ranks' event counters no longer agree, and killed workers map no heap."""
        if self.backend.lost_workers:
            self._broken = f"{what} and some of its worker processes had to be killed"
        elif self.graph.world_size > 1:
            self._broken = f"{what}; the ranks' event counters no longer agree"
        else:
            self._reset_events()

    def _require_open(self) -> None:
        if not self._finalizer.alive:
            raise BackendError(f"this kernel ({self.kernel_path.name}) is closed: build a new one")

    def _require_usable(self) -> None:
        self._require_open()
        if self._broken:
            raise BackendError(f"{self._broken}: build a new kernel")

    def _stamps(self) -> np.ndarray:
        """This rank's trace buffer on the heap, [tasks, TRACE_WORDS] (a copy)."""
        words = self.words(self.layout.trace_off, TRACE_WORDS * len(self.tables.rows))
        return words.cpu().numpy().reshape(-1, TRACE_WORDS).copy()

    def save_image(self, path) -> None:
        """Write the tables and the heap as it is now (inputs bound), for ``megakernel disasm --execute``."""
        self._require_open()
        outputs = {name: [t.addr(0, 0), str(t.dtype).removeprefix("torch."), t.rows, t.cols, t.row_stride]
                   for name, t in self.graph.outputs.items()}
        np.savez(path, tables=np.frombuffer(serialize(self.tables), dtype=np.uint8), heap=self.heap.data.cpu().numpy(),
                 comm=self.heap.comm.cpu().numpy(), outputs=np.frombuffer(json.dumps(outputs).encode(), dtype=np.uint8))

    # -- diagnosis --------------------------------------------------------------------------------
    def _header(self, heap: RankHeap | None = None) -> np.ndarray:
        """The rank's header record of this rank's heap, or of a peer's: ABORT .. LOST_BY (a copy)."""
        return self.words(self.layout.status_off, LOST_BY + 1, heap).cpu().numpy()

    def _status(self, heap: RankHeap | None = None) -> np.ndarray:
        """Per-worker status records [workers, STATUS_WORDS] of this rank's heap, or of a peer's (a copy)."""
        words = self.words(self.layout.status_off, STATUS_WORDS * (self.workers + 1), heap)
        return diagnosis.status_records(words.cpu().numpy().copy())

    def deadlock_report(self) -> str:
        """What each worker was doing when the run stopped; for a stalled wait, who should have signalled."""
        peers = {rank: self._status(heap) for rank, heap in self.peers.items()}
        return diagnosis.deadlock_report(self.tables, self._status(), peers,
                                         self.transport.arrival if self.transport else None)

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Unmap the heap from the workers and release it (views from ``tensor`` keep their part alive);
        the kernel cannot run afterwards.

        With several ranks, a collective after a run: the ranks meet first, because a peer's last
        launch may still signal this rank's events (its tasks release the next step's producers) or
        read its status records; a peer that does not come within ``timeout`` is not waited for. A run
        (or capture, or check) of another thread finishes first: its result is not lost.
        """
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._finalizer.alive and self.launches and self.graph.world_size > 1 and not self._broken:
            try:
                self.group.barrier(timeout=self.timeout, why="close the kernel")
            except BackendError:
                pass  # a peer that failed or left: nothing of it runs on this heap any more
        self._finalizer()
        self.heap = self.view = None
        self.peers = {}

    def __enter__(self) -> "Megakernel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _connect_nodes(kernel: Megakernel, shadows: dict[int, torch.Tensor]) -> Transport:
    """The transport stage (ranks on several nodes): this rank's channels to the peers of other nodes from its
    tables, the channels into it from theirs (an exchange), the progress agent started."""
    group, rank = kernel.group, kernel.graph.rank
    try:
        outgoing, refused = [c for c in outgoing_channels(kernel.tables, kernel.graph, group.topology) if c.messages], None
    except GraphError as error:
        outgoing, refused = [], f"rank {rank}: {error}"
    every = group.all_gather((outgoing, refused))  # a rank that cannot plan tells the others, which wait for it
    if any(why for _, why in every):
        raise GraphError(next(why for _, why in every if why))
    incoming = [c for channels, _ in every for c in channels if c.dst == rank]
    headers = {r: kernel.words(kernel.layout.status_off, LOST_BY + 1, heap)
               for r, heap in [(rank, None), *kernel.peers.items()]}
    return Transport(rank, outgoing, incoming, kernel.heap.comm, shadows, kernel.layout.events_off - COMM, headers)


def _release(backend: Backend, transport: Transport | None, timeout: float) -> None:
    """What closing a kernel lets go: the transport (its peers told), then the heap."""
    try:
        if transport is not None:
            transport.close(timeout)
    finally:
        backend.close()


def _check_buildable(graph: Graph, workers: int | None) -> None:
    if not isinstance(graph, Graph):
        raise GraphError(f"Megakernel needs a Graph, got {type(graph).__name__}")
    if not graph.tasks:
        raise GraphError("the graph has no tasks: add ops before building a kernel")
    if not graph.outputs:
        raise GraphError("the graph has no outputs: mark them with graph.output(name, tensor)")
    if workers is not None and not is_count(workers):
        raise GraphError(f"workers must be a positive integer, got {workers!r}")


def _host_writes(graph: Graph) -> HostWrites:
    """The record of the host's writes of ``graph``'s inputs, counting those no task writes, here or from a peer."""
    tasks = graph.tasks
    written = set(tasks.writes.table()[:, 0].tolist())
    written.update(region[0] for regions in tasks.remote for _, region in regions)
    return HostWrites({t.buffer.index: (t.buffer.offset, t.buffer.nbytes) for t in graph.inputs.values()
                       if t.buffer.index not in written})


def _seal(graph: Graph, group: Group, timeout: float) -> Graph:
    """The seal stage: once the ranks agree on their ops, ``graph``'s sealed copy (``Graph.sealed``), its
    buffers agreed too."""
    group.barrier(timeout=timeout, why="build the kernel")  # names a rank that never comes
    check_agreement(group, "topology", [f"ranks on nodes {list(graph.topology.nodes)}"])
    check_agreement(group, "op", graph.op_calls)
    sealed = graph.sealed(set().union(*group.all_gather(graph.remote_targets())))
    check_agreement(group, "buffer", sealed.buffer_layout())
    return sealed


def _schedule(graph: Graph, group: Group, backend: Backend, policy: str) -> QueueTables:
    """The schedule stage: this rank's tables over the backend's workers, the periodic schedule checked
    over every rank's tables (once, by rank 0, for all of them)."""
    needed = graph.heap_bytes + graph.comm_bytes
    if needed > backend.free_memory():  # before the scheduler walks the buffers
        raise GraphError(f"the graph's buffers take {needed:,} bytes; the {backend.name} backend "
                         f"has {backend.free_memory():,} bytes free for a heap")
    tables = schedule(graph.tasks, graph.buffer_shapes(), specs=graph.specs, op_names=graph.op_names,
                      workers=backend.workers, policy=policy, rank=graph.rank, world_size=graph.world_size,
                      describe=graph.describe_task, exchange=group.all_gather)
    every = group.all_gather(tables)
    verdict = None
    if graph.rank == 0:
        try:
            check_periodic(every)
        except GraphError as error:
            verdict = str(error)
    verdict = group.all_gather(verdict)[0]
    if verdict:
        raise GraphError(verdict)
    return tables


def _lay_out_heap(graph: Graph, group: Group, tables: QueueTables, trace: bool) -> HeapLayout:
    """The heap stage's layout: the graph's buffers, then the tables' regions, each as large as the largest
    rank's (the heap is symmetric)."""
    sizes = [max(column) for column in zip(*group.all_gather(_region_sizes(tables, trace)))]
    return HeapLayout.of(graph.heap_bytes, graph.comm_bytes, sizes)


def _region_sizes(tables: QueueTables, trace: bool) -> list[int]:
    """This rank's bytes per region of its ``HeapLayout``, in field order (the ranks agree on the largest of each)."""
    return [8 * max(tables.num_events, 1), 8 * STATUS_WORDS * (tables.workers + 1), tables.rows.nbytes,
            tables.signals.nbytes, tables.queue.nbytes, tables.queue_index.nbytes,
            8 * TRACE_WORDS * len(tables.rows) if trace else 8]


@dataclass(frozen=True)
class Captured:
    """One launch of ``steps`` steps recorded by ``Megakernel.capture``; ``replay()`` runs it again."""

    kernel: Megakernel
    steps: int
    launch: Callable[[], None]

    def replay(self) -> None:
        """Enqueue the launch again (GPU: on the current stream, without waiting; cpu: run it); the kernel
        counts its steps. ``kernel.check()`` tells whether it went well."""
        self.kernel._replay(self)
