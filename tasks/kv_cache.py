"""The KV cache: where a sequence's keys and values are, and the append that writes them.

A cache of one layer is two buffers of rows of ``kv_heads * head_dim`` elements, one row per position of
a sequence. Contiguous: ``[batch * max_seq, ...]``, batch row b's position p at cache row
``b * max_seq + p``. Paged: a pool of pages of ``page_size`` rows, ``[pages * page_size, ...]``, and a
block table ``[batch, max_pages]`` (int64, on the heap) of the pages that hold each batch row's
positions, in order: position p at pool row ``table[b, p // page_size] * page_size + p % page_size``.
The positions are device scalars, so one compiled graph serves every step: ``kv_append`` writes row
``pos`` and the attention tiles (``attention``, ``chunk_attention``) read rows ``0 ..= pos``. Their
declared regions cover what they may touch: a contiguous cache's batch row, or the whole pool (``Paging``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import triton
import triton.language as tl

from ..device import NO_SEQUENCE, checked_index, heap_ptr, row_position
from ..errors import is_count
from .common import TaskType, copy_row, next_power_of_2, position_runs, require_float


@triton.jit
def cache_row(base, table, position, pages, PAGE: tl.constexpr):
    """The cache row of a sequence's ``position`` (in range; a scalar or a vector of them): itself in a
    contiguous cache (PAGE 0); in a paged one, a pool row through the block table row at heap offset
    ``table`` (a page number outside the pool's ``pages``: clamped, so that no access leaves the pool)."""
    if PAGE == 0:
        return position
    page = tl.load(heap_ptr(base, table, tl.int64) + position // PAGE)
    return tl.minimum(tl.maximum(page, 0), pages - 1) * PAGE + position % PAGE


@triton.jit
def kv_append_tile(base, status,
                   cache,          # heap offset of the cache's first row (paged: the pool's)
                   x, x_stride,    # heap offset of the first row to append, the rows' stride in elements
                   pos, pos_step,  # heap offset of the first row's int64 position, bytes to the next row's (0: the same)
                   first, rows,    # the tile's batch rows: first .. first + rows (one on a GPU)
                   seq_len,        # positions of a batch row: positions below it are valid
                   table,          # paged: heap offset of the block table
                   table_stride,   # paged: bytes from one block table row to the next
                   group,          # paged: batch rows per block table row (a sequence's verification rows)
                   pages,          # paged: the pool's pages
                   cols,           # elements per row
                   cache_stride,   # the cache's row stride, in elements
                   DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr):
    """Copy each row into the cache row of its position (``cache_row``: row ``b * seq_len + position`` of a
    contiguous cache; a position outside the sequence, or a page outside the pool: no copy, reported; the
    cache keeps every row it had; a row of no sequence: no copy)."""
    element_bytes: tl.constexpr = DTYPE.primitive_bitwidth // 8
    for r in range(0, rows):
        at = heap_ptr(base, pos + r * pos_step, tl.int64)
        position = tl.load(at)
        checked = row_position(status, at, seq_len)  # NO_SEQUENCE, or in [0, seq_len)
        write = (checked == position) & (checked >= 0)
        row_table = table + ((first + r).to(tl.int32) // group.to(tl.int32)) * table_stride  # int32 division
        if PAGE != 0:
            page = tl.load(heap_ptr(base, row_table, tl.int64) + tl.maximum(checked, 0) // PAGE)
            write = write & (checked_index(status, page, pages) == page)
            row = cache_row(base, row_table, checked, pages, PAGE)
        else:
            row = (first + r) * seq_len + checked
        if write:
            copy_row(base, cache + row * cache_stride * element_bytes, x + r * x_stride * element_bytes, cols, DTYPE,
                     BLOCK_N)


def _append_reference(heap, task) -> None:
    """The rows' cache rows first, then one copy of the rows that write."""
    rows, cache_rows = [], []
    for r, value in enumerate(heap.words(task.pos, task.rows, task.pos_step)):
        row = _cache_row(heap, task, task.first + r, value, task.pos + r * task.pos_step)
        if row is not None:
            rows.append(r)
            cache_rows.append(row)
    if not rows:
        return
    x = heap.tensor(task.x, task.DTYPE, task.rows, task.cols, task.x_stride)
    extent = task.pages * task.PAGE if task.PAGE else (task.first + task.rows) * task.seq_len
    cache = heap.tensor(task.cache, task.DTYPE, extent, task.cols, task.cache_stride)
    if len(rows) == 1:
        cache[cache_rows[0]].copy_(x[rows[0]])
    else:  # rows of distinct sequences, or of distinct positions of one: distinct cache rows
        cache.index_copy_(0, torch.tensor(cache_rows), x[:len(rows)] if rows[-1] == len(rows) - 1 else x[rows])


def _cache_row(heap, task, b: int, value: int, at: int) -> int | None:
    """``kv_append_tile``'s cache row for batch row ``b`` at position ``value`` (read at heap offset ``at``), or
    None where the tile copies nothing (a row of no sequence, a position or page clamped)."""
    if value == NO_SEQUENCE.value:
        return None
    # (an index in range is checked here, its message made only for one that is not: ~1 us a row)
    position = value if 0 <= value < task.seq_len else heap.checked_index(value, task.seq_len, f"heap offset {at}")
    row = b * task.seq_len + position
    if task.PAGE != 0:
        at = task.table + b // task.group * task.table_stride + 8 * (position // task.PAGE)
        page = heap.word(at)
        frame = page if 0 <= page < task.pages else heap.checked_index(page, task.pages,
                                                                       f"heap offset {at} (a block table)")
        row = frame * task.PAGE + position % task.PAGE
        if frame != page:
            return None  # a page clamped (the torch backend): no copy, as the tile
    if position != value:
        return None  # a position clamped: no copy, the cache keeps every row it had, as the tile
    return row


def reference_cache(heap, task, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of positions [start, end) of a batch row, float32 [end - start, HEAD_DIM] each,
    for a reference tile: a contiguous cache's rows, or a paged one's through the block table, page by
    page (a page outside the pool bounded by ``heap.checked_index``)."""
    page = task.PAGE
    if page == 0:
        runs, rows = [(start, end - start)], task.seq_len
    else:
        last = (end - 1) // page
        table = heap.tensor(task.table, torch.int64, 1, last + 1, last + 1)[0].tolist()
        runs, rows = [], task.pages * page
        for p in range(start // page, last + 1):
            frame = heap.checked_index(table[p], task.pages, f"heap offset {task.table + 8 * p} (a block table)")
            lo, hi = max(start, p * page), min(end, (p + 1) * page)
            runs.append((frame * page + lo - p * page, hi - lo))

    def gather(cache: int) -> torch.Tensor:
        pool = heap.tensor(cache, task.DTYPE, rows, task.HEAD_DIM, task.cache_stride)
        parts = [pool[r0:r0 + n] for r0, n in runs]
        return (parts[0] if len(parts) == 1 else torch.cat(parts)).float()
    return gather(task.k), gather(task.v)


def paged_caches(heap, task, table: torch.Tensor, lasts: torch.Tensor, span: int, heads: int,
                 where: Callable[[int, int], int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [0, span) of n sequences through their block table rows ``table`` [n, pages
    of span] (read, never written), each sequence's furthest position in ``lasts`` [n] (-1: none): float32 [n,
    ``heads``, span, HEAD_DIM] each, for a whole-row or whole-block reference tile. The entries past a
    sequence's last page are not checked (where one is outside the pool, page 0 stands in: those positions are
    not used), as the tiles read only the pages they reach; a page reached outside the pool is bounded by
    ``heap.checked_index`` (``where(i, p)``: the heap offset of entry p of row i, for its report). Whole pages
    are gathered, one ``index_select`` a cache."""
    page, hd, n = task.PAGE, task.HEAD_DIM, lasts.numel()
    lowest, highest = torch.aminmax(table)
    if int(lowest) < 0 or int(highest) >= task.pages:  # (else every entry is a page: unreached ones read, unused)
        table = torch.where(torch.arange(table.shape[1]) <= lasts[:, None] // page, table, 0)  # (not the heap's)
        for i, p in (~((table >= 0) & (table < task.pages))).nonzero().tolist():  # reached: bounded, reported
            table[i, p] = heap.checked_index(int(table[i, p]), task.pages, f"heap offset {where(i, p)} (a block table)")
    frames = table.reshape(-1)

    def gather(cache: int) -> torch.Tensor:
        pool = heap.tensor(cache, task.DTYPE, task.pages * page, heads * hd, task.cache_stride)
        whole = pool.view(task.pages, page, heads * hd).index_select(0, frames).view(n, -1, heads, hd)
        return whole[:, :span].float().transpose(1, 2)
    return gather(task.k), gather(task.v)


def no_sequence(heap, offset: int) -> bool:
    """Whether the position at heap ``offset`` says its row holds no sequence (a reference tile's check)."""
    return heap.word(offset) == NO_SEQUENCE.value


def kv_append(g, cache, x, pos, batch: int, table=None, page_size: int | None = None, rows_per_sequence: int = 1):
    """Write row b of ``x`` [batch, cols] at the cache row of position ``*pos`` of batch row b (``pos``: one
    position, or one per row, ``common.row_positions``; a tile per row, or with ``Graph.few_tiles`` per run
    of rows, ``common.position_runs``): contiguous, row ``b * max_seq + *pos``; paged
    (``table`` [batch, max_pages] int64 and ``page_size``), through the block table (module docstring);
    with ``rows_per_sequence`` R, rows ``b * R ..`` are one sequence's, at block table row b.
    Returns ``cache``."""
    g.require(cache.ndim == 2 and x.ndim == 2 and x.rows == batch and cache.cols == x.cols and cache.dtype == x.dtype,
              f"kv_append: cache {cache.shape} {cache.dtype} and x {x.shape} {x.dtype} do not match for batch {batch}")
    require_float(g, "kv_append", x=x)
    g.require(rows_per_sequence == 1 or table is not None,
              f"kv_append: rows_per_sequence {rows_per_sequence!r} needs a block table (a paged cache)")
    paging = Paging.checked(g, "kv_append", cache, batch, table, page_size, rows_per_sequence)
    opcode = g.opcode(KV_APPEND, DTYPE=x.dtype, BLOCK_N=min(next_power_of_2(x.cols), 1024), PAGE=paging.page)
    for run in position_runs(g, "kv_append", pos, batch):
        rows = range(run.row, run.row + run.rows)
        g.add_task(opcode, cache=cache.addr(0, 0), x=x.addr(run.row, 0), x_stride=x.row_stride, pos=run.pos,
                   pos_step=run.pos_step, first=run.row, rows=run.rows, seq_len=paging.max_seq,
                   table=paging.table_row(0), table_stride=8 * paging.table.row_stride if paging.page else 0,
                   group=paging.group, pages=paging.pages, cols=x.cols, cache_stride=cache.row_stride,
                   reads=(x.region(run.row, run.rows, 0, x.cols), run.region,
                          *(region for b in rows for region in paging.table_region(b))),
                   writes=tuple(paging.written(cache, b) for b in rows),
                   bytes=2 * run.rows * x.cols * x.element_size, flops=0)
    return cache


@dataclass(frozen=True)
class Paging:
    """Where a batch row's positions are in a cache: a contiguous block of ``max_seq`` rows (``page`` 0),
    or ``page``-row pages of a pool of ``pages`` through a block table."""

    max_seq: int       # positions per batch row
    page: int          # rows per page; 0: contiguous
    pages: int         # pages in the pool (paged)
    table: Any         # the block table (paged), else None
    group: int = 1     # rows per block table row (paged: a sequence's verification rows share its row)

    @classmethod
    def checked(cls, g, op: str, cache, batch: int, table, page_size: int | None, group: int = 1) -> "Paging":
        """The paging of ``cache`` for ``batch`` rows: contiguous without a block ``table``, else pages of
        ``page_size`` rows, ``group`` rows to a block table row; refused (``GraphError``) when the shapes
        do not fit."""
        if table is None:
            g.require(page_size is None, f"{op}: page_size {page_size} without a block table")
            g.require(cache.rows % batch == 0, f"{op}: cache of {cache.rows} rows is not {batch} batch rows")
            return cls(cache.rows // batch, 0, 0, None)
        g.require(is_count(page_size) and cache.rows % page_size == 0,
                  f"{op}: page_size must be a positive int dividing the pool's {cache.rows} rows, got {page_size!r}")
        g.require(is_count(group) and batch % group == 0,
                  f"{op}: rows_per_sequence must be a positive int dividing the {batch} rows, got {group!r}")
        g.require(table.ndim == 2 and table.rows * group == batch and table.dtype == torch.int64,
                  f"{op}: the block table must be int64 [{batch // group} sequences, max_pages], got {table.shape} "
                  f"{table.dtype}")
        return cls(table.cols * page_size, page_size, cache.rows // page_size, table, group)

    def block(self, most: int) -> int:
        """Positions per step of a tile: ``most`` (a power of two), or in a paged cache the largest power
        of two at most that which divides a page (aligned steps then never cross a page)."""
        return min(most, self.page & -self.page) if self.page else most

    def first_row(self, b: int) -> int:
        return 0 if self.page else b * self.max_seq

    def table_row(self, b: int) -> int:
        return self.table.addr(b // self.group, 0) if self.page else 0

    def table_region(self, b: int) -> tuple:
        return (self.table.region(b // self.group, 1, 0, self.table.cols),) if self.page else ()

    def readable(self, cache, b: int, col: int, cols: int):
        """The region of ``cache`` batch row b may read: its block, or the whole pool."""
        return (cache.region(0, cache.rows, col, cols) if self.page
                else cache.region(b * self.max_seq, self.max_seq, col, cols))

    def written(self, cache, b: int):
        """The region a ``kv_append`` of batch row b declares it writes: its block; in a pool, the pool row
        numbered like the block table's first row plus b (modulo the pool), a stand-in for the row it
        writes, which is known only on the device. Sequences have pages of their own and a sequence's rows
        write distinct positions, so appends of different rows need no order between them (the spill page
        takes only writes no one reads); every reader declares the whole pool, so it comes after every
        append of its step and before those of the next."""
        if not self.page:
            return self.readable(cache, b, 0, cache.cols)
        return cache.region((self.table.row0 + b) % cache.rows, 1, 0, cache.cols)


def same_caches(g, op: str, q, k_cache, v_cache) -> None:
    """Refuse caches the tiles would misread: they read K and V with one row stride and everything in
    q's dtype (float)."""
    require_float(g, op, q=q, k_cache=k_cache, v_cache=v_cache)
    g.require(k_cache.shape == v_cache.shape and k_cache.row_stride == v_cache.row_stride
              and k_cache.dtype == v_cache.dtype == q.dtype,
              f"{op}: caches {k_cache.shape} {k_cache.dtype} (row stride {k_cache.row_stride}) and "
              f"{v_cache.shape} {v_cache.dtype} (row stride {v_cache.row_stride}) must match each other and "
              f"q's dtype {q.dtype}")


def _example(g):
    """Appends of two batch rows at one position, to a contiguous cache and to a paged pool (pages of 16
    rows, 3 per row, in a pool of 40: any index input is a page)."""
    x, pos = g.input("kv_cache.x", (2, 48), torch.bfloat16), g.input("kv_cache.pos", (1,), torch.int64)
    table = g.input("kv_cache.table", (2, 3), torch.int64)
    return (g.kv_append(g.input("kv_cache.cache", (2 * 80, 48), torch.bfloat16), x, pos, batch=2),
            g.kv_append(g.input("kv_cache.pool", (40 * 16, 48), torch.bfloat16), x, pos, batch=2, table=table,
                        page_size=16))


KV_APPEND = TaskType("kv_append", kv_append_tile, _append_reference, _example)
TASK_TYPES = (KV_APPEND,)
OPS = {"kv_append": kv_append}
