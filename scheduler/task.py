"""The scheduler's view of a graph: tile tasks, the regions they touch, and their cost."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Region(NamedTuple):
    """A rectangle ``[row0, row1) x [col0, col1)`` of one heap buffer, in the buffer's element coordinates.

    A tuple of ints, not a dataclass: a big graph has millions of them, and tuples of ints are the
    one container CPython's cyclic garbage collector stops tracking (which keeps building linear).
    """

    buffer: int
    row0: int
    row1: int
    col0: int
    col1: int

    def overlaps(self, other: "Region") -> bool:
        return (self.buffer == other.buffer and self.row0 < other.row1 and other.row0 < self.row1
                and self.col0 < other.col1 and other.col0 < self.col1)

    def covers(self, row0: int, row1: int, col0: int, col1: int) -> bool:
        return self.row0 <= row0 and row1 <= self.row1 and self.col0 <= col0 and col1 <= self.col1


@dataclass(slots=True)
class Task:
    """One tile task: what it runs (``opcode`` + argument words), what it touches, what it costs.

    ``op`` is the index of the graph op (or op phase) that made the task: the global order key,
    the same on every rank. ``remote`` lists the regions it writes on other ranks' heaps as
    ``(rank, region)``. ``cost`` is in the scheduler's time unit (see ``placement.task_cost``).
    """

    opcode: int
    args: tuple[int, ...]
    reads: tuple[Region, ...]
    writes: tuple[Region, ...]
    cost: float
    op: int
    remote: tuple[tuple[int, Region], ...] = ()
