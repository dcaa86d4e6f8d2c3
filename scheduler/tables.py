"""The queue format: task tables, signal tables and per-worker queues, as the kernel reads them.

Version 3 layout of a serialized table (all integers little-endian int64):

    header   HEADER_WORDS words: MAGIC, VERSION, rank, world_size, workers, events,
             tasks, row_words, signals, metadata_bytes (each a count)
    tasks    tasks x row_words: opcode, wait_event, fan_in, carry_event, carry_fan_in, signal_start,
             signal_count, guard, args...
    signals  signals x SIGNAL_WORDS: rank, event, increment (``events.Signal``)
    queue    tasks: task ids, worker 0's queue, then worker 1's, ...
    index    workers + 1: where each worker's queue starts in ``queue``
    task_op  tasks: index of the graph op each task came from
    metadata UTF-8 JSON: opcode specs (task type, constexprs, argument names), op names, and the
             other ranks' tasks that raise this rank's events (rank, task, worker, position, op)

A task waits for ``wait_event`` to count ``epoch * fan_in`` (its producers in the step) and for
``carry_event`` to count ``(epoch - 1) * carry_fan_in`` (its producers in the previous step, see
``scheduler.events``). A task whose ``guard`` is a heap offset (not -1) skips its tile, still waiting
and signalling, in a step where the int64 there is -1 (``Graph.guarded``). A task's row number is its
position in the global order: program order, the same key on every rank. Argument words that address memory are
byte offsets into the heap: every process maps the heap at its own address, so the kernel adds its
local heap base (or a peer's, for a remote store or signal). Offsets into the heap's comm area are
tagged (``layout.COMM``) here and rewritten when the rows are uploaded (``layout.device_words``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from ..errors import GraphError
from ..layout import (ARG0, CARRY_EVENT, CARRY_FAN_IN, FAN_IN, GUARD, NO_GUARD, OPCODE, SIGNAL_COUNT, SIGNAL_EVENT,
                      SIGNAL_INCREMENT, SIGNAL_RANK, SIGNAL_START, SIGNAL_WORDS, WAIT_EVENT)
from .events import NO_EVENT, Events, Signal
from .placement import Placement
from .task import Tasks

MAGIC = 0x4D4B5154_41424C45  # "MKTABLE"
VERSION = 3
HEADER_WORDS = 10


class FormatError(GraphError):
    """A serialized table that this version cannot read."""


@dataclass(frozen=True)
class Spec:
    """What an opcode runs: a task type and the compile-time constants of its tile."""

    task_type: str
    constexprs: tuple[tuple[str, object], ...]
    arg_names: tuple[str, ...]

    @property
    def label(self) -> str:
        consts = ", ".join(f"{k}={v}" for k, v in self.constexprs)
        return f"{self.task_type}[{consts}]"


@dataclass
class QueueTables:
    rank: int
    world_size: int
    workers: int
    num_events: int
    rows: np.ndarray         # int64 [tasks, row_words]: task i's row, in the global order
    signals: np.ndarray      # int64 [signals, SIGNAL_WORDS]
    queue: np.ndarray        # int64 [tasks]
    queue_index: np.ndarray  # int64 [workers + 1]
    task_op: np.ndarray      # int64 [tasks]
    specs: list[Spec] = field(default_factory=list)
    op_names: list[str] = field(default_factory=list)
    # event -> the tasks of other ranks that raise it: (rank, task, worker, queue position, op)
    remote_producers: dict[int, list[tuple[int, int, int, int, int]]] = field(default_factory=dict)
    # row -> the graph's task id (rows are in the global order); what the kernel does not need, not serialized
    task_ids: np.ndarray | None = None

    @property
    def row_words(self) -> int:
        return self.rows.shape[1]

    def worker_queue(self, worker: int) -> np.ndarray:
        return self.queue[self.queue_index[worker]:self.queue_index[worker + 1]]

    def producers_of(self, event: int) -> list[int]:
        """Task ids of this rank that signal ``event`` of this rank."""
        signals = np.nonzero((self.signals[:, SIGNAL_EVENT] == event) & (self.signals[:, SIGNAL_RANK] == self.rank))[0]
        return sorted({int(t) for t in np.searchsorted(self.rows[:, SIGNAL_START], signals, side="right") - 1})

    def worker_of(self) -> np.ndarray:
        """task -> the worker that runs it."""
        owner = np.empty(len(self.queue), dtype=np.int64)
        for w in range(self.workers):
            owner[self.worker_queue(w)] = w
        return owner

    def queue_position(self) -> np.ndarray:
        """task -> its position in its worker's queue."""
        position = np.empty(len(self.queue), dtype=np.int64)
        for w in range(self.workers):
            position[self.worker_queue(w)] = np.arange(len(self.worker_queue(w)))
        return position


def read_signals(signals: np.ndarray) -> list[Signal]:
    """Rows of a signal table as ``Signal``s."""
    return [Signal(row[SIGNAL_RANK], row[SIGNAL_EVENT], row[SIGNAL_INCREMENT]) for row in signals.tolist()]


def build_tables(tasks: Tasks, placement: Placement, events: Events, *, specs: list[Spec],
                 op_names: list[str], workers: int, rank: int = 0, world_size: int = 1,
                 remote_producers: dict[int, list[tuple[int, int, int, int, int]]] | None = None) -> QueueTables:
    # Built column by column with numpy, not row by row (a million small numpy assignments would cost
    # more than the rest of the scheduler). Task columns are read in task id order, the order their
    # values lie in memory, and then permuted to rows: reading them in the global order misses the cache.
    n = len(tasks)
    order = np.asarray(placement.order, dtype=np.int64)  # row -> task id
    row_of = np.empty(n, dtype=np.int64)                 # task id -> row
    row_of[order] = np.arange(n)
    arg_counts = tasks.args.counts()
    rows = np.zeros((n, ARG0 + (int(arg_counts.max()) if n else 0)), dtype=np.int64)
    rows[:, OPCODE] = np.asarray(tasks.opcode, dtype=np.int64)[order]
    rows[:, WAIT_EVENT] = np.asarray(events.wait_event, dtype=np.int64)[order]
    rows[:, FAN_IN] = np.asarray(events.fan_in, dtype=np.int64)[order]
    rows[:, CARRY_EVENT] = np.asarray(events.carry_event, dtype=np.int64)[order]
    rows[:, CARRY_FAN_IN] = np.asarray(events.carry_fan_in, dtype=np.int64)[order]
    signal_counts = np.fromiter(map(len, events.signals), dtype=np.int64, count=n)[order]
    rows[:, SIGNAL_START] = np.cumsum(signal_counts) - signal_counts
    rows[:, SIGNAL_COUNT] = signal_counts
    rows[:, GUARD] = np.frombuffer(tasks.guard, dtype=np.int64)[order]
    # Argument words, one block per argument count (a graph has a handful): the block's tasks' words
    # in one array, reshaped to [tasks, count] and stored into those tasks' rows.
    words, first_word = tasks.args.table()[:, 0], np.cumsum(arg_counts) - arg_counts
    for count in np.unique(arg_counts[arg_counts > 0]).tolist():
        ids = np.flatnonzero(arg_counts == count)
        rows[row_of[ids], ARG0:ARG0 + count] = words[first_word[ids, None] + np.arange(count)]
    signal_rows = np.fromiter(chain.from_iterable(chain.from_iterable(events.signals[tid] for tid in placement.order)),
                              dtype=np.int64, count=SIGNAL_WORDS * int(signal_counts.sum())).reshape(-1, SIGNAL_WORDS)
    task_op = np.asarray(tasks.op, dtype=np.int64)[order]
    worker_by_row = np.asarray(placement.worker, dtype=np.int64)[order]
    queue = np.argsort(worker_by_row, kind="stable").astype(np.int64)
    index = np.zeros(workers + 1, dtype=np.int64)
    index[1:] = np.cumsum(np.bincount(worker_by_row, minlength=workers))
    return QueueTables(rank, world_size, workers, events.count, rows, signal_rows, queue, index, task_op,
                       list(specs), list(op_names), dict(remote_producers or {}), order)


def serialize(t: QueueTables) -> bytes:
    meta = json.dumps({
        "specs": [[s.task_type, [list(kv) for kv in s.constexprs], list(s.arg_names)] for s in t.specs],
        "ops": t.op_names,
        "remote_producers": [[event, [list(p) for p in ps]] for event, ps in sorted(t.remote_producers.items())],
    }).encode()
    header = np.array([MAGIC, VERSION, t.rank, t.world_size, t.workers, t.num_events, len(t.rows),
                       t.row_words, len(t.signals), len(meta)], dtype="<i8")
    parts = [header, t.rows, t.signals, t.queue, t.queue_index, t.task_op]
    # join() reads the arrays' buffers directly: one copy of a table that may be hundreds of MiB.
    return b"".join([*(np.ascontiguousarray(p, dtype="<i8") for p in parts), meta])


def deserialize(blob: bytes) -> QueueTables:
    if len(blob) < HEADER_WORDS * 8:
        raise FormatError(f"not a megakernel task table: {len(blob)} bytes is shorter than the header")
    header = np.frombuffer(blob, dtype="<i8", count=HEADER_WORDS)
    magic, version, rank, world, workers, events, n, row_words, n_signals, meta_len = (int(v) for v in header)
    if magic != MAGIC:
        raise FormatError(f"not a megakernel task table: magic {magic:#x}, expected {MAGIC:#x}")
    if version != VERSION:
        raise FormatError(f"task table format version {version}; this megakernel reads version {VERSION}")
    if min(world - 1, rank, world - 1 - rank, workers - 1, events, n, row_words - ARG0, n_signals, meta_len) < 0:
        raise FormatError(f"task table header has impossible counts: {header.tolist()}")
    if events > 2 * n:  # an event is made for a task's wait, and a task waits on at most two
        raise FormatError(f"task table header has {events} events for {n} tasks (at most 2 per task)")
    sizes = [n * row_words, n_signals * SIGNAL_WORDS, n, workers + 1, n]
    expected = (HEADER_WORDS + sum(sizes)) * 8 + meta_len
    if len(blob) != expected:
        raise FormatError(f"task table is {len(blob)} bytes; its header describes {expected}")
    words = np.frombuffer(blob, dtype="<i8", count=sum(sizes), offset=HEADER_WORDS * 8).astype(np.int64)
    tasks, signals, queue, index, task_op = np.split(words, np.cumsum(sizes)[:-1])
    try:
        meta = json.loads(blob[len(blob) - meta_len:].decode())
        specs = [Spec(name, tuple((k, v) for k, v in consts), tuple(args)) for name, consts, args in meta["specs"]]
        remote = {int(event): [tuple(map(int, p)) for p in ps] for event, ps in meta["remote_producers"]}
        ops = [str(name) for name in meta["ops"]]
    except (ValueError, KeyError, TypeError) as error:
        raise FormatError(f"task table metadata is not readable: {type(error).__name__}: {error}") from None
    if any(ARG0 + len(spec.arg_names) > row_words for spec in specs):
        raise FormatError(f"task table metadata: an opcode's argument words do not fit a row of {row_words} words")
    if not all(len(p) == 5 for ps in remote.values() for p in ps):
        raise FormatError("task table metadata: a remote producer is not (rank, task, worker, position, op)")
    t = QueueTables(rank, world, workers, events, tasks.reshape(n, row_words), signals.reshape(n_signals, SIGNAL_WORDS),
                    queue, index, task_op, specs, ops, remote)
    _check_references(t)
    _check_words(t)
    return t


def _check_words(t: QueueTables) -> None:
    """The words of each row that the table alone can check: argument words are heap offsets, counts and
    strides (never negative; the heap's size is not the table's to know, ``HeapView`` bounds a view of
    it), the words past an opcode's arguments are zero, counts and the guard are in range."""
    rows = t.rows
    for what, column in (("fan_in", FAN_IN), ("carry_fan_in", CARRY_FAN_IN)):
        bad = np.flatnonzero(rows[:, column] < 0)
        if len(bad):
            raise FormatError(f"task table task {int(bad[0])}: word {what} is {int(rows[bad[0], column])}, a count")
    guards = rows[:, GUARD]
    bad = np.flatnonzero((guards != NO_GUARD) & ((guards < 0) | (guards % 8 != 0)))
    if len(bad):
        raise FormatError(f"task table task {int(bad[0])}: word guard is {int(guards[bad[0]])}, neither {NO_GUARD} "
                          "nor the heap offset of an int64")
    for opcode, spec in enumerate(t.specs):
        tasks = np.flatnonzero(rows[:, OPCODE] == opcode)
        words = rows[tasks, ARG0:]
        used = len(spec.arg_names)
        bad = np.argwhere(np.concatenate([words[:, :used] < 0, words[:, used:] != 0], axis=1))
        if len(bad):
            task, word = int(tasks[bad[0][0]]), int(bad[0][1])
            name = spec.arg_names[word] if word < used else f"{ARG0 + word} (past {spec.task_type}'s arguments)"
            raise FormatError(f"task table task {task} ({spec.task_type}): word {name} is {int(words[bad[0][0], word])}; "
                              + ("an argument word is a heap offset, count or stride, never negative" if word < used
                                 else "words past an opcode's arguments are 0"))


def _check_references(t: QueueTables) -> None:
    """Every number of a table that indexes something points inside it (a table may come from anyone)."""
    n, rows = len(t.rows), t.rows
    problems = [
        ("an opcode", rows[:, OPCODE], len(t.specs)),
        ("a wait event", rows[:, WAIT_EVENT][rows[:, WAIT_EVENT] != NO_EVENT], t.num_events),
        ("a carried wait's event", rows[:, CARRY_EVENT][rows[:, CARRY_EVENT] != NO_EVENT], t.num_events),
        ("a task's op", t.task_op, len(t.op_names)),
        ("a queue entry", t.queue, n),
        ("a signal's rank", t.signals[:, SIGNAL_RANK], t.world_size),
        ("a local signal's event", t.signals[t.signals[:, SIGNAL_RANK] == t.rank, SIGNAL_EVENT], t.num_events),
        ("a signal range's end", rows[:, SIGNAL_START] + rows[:, SIGNAL_COUNT], len(t.signals) + 1),
    ]
    for what, values, bound in problems:
        if len(values) and (values.min() < 0 or values.max() >= bound):
            raise FormatError(f"task table has {what} outside [0, {bound}): {int(values[(values < 0) | (values >= bound)][0])}")
    if (rows[:, SIGNAL_START] < 0).any() or (rows[:, SIGNAL_COUNT] < 0).any():
        raise FormatError("task table has a negative signal range")
    if t.queue_index[0] != 0 or t.queue_index[-1] != n or (np.diff(t.queue_index) < 0).any() \
            or len(np.unique(t.queue)) != n:
        raise FormatError("task table's queues are not one ordering of its tasks")


def disassemble(t: QueueTables) -> str:
    """A readable listing: the header, then every worker's queue in execution order."""
    lines = [f"megakernel task table v{VERSION}: rank {t.rank}/{t.world_size}, {t.workers} workers, "
             f"{len(t.rows)} tasks, {t.num_events} events, {len(t.signals)} signals, {t.row_words} words/row"]
    for opcode, spec in enumerate(t.specs):
        lines.append(f"  opcode {opcode}: {spec.label}")
    for w in range(t.workers):
        q = t.worker_queue(w)
        lines.append(f"worker {w}: {len(q)} tasks")
        for pos, tid in enumerate(q):
            row = t.rows[tid]
            spec = t.specs[row[OPCODE]]
            wait = " ".join([*([] if row[WAIT_EVENT] == NO_EVENT else [f"ev{row[WAIT_EVENT]}>=e*{row[FAN_IN]}"]),
                             *([] if row[CARRY_EVENT] == NO_EVENT else [f"ev{row[CARRY_EVENT]}>=(e-1)*{row[CARRY_FAN_IN]}"])]) or "-"
            start, count = row[SIGNAL_START], row[SIGNAL_COUNT]
            sigs = " ".join(f"r{s.rank}:ev{s.event}+{s.increment}" for s in read_signals(t.signals[start:start + count])) or "-"
            args = " ".join(f"{name}={int(v)}" for name, v in zip(spec.arg_names, row[ARG0:]))
            guard = "" if row[GUARD] == NO_GUARD else f" guard@{row[GUARD]}"
            lines.append(f"  [{pos:>4}] task {tid:>5} {t.op_names[t.task_op[tid]]:<16} {spec.task_type:<14} "
                         f"wait {wait:<12} signal {sigs:<16} {args}{guard}")
    return "\n".join(lines)
