"""The torch backend: the cpu backend's worker processes, heap, queues, events and epochs, with every
tile run as its task type's torch reference instead of the Triton interpreter.

A worker here is ``device.persistent_loop`` written in Python (``run_worker``): it reads the same
tables from the same heap, waits on the same event counters with real atomics (``atomics``), skips
guarded tasks, runs the tile, raises FAULTED after a tile that met an index out of range, stamps the
trace and signals its consumers, local or on a peer's heap. Only the tile differs: the task type's
``reference(heap, task[, peers])``, which reads the task's words from views of the heap and computes
what the Triton tile computes (float32 accumulation, rounding to the stored type); a data-dependent
index it reads is clamped and reported through the worker's status record (``WorkerHeap``), as the
kernel's ``checked_index`` does. So models run at the speed of torch on the machine, while the
interpreter stays the proof of the Triton tiles.

A wait polls with plain loads for a while, then yields, then sleeps (up to MAX_NAP_S): a waiting worker
leaves the cores to the working ones. It polls long (SPIN_S) when the job's workers have a core each,
briefly (SHORT_SPIN_S) when they share cores: there a spinning worker takes the core of the one it waits for.
The same holds when another program shares the cores, which no count of them tells: a worker that the
kernel preempts (involuntary context switches: something else wants its core), twice within SHARED_S,
polls briefly too for a while. A wait asks only once a brief poll found nothing (most waits end before).
With fewer cores free than workers (another program busy on them, ``core_share``), a launch deals the
queues out over fewer workers: a worker then runs several queues' tasks in the global order, each task
writing its own queue's status record, as that queue's worker would.
"""
from __future__ import annotations

import bisect
import math
import os
import resource
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import numpy as np
import torch

from .. import atomics
from ..device import NO_SEQUENCE
from ..errors import BackendError
from ..heap import HeapView, HostWrites, RankHeap
from ..layout import (ABORT, DONE, EPOCH, EVENT, EXPECTED, FAULT, FAULT_AT, FAULT_BOUND, FAULT_KIND, FAULT_VALUE,
                     FAULTED, INDEX, NOT_FINITE, OBSERVED, SIGNAL_WORDS, STATE, STATUS_WORDS, STOPPED, TASK, TIMED_OUT,
                     TRACE_WORDS)
from ..scheduler import (ARG0, CARRY_EVENT, CARRY_FAN_IN, FAN_IN, GUARD, NO_GUARD, OPCODE, SIGNAL_COUNT,
                        SIGNAL_START, WAIT_EVENT, Spec, read_signals)
from ..tasks import TASK_TYPES
from .core_share import CoreShare, plan
from .cpu import CpuBackend, WorkerPool, usable_cores

SPIN_S = 1e-3       # a wait polls this long before it first yields its core, when every worker has a core
SHORT_SPIN_S = 20e-6  # ... when workers share cores
DERIVED_SHARE = 4  # a quarter of the machine's memory, over the job's workers, holds what tiles derive
MAX_NAP_S = 1e-3    # the longest sleep between two polls
# Preempted twice within SHARED_S, a worker counts its cores as shared for SHARED_S more: it polls SHORT_SPIN_S
# and naps at most SHARED_NAP_S. (Beside a busy loop on 2 cores a step then takes ~2.8x its time alone, not
# ~9.6x; alone, the host's work between launches costs ~3% through it: bench/torch_backend.py.)
SHARED_S = 0.02
SHARED_NAP_S = 100e-6


class TorchBackend(CpuBackend):
    """Workers are processes of a pool, as on the cpu backend, each running ``run_worker``."""

    name = "torch"
    loop = f"{__name__}:run_worker"  # what the cpu backend's workers run (``cpu.Launch.loop``), by name

    def __init__(self, group, kernel_path, workers: int | None, pool: WorkerPool | None, specs: list[Spec],
                 host_writes: HostWrites):
        missing = sorted({s.task_type for s in specs if not callable(TASK_TYPES[s.task_type].reference)})
        if missing:  # before any process or memory is taken
            raise BackendError(f"the torch backend runs each tile as its task type's torch reference; task type "
                               f"{missing[0]!r} has none (reference={TASK_TYPES[missing[0]].reference!r})")
        super().__init__(group, kernel_path, workers, pool)
        self.specs = specs
        self.host_writes = host_writes  # the kernel's, kept up to date by it
        # one rank on the machine: the other ranks' workers would count as other programs
        self.share = (CoreShare(frozenset(os.sched_getaffinity(0)), self._pids)
                      if group.world_size == 1 and hasattr(os, "sched_getaffinity") else None)

    def _pids(self) -> list[int]:
        return [os.getpid(), *(worker.process.pid for worker in self.processes)]

    def _launch_extras(self) -> dict:
        # the job's worker processes on this machine (its ranks', virtual or not): a core each, or sharing
        processes, cores = self.workers * self.group.world_size, usable_cores()
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        free = cores if self.share is None else self.share.look()
        return dict(specs=self.specs, threads=max(1, cores // processes),  # torch's own threads
                    spin_s=SPIN_S if processes <= cores else SHORT_SPIN_S,
                    derived_bytes=memory // DERIVED_SHARE // processes, stable=self.host_writes.stable(),
                    plan=plan(self.workers, free))


@dataclass
class Derived:
    """What a tile derived (``HeapView.derived``), what tells whether its sources changed, and the bytes kept."""

    value: torch.Tensor
    stamp: tuple | None     # the writes so far of the inputs that hold the sources (``HostWrites``); None: ...
    sources: tuple[torch.Tensor, ...]  # ... copies of the sources' bytes, compared at each use
    size: int


class WorkerHeap(HeapView):
    """A rank's heap as one worker's tiles see it: one flat area (offsets as the kernel reads them,
    ``layout.device_words``), and a data-dependent index out of range clamped and noted in the
    worker's status record, as ``device.checked_index`` does. What tiles derive from the heap (weights
    unpacked from a GGUF file's bytes, or laid out for the CPU's matrix library) is kept, up to
    ``derived_bytes``, and made again when its sources change. Sources inside inputs that only ``bind``
    writes (``stable``, from ``HostWrites``, updated at each launch) change when the host writes them again;
    other sources are copied and compared at each use (reading them twice, where unpacking a GGUF block
    would cost tens of torch calls per format)."""

    def __init__(self, whole: torch.Tensor, status: np.ndarray | None = None, derived_bytes: int = 0):
        super().__init__(RankHeap(whole, whole[:0]))
        self.status = status  # this worker's record, on this rank's heap; None for a peer's heap
        self._views: dict[tuple, torch.Tensor] = {}
        self._words = whole[:whole.numel() // 8 * 8].view(torch.int64).numpy()
        self._base = whole.data_ptr()
        self._derived: dict[tuple, Derived] = {}
        self._derived_room = derived_bytes  # bytes left for more
        self._stable: tuple[tuple[int, int, int], ...] = ()  # (first byte, end byte, writes) by first byte
        self._stamps: dict[tuple, tuple | None] = {}  # by what-derived key, while ``stable`` stays the same

    @property
    def stable(self) -> tuple[tuple[int, int, int], ...]:
        return self._stable

    @stable.setter
    def stable(self, stable: tuple[tuple[int, int, int], ...]) -> None:
        if stable != self._stable:  # a bind wrote an input: the stamps are worked out again
            self._stable = stable
            self._stamps.clear()

    def derived(self, key: tuple, sources: tuple[torch.Tensor, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        stamp = self._stamp(key, sources)
        kept = self._derived.get(key)
        if kept is not None:
            if stamp is None and kept.stamp is None:
                same = all(torch.equal(now, then) for now, then in zip(sources, kept.sources))
            else:
                same = stamp == kept.stamp
            if same:
                return kept.value
            del self._derived[key]
            self._derived_room += kept.size
        value = make()
        copies = () if stamp is not None else tuple(source.clone() for source in sources)
        size = value.nbytes + sum(copy.nbytes for copy in copies)
        if size <= self._derived_room:
            self._derived[key] = Derived(value, stamp, copies, size)
            self._derived_room -= size
        return value

    def keeps(self, key: tuple, sources: tuple[torch.Tensor, ...], nbytes: int) -> bool:
        if key in self._derived:
            return True
        copies = 0 if self._stamp(key, sources) is not None else sum(source.nbytes for source in sources)
        return nbytes + copies <= self._derived_room

    def _stamp(self, key: tuple, sources: tuple[torch.Tensor, ...]) -> tuple | None:
        """The (first byte, writes) of the stable input holding each source, or None if one lies outside them;
        worked out once for ``key`` (the same sources every time) while ``stable`` stays the same (a linear
        tile asks twice a step: ~5 us each)."""
        if key not in self._stamps:
            self._stamps[key] = self._find_stamp(sources)
        return self._stamps[key]

    def _find_stamp(self, sources: tuple[torch.Tensor, ...]) -> tuple | None:
        stamp = []
        for source in sources:
            first = source.data_ptr() - self._base
            extent = 1 + sum((size - 1) * stride for size, stride in zip(source.shape, source.stride()))
            at = bisect.bisect_right(self.stable, (first, math.inf)) - 1
            if at < 0 or first + extent * source.element_size() > self.stable[at][1]:
                return None
            stamp.append((self.stable[at][0], self.stable[at][2]))
        return tuple(stamp)

    def word(self, offset: int) -> int:
        """``HeapView.word`` read through numpy: a tile reads a few every step (~0.3 us, not ~5)."""
        if offset % 8 or not 0 <= offset < 8 * self._words.size:
            return super().word(offset)  # its error
        return int(self._words[offset // 8])

    def words(self, offset: int, count: int, step: int) -> list[int]:
        """``HeapView.words`` read through numpy, in one call."""
        last = offset + (count - 1) * step
        if offset % 8 or step % 8 or step < 0 or count < 1 or not 0 <= offset <= last < 8 * self._words.size:
            return super().words(offset, count, step)  # its error, or its answer
        if step == 0:
            return [int(self._words[offset // 8])] * count
        return self._words[offset // 8:last // 8 + 1:step // 8].tolist()

    def tensor(self, offset: int, dtype: torch.dtype | str, rows: int, cols: int, row_stride: int) -> torch.Tensor:
        """``HeapView.tensor``, made once: a tile asks for the same views every step (~5 us each to make)."""
        key = (offset, dtype, rows, cols, row_stride)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = super().tensor(offset, dtype, rows, cols, row_stride)
        return view

    def checked_index(self, value: int, bound: int, where: str) -> int:
        if 0 <= value < bound:
            return value
        self._record_fault(INDEX, value, bound)
        return min(max(value, 0), bound - 1)

    def not_finite(self, row: int, position: int, where: str) -> None:
        self._record_fault(NOT_FINITE, row, position)

    def _record_fault(self, kind: int, value: int, bound: int) -> None:
        """``device.record_fault``."""
        status = self.status
        if status[FAULT] < status[EPOCH]:  # the first fault of the step
            status[FAULT_KIND], status[FAULT_VALUE], status[FAULT_BOUND] = kind, value, bound
            status[FAULT_AT] = status[DONE]
            status[FAULT] = status[EPOCH]


@dataclass(frozen=True)
class Entry:
    """A queue entry as the loop runs it: the task, its two waits (event, or -1; fan-in), its guard's word
    on the rank's heap (-1: none), its tile as a call, its signals as addresses and increments, the status
    record of its queue's worker, that worker and the task's position in its queue."""

    task: int
    wait: int
    fan_in: int
    carry: int
    carry_fan_in: int
    guard: int
    tile: Callable[[], None]
    label: str
    signal_at: np.ndarray
    increments: np.ndarray
    status: np.ndarray
    worker: int
    position: int


def _program(words: np.ndarray, args: dict[str, int], rank: int, queue_of: int, specs: list[Spec],
             heaps: dict[int, WorkerHeap], status: np.ndarray) -> list[Entry]:
    """Worker ``queue_of``'s queue, read from the tables on rank ``rank``'s heap (``words``, int64); ``status``:
    that worker's record."""
    index = words[args["index_off"] // 8 + queue_of:][:2].tolist()
    queue = words[args["queue_off"] // 8 + index[0]:][:index[1] - index[0]].tolist()
    rank_heap, row_words = heaps[rank], args["ROW"]
    events = args["events_off"]
    entries = []
    for position, task in enumerate(queue):
        row = words[args["tasks_off"] // 8 + task * row_words:][:row_words].tolist()
        spec = specs[row[OPCODE]]
        task_type = TASK_TYPES[spec.task_type]
        namespace = SimpleNamespace(**dict(zip(spec.arg_names, row[ARG0:])), **dict(spec.constexprs))
        tile_args = (rank_heap, namespace, heaps) if task_type.needs_peers else (rank_heap, namespace)
        start = args["signals_off"] // 8 + row[SIGNAL_START] * SIGNAL_WORDS
        signals = read_signals(words[start:start + SIGNAL_WORDS * row[SIGNAL_COUNT]].reshape(-1, SIGNAL_WORDS))
        entries.append(Entry(
            task, row[WAIT_EVENT], row[FAN_IN], row[CARRY_EVENT], row[CARRY_FAN_IN],
            -1 if row[GUARD] == NO_GUARD else row[GUARD] // 8,
            lambda reference=task_type.reference, tile_args=tile_args: reference(*tile_args), spec.label,
            atomics.addresses(*(heaps[s.rank].heap.data.data_ptr() + events + 8 * s.event for s in signals)),
            np.array([s.increment for s in signals], dtype=np.int64), status, queue_of, position))
    return entries


def run_worker(heaps: list[torch.Tensor], rank: int, worker: int, args: dict[str, int], programs: dict,
               specs: list[Spec], threads: int, spin_s: float, derived_bytes: int,
               stable: tuple[tuple[int, int, int], ...], plan: tuple[tuple[int, ...], ...]) -> None:
    """One worker's launch: ``args["steps"]`` steps of its queues (``plan[worker]``: its own, or with fewer cores
    free than workers, some workers' queues or none, ``core_share``) on rank ``rank``'s heap (``heaps[r]``: rank
    r's whole heap as mapped here), as ``device.persistent_loop`` runs them. ``programs``: what earlier
    launches on this heap made of its tables ("tables": those read, "views": the heaps' views, "by_queues": the
    program of each set of queues run), kept while they stay the same. ``threads``: torch's threads in this
    process; ``spin_s``: how long a wait polls before it yields; ``derived_bytes``: what this worker's tiles may
    keep of what they derive, ``stable``: the inputs that only the host's ``bind`` writes, with its writes so
    far (``WorkerHeap``)."""
    queues = plan[worker]
    if not queues:  # its queues run on another worker this launch
        return
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    with torch.inference_mode():  # no autograd bookkeeping: a small tile's torch calls cost ~40% less
        _run(heaps, rank, queues, args, programs, specs, spin_s, derived_bytes, stable)


def _run(heaps: list[torch.Tensor], rank: int, queues: tuple[int, ...], args: dict[str, int], programs: dict,
         specs: list[Spec], spin_s: float, derived_bytes: int, stable: tuple[tuple[int, int, int], ...]) -> None:
    words = heaps[rank].view(torch.int64).numpy()
    base = heaps[rank].data_ptr()
    status_at = args["status_off"] // 8
    records = [words[status_at + STATUS_WORDS * (q + 1):][:STATUS_WORDS] for q in queues]  # each queue's worker's
    abort = status_at + ABORT
    tables = _tables_bytes(words, args, specs)
    if programs.get("tables") != tables:  # new tables: new views (and what tiles derived from the old ones goes)
        programs.update(tables=tables, by_queues={},
                        views={r: WorkerHeap(h, records[0] if r == rank else None, derived_bytes if r == rank else 0)
                               for r, h in enumerate(heaps)})
    views = programs["views"]
    program = programs["by_queues"].get(queues)
    if program is None:  # the queues' tasks in the global order (task ids): each wait's producer runs before it
        program = programs["by_queues"][queues] = sorted(
            (entry for q, record in zip(queues, records)
             for entry in _program(words, args, rank, q, specs, views, record)), key=lambda entry: entry.task)
    heap = views[rank]
    heap.stable = stable
    trace = args["trace_off"] // 8 if args["TRACE"] else -1
    events = args["events_off"] // 8
    waits = Waits(words, base, events, abort, records[0], args["timeout_ns"], spin_s, _Addresses(base + 8 * events))
    epoch = int(records[0][EPOCH]) + 1
    running = words[abort] == 0  # a stall the host has not read yet: keep its records
    for step in range(args["steps"]):
        if not running or words[abort] != 0:  # a host that stops the run is heard at the next step
            break
        now = epoch + step
        for record in records:
            record[DONE] = 0
            record[EPOCH] = now
        for entry in program:
            status = heap.status = waits.status = entry.status  # its queue's record: faults and stalls go there
            if trace >= 0:
                stamp = trace + entry.task * TRACE_WORDS
                words[stamp] = time.monotonic_ns()
            running = (waits.wait(entry.wait, now * entry.fan_in, entry.task)
                       and waits.wait(entry.carry, (now - 1) * entry.carry_fan_in, entry.task))
            if not running:
                break
            if trace >= 0:
                words[stamp + 1] = time.monotonic_ns()
            if entry.guard < 0 or words[entry.guard] != NO_SEQUENCE.value:
                try:
                    entry.tile()
                except Exception as error:
                    atomics.exchange(atomics.addresses(base + 8 * abort), 1)  # the other workers stop
                    raise BackendError(f"rank {rank} worker {entry.worker}: task {entry.task} ({entry.label}) failed: "
                                       f"{type(error).__name__}: {error}") from error
            if status[FAULT] == now:  # a tile faulted: tell the host, before the signals
                atomics.maximum(atomics.addresses(base + 8 * (status_at + FAULTED)), now)
            if trace >= 0:
                words[stamp + 2] = time.monotonic_ns()
            if entry.increments.size:
                atomics.add(entry.signal_at, entry.increments)
            status[DONE] = entry.position + 1


def _tables_bytes(words: np.ndarray, args: dict[str, int], specs: list[Spec]) -> bytes:
    """Everything a worker's program is made of: the task rows, signals, queues and index (laid out one
    after another from tasks_off up to trace_off, ``HeapLayout.of``) and the specs; a program is made
    again when they change (``Megakernel.upload_tables``)."""
    return words[args["tasks_off"] // 8:args["trace_off"] // 8].tobytes() + repr(specs).encode()


@dataclass
class Waits:
    """How a worker waits on its rank's event counters (``words``, at word ``events``)."""

    words: np.ndarray
    base: int            # the heap's address here
    events: int
    abort: int           # the rank's ABORT word
    status: np.ndarray   # this worker's record
    timeout_ns: int
    spin_s: float        # how long a wait polls before it first yields
    addresses: dict[int, np.ndarray]  # each event counter's address, as ``atomics`` takes it (``_Addresses``)
    preempted: int = 0   # this process's involuntary context switches when a wait last polled
    preempted_at: float = float("-inf")  # when a wait last found it preempted
    shared_until: float = 0.0  # till when the cores count as shared (``_spin``)

    def wait(self, event: int, target: int, task: int) -> bool:
        """Wait until ``event`` counts ``target`` (no wait for event -1 or a target of 0), the rank is
        stopped, or the timeout passes; whether it counted. A wait that times out writes this worker's
        status record and stops every worker of the rank (``device.report_stall``)."""
        if event < 0 or target <= 0:
            return True
        words, at = self.words, self.events + event
        if words[at] < target:
            start, polled = time.monotonic_ns(), time.perf_counter()
            spin_until, nap, longest = polled + SHORT_SPIN_S, 0.0, None
            while words[at] < target:
                if time.perf_counter() < spin_until:
                    continue
                if longest is None:  # a short poll found nothing: how much longer (most waits end before)
                    spin, longest = self._spin(time.perf_counter())
                    spin_until = polled + spin
                    continue
                if words[self.abort] != 0 or time.monotonic_ns() - start > self.timeout_ns:
                    self._report_stall(task, event, target)
                    return False
                time.sleep(nap)  # 0: a yield
                nap = min(longest, max(nap * 2, 20e-6)) if nap else 1e-6
        atomics.load_acquire(self.addresses[event])  # the producers' stores are visible from here
        return True

    def _spin(self, now: float) -> tuple[float, float]:
        """How long this wait polls before it yields, and its longest nap: ``spin_s`` and MAX_NAP_S, or
        SHORT_SPIN_S and SHARED_NAP_S while the cores count as shared (the process preempted twice within
        SHARED_S, by something, ours or not, that wants its core)."""
        switches = resource.getrusage(resource.RUSAGE_SELF).ru_nivcsw
        if switches != self.preempted:  # preempted twice within SHARED_S: not a passing kernel thread
            if now - self.preempted_at < SHARED_S:
                self.shared_until = now + SHARED_S
            self.preempted, self.preempted_at = switches, now
        return (SHORT_SPIN_S, SHARED_NAP_S) if now < self.shared_until else (self.spin_s, MAX_NAP_S)

    def _report_stall(self, task: int, event: int, target: int) -> None:
        words, status = self.words, self.status
        status[TASK], status[EVENT], status[EXPECTED] = task, event, target
        status[OBSERVED] = words[self.events + event]
        status[STATE] = STOPPED if words[self.abort] != 0 else TIMED_OUT
        atomics.exchange(atomics.addresses(self.base + 8 * self.abort), 1)


class _Addresses(dict):
    """Event counter ``e``'s address as ``atomics`` takes it (the counters are int64 words from ``first``),
    made on first use."""

    def __init__(self, first: int):
        super().__init__()
        self.first = first

    def __missing__(self, event: int) -> np.ndarray:
        address = self[event] = atomics.addresses(self.first + 8 * event)
        return address
