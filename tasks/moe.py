"""Mixture-of-experts on the device: the router's top-k, expert GEMVs addressed by it, the weighted sum.

The choice of experts is known only mid-step, on the device, so the task graph is fixed when it is
built and only addresses depend on the router: per token, ``route`` writes the top-k experts and
their weights to the heap; for each (token, slot) the ``expert_linear`` tiles read the expert's index
there and stream that expert's slice of a stacked weight ``[experts * n, K]`` (at batch 1 only k of
the experts are read at all); ``moe_sum`` adds the k slot outputs, weighted, in slot order (bitwise
independent of which tile finished first).

At more than one token ``moe_mlp`` groups the rows by expert (``grouped_experts``): the rows that chose
one expert in a step share one pass over its weights. A step chooses at most ``groups = min(experts,
tokens * k)`` distinct experts, so the graph holds a tile per (group j, column block), and tile j
serves the j-th smallest expert that some row chose: it counts the rows per expert (a histogram of the
router's table), finds its expert, gathers that expert's rows in routed order, multiplies them by the
expert's weights (``tl.dot`` from 16 tokens, GEMV below) and writes each row's output. A group past the
experts chosen reads no weight. Which rows a tile writes depends on the router, so its declared write
is a marker of its own (``served``: an int64 per tile, the weight passes it has run) and the readers of
the grouped output read every marker of the op: the fan-ins stay static, the writes are disjoint by
construction (a row chose one expert per slot) and a next step's writers wait for this step's readers.

Under expert parallelism (``expert_parallel``) each rank holds its experts whole (``Held.balanced``) and
every token's row (attention's all-reduce leaves them on every rank): its grouped tiles serve its own
experts, its ``moe_sum`` adds their slots, and ``expert_parallel.combine`` sums the ranks' parts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import checked_index, heap_ptr
from ..errors import is_count
from . import quantized
from .common import (TaskType, Tiling, ceil_div, dot, heap_index, load_block, next_power_of_2, require_float, rounded,
                     routed_rows, store_block, vector_aligned)
from .elementwise import combined, combined_reference
from .expert_parallel import combine, held_experts
from .formats import FORMATS_BY_CODE, Quantized
from .linear import DOT_MIN_M, gemv_blocks, gemv_one_row, plan


@triton.jit
def route_tile(base,
               experts, weights,   # heap offsets of the token's k expert indices (int64) and k weights
               logits,             # heap offset of the token's router logits
               count,              # the number of experts
               K: tl.constexpr, NORMALIZE: tl.constexpr, L_DTYPE: tl.constexpr, WEIGHT_DTYPE: tl.constexpr,
               BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Softmax of the token's router logits (float32), its ``K`` largest probabilities in decreasing order
    (the lowest index first among equal ones) and their experts; with NORMALIZE the k weights are divided
    by their sum. ``count <= BLOCK_E``."""
    e = tl.arange(0, BLOCK_E)
    v = tl.load(heap_ptr(base, logits, L_DTYPE) + e, mask=e < count, other=float("-inf")).to(tl.float32)
    p = tl.exp(v - tl.max(v, axis=0))
    p = tl.where(e < count, p / tl.sum(p, axis=0), -1.0)
    slot = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), tl.int64)
    top = tl.zeros((BLOCK_K,), tl.float32)
    for s in tl.static_range(K):
        best = tl.max(p, axis=0)
        index = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
        chosen = tl.where(slot == s, index.to(tl.int64), chosen)
        top = tl.where(slot == s, best, top)
        p = tl.where(e == index, -1.0, p)
    if NORMALIZE:
        top = top / tl.sum(top, axis=0)
    tl.store(heap_ptr(base, experts, tl.int64) + slot, chosen, mask=slot < K)
    tl.store(heap_ptr(base, weights, WEIGHT_DTYPE) + slot, rounded(top, WEIGHT_DTYPE), mask=slot < K)


def _route_reference(heap, task) -> None:
    logits = heap.tensor(task.logits, task.L_DTYPE, 1, task.count, task.count).float()
    top, chosen = torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True, stable=True)  # ties: lowest first
    top, chosen = top[:, :task.K], chosen[:, :task.K]
    if task.NORMALIZE:
        top = top / top.sum(dim=-1, keepdim=True)
    heap.tensor(task.experts, torch.int64, 1, task.K, task.K).copy_(chosen)
    heap.tensor(task.weights, task.WEIGHT_DTYPE, 1, task.K, task.K).copy_(top)


def route(g, logits, k: int, normalize: bool, weight_dtype: torch.dtype = torch.float32):
    """Per token (row of ``logits [tokens, experts]``): the ``k`` experts of largest softmax probability
    and their probabilities (divided by their sum with ``normalize``), as ``(experts int64 [tokens, k],
    weights [tokens, k] of weight_dtype)``. Equal probabilities go to the lowest expert first
    (``torch.topk`` leaves the order of ties unspecified, and its CPU and CUDA kernels differ)."""
    require_float(g, "route", logits=logits)
    g.require(logits.ndim == 2 and is_count(k) and k <= logits.cols,
              f"route: logits must be [tokens, experts] and 1 <= k <= experts, got {logits.shape} and k={k!r}")
    g.require(logits.cols <= 4096, f"route: at most 4096 experts, got {logits.cols}")
    experts = g.new_tensor((logits.rows, k), torch.int64)
    weights = g.new_tensor((logits.rows, k), weight_dtype)
    opcode = g.opcode(ROUTE, K=k, NORMALIZE=bool(normalize), L_DTYPE=logits.dtype, WEIGHT_DTYPE=weight_dtype,
                      BLOCK_E=triton.next_power_of_2(logits.cols), BLOCK_K=triton.next_power_of_2(k))
    for b in range(logits.rows):
        g.add_task(opcode, experts=experts.addr(b, 0), weights=weights.addr(b, 0), logits=logits.addr(b, 0),
                   count=logits.cols, reads=(logits.region(b, 1, 0, logits.cols),),
                   writes=(experts.region(b, 1, 0, k), weights.region(b, 1, 0, k)),
                   bytes=logits.cols * logits.element_size, flops=8 * logits.cols * k)
    return experts, weights


@triton.jit
def expert_linear_tile(base, status,
                       y, x, w,         # heap offsets: the output row, the input row, rows [r0, r0 + n) of expert 0
                       expert,          # heap offset of the int64 expert index
                       count,           # the number of experts
                       expert_bytes,    # bytes from one expert's rows to the next one's
                       n, k, w_stride,  # the tile is n rows of w, k long; w's row stride in elements
                       X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, ALIGNED: tl.constexpr):
    """``y[0, :n] = x[0, :k] @ w_e[:n, :k].T`` for the expert ``e`` read from the heap (an index outside
    [0, count): expert 0, reported): the one-row GEMV of ``linear``, on the expert's rows."""
    e = checked_index(status, tl.load(heap_ptr(base, expert, tl.int64)), count)
    gemv_one_row(base, y, x, w + e * expert_bytes, n, k, w_stride, tl.full((1,), True, tl.int1), X_DTYPE, W_DTYPE,
                 Y_DTYPE, BLOCK_N, BLOCK_K, EVEN_K, ALIGNED)


def _expert_linear_reference(heap, task) -> None:
    e = heap_index(heap, task.expert, task.count)
    x = heap.tensor(task.x, task.X_DTYPE, 1, task.k, task.k).float()
    w = heap.tensor(task.w + e * task.expert_bytes, task.W_DTYPE, task.n, task.k, task.w_stride).float()
    heap.tensor(task.y, task.Y_DTYPE, 1, task.n, task.n).copy_(x @ w.T)


def expert_rows(g, x, w, experts, count: int):
    """For each token b and slot s of ``experts [tokens, slots]`` (the router's top-k: a slot per chosen
    expert), row ``b * slots + s`` of the result is ``x_row @ w_e.T``: ``w_e`` is expert ``e = experts[b,
    s]``'s rows of ``w [count * n, K]`` (the experts' weights stacked), ``x_row`` is ``x[b]`` when ``x``
    has a row per token (every slot reads its token's row) or ``x[b * slots + s]`` when it has a row per
    slot. Returns ``[tokens * slots, n]`` in x's dtype. A ``Quantized`` w is dequantized in the tiles
    (``tasks.quantized.expert_rows``)."""
    if isinstance(w, Quantized):
        return quantized.expert_rows(g, x, w, experts, count)
    tokens, slots = experts.rows, experts.cols
    g.require(experts.ndim == 2 and experts.dtype == torch.int64,
              f"expert_rows: experts must be int64 [tokens, slots], got {experts.shape} {experts.dtype}")
    require_float(g, "expert_rows", x=x, w=w)
    g.require(x.ndim == 2 and w.ndim == 2 and x.cols == w.cols and x.rows in (tokens, tokens * slots),
              f"expert_rows: x {x.shape} must have a row per token ({tokens}) or per slot ({tokens * slots}), and as "
              f"many columns as w {w.shape}")
    g.require(is_count(count) and w.rows % count == 0,
              f"expert_rows: w has {w.rows} rows, not a whole number per expert for {count!r} experts")
    n_total, k_total = w.rows // count, x.cols
    y = g.new_tensor((tokens * slots, n_total), x.dtype)
    blocks = gemv_blocks(1, w.dtype, k_total)
    _, block_n, block_k = blocks
    tile_rows = plan(1, n_total, k_total, blocks, w.element_size, max(1, g.parallelism // (tokens * slots)),
                     1).tile_rows
    x_size, w_size, y_size = x.element_size, w.element_size, y.element_size
    expert_bytes = n_total * w.row_stride * w_size
    aligned = vector_aligned(x.addr(0, 0), w.addr(0, 0), x.row_stride * x_size, w.row_stride * w_size, expert_bytes,
                             k_total * x_size, k_total * w_size)
    opcode = g.opcode(EXPERT_LINEAR, X_DTYPE=x.dtype, W_DTYPE=w.dtype, Y_DTYPE=y.dtype, BLOCK_N=block_n,
                      BLOCK_K=block_k, EVEN_K=k_total % block_k == 0, ALIGNED=aligned)
    whole_w = w.region(0, w.rows, 0, k_total)  # the rows read depend on the router: all of them, as far as order goes
    for b, s, row, x_row in routed_rows(x, experts):
        for c0 in range(0, n_total, tile_rows):
            n = min(tile_rows, n_total - c0)
            g.add_task(opcode, y=y.addr(row, c0), x=x.addr(x_row, 0), w=w.addr(c0, 0), expert=experts.addr(b, s),
                       count=count, expert_bytes=expert_bytes, n=n, k=k_total, w_stride=w.row_stride,
                       reads=(x.region(x_row, 1, 0, k_total), experts.region(b, 1, s, 1), whole_w),
                       writes=(y.region(row, 1, c0, n),),
                       bytes=k_total * x_size + n * k_total * w_size + n * y_size, flops=2 * n * k_total)
    return y


# -- rows grouped by expert ---------------------------------------------------------------------------------

GROUP_CHUNK = 64      # routed rows a grouped tile compares at a time (a [BLOCK_M, GROUP_CHUNK] block)
GROUP_BLOCK_N = 16    # rows of w per block of a GEMV grouped tile
GROUP_BLOCK_K = 64
GROUP_DOT_BLOCK_K = 32  # with tl.dot: 64 spills 88-296 bytes a thread at 128 registers (sm_90)
FLOAT_FORMAT = tl.constexpr(0)  # the FORMAT of weights stored as floats (quantized formats count from 1)


@triton.jit
def _group_expert(base, experts, routed, j, count, first, held, BINS: tl.constexpr, CHUNK: tl.constexpr):
    """(expert, rows): the ``j``-th smallest of the experts ``first .. first + held`` that some of the
    ``routed`` rows of the router's table chose, and how many rows chose it; rows 0 when fewer than j + 1
    of them were chosen. ``BINS > count``: the last bin takes the padding (and an index outside [0, count),
    which no expert then serves)."""
    r = tl.arange(0, CHUNK)
    rows = tl.zeros((BINS,), tl.int32)
    for r0 in range(0, routed, CHUNK):
        ids = tl.load(heap_ptr(base, experts, tl.int64) + r0 + r, mask=r0 + r < routed, other=-1)
        ids = tl.where((ids >= 0) & (ids < count), ids, BINS - 1).to(tl.int32)
        rows += tl.histogram(ids, BINS)
    e = tl.arange(0, BINS)
    chosen = (rows > 0) & (e >= first) & (e < first + held)
    this = chosen & (tl.cumsum(chosen.to(tl.int32), axis=0) - 1 == j)
    return tl.sum(tl.where(this, e, 0), axis=0), tl.sum(tl.where(this, rows, 0), axis=0)


@triton.jit
def _rows_of(base, experts, routed, expert, m0, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """int32 [BLOCK_M]: the routed rows ``m0 .. m0 + BLOCK_M`` of those that chose ``expert``, in routed
    order (0 past the last)."""
    p = m0 + tl.arange(0, BLOCK_M)[:, None]
    r = tl.arange(0, CHUNK)
    found = tl.zeros((BLOCK_M,), tl.int32)
    seen = 0
    for r0 in range(0, routed, CHUNK):
        hit = tl.load(heap_ptr(base, experts, tl.int64) + r0 + r, mask=r0 + r < routed, other=-1) == expert
        order = seen + tl.cumsum(hit.to(tl.int32), axis=0) - 1
        found += tl.sum(tl.where(hit[None, :] & (order[None, :] == p), r0 + r[None, :], 0), axis=1)
        seen += tl.sum(hit.to(tl.int32), axis=0)
    return found


@triton.jit
def _w_rows(base, w, scales, rows, k0, k, w_stride, scales_stride, scale_offset, W_DTYPE: tl.constexpr,
            FORMAT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGNED: tl.constexpr):
    """Columns ``k0 .. k0 + BLOCK_K`` (0 from k on) of the weight rows ``rows`` [BLOCK_N, 1]: as stored
    (W_DTYPE) for float weights, dequantized to float32 for a quantized FORMAT."""
    if FORMAT == FLOAT_FORMAT:
        rk = tl.arange(0, BLOCK_K)[None, :]
        return tl.load(heap_ptr(base, w, W_DTYPE) + rows.to(tl.int64) * w_stride + k0 + rk, mask=k0 + rk < k,
                       other=0.0)
    else:
        return quantized.dequantized_block(base, w, scales, rows, k0, k, w_stride, scales_stride, scale_offset,
                                           FORMAT, BLOCK_N, BLOCK_K, ALIGNED)


@triton.jit
def _expert_product(base, x, w, scales, x_rows, m, w_rows, k, x_stride, w_stride, scales_stride, scale_offset,
                    X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, FORMAT: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, ALIGNED: tl.constexpr):
    """float32 [BLOCK_M, BLOCK_N]: ``x[x_rows[:m]] @ w[w_rows].T``, every block of w loaded once for the m
    rows of x: with ``tl.dot`` (USE_DOT) or reduced across K per row of x."""
    rm = tl.arange(0, BLOCK_M)[:, None]
    rk = tl.arange(0, BLOCK_K)[None, :]
    x_ptr = heap_ptr(base, x, X_DTYPE)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k, BLOCK_K):
        b = _w_rows(base, w, scales, w_rows, k0, k, w_stride, scales_stride, scale_offset, W_DTYPE, FORMAT, BLOCK_N,
                    BLOCK_K, ALIGNED)
        if USE_DOT:
            a = tl.load(x_ptr + x_rows[:, None].to(tl.int64) * x_stride + k0 + rk, mask=(rm < m) & (k0 + rk < k),
                        other=0.0)
            acc += dot(a, tl.trans(b))
        else:
            for i in range(0, m):
                x_row = tl.sum(tl.where(tl.arange(0, BLOCK_M) == i, x_rows, 0), axis=0).to(tl.int64)
                a = tl.load(x_ptr + x_row * x_stride + k0 + rk, mask=k0 + rk < k, other=0.0).to(tl.float32)
                acc = tl.where(rm == i, acc + tl.sum(b.to(tl.float32) * a, axis=1)[None, :], acc)
    return acc


@triton.jit
def grouped_expert_tile(base,
                        y, x, w, scales,   # heap offsets: y's and x's first rows, the stacked weight's, its scales'
                        experts,           # heap offset of the router's int64 table [tokens, slots], row-major
                        served,            # heap offset of this tile's int64 marker: the weight passes it ran
                        j,                 # the tile serves the j-th smallest expert chosen
                        routed, count,     # rows of the table (tokens * slots); the number of experts
                        first, held,       # the experts this rank serves: ids first .. first + held (``Held``)
                        x_per,             # routed rows per row of x: 1 (a row per slot) or slots (per token)
                        row0, n, k,        # the tile: columns row0 .. row0 + n of y, K = k
                        expert_rows,       # rows of w per expert
                        second,            # GATED: rows from an expert's gate rows to its up rows
                        y_stride, x_stride, w_stride, scales_stride, scale_offset,
                        X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, FORMAT: tl.constexpr,
                        ACT: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, ALIGNED: tl.constexpr):
    """For the j-th expert ``e`` chosen of those served and each routed row ``r`` that chose it: ``y[r,
    row0:row0 + n] = x[r // x_per] @ W_e[row0:row0 + n].T``, or with ACT (a gated activation,
    ``elementwise.combined``) ``ACT(x @ W_e[row0 + rows].T, x @ W_e[second + row0 + rows].T)``; W_e expert
    e's rows of the stacked weight (the ``e - first``-th expert stacked; float, or dequantized: FORMAT).
    BLOCK_M rows of x at a time, each block of W_e loaded once per BLOCK_M rows; none when no row chose a
    j-th expert. ``*served`` += 1 when the tile ran a pass."""
    routed, x_per = routed.to(tl.int32), x_per.to(tl.int32)  # int32 row indices: no 64-bit division
    expert, chosen = _group_expert(base, experts, routed, j, count, first, held, BINS, CHUNK)
    marker = heap_ptr(base, served, tl.int64)
    tl.store(marker, tl.load(marker) + (chosen > 0).to(tl.int64))
    n = n.to(tl.int32)
    rn = tl.arange(0, BLOCK_N)[None, :]
    for m0 in range(0, chosen, BLOCK_M):
        rows = _rows_of(base, experts, routed, expert, m0, BLOCK_M, CHUNK)
        m = tl.minimum(chosen - m0, BLOCK_M)
        for r0 in range(0, n, BLOCK_N):
            w_rows = (expert - first) * expert_rows + row0 + tl.minimum(r0 + tl.arange(0, BLOCK_N)[:, None], n - 1)
            acc = _expert_product(base, x, w, scales, rows // x_per, m, w_rows, k, x_stride, w_stride, scales_stride,
                                  scale_offset, X_DTYPE, W_DTYPE, FORMAT, BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, ALIGNED)
            if ACT != "":  # the up rows after the gate rows: one weight block live at a time (no spills)
                acc = combined(acc, _expert_product(base, x, w, scales, rows // x_per, m, w_rows + second, k, x_stride,
                                                    w_stride, scales_stride, scale_offset, X_DTYPE, W_DTYPE, FORMAT,
                                                    BLOCK_M, BLOCK_N, BLOCK_K, USE_DOT, ALIGNED), ACT)
            out = heap_ptr(base, y, Y_DTYPE) + rows[:, None].to(tl.int64) * y_stride + row0 + r0 + rn
            tl.store(out, rounded(acc, Y_DTYPE), mask=(tl.arange(0, BLOCK_M)[:, None] < m) & (r0 + rn < n))


def _grouped_expert_reference(heap, task) -> None:
    ids = heap.tensor(task.experts, torch.int64, 1, task.routed, task.routed)[0]
    chosen = torch.unique(ids[(ids >= task.first) & (ids < task.first + task.held)])  # sorted
    served = heap.tensor(task.served, torch.int64, 1, 1, 1)
    served += int(task.j < len(chosen))
    if task.j >= len(chosen):
        return
    e = int(chosen[task.j])
    rows = (ids == e).nonzero()[:, 0]
    x = heap.tensor(task.x, task.X_DTYPE, task.routed // task.x_per, task.k, task.x_stride)[rows // task.x_per].float()

    def products(gate_or_up: int) -> torch.Tensor:
        row = (e - task.first) * task.expert_rows + gate_or_up + task.row0
        if task.FORMAT == FLOAT_FORMAT.value:
            size = getattr(torch, task.W_DTYPE).itemsize
            w = heap.tensor(task.w + row * task.w_stride * size, task.W_DTYPE, task.n, task.k, task.w_stride).float()
        else:
            w = quantized.unpacked_weight(heap, FORMATS_BY_CODE[task.FORMAT], task.w, task.w_stride,
                                          task.scales, task.scales_stride, task.scale_offset, task.n, task.k, row, 0)
        return x @ w.T

    out = products(0) if not task.ACT else combined_reference(products(0), products(task.second), task.ACT)
    size = getattr(torch, task.Y_DTYPE).itemsize
    heap.tensor(task.y + task.row0 * size, task.Y_DTYPE, task.routed, task.n, task.y_stride)[rows] = \
        out.to(getattr(torch, task.Y_DTYPE))


def grouped_experts(g, x, w, experts, count: int, act: str = "", after=None, passes=None,
                    expert_parallel: bool = False):
    """``expert_rows`` with the rows grouped by expert: row ``b * slots + s`` of the result is ``x_row @
    w_e.T`` for ``e = experts[b, s]`` (``x_row`` as in ``expert_rows``), each expert's weights read once
    for all the rows that chose it (see the module's docstring). ``act`` ("silu_mul", "gelu_tanh_mul"):
    w holds each expert's gate rows then its up rows, and the result is ``act(gate, up)``, half as wide.
    ``experts`` must come from ``route`` (one slot per expert chosen). ``after``: the marker of a grouped
    op whose output ``x`` is (its readers read every marker). ``passes``: int64 [count], ``passes[j]``
    counts the weight passes of the j-th smallest expert chosen (j < ``min(count, tokens * slots)``, the
    groups). ``expert_parallel``: w stacks this rank's experts (``Held.balanced``), the only ones it serves:
    the rows of the others are not written. Returns ``(y, marker)``."""
    tokens, slots = experts.rows, experts.cols
    g.require(experts.ndim == 2 and experts.dtype == torch.int64,
              f"grouped_experts: experts must be int64 [tokens, slots], got {experts.shape} {experts.dtype}")
    is_quantized = isinstance(w, Quantized)
    require_float(g, "grouped_experts", x=x, **({} if is_quantized else {"w": w}))
    g.require(not is_quantized or w.data.graph is g, "grouped_experts: the quantized weight belongs to another graph")
    g.require(act in ("", "silu_mul", "gelu_tanh_mul"), f"grouped_experts: act must be '', 'silu_mul' or "
                                                         f"'gelu_tanh_mul', got {act!r}")
    g.require(x.ndim == 2 and (is_quantized or w.ndim == 2) and x.cols == w.cols and x.rows in (tokens, tokens * slots),
              f"grouped_experts: x {x.shape} must have a row per token ({tokens}) or per slot ({tokens * slots}), and "
              f"as many columns as w {w.shape}")
    g.require(is_count(count) and count <= 4096, f"grouped_experts: count must be 1 to 4096 experts, got {count!r}")
    held = held_experts(g, "grouped_experts", count, expert_parallel)
    g.require(w.rows % (held.stacked * (2 if act else 1)) == 0,
              f"grouped_experts: w has {w.rows} rows, not a whole number per expert{' (gate and up)' if act else ''} "
              f"for {held.stacked} experts")
    expert_rows, k_total, routed = w.rows // held.stacked, x.cols, tokens * slots
    n_total = expert_rows // 2 if act else expert_rows
    groups = min(held.stacked, routed)  # the same on every rank (buffers agree); a group past held.count does nothing
    g.require(passes is None or (passes.shape == (count,) and passes.dtype == torch.int64),
              f"grouped_experts: passes must be int64 [{count}], got "
              f"{None if passes is None else (passes.shape, passes.dtype)}")
    y = g.new_tensor((routed, n_total), x.dtype)
    use_dot = tokens >= DOT_MIN_M  # an expert gets at most a row per token
    if is_quantized:
        # with tl.dot gathered [16, 32] blocks: the vector path's spill 28-64 bytes on sm_90 (Q4_K and Q8_0 then
        # none; FP8 still 24-68 bytes with 16+ rows: an open item)
        block_n, block_k, aligned = ((quantized.BLOCK_N, GROUP_DOT_BLOCK_K, False) if use_dot else
                                     quantized.tile_blocks(w, [0], [k_total]))
        data, scales, scale_words = w.data, w.scales, quantized.scale_words(w)
        w_dtype, w_size = torch.uint8, w.format.row_bytes(k_total) / k_total
    else:
        block_k = min(GROUP_DOT_BLOCK_K if use_dot else GROUP_BLOCK_K, max(16, next_power_of_2(k_total)))
        block_n, aligned = GROUP_BLOCK_N, False
        data, scales, scale_words = w, None, {"scales": 0, "scales_stride": 0, "scale_offset": 0}
        w_dtype, w_size = w.dtype, w.element_size
    block_n = max(block_n, 16) if use_dot else block_n
    # enough column blocks for every worker to get a tile when as many experts as can be are chosen
    splits = 1 if g.few_tiles else min(ceil_div(n_total, block_n), ceil_div(g.parallelism, groups))
    tile_rows = ceil_div(ceil_div(n_total, splits), block_n) * block_n
    starts = range(0, n_total, tile_rows)
    marker = g.new_tensor((groups, len(starts)), torch.int64)
    opcode = g.opcode(GROUPED_EXPERT, X_DTYPE=x.dtype, W_DTYPE=w_dtype, Y_DTYPE=y.dtype,
                      FORMAT=w.format.code if is_quantized else FLOAT_FORMAT.value, ACT=act,
                      BINS=next_power_of_2(count + 1), CHUNK=min(GROUP_CHUNK, next_power_of_2(routed)),
                      BLOCK_M=16 if use_dot else next_power_of_2(tokens), BLOCK_N=block_n, BLOCK_K=block_k,
                      USE_DOT=use_dot, ALIGNED=aligned)
    whole = (x.region(0, x.rows, 0, k_total), experts.region(0, tokens, 0, slots),
             data.region(0, data.rows, 0, data.cols), *((scales.region(0, scales.rows, 0, scales.cols),) if scales
                                                         is not None else ()),
             *((after.region(0, after.rows, 0, after.cols),) if after is not None else ()))
    gates = 2 if act else 1
    for group in range(groups):
        for c, c0 in enumerate(starts):
            n = min(tile_rows, n_total - c0)
            counts = passes is not None and c == 0  # counts into passes: its marker cell stands for that
            g.add_task(opcode, y=y.addr(0, 0), x=x.addr(0, 0), w=data.addr(0, 0), **scale_words,
                       experts=experts.addr(0, 0), served=passes.addr(0, group) if counts else marker.addr(group, c),
                       j=group, routed=routed, count=count, first=held.first, held=held.count, x_per=slots if x.rows == tokens else 1, row0=c0, n=n,
                       k=k_total, expert_rows=expert_rows, second=n_total, y_stride=y.row_stride,
                       x_stride=x.row_stride, w_stride=data.row_stride, reads=whole,
                       writes=(marker.region(group, 1, c, 1),) + ((passes.region(0, 1, group, 1),) if counts else ()),
                       bytes=int(gates * n * k_total * w_size) + 8 * routed, flops=2 * gates * n * k_total * tokens)
    return y, marker


@triton.jit
def moe_sum_tile(base,
                 out, y, weights,   # heap offsets: the token's output tile, its slot 0 tile, its k weights
                 experts,           # HELD: heap offset of the token's k experts
                 first, held,       # HELD: the experts this rank serves, ids first .. first + held
                 cols,              # the tile's columns
                 y_stride,          # y's row stride, in elements
                 K: tl.constexpr, Y_DTYPE: tl.constexpr, WEIGHT_DTYPE: tl.constexpr, HELD: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """``out = sum_s weights[s] * y[s]`` over the token's K slot rows, in slot order, in float32; with
    HELD only the slots whose expert this rank serves (the others' rows are not written: never read)."""
    acc = tl.zeros((1, BLOCK_N), tl.float32)
    for s in tl.static_range(K):
        weight = tl.load(heap_ptr(base, weights, WEIGHT_DTYPE) + s).to(tl.float32)
        if HELD:
            e = tl.load(heap_ptr(base, experts, tl.int64) + s)
            if (e >= first) & (e < first + held):
                acc += weight * load_block(heap_ptr(base, y, Y_DTYPE) + s * y_stride, y_stride, 1, cols, 1, BLOCK_N)
        else:
            acc += weight * load_block(heap_ptr(base, y, Y_DTYPE) + s * y_stride, y_stride, 1, cols, 1, BLOCK_N)
    store_block(heap_ptr(base, out, Y_DTYPE), cols, 1, cols, acc, 1, BLOCK_N)


def _moe_sum_reference(heap, task) -> None:
    acc = torch.zeros(1, task.cols)
    size = getattr(torch, task.Y_DTYPE).itemsize
    weights = heap.tensor(task.weights, task.WEIGHT_DTYPE, 1, task.K, task.K).float()
    ids = heap.tensor(task.experts, torch.int64, 1, task.K, task.K)[0] if task.HELD else None
    for s in range(task.K):
        if ids is None or task.first <= int(ids[s]) < task.first + task.held:
            acc = acc + weights[0, s] * heap.tensor(task.y + s * task.y_stride * size, task.Y_DTYPE, 1, task.cols,
                                                    task.cols).float()
    heap.tensor(task.out, task.Y_DTYPE, 1, task.cols, task.cols).copy_(acc)


def moe_sum(g, y, weights, after=None, experts=None, count: int | None = None):
    """``out[b] = sum_s weights[b, s] * y[b * slots + s]`` (``y [tokens * slots, n]``, ``weights [tokens,
    slots]``: a slot per expert of the router's top-k), in slot order: ``[tokens, n]`` in y's dtype.
    ``after``: the marker of the ``grouped_experts`` op that wrote y. ``experts`` (the router's, over
    ``count`` experts, under expert parallelism): only the slots of this rank's experts (``Held.balanced``),
    its part of the sum (``combine``)."""
    tokens, slots = weights.rows, weights.cols
    require_float(g, "moe_sum", y=y, weights=weights)
    g.require(y.ndim == 2 and y.rows == tokens * slots,
              f"moe_sum: y {y.shape} must have a row per slot of weights {weights.shape}")
    g.require(experts is None or experts.shape == weights.shape and experts.dtype == torch.int64,
              f"moe_sum: experts must be the router's, int64 shaped as weights {weights.shape}")
    held = None if experts is None else held_experts(g, "moe_sum", count, True)
    out = g.new_tensor((tokens, y.cols), y.dtype)
    tiling = Tiling(1, y.cols)
    marker = (after.region(0, after.rows, 0, after.cols),) if after is not None else ()
    opcode = g.opcode(MOE_SUM, K=slots, Y_DTYPE=y.dtype, WEIGHT_DTYPE=weights.dtype, HELD=held is not None,
                      BLOCK_N=tiling.block_n)
    for b in range(tokens):
        routing = ({"experts": 0, "first": 0, "held": 0} if held is None else
                   {"experts": experts.addr(b, 0), "first": held.first, "held": held.count})
        chosen = () if held is None else (experts.region(b, 1, 0, slots),)
        for _, _, c0, n in tiling:
            g.add_task(opcode, out=out.addr(b, c0), y=y.addr(b * slots, c0), weights=weights.addr(b, 0), **routing,
                       cols=n, y_stride=y.row_stride,
                       reads=(y.region(b * slots, slots, c0, n), weights.region(b, 1, 0, slots), *chosen, *marker),
                       writes=(out.region(b, 1, c0, n),), bytes=(slots + 1) * n * y.element_size, flops=2 * slots * n)
    return out


def moe_mlp(g, x, router, gate_up, down, k: int, normalize: bool, weight_dtype: torch.dtype, act: str = "silu_mul",
            passes=None, expert_parallel: bool = False):
    """A sparse MLP over ``x [tokens, hidden]``: ``router [E, hidden]``, ``gate_up [E * 2I, hidden]`` (each
    expert's gate rows, then its up rows), ``down [E * hidden, I]``; the k experts of largest router
    probability per token, their outputs weighted and summed. The rows are grouped by expert
    (``grouped_experts``: the activation in the gate/up tiles); ``passes`` (int64 [E])
    counts the experts' weight passes (``grouped_experts``). ``expert_parallel``: this rank's experts
    whole (``Held.balanced``; gate_up and down stack ``stacked`` of them): each rank sums its experts'
    slots and the parts are combined over the ranks (``combine``), so every rank returns the whole sum;
    without it, a share of every expert's columns and the caller sums the ranks' parts. Returns
    ``[tokens, hidden]``."""
    count = router.rows
    stacked = held_experts(g, "moe_mlp", count, expert_parallel).stacked
    g.require(gate_up.rows % (2 * stacked) == 0 and down.rows == stacked * x.cols,
              f"moe_mlp: gate_up {gate_up.shape} and down {down.shape} do not hold {stacked} experts of hidden {x.cols}")
    experts, weights = g.route(g.linear(x, router), k, normalize, weight_dtype)
    hidden, marker = grouped_experts(g, x, gate_up, experts, count, act=act, passes=passes,
                                     expert_parallel=expert_parallel)
    y, marker = grouped_experts(g, hidden, down, experts, count, after=marker, expert_parallel=expert_parallel)
    if not expert_parallel:
        return moe_sum(g, y, weights, after=marker)
    part = moe_sum(g, y, weights, after=marker, experts=experts, count=count)
    return combine(g, part, experts, count) if g.world_size > 1 else part


def _example(g):
    """Top-3 of 5 experts (expert intermediate 40, float32 weights renormalised) over two tokens, bf16: the
    grouped GEMV tiles, and the gate/up rows again a pass per slot (``expert_rows``); top-2 of the same
    experts over 20 tokens (the grouped ``tl.dot`` tiles, GeGLU); and a rank's part under expert
    parallelism (in a world of one: every expert; ``expert_parallel``'s example combines parts)."""
    x = g.input("moe.x", (2, 64), torch.bfloat16)
    router, gate_up = g.input("moe.router", (5, 64), torch.bfloat16), g.input("moe.gate_up", (5 * 80, 64), torch.bfloat16)
    down = g.input("moe.down", (5 * 64, 40), torch.bfloat16)
    x20 = g.input("moe.x20", (20, 64), torch.bfloat16)
    experts, weights = g.route(g.linear(x, router), 3, True)
    both = g.expert_rows(x, gate_up, experts, 5)
    y, marker = g.grouped_experts(g.silu_mul(both[:, :40], both[:, 40:]), down, experts, 5, expert_parallel=True)
    return (g.moe_mlp(x, router, gate_up, down, 3, True, torch.float32),
            both,
            g.moe_mlp(x20, router, gate_up, down, 2, False, torch.float32, act="gelu_tanh_mul"),
            g.moe_sum(y, weights, marker, experts, 5))


ROUTE = TaskType("route", route_tile, _route_reference, _example)
EXPERT_LINEAR = TaskType("expert_linear", expert_linear_tile, _expert_linear_reference, _example)
GROUPED_EXPERT = TaskType("grouped_expert", grouped_expert_tile, _grouped_expert_reference, _example)
MOE_SUM = TaskType("moe_sum", moe_sum_tile, _moe_sum_reference, _example)
TASK_TYPES = (ROUTE, EXPERT_LINEAR, GROUPED_EXPERT, MOE_SUM)
OPS = {"route": route, "expert_rows": expert_rows, "grouped_experts": grouped_experts, "moe_sum": moe_sum,
       "moe_mlp": moe_mlp}
