"""Dependency inference from the regions tasks read and write.

Tasks arrive in program order. A task depends on every earlier task whose region overlaps one of
its own in a conflicting way: read-after-write, write-after-read, write-after-write. Overlap is
decided on rectangles of the underlying buffer, so views and slices are handled exactly.

To stay linear in the number of tasks, every buffer is cut into a grid of cells; each cell remembers
the accesses that touched it since the last write that covered it whole. A new access only looks at
the cells it touches. Buffers that no task writes (weights, inputs) create no dependency and are
never indexed.

Tiles of one op often read the very same rectangle (every GEMV tile of a linear reads the whole
input row), so consecutive reads of one rectangle with no write to its buffer in between form one
*read group*: the cells hold the group once, and each later member costs O(1) instead of a visit to
every cell. The dependencies come out the same as with one entry per read.

A graph that runs again and again is a loop: ``infer_periodic`` carries the analysis on into a
second copy of the program, and the second copy's dependencies on the first are the ones that cross
from step ``e`` to step ``e + 1``. Two copies are enough: the same task runs on the same worker in
every step, so a dependency on step ``e - 1`` is implied by one on step ``e``. The second copy only
looks up what the first left in the cells (``_across_wrap``): its own accesses are of its own step.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from ..errors import GraphError
from .task import Tasks

CELL_ROWS = 16
CELL_COLS = 256
MAX_CELLS = 1 << 24  # cells of the written buffers: each costs a Python object when a write covers it

Rect = tuple[int, int, int, int]  # row0, row1, col0, col1


class _Cell:
    """Accesses since the last covering write: writers as (task id, *rect), readers as (read group's task
    ids, *rect). Plain tuples, compared inline, because this is the innermost loop of the scheduler; columns
    first, because the tiles sharing a cell are most often side by side along a row."""

    __slots__ = ("writers", "readers")

    def __init__(self) -> None:
        self.writers: list[tuple[int, int, int, int, int]] = []
        self.readers: list[tuple[list[int], int, int, int, int]] = []


class _ReadGroup:
    """Consecutive reads of one rectangle of a buffer, with no write to that buffer in between."""

    __slots__ = ("rect", "tids", "producers")

    def __init__(self, rect: Rect, tid: int) -> None:
        self.rect = rect
        self.tids = [tid]                  # shared with the cells' reader entries: a member joins in O(1)
        self.producers: set[int] = set()   # the writers the rectangle waits for, the same for every member


def infer_dependencies(tasks: Tasks, shapes: dict[int, tuple[int, int]]) -> list[tuple[int, ...]]:
    """For each task, the sorted ids of the earlier tasks it must wait for.

    ``shapes`` maps each buffer to its (rows, cols), so that a cell on the buffer's edge counts as
    covered by a write that reaches the edge.
    """
    return _within_step(tasks.reads, tasks.writes, shapes)[0]


def infer_periodic(tasks: Tasks, shapes: dict[int, tuple[int, int]]
                   ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """For each task, its producers within a step (``infer_dependencies``) and the tasks of the previous
    step it must wait for (read-after-write, write-after-read, write-after-write across the wrap).

    Only tasks later in program order are kept: a task ``p`` before ``t`` that touches what ``t`` touches
    is ordered before ``t`` in every step (directly or through the writes between them), and ``t`` of
    step e + 1 runs after ``t`` of step e, on the same worker.
    """
    producers, grid = _within_step(tasks.reads, tasks.writes, shapes)
    return producers, _across_wrap(tasks.reads, tasks.writes, shapes, grid)


@dataclass
class _Grid:
    """The cells of the written buffers as the step leaves them, and when each buffer was last touched.

    Cell (buffer b, row cell cr, column cell cc) has the integer key ``first[b] + cr * grid_cols[b] + cc``:
    each written buffer owns a disjoint range of keys (regions lie inside their buffer, as tensor views
    do), so no key tuple is built per visit.
    """

    first: dict[int, int]
    grid_cols: dict[int, int]
    cells: dict[int, _Cell] = field(default_factory=dict)
    last_write: dict[int, int] = field(default_factory=dict)  # buffer -> the step's last task that writes it
    last_touch: dict[int, int] = field(default_factory=dict)  # buffer -> the step's last task that reads or writes it


def _key_ranges(writes_of: list, shapes: dict[int, tuple[int, int]]) -> _Grid:
    grid = _Grid({}, {})
    next_key = 0
    for writes in writes_of:
        for buffer, *_ in writes:
            if buffer not in grid.first:
                rows, cols = shapes[buffer]
                grid.first[buffer] = next_key
                grid.grid_cols[buffer] = -(-cols // CELL_COLS)
                next_key += -(-rows // CELL_ROWS) * grid.grid_cols[buffer]
                if next_key > MAX_CELLS:
                    raise GraphError(f"the buffers tasks write span {next_key:,} dependency cells ({CELL_ROWS}x{CELL_COLS} "
                                     f"elements each) with buffer {buffer} ({rows}x{cols}); at most {MAX_CELLS:,}")
    return grid


def _within_step(reads_of: list, writes_of: list, shapes: dict[int, tuple[int, int]]
                 ) -> tuple[list[tuple[int, ...]], _Grid]:
    grid = _key_ranges(writes_of, shapes)
    first, grid_cols, cells = grid.first, grid.grid_cols, grid.cells
    last_write, last_touch = grid.last_write, grid.last_touch
    open_group: dict[int, _ReadGroup] = {}  # per buffer: the read group a read of the same rectangle joins
    producers: list[tuple[int, ...]] = []
    for tid, (reads, writes) in enumerate(zip(reads_of, writes_of)):
        deps: set[int] = set()
        for buffer, r0, r1, c0, c1 in reads:
            base = first.get(buffer)
            if base is None:
                continue
            last_touch[buffer] = tid
            rect = (r0, r1, c0, c1)
            group = open_group.get(buffer)
            if group is not None and group.rect == rect:
                group.tids.append(tid)
                deps |= group.producers
                continue
            group = open_group[buffer] = _ReadGroup(rect, tid)
            entry = (group.tids, r0, r1, c0, c1)
            width = grid_cols[buffer]
            cc0, cc1 = c0 // CELL_COLS, (c1 - 1) // CELL_COLS + 1
            for cr in range(r0 // CELL_ROWS, (r1 - 1) // CELL_ROWS + 1):
                row_key = base + cr * width
                for key in range(row_key + cc0, row_key + cc1):
                    cell = cells.get(key)
                    if cell is None:
                        cell = cells[key] = _Cell()
                    for other, a0, a1, b0, b1 in cell.writers:
                        if b0 < c1 and c0 < b1 and a0 < r1 and r0 < a1:
                            group.producers.add(other)
                    cell.readers.append(entry)
            deps |= group.producers
        for buffer, r0, r1, c0, c1 in writes:
            open_group.pop(buffer, None)  # the cells change: later reads must look at them again
            last_write[buffer] = last_touch[buffer] = tid
            entry = (tid, r0, r1, c0, c1)
            rows, cols = shapes[buffer]
            base, width = first[buffer], grid_cols[buffer]
            for cr in range(r0 // CELL_ROWS, (r1 - 1) // CELL_ROWS + 1):
                row_key = base + cr * width
                covers_rows = r0 <= cr * CELL_ROWS and min((cr + 1) * CELL_ROWS, rows) <= r1
                for cc in range(c0 // CELL_COLS, (c1 - 1) // CELL_COLS + 1):
                    cell = cells.get(row_key + cc)
                    if cell is None:
                        cell = cells[row_key + cc] = _Cell()
                    for other, a0, a1, b0, b1 in cell.writers:
                        if b0 < c1 and c0 < b1 and a0 < r1 and r0 < a1:
                            deps.add(other)
                    for readers, a0, a1, b0, b1 in cell.readers:
                        if b0 < c1 and c0 < b1 and a0 < r1 and r0 < a1:
                            deps.update(readers)
                    if covers_rows and c0 <= cc * CELL_COLS and min((cc + 1) * CELL_COLS, cols) <= c1:
                        cell.writers = [entry]
                        cell.readers = []
                    else:
                        cell.writers.append(entry)
        deps.discard(tid)  # a task that reads and writes one region, or writes it twice, needs no wait on itself
        producers.append(tuple(sorted(deps)))
    return producers, grid


def _across_wrap(reads_of: list, writes_of: list, shapes: dict[int, tuple[int, int]], grid: _Grid
                 ) -> list[tuple[int, ...]]:
    """The second step's dependencies on later tasks of the first, from the cells the first left behind.

    The accesses the second step adds never matter here (they are of its own step), so it only looks:
    a task finds the first step's accesses in the cells it touches, until a write of the second step
    covers a cell (the cell is then dropped). A buffer whose last access in the step (its last write,
    for a read) comes no later than the task holds nothing later than it, and is not visited at all:
    most reads of a step are of what was written before them. Consecutive reads of one rectangle of a
    buffer, with no write to it in between, find the same writers, looked up once.
    """
    first, grid_cols, cells = grid.first, grid.grid_cols, grid.cells
    last_write, last_touch = grid.last_write, grid.last_touch
    read_writers: dict[int, tuple[Rect, list[int]]] = {}  # buffer -> (rect, its writers)
    carried: list[tuple[int, ...]] = []
    for tid, (reads, writes) in enumerate(zip(reads_of, writes_of)):
        deps: set[int] = set()
        for buffer, r0, r1, c0, c1 in reads:
            if last_write.get(buffer, -1) <= tid:
                continue
            rect = (r0, r1, c0, c1)
            found = read_writers.get(buffer)
            if found is None or found[0] != rect:
                writers: list[int] = []
                base, width = first[buffer], grid_cols[buffer]
                cc0, cc1 = c0 // CELL_COLS, (c1 - 1) // CELL_COLS + 1
                for cr in range(r0 // CELL_ROWS, (r1 - 1) // CELL_ROWS + 1):
                    row_key = base + cr * width
                    for key in range(row_key + cc0, row_key + cc1):
                        cell = cells.get(key)
                        if cell is not None:
                            writers.extend(other for other, a0, a1, b0, b1 in cell.writers
                                           if b0 < c1 and c0 < b1 and a0 < r1 and r0 < a1)
                found = read_writers[buffer] = (rect, writers)
            deps.update(p for p in found[1] if p > tid)
        for buffer, r0, r1, c0, c1 in writes:
            read_writers.pop(buffer, None)  # the cells change: later reads must look at them again
            if last_touch[buffer] <= tid:
                continue
            rows, cols = shapes[buffer]
            base, width = first[buffer], grid_cols[buffer]
            # The cells the write covers whole: inside the rectangle, or cut only by the buffer's edge.
            whole_r0, whole_c0 = -(-r0 // CELL_ROWS), -(-c0 // CELL_COLS)
            whole_r1 = r1 // CELL_ROWS if r1 < rows else -(-rows // CELL_ROWS)
            whole_c1 = c1 // CELL_COLS if c1 < cols else -(-cols // CELL_COLS)
            for cr in range(r0 // CELL_ROWS, (r1 - 1) // CELL_ROWS + 1):
                for cc in range(c0 // CELL_COLS, (c1 - 1) // CELL_COLS + 1):
                    key = base + cr * width + cc
                    cell = cells.get(key)
                    if cell is None:
                        continue
                    # A cell lists its accesses in program order (the read groups of one buffer follow
                    # one another), so the ones later than the task are at the end.
                    for other, a0, a1, b0, b1 in reversed(cell.writers):
                        if other <= tid:
                            break
                        if b0 < c1 and c0 < b1 and a0 < r1 and r0 < a1:
                            deps.add(other)
                    for readers, a0, a1, b0, b1 in reversed(cell.readers):
                        if readers[-1] <= tid:
                            break
                        if b0 < c1 and c0 < b1 and a0 < r1 and r0 < a1:
                            deps.update(readers[bisect_right(readers, tid):])  # a group's ids are in order
                    if whole_r0 <= cr < whole_r1 and whole_c0 <= cc < whole_c1:
                        del cells[key]
        carried.append(tuple(sorted(deps)))
    return carried
