"""Causal attention of a prefill chunk: blocks of a sequence's consecutive prompt rows against its KV cache.

A prefill chunk holds prompt tokens at positions of their own (``pos`` [rows], -1: an unused row). The
chunk's rows are cut into blocks of BLOCK_ROWS; the rows of a block belong to one sequence (the host
packs a sequence's rows from a block boundary), so they share its pages: a tile per (block, KV head)
scores the block's rows against the keys of positions up to the block's last (its own rows' keys,
written by ``kv_append`` just before, and the pages of earlier chunks) with ``tl.dot`` and an online
softmax, each row masked to the keys at or before its position (and inside its window). A chunk of C
rows is C / BLOCK_ROWS x KV heads tiles, against C x KV heads x splits partial tiles and C x heads
combine tiles for decode attention; where a tile costs a host call (``Graph.few_tiles``), a tile loops
over a run of blocks and KV heads (about one a worker) and its torch reference takes them all at once.
The cache is a paged pool (``kv_cache``) or contiguous.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..device import heap_ptr
from ..errors import is_count
from .kv_cache import Paging, cache_row, paged_caches, same_caches
from .common import TaskType, ceil_div, dot, rounded, row_offsets, row_positions, vector_aligned

BLOCK_ROWS = 16   # chunk rows per tile (a sequence's part of a chunk starts at a multiple of it)
BLOCK_KEYS = 16   # key positions per step; both are tl.dot's smallest dimension


@triton.jit
def chunk_attention_tile(base,
                         out, q,         # heap offsets of the first block's first row at the first KV head's
                         #                 first query head
                         k, v,           # heap offsets of the first KV head's column in the first cache row of
                         #                 the first block's sequence (paged: the pool's)
                         pos,            # heap offset of the first row's int64 position
                         rows,           # the tile's rows: blocks of block_rows rows, the last maybe fewer
                         block_rows,     # rows of a block (at most BLOCK_M): each block one sequence's
                         kv_heads,       # the tile's KV heads (consecutive)
                         seq_len,        # positions of a sequence: later ones are clamped
                         table, table_stride,  # paged: heap offset of the first block's block table row; bytes to
                         #                       the next block's
                         pages,          # paged: the pool's pages
                         window,         # keys attended: p - window < key <= p
                         q_stride, out_stride, cache_stride,  # row strides, in elements
                         DTYPE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
                         PAGE: tl.constexpr, RUNS: tl.constexpr):
    """One block and KV head (``_block_attention``), or with RUNS (where a tile costs a host call:
    ``Graph.few_tiles``) each (block, KV head) of a run of them in turn. A GPU's tile does not loop: under
    triton 3.6 the loop around it spilled 116 bytes of the serving step with drafts on sm_90."""
    if RUNS:
        size: tl.constexpr = DTYPE.primitive_bitwidth // 8
        heads = kv_heads.to(tl.int32)  # int32 divisions (common.py)
        per_block = block_rows.to(tl.int32)
        for t in range(0, (rows.to(tl.int32) + per_block - 1) // per_block * heads):
            b = t // heads
            head = (t % heads) * HEAD_DIM * size  # the KV head's first byte in a cache row
            r0 = b * per_block
            _block_attention(base, out + r0 * out_stride * size + GROUP * head,
                             q + r0 * q_stride * size + GROUP * head, k + head, v + head, pos + r0 * 8,
                             tl.minimum(per_block, rows - r0), seq_len, table + b * table_stride, pages, window,
                             q_stride, out_stride, cache_stride, DTYPE, GROUP, HEAD_DIM, SCALE, BLOCK_M, BLOCK_N,
                             BLOCK_D, ALIGNED, PAGE)
    else:
        _block_attention(base, out, q, k, v, pos, rows, seq_len, table, pages, window, q_stride, out_stride,
                         cache_stride, DTYPE, GROUP, HEAD_DIM, SCALE, BLOCK_M, BLOCK_N, BLOCK_D, ALIGNED, PAGE)


@triton.jit
def _block_attention(base, out, q, k, v, pos, rows, seq_len, table, pages, window, q_stride, out_stride, cache_stride,
                     DTYPE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SCALE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ALIGNED: tl.constexpr,
                     PAGE: tl.constexpr):
    """``out = softmax(q k^T) v`` for ``rows`` rows x GROUP query heads, each row over its sequence's keys
    at or before its position (a row of no sequence: zeros).

    One query head at a time: per step of BLOCK_N keys a ``[BLOCK_M, BLOCK_N]`` block of scores and an
    online softmax per row in float32, both products by ``dot``: q, K and V as stored and the
    probabilities rounded to DTYPE (on tensor cores for 16-bit caches), float32 accumulators; the later
    heads of the group find the keys in cache. ALIGNED (q, out, the caches and their row strides 16-byte
    aligned, checked by the host): rows are loaded as 16-byte vectors, one address per vector rather than
    per element. Both keep the tile inside the register budget every tile of the one kernel shares.
    """
    i = tl.arange(0, BLOCK_M)
    used = i < rows
    d = tl.arange(0, BLOCK_D)[None, :]
    positions = tl.load(heap_ptr(base, pos, tl.int64) + i, mask=used, other=-1)
    positions = tl.where(positions < 0, -1, tl.minimum(positions, seq_len - 1))     # [BLOCK_M]
    last = tl.max(positions, axis=0)
    first = tl.maximum(tl.min(tl.where(positions < 0, seq_len, positions), axis=0) + 1 - window, 0)
    # Pointers made here, not by heap_ptr, and hinted here: triton 3.6 drops a hint put on a helper's
    # return value (common.row_offsets puts its own inside the helper, which is kept).
    q_ptr, out_ptr = (base + q).to(tl.pointer_type(DTYPE)), (base + out).to(tl.pointer_type(DTYPE))
    k_ptr, v_ptr = (base + k).to(tl.pointer_type(DTYPE)), (base + v).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        q_ptr, out_ptr = tl.multiple_of(q_ptr, 16), tl.multiple_of(out_ptr, 16)
        k_ptr, v_ptr = tl.multiple_of(k_ptr, 16), tl.multiple_of(v_ptr, 16)
    q_rows = row_offsets(i[:, None], q_stride, DTYPE, ALIGNED)
    out_rows = row_offsets(i[:, None], out_stride, DTYPE, ALIGNED)
    j = tl.arange(0, BLOCK_N)
    for g in range(GROUP):
        qg = tl.load(q_ptr + q_rows + g * HEAD_DIM + d, mask=used[:, None] & (d < HEAD_DIM), other=0.0)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for s0 in range(first - first % BLOCK_N, last + 1, BLOCK_N):
            keys = s0 + j
            if PAGE % BLOCK_N == 0:  # the step's keys lie in one page (or a contiguous cache): consecutive rows
                cache_rows = cache_row(base, table, s0, pages, PAGE) + j
            else:                    # pages smaller than a step: a page lookup per key
                cache_rows = cache_row(base, table, tl.minimum(keys, last), pages, PAGE)
            cache = row_offsets(cache_rows[:, None], cache_stride, DTYPE, ALIGNED)
            mask = (keys <= last)[:, None] & (d < HEAD_DIM)
            kk = tl.load(k_ptr + cache + d, mask=mask, other=0.0)
            vv = tl.load(v_ptr + cache + d, mask=mask, other=0.0)
            seen = (keys[None, :] <= positions[:, None]) & (keys[None, :] > positions[:, None] - window)
            scores = tl.where(seen, dot(qg, tl.trans(kk)) * SCALE, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)   # a row with no key yet stays empty
            p = tl.exp(scores - shift[:, None])
            alpha = tl.exp(m - shift)
            l = l * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + dot(rounded(p, DTYPE), vv)
            m = m_new
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + out_rows + g * HEAD_DIM + d, rounded(o, DTYPE), mask=used[:, None] & (d < HEAD_DIM))


def _reference(heap, task) -> None:
    """Every (block, KV head) of the tile at once, in float32: each block's keys and values up to the furthest
    position of the tile's rows (``_block_caches``), the keys a row does not attend masked out."""
    group, hd, heads, per_block = task.GROUP, task.HEAD_DIM, task.kv_heads, task.block_rows
    blocks, cols = -(-task.rows // per_block), task.kv_heads * task.GROUP * task.HEAD_DIM
    out = heap.tensor(task.out, task.DTYPE, task.rows, cols, task.out_stride)
    positions = torch.full((blocks * per_block,), -1)  # the last block's missing rows: no sequence
    positions[:task.rows] = heap.tensor(task.pos, torch.int64, 1, task.rows, task.rows)[0].clamp(max=task.seq_len - 1)
    positions = positions.view(blocks, per_block)
    lasts = positions.max(1).values                                                   # [blocks]
    span = int(lasts.max()) + 1
    if span <= 0:
        out.zero_()
        return
    k, v = _block_caches(heap, task, lasts, span)                                     # [blocks or 1, heads, span, hd]
    q = torch.zeros(blocks * per_block, cols)
    q[:task.rows] = heap.tensor(task.q, task.DTYPE, task.rows, cols, task.q_stride)
    q = q.view(blocks, per_block, heads, group * hd).transpose(1, 2).reshape(blocks, heads, per_block * group, hd)
    keys = torch.arange(span)
    seen = (keys <= positions[..., None]) & (keys > positions[..., None] - task.window)  # [blocks, per_block, span]
    seen = seen[:, None, :, None, :].expand(blocks, 1, per_block, group, span).reshape(blocks, 1, -1, span)
    scores = ((q * task.SCALE) @ k.transpose(-1, -2)).masked_fill_(~seen, float("-inf"))
    # a row of no sequence: no key, zeros; the probabilities rounded to the cache's dtype before they weigh V, as
    # the tile rounds its p for the dot (and transformers' eager attention its softmax): in bfloat16 a prompt's
    # greedy tokens then stay transformers' where float32 probabilities parted from them (a no-op in float32)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0).to(getattr(torch, task.DTYPE)).float()
    o = (weights @ v).view(blocks, heads, per_block, group * hd).transpose(1, 2).reshape(blocks * per_block, cols)
    out.copy_(o[:task.rows])


def _block_caches(heap, task, lasts: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [0, span) of each block's sequence (its ``lasts`` entry: the furthest
    position of its rows, -1: none), float32 [blocks, kv_heads, span, HEAD_DIM]: a contiguous cache's one
    sequence ([1, ...], every block's), or a paged one's pages through each block's table row (``table_stride``
    bytes apart: ``kv_cache.paged_caches``)."""
    heads, hd = task.kv_heads, task.HEAD_DIM
    if task.PAGE == 0:
        return tuple(heap.tensor(cache, task.DTYPE, span, heads * hd, task.cache_stride).view(1, span, heads, hd)
                     .float().transpose(1, 2) for cache in (task.k, task.v))
    table = heap.tensor(task.table, torch.int64, lasts.numel(), (span - 1) // task.PAGE + 1, task.table_stride // 8)
    return paged_caches(heap, task, table, lasts, span, heads, lambda b, p: task.table + b * task.table_stride + 8 * p)


def chunk_attention(g, q, k_cache, v_cache, pos, head_dim: int, window: int | None = None, table=None,
                    page_size: int | None = None, rows_per_sequence: int | None = None):
    """Causal attention of a prefill chunk's rows ``q`` [rows, heads * head_dim] at positions ``pos``
    ([rows] int64, -1: an unused row, which gets zeros) over their sequence's cache: contiguous
    (``k_cache`` [max_seq, ...], one sequence) or paged (``table`` [rows, max_pages], ``page_size``).
    Every block of BLOCK_ROWS rows holds one sequence's rows: its first row's block table row serves
    the block; with ``rows_per_sequence`` R (at most BLOCK_ROWS), every block of R rows, and the table
    has a row per block (a sequence's verification rows, ``tasks.speculation``). ``window``: keys
    ``p - window < key <= p``."""
    heads, kv_heads = q.cols // head_dim, k_cache.cols // head_dim
    g.require(q.cols % head_dim == 0 and k_cache.cols % head_dim == 0 and heads % kv_heads == 0,
              f"chunk_attention: q {q.shape} and cache {k_cache.shape} are not whole heads of {head_dim} with "
              f"query heads a multiple of KV heads")
    same_caches(g, "chunk_attention", q, k_cache, v_cache)
    g.require(window is None or is_count(window),
              f"chunk_attention: window must be None or a positive integer, got {window!r}")
    chunk_rows = q.rows
    g.require(rows_per_sequence is None or (isinstance(rows_per_sequence, int) and 1 <= rows_per_sequence <= BLOCK_ROWS),
              f"chunk_attention: rows_per_sequence must be None or an int in [1, {BLOCK_ROWS}], got {rows_per_sequence!r}")
    block = rows_per_sequence or BLOCK_ROWS
    paging = Paging.checked(g, "chunk_attention", k_cache, chunk_rows if table is not None else 1, table, page_size,
                            rows_per_sequence or 1)
    positions = row_positions(g, "chunk_attention", pos, chunk_rows)
    g.require(pos.block().cols == chunk_rows,
              f"chunk_attention: pos must have one position per row ({chunk_rows},), got {pos.shape}")
    group = heads // kv_heads
    out = g.new_tensor(q.shape, q.dtype)
    size = q.element_size
    aligned = vector_aligned(q.addr(0, 0), q.row_stride * size, out.addr(0, 0), head_dim * size, k_cache.addr(0, 0),
                             v_cache.addr(0, 0), k_cache.row_stride * size)
    opcode = g.opcode(CHUNK_ATTENTION, DTYPE=q.dtype, GROUP=group, HEAD_DIM=head_dim,
                      SCALE=1.0 / math.sqrt(head_dim), BLOCK_M=BLOCK_ROWS, BLOCK_N=BLOCK_KEYS,
                      BLOCK_D=max(BLOCK_KEYS, triton.next_power_of_2(head_dim)), ALIGNED=aligned, PAGE=paging.page,
                      RUNS=g.few_tiles)
    blocks = ceil_div(chunk_rows, block)
    # a tile per (block, KV head); where a tile costs a host call, runs of blocks and of KV heads, about a tile
    # per worker (runs of blocks first: a full chunk's runs share its work evenly)
    per_run = ceil_div(blocks, g.parallelism) if g.few_tiles else 1
    runs = ceil_div(blocks, per_run)
    per_tile = ceil_div(kv_heads, min(kv_heads, ceil_div(g.parallelism, runs))) if g.few_tiles else 1
    for r0 in range(0, chunk_rows, per_run * block):
        rows = min(per_run * block, chunk_rows - r0)
        for h in range(0, kv_heads, per_tile):
            count, q_col = min(per_tile, kv_heads - h), h * group * head_dim
            g.add_task(opcode, out=out.addr(r0, q_col), q=q.addr(r0, q_col), k=k_cache.addr(0, h * head_dim),
                       v=v_cache.addr(0, h * head_dim), pos=positions[r0][0], rows=rows, block_rows=block,
                       kv_heads=count, seq_len=paging.max_seq, table=paging.table_row(r0),
                       table_stride=paging.table_row(block) - paging.table_row(0), pages=paging.pages,
                       window=min(window or paging.max_seq, paging.max_seq), q_stride=q.row_stride,
                       out_stride=out.row_stride, cache_stride=k_cache.row_stride,
                       reads=tuple(dict.fromkeys((  # a pool's region once, not once a block
                           q.region(r0, rows, q_col, count * group * head_dim), pos.block().region(0, 1, r0, rows),
                           *(region for b in range(r0, r0 + rows, block) for region in paging.table_region(b)),
                           paging.readable(k_cache, 0, h * head_dim, count * head_dim),
                           paging.readable(v_cache, 0, h * head_dim, count * head_dim)))),
                       writes=(out.region(r0, rows, q_col, count * group * head_dim),),
                       bytes=2 * ceil_div(rows, block) * paging.max_seq * count * head_dim * size,
                       flops=4 * rows * count * group * paging.max_seq * head_dim)
    return out


def _example(g):
    """A chunk of 20 rows (two blocks, the second partly used) with two query heads per KV head, over a
    paged pool (pages of 16 rows, 3 per row, 40 pages: any index input is a page) and a contiguous cache."""
    q = g.input("chunk_attention.q", (20, 96), torch.bfloat16)
    pos = g.input("chunk_attention.pos", (20,), torch.int64)
    table = g.input("chunk_attention.table", (20, 3), torch.int64)
    pool = g.input("chunk_attention.pool", (40 * 16, 48), torch.bfloat16)
    cache = g.input("chunk_attention.cache", (48, 48), torch.bfloat16)
    return (g.chunk_attention(q, pool, pool, pos, 48, table=table, page_size=16),
            g.chunk_attention(q, cache, cache, pos, 48, window=20))


CHUNK_ATTENTION = TaskType("chunk_attention", chunk_attention_tile, _reference, _example)
TASK_TYPES = (CHUNK_ATTENTION,)
OPS = {"chunk_attention": chunk_attention}
