"""Dependency inference from the regions tasks read and write.

Tasks arrive in program order. A task depends on every earlier task whose region overlaps one of
its own in a conflicting way: read-after-write, write-after-read, write-after-write. Overlap is
decided on rectangles of the underlying buffer, so views and slices are handled exactly.

To stay linear in the number of tasks, every buffer is cut into a grid of cells; each cell remembers
the accesses that touched it since the last write that covered it whole. A new access only looks at
the cells it touches. Buffers that no task writes (weights, inputs) create no dependency and are
never indexed.
"""
from __future__ import annotations

from .task import Region, Task

CELL_ROWS = 16
CELL_COLS = 256


class _Cell:
    __slots__ = ("writers", "readers")

    def __init__(self) -> None:
        self.writers: list[tuple[int, Region]] = []
        self.readers: list[tuple[int, Region]] = []


def _cell_keys(r: Region):
    for cr in range(r.row0 // CELL_ROWS, (r.row1 - 1) // CELL_ROWS + 1):
        for cc in range(r.col0 // CELL_COLS, (r.col1 - 1) // CELL_COLS + 1):
            yield (r.buffer, cr, cc)


def infer_dependencies(tasks: list[Task], shapes: dict[int, tuple[int, int]]) -> list[tuple[int, ...]]:
    """For each task, the sorted ids of the earlier tasks it must wait for.

    ``shapes`` maps each buffer to its (rows, cols), so that a cell on the buffer's edge counts as
    covered by a write that reaches the edge.
    """
    written = {r.buffer for t in tasks for r in t.writes}
    cells: dict[tuple[int, int, int], _Cell] = {}
    producers: list[tuple[int, ...]] = []
    for tid, task in enumerate(tasks):
        deps: set[int] = set()
        for r in task.reads:
            if r.buffer not in written:
                continue
            for key in _cell_keys(r):
                cell = cells.get(key)
                if cell is None:
                    cell = cells[key] = _Cell()
                for other, region in cell.writers:
                    if other != tid and region.overlaps(r):
                        deps.add(other)
                cell.readers.append((tid, r))
        for r in task.writes:
            for key in _cell_keys(r):
                cell = cells.get(key)
                if cell is None:
                    cell = cells[key] = _Cell()
                for other, region in cell.writers:
                    if other != tid and region.overlaps(r):
                        deps.add(other)
                for other, region in cell.readers:
                    if other != tid and region.overlaps(r):
                        deps.add(other)
                _, cr, cc = key
                rows, cols = shapes[r.buffer]
                if r.covers(cr * CELL_ROWS, min((cr + 1) * CELL_ROWS, rows),
                            cc * CELL_COLS, min((cc + 1) * CELL_COLS, cols)):
                    cell.writers = [(tid, r)]
                    cell.readers = []
                else:
                    cell.writers.append((tid, r))
        producers.append(tuple(sorted(deps)))
    return producers
