"""Decode attention over a KV cache, grouped-query, flash-decoding style.

The cache of one layer is two buffers ``[batch * max_seq, kv_heads * head_dim]``; batch row b's
position p is cache row ``b * max_seq + p``. The current position is a device scalar, so one
compiled graph serves every step: ``kv_append`` writes row ``pos`` and the attention tiles read
rows ``0 ..= pos``. Their declared regions cover the whole cache of the batch row, which is what
they may touch.

Attention is split along the sequence: a partial tile per (batch row, KV head, split) computes, for
the query heads of its group, the running max ``m``, the sum of exponentials ``l`` and the
unnormalised output over its positions (an online softmax, numerically stable); a combine tile per
(batch row, KV head) rescales the partials by ``exp(m_s - max m)`` and normalises.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..device import heap_ptr
from .common import HeapView, TaskType, copy_row, next_power_of_2, rounded

SPLIT = 64       # positions per partial tile
BLOCK_S = 16     # positions per inner step


@triton.jit
def kv_append_tile(base, args, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Copy one row of ``cols`` elements into cache row ``first_row + *pos``."""
    cache, x, pos = tl.load(args + 0), tl.load(args + 1), tl.load(args + 2)
    cols, cache_stride = tl.load(args + 3), tl.load(args + 4)
    row = tl.load(heap_ptr(base, pos, tl.int64))
    copy_row(base, cache + row * cache_stride * DTYPE.primitive_bitwidth // 8, x, cols, DTYPE, BLOCK_N)


APPEND_ARGS = ("cache", "x", "pos", "cols", "cache_stride")


def _append_reference(heap: HeapView, args: dict[str, int], consts: dict) -> None:
    row = int(heap.tensor(args["pos"], torch.int64, 1, 1, 1))
    x = heap.tensor(args["x"], consts["DTYPE"], 1, args["cols"], args["cols"])
    stride = args["cache_stride"]
    heap.tensor(args["cache"] + row * stride * x.element_size(), consts["DTYPE"], 1, args["cols"], stride).copy_(x)


@triton.jit
def attention_partial_tile(base, args, DTYPE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                           SCALE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_S: tl.constexpr):
    """Online softmax of ``GROUP`` query heads against cache positions [start, min(start + length, pos + 1))."""
    o, ml, q = tl.load(args + 0), tl.load(args + 1), tl.load(args + 2)
    k, v, pos = tl.load(args + 3), tl.load(args + 4), tl.load(args + 5)
    start, length, cache_stride = tl.load(args + 6), tl.load(args + 7), tl.load(args + 8)
    end = tl.minimum(start + length, tl.load(heap_ptr(base, pos, tl.int64)) + 1)
    g = tl.arange(0, BLOCK_G)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    j = tl.arange(0, BLOCK_S)
    qv = tl.load(heap_ptr(base, q, DTYPE) + g * HEAD_DIM + d, mask=(g < GROUP) & (d < HEAD_DIM), other=0.0)
    qv = qv.to(tl.float32) * SCALE
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for s0 in range(start, end, BLOCK_S):
        valid = s0 + j < end
        rows = (s0 + j)[:, None] * cache_stride + d
        kv = tl.load(heap_ptr(base, k, DTYPE) + rows, mask=valid[:, None] & (d < HEAD_DIM), other=0.0).to(tl.float32)
        vv = tl.load(heap_ptr(base, v, DTYPE) + rows, mask=valid[:, None] & (d < HEAD_DIM), other=0.0).to(tl.float32)
        scores = tl.sum(qv[:, None, :] * kv[None, :, :], axis=2)                   # [G, S]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vv[None, :, :], axis=1)
        m = m_new
    gg = tl.arange(0, BLOCK_G)
    tl.store(heap_ptr(base, o, tl.float32) + g * HEAD_DIM + d, acc, mask=(g < GROUP) & (d < HEAD_DIM))
    tl.store(heap_ptr(base, ml, tl.float32) + gg, m, mask=gg < GROUP)
    tl.store(heap_ptr(base, ml, tl.float32) + GROUP + gg, l, mask=gg < GROUP)


PARTIAL_ARGS = ("o", "ml", "q", "k", "v", "pos", "start", "length", "cache_stride")


def _partial_reference(heap: HeapView, args: dict[str, int], consts: dict) -> None:
    group, hd, dtype = consts["GROUP"], consts["HEAD_DIM"], consts["DTYPE"]
    stride = args["cache_stride"]
    end = min(args["start"] + args["length"], int(heap.tensor(args["pos"], torch.int64, 1, 1, 1)) + 1)
    q = heap.tensor(args["q"], dtype, group, hd, hd).float() * consts["SCALE"]
    o = heap.tensor(args["o"], torch.float32, group, hd, hd)
    ml = heap.tensor(args["ml"], torch.float32, 2, group, group)
    if end <= args["start"]:
        o.zero_()
        ml[0].fill_(float("-inf"))
        ml[1].zero_()
        return
    size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    k = heap.tensor(args["k"] + args["start"] * stride * size, dtype, end - args["start"], hd, stride).float()
    v = heap.tensor(args["v"] + args["start"] * stride * size, dtype, end - args["start"], hd, stride).float()
    scores = q @ k.T
    m = scores.max(-1).values
    p = (scores - m[:, None]).exp()
    o.copy_(p @ v)
    ml[0].copy_(m)
    ml[1].copy_(p.sum(-1))


@triton.jit
def attention_combine_tile(base, args, DTYPE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """``out = sum_s exp(m_s - M) o_s / sum_s exp(m_s - M) l_s`` over ``splits`` partials, M = max_s m_s."""
    out, o, ml, splits = tl.load(args + 0), tl.load(args + 1), tl.load(args + 2), tl.load(args + 3)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)[None, :]
    mask_g = g < GROUP
    ml_ptr = heap_ptr(base, ml, tl.float32)
    top = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    for s in range(0, splits):
        top = tl.maximum(top, tl.load(ml_ptr + s * 2 * GROUP + g, mask=mask_g, other=float("-inf")))
    top = tl.where(mask_g, top, 0.0)
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    mask = mask_g[:, None] & (d < HEAD_DIM)
    for s in range(0, splits):
        weight = tl.exp(tl.load(ml_ptr + s * 2 * GROUP + g, mask=mask_g, other=float("-inf")) - top)
        total += weight * tl.load(ml_ptr + s * 2 * GROUP + GROUP + g, mask=mask_g, other=0.0)
        part = tl.load(heap_ptr(base, o, tl.float32) + s * GROUP * HEAD_DIM + g[:, None] * HEAD_DIM + d, mask=mask,
                       other=0.0)
        acc += weight[:, None] * part
    result = acc / tl.where(mask_g, total, 1.0)[:, None]
    tl.store(heap_ptr(base, out, DTYPE) + g[:, None] * HEAD_DIM + d, rounded(result, DTYPE), mask=mask)


COMBINE_ARGS = ("out", "o", "ml", "splits")


def _combine_reference(heap: HeapView, args: dict[str, int], consts: dict) -> None:
    group, hd, splits = consts["GROUP"], consts["HEAD_DIM"], args["splits"]
    o = heap.tensor(args["o"], torch.float32, splits * group, hd, hd).reshape(splits, group, hd)
    ml = heap.tensor(args["ml"], torch.float32, splits * 2, group, group).reshape(splits, 2, group)
    weight = (ml[:, 0] - ml[:, 0].max(0).values).exp()                       # [splits, group]
    result = (weight[:, :, None] * o).sum(0) / (weight * ml[:, 1]).sum(0)[:, None]
    heap.tensor(args["out"], consts["DTYPE"], group, hd, hd).copy_(result)


KV_APPEND = TaskType("kv_append", kv_append_tile, APPEND_ARGS, _append_reference)
PARTIAL = TaskType("attention_partial", attention_partial_tile, PARTIAL_ARGS, _partial_reference)
COMBINE = TaskType("attention_combine", attention_combine_tile, COMBINE_ARGS, _combine_reference)


def kv_append(g, cache, x, pos, batch: int):
    """Write row b of ``x`` [batch, cols] at cache row ``b * max_seq + *pos``; returns ``cache``."""
    g.check(cache.ndim == 2 and x.ndim == 2 and x.rows == batch and cache.rows % batch == 0 and cache.cols == x.cols
            and cache.dtype == x.dtype,
            f"kv_append: cache {cache.shape} {cache.dtype} and x {x.shape} {x.dtype} do not match for batch {batch}")
    max_seq = cache.rows // batch
    opcode = g.opcode(KV_APPEND, DTYPE=x.dtype, BLOCK_N=min(next_power_of_2(x.cols), 1024))
    for b in range(batch):
        g.add_task(opcode, (cache.addr(b * max_seq, 0), x.addr(b, 0), pos.addr(0, 0), x.cols, cache.row_stride),
                   reads=(x.region(b, 1, 0, x.cols), pos.region(0, 1, 0, 1)),
                   writes=(cache.region(b * max_seq, max_seq, 0, cache.cols),),
                   bytes=2 * x.cols * x.element_size, flops=0)
    return cache


def decode_attention(g, q, k_cache, v_cache, pos, batch: int, head_dim: int):
    """Attention of ``q`` [batch, heads * head_dim] over cache rows 0 ..= ``*pos`` of every batch row.

    The caches hold ``kv_heads`` heads; each KV head serves ``heads / kv_heads`` query heads.
    """
    heads, kv_heads = q.cols // head_dim, k_cache.cols // head_dim
    g.check(q.cols % head_dim == 0 and k_cache.cols % head_dim == 0 and heads % kv_heads == 0,
            f"decode_attention: q {q.shape} and cache {k_cache.shape} are not whole heads of {head_dim} "
            f"with query heads a multiple of KV heads")
    g.check(k_cache.shape == v_cache.shape and k_cache.rows % batch == 0 and q.rows == batch,
            f"decode_attention: caches {k_cache.shape}, {v_cache.shape} and q {q.shape} for batch {batch}")
    group = heads // kv_heads
    max_seq = k_cache.rows // batch
    splits = -(-max_seq // SPLIT)
    partial_o = g.new_tensor((batch * kv_heads * splits * group, head_dim), torch.float32)
    partial_ml = g.new_tensor((batch * kv_heads * splits * 2, group), torch.float32)
    out = g.new_tensor(q.shape, q.dtype)
    shape = dict(DTYPE=q.dtype, GROUP=group, HEAD_DIM=head_dim, BLOCK_G=next_power_of_2(group),
                 BLOCK_D=next_power_of_2(head_dim))
    partial = g.opcode(PARTIAL, **shape, SCALE=1.0 / math.sqrt(head_dim), BLOCK_S=BLOCK_S)
    for b in range(batch):
        for h in range(kv_heads):
            q_rows = q.region(b, 1, h * group * head_dim, group * head_dim)
            for s in range(splits):
                slot = (b * kv_heads + h) * splits + s
                cols = h * head_dim
                g.add_task(partial, (partial_o.addr(slot * group, 0), partial_ml.addr(slot * 2, 0),
                                     q.addr(b, h * group * head_dim), k_cache.addr(b * max_seq, cols),
                                     v_cache.addr(b * max_seq, cols), pos.addr(0, 0), s * SPLIT, SPLIT,
                                     k_cache.row_stride),
                           reads=(q_rows, pos.region(0, 1, 0, 1), k_cache.region(b * max_seq, max_seq, cols, head_dim),
                                  v_cache.region(b * max_seq, max_seq, cols, head_dim)),
                           writes=(partial_o.region(slot * group, group, 0, head_dim),
                                   partial_ml.region(slot * 2, 2, 0, group)),
                           bytes=2 * min(SPLIT, max_seq) * head_dim * q.element_size,
                           flops=4 * group * min(SPLIT, max_seq) * head_dim)
    g.phase("decode_attention.combine")
    combine = g.opcode(COMBINE, **shape)
    for b in range(batch):
        for h in range(kv_heads):
            slot = (b * kv_heads + h) * splits
            g.add_task(combine, (out.addr(b, h * group * head_dim), partial_o.addr(slot * group, 0),
                                 partial_ml.addr(slot * 2, 0), splits),
                       reads=(partial_o.region(slot * group, splits * group, 0, head_dim),
                              partial_ml.region(slot * 2, splits * 2, 0, group)),
                       writes=(out.region(b, 1, h * group * head_dim, group * head_dim),),
                       bytes=splits * group * (head_dim + 2) * 4, flops=2 * splits * group * head_dim)
    return out


TASK_TYPES = (KV_APPEND, PARTIAL, COMBINE)
OPS = {"kv_append": kv_append, "decode_attention": decode_attention}
