"""Linear layers ``y = x @ w.T`` (w is [out, in], as in torch), optionally split along K.

Small batches (M < DOT_MIN_M) use GEMV tiles, built to stream w at memory bandwidth: w rows are
contiguous along K, so every thread loads 16-byte vectors along K, several blocks of w are loaded
before the first FMA of a step, rows past the tile's last are clamped (re-read, never stored) instead
of masked, and K is masked only when it is not a whole number of blocks. A tile covers any number of
rows of w: it walks them as (row block, step) pairs in one flat loop, so one task can stream a large
slice of w and the reduction of a finished row block overlaps the loads of the next one.

- One row of x (decode at batch 1): products accumulate elementwise into a float32
  ``BLOCK_N x BLOCK_K`` block, reduced across K once per row block.
- 2 to 15 rows: each step's products are reduced across K per row of x (an elementwise partial per
  row of x would take M times the registers).
- 16 rows and more: ``tl.dot`` tiles.

With ``split_k = S`` each tile covers a K-range and writes a float32 partial; one reduction tile per
output block then adds the S partials in a fixed order, so the result does not depend on which
partial finished first. ``split_k=None`` (the default) chooses the tiling from ``Graph.parallelism``,
the number of workers the graph is meant for (``plan``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..device import heap_ptr
from ..errors import is_count
from . import quantized
from .common import (TaskType, block_at, block_count, ceil_div, dot, linear_rows, live_rows, next_power_of_2,
                     require_float, rounded, row_offsets, store_block, vector_aligned)
from .formats import Quantized
from .reduction import sum_slices

DOT_MIN_M = 16
DOT_BLOCK_M, DOT_BLOCK_N, DOT_BLOCK_K = 32, 32, 32

# GEMV blocks. The kernel runs 128 threads per program (num_warps=4) and several programs per SM, each
# thread loading 16-byte vectors along K (common.VECTOR_BYTES).
# One row of x: a block is 4 rows x 1 KiB of w (64 threads x 16 B along a row: BLOCK_K = 512 bfloat16
# or 256 float32), and a step loads ONE_ROW_UNROLL = 4 blocks, 16 KiB of w, before its first FMA: four
# programs per SM then keep 64 KiB in flight, above the ~33 KiB (bandwidth x latency, ~33 B/ns per SM
# x ~1 us) an H200 needs. The float32 accumulator is 16 registers per thread; the whole tile compiles to
# 116 registers on sm_90 (56 VGPRs on gfx942), within the 128 that four resident programs allow. Four
# rows per block is also the granularity at which rows are shared out among workers.
ONE_ROW_SEGMENT_BYTES, ONE_ROW_BLOCK_N = 1024, 4
ONE_ROW_UNROLL = tl.constexpr(4)
# 2 to 15 rows of x: a row segment is one warp wide (32 x 16 B = 512 B: BLOCK_K = 256 bfloat16), so the
# per-step reductions across K are warp shuffles with no barrier; 8 rows per block, ROWS_UNROLL = 2
# blocks = 8 KiB per step (the w blocks stay live across the loop over x's rows: 16 KiB would go over
# 128 registers).
ROWS_SEGMENT_BYTES, ROWS_BLOCK_N = 512, 8
ROWS_UNROLL = tl.constexpr(2)
MIN_BLOCK_K = 16             # the narrowest block, for a short K (``gemv_blocks``)
# Tiling (``plan``).
TILE_ROWS = 32               # rows of w per GEMV tile when the graph is meant for one worker (parallelism 1)
TASK_OVERHEAD_BYTES = 16 * 1024  # the fixed cost of a task (its wait, argument loads, the drain of its last
#                              loads, its signal: ~2 us), in the bytes a worker streams meanwhile (~8 B/ns
#                              each for 528 workers on an H200); a split-K sum phase costs about one more
MAX_WAVES = 16               # tiles per worker considered when sizing tiles
MIN_SPLIT_BLOCKS = 2         # automatic split-K: every K-range is at least this many BLOCK_K
MAX_SPLIT_K = 16             # ... and at most this many partials per output (the sum tile reads them all)


def gemv_blocks(m: int, w_dtype: torch.dtype, k: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) of the GEMV tile for ``m < DOT_MIN_M`` rows of x and w of ``w_dtype``.

    A block is 4 KiB of w: a full row segment by ONE_ROW_BLOCK_N / ROWS_BLOCK_N rows; when K is too
    short for a step of full segments, narrower and taller (up to TILE_ROWS rows), so that a small
    layer does not load, multiply and mask columns it does not have.
    """
    size = w_dtype.itemsize
    segment, unroll, segment_rows = ((ONE_ROW_SEGMENT_BYTES, ONE_ROW_UNROLL.value, ONE_ROW_BLOCK_N) if m == 1
                                     else (ROWS_SEGMENT_BYTES, ROWS_UNROLL.value, ROWS_BLOCK_N))
    block_k = min(segment // size, max(MIN_BLOCK_K, next_power_of_2(ceil_div(k, unroll))))
    block_n = min(TILE_ROWS, max(segment_rows, segment * segment_rows // (block_k * size)))
    return next_power_of_2(m), block_n, block_k


@triton.jit
def _operands(base, x, w, k, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN_K: tl.constexpr, ALIGNED: tl.constexpr):
    """x's and w's typed pointers and k as int32, with what the host checked (ALIGNED, EVEN_K) told to the
    compiler. The hints are put here, on values this function makes: one put on an argument word, or
    by a caller on what this returns, would be dropped (common.row_offsets)."""
    k = k.to(tl.int32)
    x_ptr = (base + x).to(tl.pointer_type(X_DTYPE))
    w_ptr = (base + w).to(tl.pointer_type(W_DTYPE))
    if ALIGNED:
        x_ptr = tl.multiple_of(x_ptr, 16)
        w_ptr = tl.multiple_of(w_ptr, 16)
        k = tl.multiple_of(k, 128 // X_DTYPE.primitive_bitwidth)
    if EVEN_K:
        k = tl.multiple_of(k, BLOCK_K)
    return x_ptr, w_ptr, k


@triton.jit
def _w_block(w_rows, kk, k, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Columns ``kk ..< kk + BLOCK_K`` of the w rows; with EVEN_K (k a multiple of BLOCK_K) unmasked,
    a block wholly past k (the end of the last step) re-reading the last one (in bounds, cached)."""
    if EVEN_K:
        return tl.load(w_rows + tl.minimum(kk, k - BLOCK_K))
    else:
        return tl.load(w_rows + kk, mask=kk + tl.arange(0, BLOCK_K)[None, :] < k, other=0.0)


@triton.jit
def _x_block(x_cols, kk, k, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The x columns matching ``_w_block``: zero for a block past k, so a re-read w block adds nothing."""
    if EVEN_K:  # one flag for the whole block: the loads stay 16-byte vectors
        inside = kk + tl.arange(0, BLOCK_K)[None, :] * 0 < k
        return tl.load(x_cols + tl.minimum(kk, k - BLOCK_K), mask=inside, other=0.0)
    else:
        return tl.load(x_cols + kk, mask=kk + tl.arange(0, BLOCK_K)[None, :] < k, other=0.0)


@triton.jit
def gemv_one_row(base, y, x, w, n, k, w_stride, live, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr,
                  Y_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  ALIGNED: tl.constexpr):
    """``y[0, :n] = x[0, :k] @ w[:n, :k].T`` for any n, BLOCK_N rows at a time (zero where ``live``, a [1]
    block, is not: ``live_rows``).

    One flat loop over (row block, step) pairs. A step loads ONE_ROW_UNROLL blocks of w and x, then
    accumulates their products elementwise in float32; a row block is reduced across K once, at the
    start of the next row block's first step, after that step's loads are issued, so the reduction and
    the store overlap them instead of draining the program's loads.
    """
    n = n.to(tl.int32)  # the loop divides by n and k (common.py)
    x_ptr, w_ptr, k = _operands(base, x, w, k, X_DTYPE, W_DTYPE, BLOCK_K, EVEN_K, ALIGNED)
    rn = tl.arange(0, BLOCK_N)[:, None]
    rk = tl.arange(0, BLOCK_K)[None, :]
    x_cols = x_ptr + rn * 0 + rk  # x's row repeated per w row: w's register layout, no shuffle per step
    steps = tl.cdiv(k, ONE_ROW_UNROLL * BLOCK_K)
    blocks = tl.cdiv(n, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for t in range(0, blocks * steps):
        r0 = t // steps * BLOCK_N
        k0 = (t % steps) * (ONE_ROW_UNROLL * BLOCK_K)
        # rows past n: row n - 1 again, not stored
        w_rows = w_ptr + row_offsets(tl.minimum(r0 + rn, n - 1), w_stride, W_DTYPE, ALIGNED) + rk
        b0 = _w_block(w_rows, k0, k, BLOCK_K, EVEN_K)
        b1 = _w_block(w_rows, k0 + BLOCK_K, k, BLOCK_K, EVEN_K)
        b2 = _w_block(w_rows, k0 + 2 * BLOCK_K, k, BLOCK_K, EVEN_K)
        b3 = _w_block(w_rows, k0 + 3 * BLOCK_K, k, BLOCK_K, EVEN_K)
        a0 = _x_block(x_cols, k0, k, BLOCK_K, EVEN_K)
        a1 = _x_block(x_cols, k0 + BLOCK_K, k, BLOCK_K, EVEN_K)
        a2 = _x_block(x_cols, k0 + 2 * BLOCK_K, k, BLOCK_K, EVEN_K)
        a3 = _x_block(x_cols, k0 + 3 * BLOCK_K, k, BLOCK_K, EVEN_K)
        if (k0 == 0) & (t > 0):  # the previous row block is complete
            _store_one_row(base, y, r0 - BLOCK_N, n, acc, live, Y_DTYPE, BLOCK_N)
            acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        acc += b0.to(tl.float32) * a0.to(tl.float32)
        acc += b1.to(tl.float32) * a1.to(tl.float32)
        acc += b2.to(tl.float32) * a2.to(tl.float32)
        acc += b3.to(tl.float32) * a3.to(tl.float32)
    _store_one_row(base, y, (blocks - 1) * BLOCK_N, n, acc, live, Y_DTYPE, BLOCK_N)


@triton.jit
def _store_one_row(base, y, r0, n, acc, live, Y_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``y[0, r0 + i] = sum_k acc[i, k]`` (0 where the row is not ``live``) for r0 + i below n (rows r0 + i of w)."""
    rn = r0 + tl.arange(0, BLOCK_N)
    tl.store(heap_ptr(base, y, Y_DTYPE) + rn, rounded(tl.where(live, tl.sum(acc, axis=1), 0.0), Y_DTYPE), mask=rn < n)


@triton.jit
def _gemv_rows(base, y, x, w, pos, m, n, k, y_stride, x_stride, w_stride, X_DTYPE: tl.constexpr,
               W_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ALIGNED: tl.constexpr, BY_POS: tl.constexpr):
    """``y[:m, :n] = x[:m, :k] @ w[:n, :k].T`` for 1 < m <= BLOCK_M, any n: the same walk over w, with
    each step's products reduced across K per row of x (a warp-wide reduction: shuffles only); a row that
    holds no sequence (``live_rows``) zero."""
    m, n = m.to(tl.int32), n.to(tl.int32)
    x_ptr, w_ptr, k = _operands(base, x, w, k, X_DTYPE, W_DTYPE, BLOCK_K, EVEN_K, ALIGNED)
    rn = tl.arange(0, BLOCK_N)[:, None]
    rk = tl.arange(0, BLOCK_K)[None, :]
    rm = tl.arange(0, BLOCK_M)[None, :]  # acc's columns: the rows of x
    live = live_rows(base, pos, rm, m, BY_POS)
    steps = tl.cdiv(k, ROWS_UNROLL * BLOCK_K)
    blocks = tl.cdiv(n, BLOCK_N)
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # transposed: y[i, r0 + j] is acc[j, i]
    for t in range(0, blocks * steps):
        r0 = t // steps * BLOCK_N
        k0 = (t % steps) * (ROWS_UNROLL * BLOCK_K)
        w_rows = w_ptr + row_offsets(tl.minimum(r0 + rn, n - 1), w_stride, W_DTYPE, ALIGNED) + rk
        b0 = _w_block(w_rows, k0, k, BLOCK_K, EVEN_K).to(tl.float32)
        b1 = _w_block(w_rows, k0 + BLOCK_K, k, BLOCK_K, EVEN_K).to(tl.float32)
        if (k0 == 0) & (t > 0):
            _store_rows(base, y, y_stride, m, r0 - BLOCK_N, n, acc, live, Y_DTYPE, BLOCK_M, BLOCK_N)
            acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for i in range(0, m):
            x_cols = x_ptr + row_offsets(i, x_stride, X_DTYPE, ALIGNED) + rn * 0 + rk
            part = b0 * _x_block(x_cols, k0, k, BLOCK_K, EVEN_K).to(tl.float32)
            part += b1 * _x_block(x_cols, k0 + BLOCK_K, k, BLOCK_K, EVEN_K).to(tl.float32)
            acc = tl.where(rm == i, acc + tl.sum(part, axis=1)[:, None], acc)
    _store_rows(base, y, y_stride, m, (blocks - 1) * BLOCK_N, n, acc, live, Y_DTYPE, BLOCK_M, BLOCK_N)


@triton.jit
def _store_rows(base, y, y_stride, m, r0, n, acc, live, Y_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """``y[i, r0 + j] = acc[j, i]`` (0 where row i is not ``live``, [1, BLOCK_M]) for i < m, r0 + j < n."""
    rn = r0 + tl.arange(0, BLOCK_N)[:, None]
    rm = tl.arange(0, BLOCK_M)[None, :]
    tl.store(heap_ptr(base, y, Y_DTYPE) + rm * y_stride + rn, rounded(tl.where(live, acc, 0.0), Y_DTYPE),
             mask=(rn < n) & (rm < m))


@triton.jit
def _dot_tile(base, y, x, w, pos, m, n, k, y_stride, x_stride, w_stride, X_DTYPE: tl.constexpr,
              W_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr, MANY_BLOCKS: tl.constexpr, BY_POS: tl.constexpr):
    """``y[:m, :n] = x[:m, :k] @ w[:n, :k].T`` with ``tl.dot``: one block (m <= BLOCK_M, n <= BLOCK_N, as
    a GPU's tiles are), or with MANY_BLOCKS (``Graph.few_tiles``) every BLOCK_M x BLOCK_N block in turn, a
    block's operands found by heap offsets as the tile's are (aligned where the tile's are). The loop is
    a constexpr's: around the GPU's one block it would cost registers that the kernel has none of."""
    if not MANY_BLOCKS:
        _dot_block(base, y, x, w, pos, m, n, k, y_stride, x_stride, w_stride, X_DTYPE, W_DTYPE, Y_DTYPE, BLOCK_M,
                   BLOCK_N, BLOCK_K, ALIGNED, BY_POS)
        return
    for t in range(0, block_count(m, n, BLOCK_M, BLOCK_N)):
        r0, c0 = block_at(t, n, BLOCK_M, BLOCK_N)
        _dot_block(base, y + (r0 * y_stride + c0) * (Y_DTYPE.primitive_bitwidth // 8),
                   x + r0 * x_stride * (X_DTYPE.primitive_bitwidth // 8),
                   w + c0 * w_stride * (W_DTYPE.primitive_bitwidth // 8), pos + r0 * 8, m - r0, n - c0, k, y_stride,
                   x_stride, w_stride, X_DTYPE, W_DTYPE, Y_DTYPE, BLOCK_M, BLOCK_N, BLOCK_K, ALIGNED, BY_POS)


@triton.jit
def _dot_block(base, y, x, w, pos, m, n, k, y_stride, x_stride, w_stride, X_DTYPE: tl.constexpr,
               W_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr, BY_POS: tl.constexpr):
    """``y[:m, :n] = x[:m, :k] @ w[:n, :k].T`` over one block: the first min(m, BLOCK_M) x min(n, BLOCK_N);
    a row that holds no sequence (``live_rows``) zero."""
    x_ptr, w_ptr, k = _operands(base, x, w, k, X_DTYPE, W_DTYPE, BLOCK_K, False, ALIGNED)
    rm = tl.arange(0, BLOCK_M)[:, None]
    rn = tl.arange(0, BLOCK_N)[:, None]
    rk = tl.arange(0, BLOCK_K)[None, :]
    x_rows = x_ptr + row_offsets(rm, x_stride, X_DTYPE, ALIGNED) + rk
    w_rows = w_ptr + row_offsets(rn, w_stride, W_DTYPE, ALIGNED) + rk
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k, BLOCK_K):
        a = tl.load(x_rows + k0, mask=(rm < m) & (k0 + rk < k), other=0.0)
        b = tl.load(w_rows + k0, mask=(rn < n) & (k0 + rk < k), other=0.0)
        acc += dot(a, tl.trans(b))
    acc = tl.where(live_rows(base, pos, rm, m, BY_POS), acc, 0.0)
    store_block(heap_ptr(base, y, Y_DTYPE), y_stride, m, n, acc, BLOCK_M, BLOCK_N)


@triton.jit
def linear_tile(base,
                y, x, w,                         # heap offsets of the tiles' first elements
                pos,                             # BY_POS: heap offset of the int64 position of x's first row
                m, n, k,                         # y is m x n, x m x k, w n x k
                y_stride, x_stride, w_stride,    # row strides, in elements
                X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr,
                ALIGNED: tl.constexpr, MANY_BLOCKS: tl.constexpr, BY_POS: tl.constexpr):
    """``y[:m, :n] = x[:m, :k] @ w[:n, :k].T``, any k; float32 accumulation.

    GEMV tiles take ``m <= BLOCK_M`` and any n (BLOCK_N rows at a time), ``tl.dot`` tiles one BLOCK_M x
    BLOCK_N block, or any m and n with ``MANY_BLOCKS`` (``Graph.few_tiles``). ``EVEN_K``: k is
    a multiple of BLOCK_K. ``ALIGNED``: x, w and their row strides 16-byte aligned, k a whole number of
    16-byte vectors. Both are checked by the host; with them the GEMV loads are unmasked 16-byte vectors,
    with ALIGNED alone masked ones (the ``tl.dot`` tiles' too). ``BY_POS``: x's rows have positions, from
    heap offset ``pos`` on; a row at NO_SEQUENCE holds no sequence and its y row is zero (``live_rows``).
    """
    if USE_DOT:
        _dot_tile(base, y, x, w, pos, m, n, k, y_stride, x_stride, w_stride, X_DTYPE, W_DTYPE, Y_DTYPE, BLOCK_M,
                  BLOCK_N, BLOCK_K, ALIGNED, MANY_BLOCKS, BY_POS)
    elif BLOCK_M == 1:
        gemv_one_row(base, y, x, w, n, k, w_stride, live_rows(base, pos, tl.zeros((1,), tl.int32), m, BY_POS),
                     X_DTYPE, W_DTYPE, Y_DTYPE, BLOCK_N, BLOCK_K, EVEN_K, ALIGNED)
    else:
        _gemv_rows(base, y, x, w, pos, m, n, k, y_stride, x_stride, w_stride, X_DTYPE, W_DTYPE, Y_DTYPE, BLOCK_M,
                   BLOCK_N, BLOCK_K, EVEN_K, ALIGNED, BY_POS)


def _reference(heap, task) -> None:
    x = heap.tensor(task.x, task.X_DTYPE, task.m, task.k, task.x_stride)
    w = heap.tensor(task.w, task.W_DTYPE, task.n, task.k, task.w_stride)
    y = heap.tensor(task.y, task.Y_DTYPE, task.m, task.n, task.y_stride)
    linear_rows(heap, ("linear", task.w, task.n, task.k, task.w_stride), x, y, (w,), lambda: w, w.dtype,
                heap.words(task.pos, task.m, 8) if task.BY_POS else None)


@dataclass(frozen=True)
class Plan:
    """How a linear is cut: ``tile_rows`` of w per tile (a multiple of BLOCK_N), the K-ranges, and
    ``tile_m`` rows of x per tile (BLOCK_M, or every row: ``few_tiles``)."""

    tile_rows: int
    k_ranges: tuple[tuple[int, int], ...]
    tile_m: int


def whole_block_ranges(k_total: int, splits: int, block_k: int) -> tuple[tuple[int, int], ...]:
    """``splits`` K-ranges of whole ``block_k`` blocks (the last takes any partial block), as even as possible."""
    blocks = ceil_div(k_total, block_k)
    splits = min(splits, blocks)
    bounds = [min(k_total, blocks * s // splits * block_k) for s in range(splits + 1)]
    return tuple((k0, k1 - k0) for k0, k1 in zip(bounds, bounds[1:]))


def plan(m: int, n: int, k: int, blocks: tuple[int, int, int], w_size: int, parallelism: int,
         split_k: int | None, few_tiles: bool = False) -> Plan:
    """The tiling of ``[m, k] @ [n, k].T`` for ``parallelism`` workers.

    - ``few_tiles`` (``Graph.few_tiles``): every row of x in each tile, w's rows in ``parallelism`` even
      tiles (of whole BLOCK_N blocks), K split only as ``split_k`` asks.
    - An explicit ``split_k``: that many K-ranges (of whole blocks when K has that many blocks).
    - parallelism 1: TILE_ROWS rows per GEMV tile (BLOCK_N per ``tl.dot`` tile), no split.
    - Otherwise, when the output's blocks (BLOCK_M x BLOCK_N) are fewer than the workers, K is split
      into enough ranges of at least MIN_SPLIT_BLOCKS blocks (at most MAX_SPLIT_K) for every worker to
      get a tile; never when they are not. GEMV tiles then take as many row blocks each, and a split
      GEMV as many ranges (from that fewest on), as minimises the estimated time: waves of tiles
      (ceil(tiles / parallelism)) times a tile's bytes of w plus TASK_OVERHEAD_BYTES, plus one more
      overhead for a split-K sum phase. This fills the workers evenly (the 8B layer's QKV, 1536 row
      blocks over 528 workers, gets 512 tiles of 3 blocks: one even wave rather than 2.9 uneven ones)
      and makes a big layer a few long tasks per worker instead of many short ones.
    """
    block_m, block_n, block_k = blocks
    gemv = block_m < DOT_MIN_M
    row_blocks, m_tiles, k_blocks = ceil_div(n, block_n), ceil_div(m, block_m), ceil_div(k, block_k)
    default_rows = max(block_n, TILE_ROWS // block_n * block_n) if gemv else block_n
    if few_tiles:
        k_ranges = ((0, k),) if split_k is None else plan(m, n, k, blocks, w_size, 1, split_k).k_ranges
        return Plan(ceil_div(row_blocks, parallelism) * block_n, k_ranges, m)
    if split_k is not None:
        if k_blocks >= split_k:
            k_ranges = whole_block_ranges(k, split_k, block_k)
        else:
            step = ceil_div(k, split_k)
            k_ranges = tuple((k0, min(step, k - k0)) for k0 in range(0, k, step))
        candidates = [k_ranges]
    elif parallelism == 1:
        return Plan(default_rows, ((0, k),), block_m)
    else:
        output_blocks = row_blocks * m_tiles
        max_splits = max(1, min(MAX_SPLIT_K, k_blocks // MIN_SPLIT_BLOCKS))
        fewest = 1 if output_blocks >= parallelism else min(max_splits, ceil_div(parallelism, output_blocks))
        last = fewest if output_blocks >= parallelism or not gemv else max_splits
        candidates = [whole_block_ranges(k, s, block_k) for s in range(fewest, last + 1)]
    if parallelism == 1 or not gemv:
        return Plan(default_rows, candidates[0], block_m)
    best = None
    for k_ranges in candidates:
        splits = len(k_ranges) * m_tiles
        range_bytes = max(kk for _, kk in k_ranges) * w_size
        groups = {1} | {ceil_div(row_blocks, waves * parallelism // splits) for waves in range(1, MAX_WAVES + 1)
                        if waves * parallelism >= splits}
        for g in groups:
            tiles = ceil_div(row_blocks, g) * splits
            cost = (ceil_div(tiles, parallelism) * (g * block_n * range_bytes + TASK_OVERHEAD_BYTES)
                    + (len(k_ranges) > 1) * TASK_OVERHEAD_BYTES)
            key = (cost, len(k_ranges), tiles)
            if best is None or key < best[0]:
                best = (key, Plan(g * block_n, k_ranges, block_m))
    return best[1]


def linear(g, x, w, split_k: int | None = None, out=None, pos=None):
    """``x [M, K] @ w [N, K].T -> [M, N]`` in x's dtype (into ``out``, an [M, N] view, when given);
    ``split_k`` cuts K into that many ranges. ``pos``, int64 [M]: the positions of x's rows, where a row at
    -1 (``device.NO_SEQUENCE``) holds no sequence: its output row is zero, and a backend that can skip
    its products does (the torch backend multiplies only the rows that hold one).

    ``split_k=None`` (the default) chooses the tiling for ``g.parallelism`` workers (``plan``): at 1,
    no split; above, K is split when the output alone has fewer blocks than workers. A ``Quantized`` w
    is dequantized in the tiles (``tasks.quantized.linear``).
    """
    if pos is not None:
        g.require(pos.dtype == torch.int64 and pos.shape == (x.rows,),
                  f"linear: pos must be int64 ({x.rows},), a position per row of x, got {pos.shape} {pos.dtype}")
    if isinstance(w, Quantized):
        return quantized.linear(g, x, w, split_k, out, pos)
    g.require(x.ndim == 2 and w.ndim == 2, f"linear: x {x.shape} and w {w.shape} must both be 2-D")
    require_float(g, "linear", x=x, w=w)
    g.require(x.cols == w.cols, f"linear: x has shape {x.shape} but w has shape {w.shape}; "
                                f"expected w of shape (N, {x.cols})")
    g.require(split_k is None or (is_count(split_k) and split_k <= x.cols),
              f"linear: split_k must be None or an integer in [1, {x.cols}], got {split_k!r}")
    m_total, n_total, k_total = x.rows, w.rows, x.cols
    y = out if out is not None else g.new_tensor((m_total, n_total), x.dtype)
    g.require(y.shape == (m_total, n_total) and y.dtype == x.dtype,
              f"linear: out is {y.shape} {y.dtype}, expected {(m_total, n_total)} {x.dtype}")
    use_dot = m_total >= DOT_MIN_M
    blocks = (DOT_BLOCK_M, DOT_BLOCK_N, DOT_BLOCK_K) if use_dot else gemv_blocks(m_total, w.dtype, k_total)
    block_m, block_n, block_k = blocks
    cut = plan(m_total, n_total, k_total, blocks, w.element_size, g.parallelism, split_k, g.few_tiles)
    k_ranges, tile_rows = cut.k_ranges, cut.tile_rows
    target = y if len(k_ranges) == 1 else g.new_tensor((len(k_ranges) * m_total, n_total), torch.float32)
    x_size, w_size, y_size = x.element_size, w.element_size, target.element_size
    even_k = all(kk % block_k == 0 for _, kk in k_ranges)
    starts_and_lengths = [kk for k_range in k_ranges for kk in k_range]
    aligned = vector_aligned(x.addr(0, 0), w.addr(0, 0), x.row_stride * x_size, w.row_stride * w_size,
                             *(kk * x_size for kk in starts_and_lengths), *(kk * w_size for kk in starts_and_lengths))
    opcode = g.opcode(LINEAR, X_DTYPE=x.dtype, W_DTYPE=w.dtype, Y_DTYPE=target.dtype, BLOCK_M=block_m,
                      BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot, EVEN_K=even_k and not use_dot,
                      ALIGNED=aligned, MANY_BLOCKS=use_dot and (cut.tile_m > block_m or tile_rows > block_n),
                      BY_POS=pos is not None)
    # A big graph has hundreds of thousands of these tiles: a row of them (one x tile, a tile per
    # tile_rows rows of w) is one add_tasks call, the words that change along it made as ranges.
    y_stride, x_stride, w_stride = target.row_stride, x.row_stride, w.row_stride
    starts = range(0, n_total, tile_rows)
    widths = [min(tile_rows, n_total - c0) for c0 in starts]
    w_step = tile_rows * w_stride * w_size  # bytes from one tile's w rows to the next tile's
    for s, (k0, k) in enumerate(k_ranges):
        w_tiles = [w.region(c0, n, k0, k) for c0, n in zip(starts, widths)]
        for r0 in range(0, m_total, cut.tile_m):
            m = min(cut.tile_m, m_total - r0)
            row = s * m_total + r0
            x_tile = x.region(r0, m, k0, k)
            pos_word = 0 if pos is None else pos.block().addr(0, r0)
            pos_read = () if pos is None else (pos.block().region(0, 1, r0, m),)
            y_addr = target.addr(row, 0)
            g.add_tasks(opcode, y=range(y_addr, y_addr + n_total * y_size, tile_rows * y_size), x=x.addr(r0, k0),
                        w=range(w.addr(0, k0), w.addr(0, k0) + len(starts) * w_step, w_step), pos=pos_word, m=m,
                        n=widths, k=k, y_stride=y_stride, x_stride=x_stride, w_stride=w_stride,
                        reads=[(x_tile, w_tile, *pos_read) for w_tile in w_tiles],
                        writes=[(target.region(row, m, c0, n),) for c0, n in zip(starts, widths)],
                        bytes=[m * k * x_size + n * k * w_size + m * n * y_size for n in widths],
                        flops=[2 * m * n * k for n in widths])
    if target is y:
        return y
    sum_slices(g, y, target, len(k_ranges), m_total)
    return y


def _example(g):
    """GEMV tiles for one and for two rows of x (bfloat16 w), ``tl.dot`` tiles for 20 (float32: IEEE
    products; bfloat16: tensor cores); each but the float32 20 with positions (``BY_POS``) too."""
    w = g.input("linear.w", (40, 96), torch.bfloat16)
    x1, x2, x20b = (g.input(f"linear.x{name}", (m, 96), torch.bfloat16)
                    for name, m in (("1", 1), ("2", 2), ("20b", 20)))
    pos = g.input("linear.pos", (20,), torch.int64)
    return (g.linear(x1, w), g.linear(x1, w, pos=pos[:1]), g.linear(x2, w), g.linear(x2, w, pos=pos[:2]),
            g.linear(g.input("linear.x20", (20, 96), torch.float32), g.input("linear.wf", (40, 96), torch.float32)),
            g.linear(x20b, w), g.linear(x20b, w, pos=pos))


LINEAR = TaskType("linear", linear_tile, _reference, _example)
TASK_TYPES = (LINEAR,)
OPS = {"linear": linear}
