"""Mixture-of-experts on the device: the router's top-k, expert GEMVs addressed by it, the weighted sum.

The choice of experts is known only mid-step, on the device, so the task graph is fixed when it is
built and only addresses depend on the router: per token, ``route`` writes the top-k experts and
their weights to the heap; for each (token, slot) the ``expert_linear`` tiles read the expert's index
there and stream that expert's slice of a stacked weight ``[experts * n, K]`` (at batch 1 only k of
the experts are read at all); ``moe_sum`` adds the k slot outputs, weighted, in slot order (bitwise
independent of which tile finished first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import checked_index, heap_ptr
from ..errors import is_count
from . import quantized
from .common import (TaskType, Tiling, heap_index, load_block, require_float, rounded, routed_rows, store_block,
                     vector_aligned)
from .linear import gemv_blocks, gemv_one_row, plan


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
    gemv_one_row(base, y, x, w + e * expert_bytes, n, k, w_stride, X_DTYPE, W_DTYPE, Y_DTYPE, BLOCK_N, BLOCK_K,
                 EVEN_K, ALIGNED)


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
    if isinstance(w, quantized.Quantized):
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


@triton.jit
def moe_sum_tile(base,
                 out, y, weights,   # heap offsets: the token's output tile, its slot 0 tile, its k weights
                 cols,              # the tile's columns
                 y_stride,          # y's row stride, in elements
                 K: tl.constexpr, Y_DTYPE: tl.constexpr, WEIGHT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out = sum_s weights[s] * y[s]`` over the token's K slot rows, in slot order, in float32."""
    acc = tl.zeros((1, BLOCK_N), tl.float32)
    for s in tl.static_range(K):
        weight = tl.load(heap_ptr(base, weights, WEIGHT_DTYPE) + s).to(tl.float32)
        acc += weight * load_block(heap_ptr(base, y, Y_DTYPE) + s * y_stride, y_stride, 1, cols, 1, BLOCK_N)
    store_block(heap_ptr(base, out, Y_DTYPE), cols, 1, cols, acc, 1, BLOCK_N)


def _moe_sum_reference(heap, task) -> None:
    acc = 0.0
    size = getattr(torch, task.Y_DTYPE).itemsize
    weights = heap.tensor(task.weights, task.WEIGHT_DTYPE, 1, task.K, task.K).float()
    for s in range(task.K):
        acc = acc + weights[0, s] * heap.tensor(task.y + s * task.y_stride * size, task.Y_DTYPE, 1, task.cols,
                                                task.cols).float()
    heap.tensor(task.out, task.Y_DTYPE, 1, task.cols, task.cols).copy_(acc)


def moe_sum(g, y, weights):
    """``out[b] = sum_s weights[b, s] * y[b * slots + s]`` (``y [tokens * slots, n]``, ``weights [tokens,
    slots]``: a slot per expert of the router's top-k), in slot order: ``[tokens, n]`` in y's dtype."""
    tokens, slots = weights.rows, weights.cols
    require_float(g, "moe_sum", y=y, weights=weights)
    g.require(y.ndim == 2 and y.rows == tokens * slots,
              f"moe_sum: y {y.shape} must have a row per slot of weights {weights.shape}")
    out = g.new_tensor((tokens, y.cols), y.dtype)
    tiling = Tiling(1, y.cols)
    opcode = g.opcode(MOE_SUM, K=slots, Y_DTYPE=y.dtype, WEIGHT_DTYPE=weights.dtype, BLOCK_N=tiling.block_n)
    for b in range(tokens):
        for _, _, c0, n in tiling:
            g.add_task(opcode, out=out.addr(b, c0), y=y.addr(b * slots, c0), weights=weights.addr(b, 0), cols=n,
                       y_stride=y.row_stride, reads=(y.region(b * slots, slots, c0, n), weights.region(b, 1, 0, slots)),
                       writes=(out.region(b, 1, c0, n),), bytes=(slots + 1) * n * y.element_size, flops=2 * slots * n)
    return out


def moe_mlp(g, x, router, gate_up, down, k: int, normalize: bool, weight_dtype: torch.dtype, act: str = "silu_mul"):
    """A sparse MLP over ``x [tokens, hidden]``: ``router [E, hidden]``, ``gate_up [E * 2I, hidden]`` (each
    expert's gate rows, then its up rows), ``down [E * hidden, I]``; the k experts of largest router
    probability per token, their outputs weighted and summed. Returns ``[tokens, hidden]``."""
    count = router.rows
    g.require(gate_up.rows % (2 * count) == 0 and down.rows == count * x.cols,
              f"moe_mlp: gate_up {gate_up.shape} and down {down.shape} do not hold {count} experts of hidden {x.cols}")
    experts, weights = g.route(g.linear(x, router), k, normalize, weight_dtype)
    inter = gate_up.rows // (2 * count)
    both = g.expert_rows(x, gate_up, experts, count)
    hidden = getattr(g, act)(both[:, :inter], both[:, inter:])
    return g.moe_sum(g.expert_rows(hidden, down, experts, count), weights)


def _example(g):
    """Top-3 of 5 experts (expert intermediate 40, float32 weights renormalised) over two tokens, bf16."""
    x = g.input("moe.x", (2, 64), torch.bfloat16)
    return (g.moe_mlp(x, g.input("moe.router", (5, 64), torch.bfloat16), g.input("moe.gate_up", (5 * 80, 64), torch.bfloat16),
                      g.input("moe.down", (5 * 64, 40), torch.bfloat16), 3, True, torch.float32),)


ROUTE = TaskType("route", route_tile, _route_reference, _example)
EXPERT_LINEAR = TaskType("expert_linear", expert_linear_tile, _expert_linear_reference, _example)
MOE_SUM = TaskType("moe_sum", moe_sum_tile, _moe_sum_reference, _example)
TASK_TYPES = (ROUTE, EXPERT_LINEAR, MOE_SUM)
OPS = {"route": route, "expert_rows": expert_rows, "moe_sum": moe_sum, "moe_mlp": moe_mlp}
