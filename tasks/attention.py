"""Decode attention over a KV cache (``kv_cache``: contiguous or paged), grouped-query, flash-decoding style.

Attention is split along the sequence: a partial tile per (batch row, KV head, split) computes, for
the query heads of its group, the running max ``m``, the sum of exponentials ``l`` and the
unnormalised output over its positions (an online softmax, numerically stable); a combine tile per
(batch row, query head) rescales the partials by ``exp(m_s - max m)`` and normalises. Splits are
shorter when the graph is meant for more workers than there are (batch row, KV head, split) tiles
(``split_size``); the tiles of splits past the current position do no work, and the combine tiles
read only the splits that reach it.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..device import NO_SEQUENCE, heap_ptr, row_position
from ..errors import is_count
from .common import (TaskType, ceil_div, heap_index, next_power_of_2, position_runs, rounded, row_offsets,
                     row_positions, vector_aligned)
from .kv_cache import Paging, cache_row, no_sequence, paged_caches, reference_cache, same_caches

SPLIT = 64           # positions per partial tile: at most, and at parallelism 1 (``split_size``)
BLOCK_S = 32         # positions per step of a partial tile (K and V: 2 x 32 x head_dim elements, 16 KiB at
#                      head_dim 128 in bfloat16, in flight at once), and the smallest split
COMBINE_SPLITS = 32  # partials a combine tile reads per step (16 KiB of float32 at head_dim 128)


@triton.jit
def attention_partial_tile(base, status,
                           o, ml,          # heap offsets of the float32 partials: o [GROUP, HEAD_DIM], m and l [GROUP] each
                           q,              # heap offset of the group's GROUP query heads
                           k, v,           # heap offsets of the KV head's column in the batch row's first cache
                           #                 row (paged: the pool's)
                           pos,            # heap offset of the int64 position
                           seq_len,        # positions of the batch row: positions below it are valid
                           table, pages,   # paged: heap offset of the row's block table row, the pool's pages
                           window,         # positions attended: pos - window < p <= pos (sliding window)
                           start, length,  # the split: positions [start, start + length)
                           cache_stride,   # the caches' row stride, in elements
                           DTYPE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, ALIGNED: tl.constexpr, PAGE: tl.constexpr):
    """Online softmax of ``GROUP`` query heads against positions [max(start, pos + 1 - window),
    min(start + length, pos + 1)), at their cache rows (``cache_row``).

    One query head at a time: BLOCK_S positions of K and of V per step (BLOCK_S-aligned, so that in a
    paged cache they lie in one page, whose pool rows are consecutive), each row a contiguous run of
    HEAD_DIM elements loaded as 16-byte vectors (ALIGNED: the cache, its row stride and q are 16-byte
    aligned, checked by the host). The query row is loaded in the same [BLOCK_S, BLOCK_D] shape as K
    (every row the same address), so the scores need no register shuffle; the later heads of the
    group find K and V in cache. A split wholly past the current position, or wholly before the window,
    runs no step: it writes the empty partial (m = -inf, l = 0, o = 0) and is done.
    """
    position = row_position(status, heap_ptr(base, pos, tl.int64), seq_len)  # no sequence: -1, no work
    end = tl.minimum(start + length, position + 1)
    first = tl.maximum(start, position + 1 - window)
    q_ptr, k_ptr, v_ptr = _pointers(base, q, k, v, DTYPE, ALIGNED)
    o_ptr = heap_ptr(base, o, tl.float32)
    ml_ptr = heap_ptr(base, ml, tl.float32)
    dd = tl.arange(0, BLOCK_D)
    for g in tl.static_range(GROUP):
        m, l, acc = _attend(base, q_ptr + g * HEAD_DIM, k_ptr, v_ptr, table, pages, first, end, cache_stride, DTYPE,
                            HEAD_DIM, SCALE, BLOCK_D, BLOCK_S, ALIGNED, PAGE)
        tl.store(o_ptr + g * HEAD_DIM + dd, acc, mask=dd < HEAD_DIM)
        tl.store(ml_ptr + g, m)
        tl.store(ml_ptr + GROUP + g, l)


@triton.jit
def _pointers(base, q, k, v, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """q's, K's and V's typed pointers, with ALIGNED (16-byte rows, checked by the host) told to the compiler:
    the hints are put on values made here (one put on an argument word would be dropped)."""
    q_ptr = (base + q).to(tl.pointer_type(DTYPE))
    k_ptr = (base + k).to(tl.pointer_type(DTYPE))
    v_ptr = (base + v).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        q_ptr = tl.multiple_of(q_ptr, 16)
        k_ptr = tl.multiple_of(k_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    return q_ptr, k_ptr, v_ptr


@triton.jit
def _attend(base, q_ptr, k_ptr, v_ptr, table, pages, first, end, cache_stride, DTYPE: tl.constexpr,
            HEAD_DIM: tl.constexpr, SCALE: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
            ALIGNED: tl.constexpr, PAGE: tl.constexpr):
    """One query head (at ``q_ptr``) against positions [first, end) of a KV head (K at ``k_ptr``, V at
    ``v_ptr``, their cache rows through ``cache_row``): the online softmax's running max ``m``, sum of
    exponentials ``l`` and unnormalised output ``acc`` [BLOCK_D], float32; (-inf, 0, 0) for no position."""
    j = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)[None, :]
    qg = tl.load(q_ptr + j[:, None] * 0 + d, mask=d < HEAD_DIM, other=0.0).to(tl.float32) * SCALE
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.full([], 0.0, tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s0 in range(first - first % BLOCK_S, end, BLOCK_S):
        valid = (s0 + j >= first) & (s0 + j < end)
        cache_rows = (cache_row(base, table, s0, pages, PAGE) + j)[:, None]
        step = row_offsets(cache_rows, cache_stride, DTYPE, ALIGNED) + d  # the step's elements of K and of V
        mask = valid[:, None] & (d < HEAD_DIM)
        kv = tl.load(k_ptr + step, mask=mask, other=0.0).to(tl.float32)
        vv = tl.load(v_ptr + step, mask=mask, other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(kv * qg, axis=1), float("-inf"))     # [BLOCK_S]
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * vv, axis=0)
        m = m_new
    return m, l, acc


@triton.jit
def attention_rows_tile(base, status,
                        out, out_stride,  # heap offset of the first row's first query head's output; bytes to the next
                        q, q_stride,      # heap offset of the first row's first query head; bytes to the next row's
                        k, v,             # heap offsets of the first KV head's column in the first row's first cache
                        #                   row (paged: the pool's)
                        pos, pos_step,    # heap offset of the first row's int64 position; bytes to the next (0: same)
                        seq_len,          # positions of a batch row: positions below it are valid
                        table, table_stride,  # paged: heap offset of the first row's block table row; bytes to the next
                        pages,            # paged: the pool's pages
                        window,           # positions attended: pos - window < p <= pos (sliding window)
                        rows, kv_heads,   # the tile's batch rows and KV heads
                        cache_stride,     # the caches' row stride, in elements
                        DTYPE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, ALIGNED: tl.constexpr, PAGE: tl.constexpr):
    """Whole rows' attention, normalised: each of ``rows`` batch rows, each of ``kv_heads`` KV heads, each of
    their GROUP query heads against every position the row attends, ``out = acc / l``; zero for a row of no
    sequence. For a backend where a tile costs a host call (``Graph.few_tiles``): one tile in place of the
    partial tiles (one per row, KV head and split) and the combine tiles of its rows."""
    heads = kv_heads.to(tl.int32)  # int32 divisions (common.py)
    for t in range(0, (rows * kv_heads).to(tl.int32)):  # (row, KV head) pairs: one loop, fewer registers live
        r = t // heads
        h = t % heads
        position = row_position(status, heap_ptr(base, pos + r * pos_step, tl.int64), seq_len)
        row_cache = r * seq_len * cache_stride * (DTYPE.primitive_bitwidth // 8) if PAGE == 0 else 0
        head = h * HEAD_DIM * (DTYPE.primitive_bitwidth // 8)  # the KV head's first byte in a cache row
        q_ptr, k_ptr, v_ptr = _pointers(base, q + r * q_stride + GROUP * head, k + row_cache + head,
                                        v + row_cache + head, DTYPE, ALIGNED)
        for g in tl.static_range(GROUP):
            _, l, acc = _attend(base, q_ptr + g * HEAD_DIM, k_ptr, v_ptr, table + r * table_stride, pages,
                                tl.maximum(0, position + 1 - window), position + 1, cache_stride, DTYPE, HEAD_DIM,
                                SCALE, BLOCK_D, BLOCK_S, ALIGNED, PAGE)
            dd = tl.arange(0, BLOCK_D)
            at = heap_ptr(base, out + r * out_stride + GROUP * head, DTYPE) + g * HEAD_DIM + dd
            tl.store(at, rounded(acc / tl.where(l > 0, l, 1.0), DTYPE), mask=dd < HEAD_DIM)


def _rows_reference(heap, task) -> None:
    """The rows with a sequence at once (torch's attention, in float32): their keys and values padded to the
    furthest position, the positions a row does not attend masked out."""
    group, hd, kv_heads, size = task.GROUP, task.HEAD_DIM, task.kv_heads, getattr(torch, task.DTYPE).itemsize
    cols = kv_heads * group * hd
    out = heap.tensor(task.out, task.DTYPE, task.rows, cols, task.out_stride // size)
    live, positions = [], []  # the tile rows with a sequence, and their positions
    for r, value in enumerate(heap.words(task.pos, task.rows, task.pos_step)):
        if value != NO_SEQUENCE.value:
            live.append(r)
            positions.append(value if 0 <= value < task.seq_len else  # (the message made only when needed)
                             heap.checked_index(value, task.seq_len, f"heap offset {task.pos + r * task.pos_step}"))
    if len(live) < task.rows:
        out.zero_()  # rows of no sequence
    if not live:
        return
    n, span = len(live), max(positions) + 1
    rows = slice(0, n) if live[-1] == n - 1 else torch.tensor(live)  # (the first rows: no gather)
    k, v = _row_caches(heap, task, rows, positions, span)                        # [n, kv_heads, span, hd]
    q = heap.tensor(task.q, task.DTYPE, task.rows, cols, task.q_stride // size)[rows].float()
    attended = None
    if n > 1 or span > task.window:  # positions some row does not attend
        at, last = torch.arange(span), torch.tensor(positions)[:, None]
        attended = at <= last if span <= task.window else (at <= last) & (at > last - task.window)
        attended = attended[:, None, None, :]
    attention = torch.nn.functional.scaled_dot_product_attention(q.view(n, kv_heads, group, hd), k, v, attended,
                                                                 scale=task.SCALE)
    out[rows] = attention.reshape(n, cols)


def _row_caches(heap, task, rows: torch.Tensor | slice, positions: list[int], span: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [0, span) of the tile's rows ``rows`` (at ``positions``), float32 [rows,
    kv_heads, span, HEAD_DIM] each: a contiguous cache's blocks (the first rows': views), or a paged one's
    pages through the block table (``kv_cache.paged_caches``)."""
    kv_heads, hd = task.kv_heads, task.HEAD_DIM
    if task.PAGE == 0:
        def gather(cache: int) -> torch.Tensor:
            pool = heap.tensor(cache, task.DTYPE, task.rows * task.seq_len, kv_heads * hd, task.cache_stride)
            blocks = pool.view(task.rows, task.seq_len, kv_heads, hd)
            blocks = blocks[rows] if isinstance(rows, slice) else blocks.index_select(0, rows)
            return blocks[:, :span].float().transpose(1, 2)
        return gather(task.k), gather(task.v)
    table = heap.tensor(task.table, torch.int64, task.rows, (span - 1) // task.PAGE + 1, task.table_stride // 8)
    live = range(task.rows)[rows] if isinstance(rows, slice) else rows.tolist()
    return paged_caches(heap, task, table[rows], torch.tensor(positions), span, kv_heads,
                        lambda i, p: task.table + live[i] * task.table_stride + 8 * p)


def _partial_reference(heap, task) -> None:
    group, hd, dtype = task.GROUP, task.HEAD_DIM, task.DTYPE
    position = -1 if no_sequence(heap, task.pos) else heap_index(heap, task.pos, task.seq_len)
    start, end = max(task.start, position + 1 - task.window), min(task.start + task.length, position + 1)
    q = heap.tensor(task.q, dtype, group, hd, hd).float() * task.SCALE
    o = heap.tensor(task.o, torch.float32, group, hd, hd)
    ml = heap.tensor(task.ml, torch.float32, 2, group, group)
    if end <= start:
        o.zero_()
        ml[0].fill_(float("-inf"))
        ml[1].zero_()
        return
    k, v = reference_cache(heap, task, start, end)
    scores = q @ k.T
    m = scores.max(-1).values
    p = (scores - m[:, None]).exp()
    o.copy_(p @ v)
    ml[0].copy_(m)
    ml[1].copy_(p.sum(-1))


@triton.jit
def attention_combine_tile(base, status,
                           out,           # heap offset of the first query head's output
                           o, ml,         # heap offsets of the first head's o and m in split 0's partials
                           heads,         # query heads of one KV head: the first's and the next ones (one on a GPU)
                           splits,        # partials per (batch row, KV head)
                           pos,           # heap offset of the int64 position
                           seq_len,       # cache rows of the batch row: positions below it are valid
                           split,         # cache positions per split
                           DTYPE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_P: tl.constexpr, ALIGNED: tl.constexpr):
    """Each of ``heads`` query heads: ``out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s``, M = max_s
    m_s, over the splits that reach the current position (``*pos // split + 1`` of them; the others are
    empty); zero for a row of no sequence.

    A head's partials are ``o_s`` at ``o + s * GROUP * HEAD_DIM`` floats, ``m_s`` at ``ml + s * 2 * GROUP``
    and ``l_s`` GROUP floats after it; the next head's are a row of o and a float of m and l later, its
    output HEAD_DIM elements later. BLOCK_P splits are read per step.
    """
    position = row_position(status, heap_ptr(base, pos, tl.int64), seq_len)
    reached = position.to(tl.int32) // split.to(tl.int32) + 1  # int32 division (common.py)
    active = tl.where(position < 0, 0, tl.minimum(splits, reached))
    for j in range(0, heads):
        _combine_head(base, out + j * HEAD_DIM * (DTYPE.primitive_bitwidth // 8), o + j * HEAD_DIM * 4, ml + j * 4,
                      active, DTYPE, GROUP, HEAD_DIM, BLOCK_D, BLOCK_P, ALIGNED)


@triton.jit
def _combine_head(base, out, o, ml, active, DTYPE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, ALIGNED: tl.constexpr):
    """One query head's combine over its ``active`` splits (``attention_combine_tile``)."""
    o_ptr = (base + o).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        o_ptr = tl.multiple_of(o_ptr, 16)
    m_ptr = heap_ptr(base, ml, tl.float32)
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)[None, :]
    top = tl.full([], float("-inf"), tl.float32)
    for s0 in range(0, active, BLOCK_P):
        top = tl.maximum(top, tl.max(tl.load(m_ptr + (s0 + p) * (2 * GROUP), mask=s0 + p < active,
                                             other=float("-inf")), axis=0))
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s0 in range(0, active, BLOCK_P):
        ok = s0 + p < active
        weight = tl.exp(tl.load(m_ptr + (s0 + p) * (2 * GROUP), mask=ok, other=float("-inf")) - top)
        total += tl.sum(weight * tl.load(m_ptr + (s0 + p) * (2 * GROUP) + GROUP, mask=ok, other=0.0), axis=0)
        part = tl.load(o_ptr + (s0 + p)[:, None] * (GROUP * HEAD_DIM) + d, mask=ok[:, None] & (d < HEAD_DIM),
                       other=0.0)
        acc += tl.sum(weight[:, None] * part, axis=0)
    dd = tl.arange(0, BLOCK_D)
    tl.store(heap_ptr(base, out, DTYPE) + dd, rounded(acc / tl.where(active > 0, total, 1.0), DTYPE), mask=dd < HEAD_DIM)


def _combine_reference(heap, task) -> None:
    group, hd = task.GROUP, task.HEAD_DIM
    out = heap.tensor(task.out, task.DTYPE, 1, task.heads * hd, task.heads * hd).view(task.heads, hd)
    if no_sequence(heap, task.pos):
        out.zero_()
        return
    splits = min(task.splits, heap_index(heap, task.pos, task.seq_len) // task.split + 1)
    o = heap.tensor(task.o, torch.float32, splits, task.heads * hd, group * hd).view(splits, task.heads, hd)
    m = heap.tensor(task.ml, torch.float32, splits, task.heads, 2 * group)             # [splits, heads]
    l = heap.tensor(task.ml + group * 4, torch.float32, splits, task.heads, 2 * group)
    if splits == 1:  # the weight is exp(0) = 1
        out.copy_(o[0] / l[0][:, None])
    else:
        weight = (m - m.max(0).values).exp()                                           # [splits, heads]
        out.copy_((weight[..., None] * o).sum(0) / (weight * l).sum(0)[:, None])


def split_size(sequences: int, max_seq: int, parallelism: int, few_tiles: bool = False) -> int:
    """Cache positions per partial tile, for ``sequences`` (batch rows x KV heads) of ``max_seq`` positions.

    SPLIT (64) when that makes at least ``parallelism`` partial tiles (always at parallelism 1);
    otherwise halved, down to BLOCK_S, until it does, so that every worker gets a split at long contexts.
    With ``few_tiles``: as few splits per sequence as give ``parallelism`` tiles (whole BLOCK_S steps).
    """
    if few_tiles:
        return ceil_div(ceil_div(max_seq, ceil_div(parallelism, sequences)), BLOCK_S) * BLOCK_S
    size = SPLIT
    while size > BLOCK_S and sequences * ceil_div(max_seq, size) < parallelism:
        size //= 2
    return size


def decode_attention(g, q, k_cache, v_cache, pos, batch: int, head_dim: int, window: int | None = None, table=None,
                     page_size: int | None = None, whole_rows: bool | None = None):
    """Attention of ``q`` [batch, heads * head_dim] over positions 0 ..= ``*pos`` of every batch row, or
    over the last ``window`` of them (a sliding window). ``pos``: one position, or one per row
    (``common.row_positions``; a row of no sequence does no work and gets zeros). The caches are
    contiguous, or pools of pages with a block ``table`` (``kv_append``).

    The caches hold ``kv_heads`` heads; each KV head serves ``heads / kv_heads`` query heads. The
    sequence is cut into splits of ``split_size`` positions (one partial tile per batch row, KV head
    and split) and a combine tile per batch row and query head adds up the splits that reach ``*pos``.
    A row's partial tiles are guarded by its position (``Graph.guarded``, unless built inside a guarded
    part already): a row of no sequence skips them in the loop, not in the tile (its combine reads none).
    With ``whole_rows`` (by default where a tile costs a host call: ``Graph.few_tiles``), runs of rows
    and KV heads instead, about a tile per worker, each attending its rows whole (``attention_rows_tile``).
    """
    heads, kv_heads = q.cols // head_dim, k_cache.cols // head_dim
    g.require(q.cols % head_dim == 0 and k_cache.cols % head_dim == 0 and heads % kv_heads == 0,
              f"decode_attention: q {q.shape} and cache {k_cache.shape} are not whole heads of {head_dim} "
              f"with query heads a multiple of KV heads")
    g.require(q.rows == batch, f"decode_attention: q {q.shape} for batch {batch}")
    same_caches(g, "decode_attention", q, k_cache, v_cache)
    paging = Paging.checked(g, "decode_attention", k_cache, batch, table, page_size)
    g.require(window is None or is_count(window),
              f"decode_attention: window must be None or a positive integer, got {window!r}")
    size = q.element_size
    # 16-byte vectors along head_dim: every row of q and of the caches must start 16-byte aligned
    aligned = vector_aligned(q.addr(0, 0), q.row_stride * size, head_dim * size, k_cache.addr(0, 0),
                             v_cache.addr(0, 0), k_cache.row_stride * size, v_cache.row_stride * size)
    shape = Heads(heads // kv_heads, head_dim, kv_heads, min(window or paging.max_seq, paging.max_seq))
    constexprs = dict(DTYPE=q.dtype, GROUP=shape.group, HEAD_DIM=head_dim, SCALE=1.0 / math.sqrt(head_dim),
                      BLOCK_D=next_power_of_2(head_dim), BLOCK_S=paging.block(BLOCK_S), ALIGNED=aligned,
                      PAGE=paging.page)
    out = g.new_tensor(q.shape, q.dtype)
    if g.few_tiles if whole_rows is None else whole_rows:
        _whole_rows(g, out, q, k_cache, v_cache, pos, batch, shape, paging, g.opcode(ROWS, **constexprs))
    else:
        _splits(g, out, q, k_cache, v_cache, pos, batch, shape, paging, g.opcode(PARTIAL, **constexprs))
    return out


@dataclass(frozen=True)
class Heads:
    """The heads of an attention: query heads per KV head, their size, KV heads, positions attended."""

    group: int
    head_dim: int
    kv_heads: int
    window: int


def _whole_rows(g, out, q, k_cache, v_cache, pos, batch: int, shape: Heads, paging: Paging, opcode: int) -> None:
    """``attention_rows_tile`` tiles: the rows in runs (``position_runs``), each run's KV heads in as many runs as
    leave about a tile per worker."""
    runs = position_runs(g, "decode_attention", pos, batch)
    group, head_dim, size = shape.group, shape.head_dim, q.element_size
    per_tile = ceil_div(shape.kv_heads, min(shape.kv_heads, ceil_div(g.parallelism, len(runs))))
    for run in runs:
        rows = range(run.row, run.row + run.rows)
        for h in range(0, shape.kv_heads, per_tile):
            count, cols = min(per_tile, shape.kv_heads - h), h * head_dim
            g.add_task(opcode, out=out.addr(run.row, group * cols), out_stride=out.row_stride * size,
                       q=q.addr(run.row, group * cols), q_stride=q.row_stride * size,
                       k=k_cache.addr(paging.first_row(run.row), cols), v=v_cache.addr(paging.first_row(run.row), cols),
                       pos=run.pos, pos_step=run.pos_step, seq_len=paging.max_seq, table=paging.table_row(run.row),
                       table_stride=8 * paging.table.row_stride if paging.page else 0, pages=paging.pages,
                       window=shape.window, rows=run.rows, kv_heads=count, cache_stride=k_cache.row_stride,
                       reads=tuple(dict.fromkeys((  # a pool's region once, not once a row
                           q.region(run.row, run.rows, group * cols, count * group * head_dim), run.region,
                           *(region for b in rows for region in paging.table_region(b)),
                           *(paging.readable(cache, b, cols, count * head_dim)
                             for cache in (k_cache, v_cache) for b in rows)))),
                       writes=(out.region(run.row, run.rows, group * cols, count * group * head_dim),),
                       bytes=2 * run.rows * count * shape.window * head_dim * size,
                       flops=4 * run.rows * count * group * shape.window * head_dim)


def _splits(g, out, q, k_cache, v_cache, pos, batch: int, shape: Heads, paging: Paging, partial: int) -> None:
    """Partial tiles per (batch row, KV head, split), guarded by the row's position, then combine tiles."""
    group, head_dim, kv_heads, max_seq, size = shape.group, shape.head_dim, shape.kv_heads, paging.max_seq, q.element_size
    positions = row_positions(g, "decode_attention", pos, batch)
    split = split_size(batch * kv_heads, max_seq, g.parallelism, g.few_tiles)
    splits = ceil_div(max_seq, split)
    partial_o = g.new_tensor((batch * kv_heads * splits * group, head_dim), torch.float32)
    partial_ml = g.new_tensor((batch * kv_heads * splits * 2, group), torch.float32)
    for b, (position, position_region) in enumerate(positions):
        with _row_guard(g, pos, b):
            for h in range(kv_heads):
                q_rows = q.region(b, 1, h * group * head_dim, group * head_dim)
                for s in range(splits):
                    slot = (b * kv_heads + h) * splits + s
                    cols = h * head_dim
                    g.add_task(partial, o=partial_o.addr(slot * group, 0), ml=partial_ml.addr(slot * 2, 0),
                               q=q.addr(b, h * group * head_dim), k=k_cache.addr(paging.first_row(b), cols),
                               v=v_cache.addr(paging.first_row(b), cols), pos=position, seq_len=max_seq,
                               table=paging.table_row(b), pages=paging.pages, window=shape.window,
                               start=s * split, length=split, cache_stride=k_cache.row_stride,
                               reads=(q_rows, position_region, *paging.table_region(b),
                                      paging.readable(k_cache, b, cols, head_dim),
                                      paging.readable(v_cache, b, cols, head_dim)),
                               writes=(partial_o.region(slot * group, group, 0, head_dim),
                                       partial_ml.region(slot * 2, 2, 0, group)),
                               bytes=2 * min(split, max_seq) * head_dim * size,
                               flops=4 * group * min(split, max_seq) * head_dim)
    g.phase("decode_attention.combine")
    combine = g.opcode(COMBINE, DTYPE=q.dtype, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=next_power_of_2(head_dim),
                       BLOCK_P=min(COMBINE_SPLITS, next_power_of_2(splits)),
                       ALIGNED=vector_aligned(partial_o.addr(0, 0), head_dim * partial_o.element_size))
    for b, (position, position_region) in enumerate(positions):
        for h in range(kv_heads):
            slot = (b * kv_heads + h) * splits
            reads = (partial_o.region(slot * group, splits * group, 0, head_dim),
                     partial_ml.region(slot * 2, splits * 2, 0, group), position_region)
            heads_per_tile = group if g.few_tiles else 1
            for j in range(0, group, heads_per_tile):
                head = h * group + j
                g.add_task(combine, out=out.addr(b, head * head_dim), o=partial_o.addr(slot * group + j, 0),
                           ml=partial_ml.addr(slot * 2, j), heads=heads_per_tile, splits=splits, pos=position,
                           seq_len=max_seq, split=split,
                           reads=reads, writes=(out.region(b, 1, head * head_dim, heads_per_tile * head_dim),),
                           bytes=heads_per_tile * splits * (head_dim + 2) * 4,
                           flops=2 * heads_per_tile * splits * head_dim)


def _row_guard(g, pos, b: int):
    """The guard of batch row ``b``'s partial tiles: its position (``pos``, one for every row or one per
    row), so that a row of no sequence skips them; none inside a guarded part (its guard holds)."""
    if g.is_guarded:
        return contextlib.nullcontext()
    return g.guarded(pos if pos.shape in ((1,), (1, 1)) else pos[b])


def _example(g):
    """A KV append and an attention over the cache it writes: two batch rows, two query heads per KV head;
    contiguous, and paged (pages of 16 rows, 3 per row, in a pool of 40: any index input is a page); in
    splits, and whole rows."""
    q, pos = g.input("attention.q", (2, 96), torch.bfloat16), g.input("attention.pos", (1,), torch.int64)
    cache = g.input("attention.cache", (2 * 80, 48), torch.bfloat16)
    k_cache = g.kv_append(cache, q[:, :48], pos, batch=2)
    table = g.input("attention.table", (2, 3), torch.int64)
    pool = g.kv_append(g.input("attention.pool", (40 * 16, 48), torch.bfloat16), q[:, 48:], pos, batch=2,
                       table=table, page_size=16)
    return (g.decode_attention(q, k_cache, k_cache, pos, batch=2, head_dim=48, whole_rows=False),
            g.decode_attention(q, k_cache, k_cache, pos, batch=2, head_dim=48, window=20, whole_rows=False),
            g.decode_attention(q, pool, pool, pos, batch=2, head_dim=48, table=table, page_size=16, whole_rows=False),
            g.decode_attention(q, k_cache, k_cache, pos, batch=2, head_dim=48, window=20, whole_rows=True),
            g.decode_attention(q, pool, pool, pos, batch=2, head_dim=48, table=table, page_size=16, whole_rows=True))


PARTIAL = TaskType("attention_partial", attention_partial_tile, _partial_reference, _example)
COMBINE = TaskType("attention_combine", attention_combine_tile, _combine_reference, _example)
ROWS = TaskType("attention_rows", attention_rows_tile, _rows_reference, _example)
TASK_TYPES = (PARTIAL, COMBINE, ROWS)
OPS = {"decode_attention": decode_attention}
