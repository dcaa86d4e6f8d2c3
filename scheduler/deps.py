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

A graph that runs again and again is a loop: ``infer_periodic`` runs the same analysis over two
consecutive copies of the program, and the second copy's dependencies on the first are the ones
that cross from step ``e`` to step ``e + 1``. Two copies are enough: the same task runs on the same
worker in every step, so a dependency on step ``e - 1`` is implied by one on step ``e``.
"""
from __future__ import annotations

from ..errors import GraphError
from .task import Tasks

CELL_ROWS = 16
CELL_COLS = 256
MAX_CELLS = 1 << 24  # cells of the written buffers: each costs a Python object when a write covers it

Rect = tuple[int, int, int, int]  # row0, row1, col0, col1


class _Cell:
    """Accesses since the last covering write: writers as (task id, *rect), readers as (read group's task
    ids, *rect). Plain tuples, compared inline, because this is the innermost loop of the scheduler."""

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
    return _dependencies(tasks.reads, tasks.writes, shapes)


def infer_periodic(tasks: Tasks, shapes: dict[int, tuple[int, int]]
                   ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """For each task, its producers within a step (``infer_dependencies``) and the tasks of the previous
    step it must wait for (read-after-write, write-after-read, write-after-write across the wrap).

    Only tasks later in program order are kept: a task ``p`` before ``t`` that touches what ``t`` touches
    is ordered before ``t`` in every step (directly or through the writes between them), and ``t`` of
    step e + 1 runs after ``t`` of step e, on the same worker.
    """
    n = len(tasks.reads)
    both = _dependencies(tasks.reads + tasks.reads, tasks.writes + tasks.writes, shapes)
    return both[:n], [tuple(p for p in deps if t < p < n) for t, deps in enumerate(both[n:])]


def _dependencies(reads_of: list, writes_of: list, shapes: dict[int, tuple[int, int]]) -> list[tuple[int, ...]]:
    # Cell (buffer b, row cell cr, column cell cc) has the integer key first[b] + cr * grid_cols[b] + cc:
    # each written buffer owns a disjoint range of keys (regions lie inside their buffer, as tensor views
    # do), so no key tuple is built per visit.
    first: dict[int, int] = {}
    grid_cols: dict[int, int] = {}
    next_key = 0
    for writes in writes_of:
        for buffer, *_ in writes:
            if buffer not in first:
                rows, cols = shapes[buffer]
                first[buffer] = next_key
                grid_cols[buffer] = -(-cols // CELL_COLS)
                next_key += -(-rows // CELL_ROWS) * grid_cols[buffer]
                if next_key > MAX_CELLS:
                    raise GraphError(f"the buffers tasks write span {next_key:,} dependency cells ({CELL_ROWS}x{CELL_COLS} "
                                     f"elements each) with buffer {buffer} ({rows}x{cols}); at most {MAX_CELLS:,}")
    cells: dict[int, _Cell] = {}
    open_group: dict[int, _ReadGroup] = {}  # per buffer: the read group a read of the same rectangle joins
    producers: list[tuple[int, ...]] = []
    for tid, (reads, writes) in enumerate(zip(reads_of, writes_of)):
        deps: set[int] = set()
        for buffer, r0, r1, c0, c1 in reads:
            base = first.get(buffer)
            if base is None:
                continue
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
                        if a0 < r1 and r0 < a1 and b0 < c1 and c0 < b1:
                            group.producers.add(other)
                    cell.readers.append(entry)
            deps |= group.producers
        for buffer, r0, r1, c0, c1 in writes:
            open_group.pop(buffer, None)  # the cells change: later reads must look at them again
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
                        if a0 < r1 and r0 < a1 and b0 < c1 and c0 < b1:
                            deps.add(other)
                    for readers, a0, a1, b0, b1 in cell.readers:
                        if a0 < r1 and r0 < a1 and b0 < c1 and c0 < b1:
                            deps.update(readers)
                    if covers_rows and c0 <= cc * CELL_COLS and min((cc + 1) * CELL_COLS, cols) <= c1:
                        cell.writers = [entry]
                        cell.readers = []
                    else:
                        cell.writers.append(entry)
        deps.discard(tid)  # a task that reads and writes one region, or writes it twice, needs no wait on itself
        producers.append(tuple(sorted(deps)))
    return producers
