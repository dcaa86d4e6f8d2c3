"""The scheduler's view of a graph: tile tasks, the regions they touch, and their cost."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field, fields
from functools import partial
from itertools import accumulate, chain, islice, repeat
from typing import Iterator, NamedTuple

import numpy as np


Region = tuple[int, int, int, int, int]
"""``(buffer, row0, row1, col0, col1)``: the rectangle ``[row0, row1) x [col0, col1)`` of one heap buffer,
in the buffer's element coordinates.

A plain tuple of ints, not a class, where builders make it: a big graph has millions of regions.
``Tasks`` keeps them flat (``Records``).
"""


class Task(NamedTuple):
    """One tile task: what it runs (``opcode`` + argument words), what it touches, what it costs.

    ``op`` is the index of the graph op (or op phase) that made the task: the global order key,
    the same on every rank. ``remote`` lists the regions it writes on other ranks' heaps as
    ``(rank, region)``. ``cost`` is in the scheduler's time unit (see ``placement.task_cost``).

    A read-only row of ``Tasks``, built on demand: the graph itself stores no per-task object.
    """

    opcode: int
    args: tuple[int, ...]
    reads: tuple[Region, ...]
    writes: tuple[Region, ...]
    cost: float
    op: int
    remote: tuple[tuple[int, Region], ...] = ()
    guard: int = -1   # heap offset of the int64 whose -1 makes the task skip its tile (``Graph.guarded``); -1: none


class Records:
    """A column of tuples of fixed-width records (``width`` ints each; width 1: tuples of ints), one tuple
    per task, kept flat in two typed arrays: every record's ints, and where each task's records end.

    Not a list of tuples, for a million-task graph: the tuples would be millions of objects to allocate
    and keep, and each full pass of CPython's cyclic garbage collector would visit every one of them
    through the list. ``column[tid]`` makes the task's tuple on demand; the scheduler's passes read the
    flat arrays (``ints``, ``ends``) whole.
    """

    __slots__ = ("width", "ints", "ends")

    def __init__(self, width: int = 1) -> None:
        self.width = width
        self.ints = array("q")   # the records' ints, task after task
        self.ends = array("q")   # per task: the number of records up to and including it

    def append(self, item: tuple) -> None:
        self.ints.extend(item if self.width == 1 else chain.from_iterable(item))
        self.ends.append((self.ends[-1] if self.ends else 0) + len(item))
        self._check()

    def extend(self, items: list[tuple]) -> None:
        self.ends.extend(islice(accumulate(map(len, items), initial=self.ends[-1] if self.ends else 0), 1, None))
        flat = chain.from_iterable(items)
        self.ints.extend(flat if self.width == 1 else chain.from_iterable(flat))
        self._check()

    def _check(self) -> None:
        if len(self.ints) != (self.ends[-1] if self.ends else 0) * self.width:
            raise ValueError(f"a record of other than {self.width} ints: the column would be misaligned")

    def __getitem__(self, tid: int) -> tuple:
        n = len(self.ends)
        if tid < 0:
            tid += n
        if not 0 <= tid < n:
            raise IndexError(f"task {tid} of {n}")
        w = self.width
        values = self.ints[(self.ends[tid - 1] if tid else 0) * w:self.ends[tid] * w]
        return tuple(values) if w == 1 else tuple(zip(*[iter(values)] * w))

    def __len__(self) -> int:
        return len(self.ends)

    def __iter__(self) -> Iterator[tuple]:
        return map(self.__getitem__, range(len(self.ends)))

    def counts(self) -> np.ndarray:
        """Each task's number of records."""
        return np.diff(np.frombuffer(self.ends, np.int64), prepend=0)

    def table(self) -> np.ndarray:
        """Every record, task after task, as a ``[records, width]`` array (a copy)."""
        return np.frombuffer(self.ints, np.int64).reshape(-1, self.width).copy()

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tasks' tuples."""
        del self.ints[(self.ends[n - 1] if n else 0) * self.width:]
        del self.ends[n:]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Records) and (self.width, self.ints, self.ends) == (other.width, other.ints, other.ends)

    def __copy__(self) -> "Records":
        twin = Records(self.width)
        twin.ints, twin.ends = array("q", self.ints), array("q", self.ends)
        return twin

    def __repr__(self) -> str:
        return f"Records({list(self)})"


@dataclass
class Tasks:
    """Tile tasks in program order, stored by column: one sequence per ``Task`` field, indexed by task id.

    Columns rather than a ``Task`` object per task, because of CPython's cyclic garbage collector: while
    a graph is built, each full collection visits everything that a tracked container holds, and a
    ``Task`` per task would be millions of tracked objects. Here the numeric columns are typed arrays,
    and the argument words and regions ``Records``: raw numbers that the collector never visits. The
    scheduler's passes each read one or two columns, in task id order.
    """

    opcode: array[int] = field(default_factory=partial(array, "q"))
    args: Records = field(default_factory=Records)
    reads: Records = field(default_factory=partial(Records, 5))
    writes: Records = field(default_factory=partial(Records, 5))
    cost: array[float] = field(default_factory=partial(array, "d"))
    op: array[int] = field(default_factory=partial(array, "q"))
    remote: list[tuple[tuple[int, Region], ...]] = field(default_factory=list)
    guard: array[int] = field(default_factory=partial(array, "q"))

    def append(self, opcode: int, args: tuple[int, ...], reads: tuple[Region, ...], writes: tuple[Region, ...],
               cost: float, op: int, remote: tuple[tuple[int, Region], ...] = (), guard: int = -1) -> None:
        self.opcode.append(opcode)
        self.args.append(args)
        self.reads.append(reads)
        self.writes.append(writes)
        self.cost.append(cost)
        self.op.append(op)
        self.remote.append(remote)
        self.guard.append(guard)

    def extend(self, opcode: int, args: list[tuple[int, ...]], reads: list[tuple[Region, ...]],
               writes: list[tuple[Region, ...]], costs: list[float], op: int, guard: int = -1) -> None:
        """Append a run of tasks of one opcode and op that write nothing on other ranks, one per entry of
        ``args`` (``reads``, ``writes`` and ``costs`` alike)."""
        count = len(args)
        self.opcode.extend(repeat(opcode, count))
        self.args.extend(args)
        self.reads.extend(reads)
        self.writes.extend(writes)
        self.cost.extend(costs)
        self.op.extend(repeat(op, count))
        self.remote.extend(repeat((), count))
        self.guard.extend(repeat(guard, count))

    def truncate(self, n: int) -> None:
        """Keep only the first ``n`` tasks (drops the tiles of an op that failed)."""
        for column in fields(self):
            values = getattr(self, column.name)
            if isinstance(values, Records):
                values.truncate(n)
            else:
                del values[n:]

    def __len__(self) -> int:
        return len(self.opcode)

    def __getitem__(self, tid: int) -> Task:
        return Task(self.opcode[tid], self.args[tid], self.reads[tid], self.writes[tid], self.cost[tid],
                    self.op[tid], self.remote[tid], self.guard[tid])
