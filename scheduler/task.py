"""The scheduler's view of a graph: tile tasks, the regions they touch, and their cost."""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field, fields
from functools import partial
from itertools import repeat
from typing import NamedTuple


Region = tuple[int, int, int, int, int]
"""``(buffer, row0, row1, col0, col1)``: the rectangle ``[row0, row1) x [col0, col1)`` of one heap buffer,
in the buffer's element coordinates.

A plain tuple of ints, not a class: a big graph has millions of regions, and exact tuples of ints
are what CPython's cyclic garbage collector stops tracking, so that building a graph stays linear.
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


@dataclass
class Tasks:
    """Tile tasks in program order, stored by column: one sequence per ``Task`` field, indexed by task id.

    Columns rather than a ``Task`` object per task, because of CPython's cyclic garbage collector: while
    a graph is built, each full collection visits everything that a tracked container holds, and a
    ``Task`` per task would be millions of tracked objects. Here the numeric columns are typed arrays,
    which hold raw numbers that the collector never visits, and the other columns are lists of tuples
    of ints, which the collector stops tracking once it has seen them. The scheduler's passes each read
    one or two columns, in task id order.
    """

    opcode: array[int] = field(default_factory=partial(array, "q"))
    args: list[tuple[int, ...]] = field(default_factory=list)
    reads: list[tuple[Region, ...]] = field(default_factory=list)
    writes: list[tuple[Region, ...]] = field(default_factory=list)
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
            del getattr(self, column.name)[n:]

    def __len__(self) -> int:
        return len(self.opcode)

    def __getitem__(self, tid: int) -> Task:
        return Task(self.opcode[tid], self.args[tid], self.reads[tid], self.writes[tid], self.cost[tid],
                    self.op[tid], self.remote[tid], self.guard[tid])
