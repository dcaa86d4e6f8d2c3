"""Dependency inference from the regions tasks read and write.

Tasks arrive in program order. A task depends on every earlier task whose region overlaps one of
its own in a conflicting way: read-after-write, write-after-read, write-after-write. Overlap is
decided on rectangles of the underlying buffer, so views and slices are handled exactly.

To stay linear in the number of tasks, every buffer is cut into a grid of cells; an access looks only
at the accesses in the cells it touches since the last write that covered that cell whole (the
*window* of the access in the cell). Buffers that no task writes (weights, inputs) create no
dependency and are never indexed.

Tiles of one op often read the very same rectangle (every GEMV tile of a linear reads the whole
input row), so consecutive reads of one rectangle of a buffer, with no other access to it in between,
form one *read group*: the cells hold the group once, by its first member, and every member has the
producers the group found. A write after the group depends on all its members.

A graph that runs again and again is a loop: ``infer_periodic`` also finds the dependencies that cross
from step ``e`` to step ``e + 1``, by letting a second copy of the program look into the cells as the
first left them (each cell's last window). Two copies are enough: the same task runs on the same worker
in every step, so a dependency on step ``e - 1`` is implied by one on step ``e``. The second copy only
looks: its own accesses are of its own step, and a cell it writes whole hides the first copy's accesses
from the accesses after that write.

The passes are array programs over (access, cell) pairs, sorted by cell and then program order, rather
than a walk of the tasks: a million-task graph has a few million pairs, and a loop in Python over them
would take several seconds.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import chain

import numpy as np

from ..errors import GraphError
from .task import Records, Tasks

CELL_ROWS = 16
CELL_COLS = 256
MAX_CELLS = 1 << 24  # cells of the written buffers: one access may touch all of them, each an array entry

Producers = list[tuple[int, ...]]


def infer_dependencies(tasks: Tasks, shapes: dict[int, tuple[int, int]]) -> Producers:
    """For each task, the sorted ids of the earlier tasks it must wait for.

    ``shapes`` maps each buffer to its (rows, cols), so that a cell on the buffer's edge counts as
    covered by a write that reaches the edge.
    """
    return _Cells.of(tasks, shapes).within_step()


def infer_periodic(tasks: Tasks, shapes: dict[int, tuple[int, int]]) -> tuple[Producers, Producers]:
    """For each task, its producers within a step (``infer_dependencies``) and the tasks of the previous
    step it must wait for (read-after-write, write-after-read, write-after-write across the wrap).

    Only tasks later in program order are kept: a task ``p`` before ``t`` that touches what ``t`` touches
    is ordered before ``t`` in every step (directly or through the writes between them), and ``t`` of
    step e + 1 runs after ``t`` of step e, on the same worker.
    """
    cells = _Cells.of(tasks, shapes)
    return cells.within_step(), cells.across_wrap()


def _flatten(regions: Records, buffers: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Every task's regions (of ``buffers`` only, when given) as rows of ``[buffer, row0, row1, col0, col1]``,
    in program order, and the task of each."""
    flat = regions.table()
    tid = np.repeat(np.arange(len(regions)), regions.counts())
    if buffers is None:
        return flat, tid
    keep = np.isin(flat[:, 0], buffers)
    return flat[keep], tid[keep]


def _spans(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ranges ``[starts[q], starts[q] + counts[q])``: every member, and the range ``q`` it is of."""
    owner = np.repeat(np.arange(len(counts)), counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return starts[owner] + offsets, owner


def _as_tuples(task: np.ndarray, dep: np.ndarray, ids: np.ndarray) -> Producers:
    """Pairs (task, dep) -> for each task, its sorted deps (no task waits for itself). ``ids``: the task
    ids as Python ints, shared by every tuple rather than made anew for each (millions at 1M tasks)."""
    n = len(ids)
    keep = task != dep
    pairs = _distinct(task[keep] * n + dep[keep])
    deps = ids[pairs % n].tolist()
    ends = array("q", np.cumsum(np.bincount(pairs // n, minlength=n)).tobytes())
    return [tuple(deps[a:b]) for a, b in zip(chain((0,), ends), ends)]


@dataclass
class _Cells:
    """The entries of the written buffers' cells: each write, and each read group by its first member,
    once per cell it touches; sorted by cell, then program order."""

    task: np.ndarray       # the entry's task (a read group's first member)
    group: np.ndarray      # a read group's index, -1 for a write
    rect: tuple[np.ndarray, ...]  # row0, row1, col0, col1
    covers: np.ndarray     # a write that covers the cell whole
    cell_start: np.ndarray  # where the entry's cell begins and ends in this order
    cell_end: np.ndarray
    members: np.ndarray    # read groups' member tasks, group after group, each in program order
    member_start: np.ndarray  # where each group's members begin in ``members`` (one more: the end)
    ids: np.ndarray        # the task ids, as Python ints (one per task)

    @classmethod
    def of(cls, tasks: Tasks, shapes: dict[int, tuple[int, int]]) -> "_Cells":
        n = len(tasks)
        writes, write_tid = _flatten(tasks.writes)
        written = np.unique(writes[:, 0])
        first, grid_cols, rows, cols = _key_ranges(written, shapes)
        reads, read_tid = _flatten(tasks.reads, written)
        access = np.concatenate([reads, writes])
        tid = np.concatenate([read_tid, write_tid])
        is_write = np.concatenate([np.zeros(len(reads), bool), np.ones(len(writes), bool)])
        del reads, writes, read_tid, write_tid  # the biggest arrays here: their memory serves the next ones
        order = np.argsort(tid * 2 + is_write, kind="stable")  # program order: a task's reads, then its writes
        tid, is_write = tid[order], is_write[order]
        buffer, r0, r1, c0, c1 = (access[order, column] for column in range(5))
        del access

        # Read groups: a read whose buffer's previous access is a read of the same rectangle joins its group.
        by_buffer = np.argsort(buffer, kind="stable")
        w = is_write[by_buffer]
        joins = np.zeros(len(by_buffer), bool)
        joins[1:] = ~w[1:] & ~w[:-1]
        for column in (buffer, r0, r1, c0, c1):
            same = column[by_buffer]
            joins[1:] &= same[1:] == same[:-1]
        starts_group = ~w & ~joins
        group_of = np.cumsum(starts_group) - 1
        members = tid[by_buffer][~w]
        member_start = np.append(np.flatnonzero(starts_group[~w]), len(members))
        entry = np.sort(by_buffer[w | starts_group])  # writes and groups' first members, in program order
        group = np.full(len(tid), -1)
        group[by_buffer[starts_group]] = group_of[starts_group]
        tid, group, buffer, r0, r1, c0, c1 = (a[entry] for a in (tid, group, buffer, r0, r1, c0, c1))

        # Each entry once per cell it touches.
        b = np.searchsorted(written, buffer)
        cr0, cc0 = r0 // CELL_ROWS, c0 // CELL_COLS
        height, width = (r1 - 1) // CELL_ROWS + 1 - cr0, (c1 - 1) // CELL_COLS + 1 - cc0
        at, e = _spans(np.zeros(len(tid), np.int64), height * width)
        cr, cc = cr0[e] + at // width[e], cc0[e] + at % width[e]
        key = first[b[e]] + cr * grid_cols[b[e]] + cc
        order = np.lexsort((e, key))
        key, e, cr, cc = key[order], e[order], cr[order], cc[order]
        rect = tuple(a[e] for a in (r0, r1, c0, c1))
        covers = ((group[e] < 0) & (rect[0] <= cr * CELL_ROWS) & (np.minimum((cr + 1) * CELL_ROWS, rows[b[e]]) <= rect[1])
                  & (rect[2] <= cc * CELL_COLS) & (np.minimum((cc + 1) * CELL_COLS, cols[b[e]]) <= rect[3]))
        cell_start = np.searchsorted(key, key, side="left")
        cell_end = np.searchsorted(key, key, side="right")
        return cls(tid[e], group[e], rect, covers, cell_start, cell_end, members, member_start,
                   np.arange(n).astype(object))

    def within_step(self) -> Producers:
        """Each entry against the entries of its window: a write against all, a read group against writes."""
        entry = np.arange(len(self.task))
        covering = np.where(self.covers, entry, -1)
        before = np.maximum.accumulate(np.concatenate([[-1], covering[:-1]]))  # the cell's last covering write
        return self._pairs(entry, np.maximum(before, self.cell_start), entry, across=False)

    def across_wrap(self) -> Producers:
        """The second step's entries against the last windows the first step left in their cells, where no
        write of the second step covered the cell before them: the first step's later tasks."""
        entry = np.arange(len(self.task))
        last = np.maximum.accumulate(np.where(self.covers, entry, -1))
        looks = np.concatenate([[-1], last[:-1]]) < self.cell_start
        entry = entry[looks]
        cell_start, cell_end = self.cell_start[entry], self.cell_end[entry]
        last_window = np.maximum(last[cell_end - 1], cell_start)
        cell_task = self.cell_start * len(self.ids) + self.task  # ascending: cells in order, tasks in order within one
        # The cell's first entry of a later task. No read group before it has members after the task: a write
        # of the task ends the group, and an entry that reads only looks at writes.
        later = np.searchsorted(cell_task, cell_task[entry], side="right")
        return self._pairs(entry, np.maximum(last_window, later), cell_end, across=True)

    def _pairs(self, entry: np.ndarray, start: np.ndarray, stop: np.ndarray, across: bool) -> Producers:
        """The dependencies of each ``entry`` on the overlapping entries in ``[start, stop)`` of its cell: for
        a write, all of them; for a read group, the writes. ``across``: only on later tasks."""
        is_write = self.group[entry] < 0
        writes = np.flatnonzero(self.group < 0)
        other, of_write = _spans(start[is_write], stop[is_write] - start[is_write])
        lo, hi = np.searchsorted(writes, start[~is_write]), np.searchsorted(writes, stop[~is_write])
        at, of_read = _spans(lo, hi - lo)
        mine = np.concatenate([entry[is_write][of_write], entry[~is_write][of_read]])
        other = np.concatenate([other, writes[at]])
        overlap = np.ones(len(mine), bool)
        for low, high in ((self.rect[0], self.rect[1]), (self.rect[2], self.rect[3])):
            overlap &= (low[other] < high[mine]) & (low[mine] < high[other])
        mine, other = mine[overlap], other[overlap]
        my_group, other_group = self.group[mine], self.group[other]
        my_task, other_task = self.task[mine], self.task[other]
        plain = (my_group < 0) & (other_group < 0)
        task, dep = [my_task[plain]], [other_task[plain]]
        # A read group's members have its producers; a write waits for every member of a group it overlaps.
        groups, writer = _unique_pairs(my_group[my_group >= 0], other_task[my_group >= 0])
        members, owner = self._members(groups)
        task += [members]
        dep += [writer[owner]]
        writer, groups = _unique_pairs(my_task[other_group >= 0], other_group[other_group >= 0])
        members, owner = self._members(groups)
        task += [writer[owner]]
        dep += [members]
        task, dep = np.concatenate(task), np.concatenate(dep)
        if across:
            task, dep = task[dep > task], dep[dep > task]
        return _as_tuples(task, dep, self.ids)

    def _members(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The members of each of ``groups``, and the index in ``groups`` of each."""
        at, owner = _spans(self.member_start[groups], self.member_start[groups + 1] - self.member_start[groups])
        return self.members[at], owner


def _unique_pairs(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct pairs ``(a[i], b[i])`` (non-negative ints), sorted."""
    span = int(b.max()) + 1 if len(b) else 1
    pairs = _distinct(a * span + b)
    return pairs // span, pairs % span


def _distinct(values: np.ndarray) -> np.ndarray:
    """The distinct values, sorted (``np.unique`` hashes first, several times slower on these arrays)."""
    values = np.sort(values)
    return values[np.concatenate([values[:1] == values[:1], values[1:] != values[:-1]])]


def _key_ranges(written: np.ndarray, shapes: dict[int, tuple[int, int]]
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """For each written buffer: its first cell key, its cells per row of cells, its rows and columns.
    Each buffer owns a disjoint range of keys (regions lie inside their buffer, as tensor views do)."""
    first, grid_cols, rows, cols = [], [], [], []
    next_key = 0
    for buffer in written.tolist():
        r, c = shapes[buffer]
        first.append(next_key)
        grid_cols.append(-(-c // CELL_COLS))
        rows.append(r)
        cols.append(c)
        next_key += -(-r // CELL_ROWS) * grid_cols[-1]
        if next_key > MAX_CELLS:
            raise GraphError(f"the buffers tasks write span {next_key:,} dependency cells ({CELL_ROWS}x{CELL_COLS} "
                             f"elements each) with buffer {buffer} ({r}x{c}); at most {MAX_CELLS:,}")
    return tuple(np.array(v, np.int64) for v in (first, grid_cols, rows, cols))
