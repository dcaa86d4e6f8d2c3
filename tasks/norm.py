"""RMSNorm: ``y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` (Llama's), or with ``unit_offset``
``y = ((1 + w) * x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` (Gemma's: one rounding), over each row or each head.

With ``head_dim`` set, every ``head_dim`` segment of a row is normalised on its own with one shared
weight (Qwen3's q/k norm); the tile then walks *segments*: segment i is row i // segments, columns
(i % segments) * head_dim onwards.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import heap_ptr
from ..errors import is_number
from .common import TaskType, ceil_div, require_float, rounded

ROWS_PER_TILE = 4
MAX_BLOCK_N = 1024


@triton.jit
def rms_norm_tile(base,
                  out, x, w,              # heap offsets: output and input rows, the weight
                  rows, cols,             # rows <= BLOCK_M segments of cols elements each
                  out_stride, x_stride,   # row strides, in elements
                  segments,               # segments per row (head_dim norms), else 1
                  EPS: tl.constexpr, UNIT_OFFSET: tl.constexpr, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Normalise each segment, BLOCK_N columns at a time (two passes)."""
    segments = segments.to(tl.int32)  # a divisor (common.py)
    r = tl.arange(0, BLOCK_M)[:, None]
    c = tl.arange(0, BLOCK_N)[None, :]
    x_ptr = heap_ptr(base, x, X_DTYPE) + (r // segments) * x_stride + (r % segments) * cols
    out_ptr = heap_ptr(base, out, X_DTYPE) + (r // segments) * out_stride + (r % segments) * cols
    w_ptr = heap_ptr(base, w, W_DTYPE)
    squares = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for c0 in range(0, cols, BLOCK_N):
        mask = (r < rows) & (c0 + c < cols)
        v = tl.load(x_ptr + c0 + c, mask=mask, other=0.0).to(tl.float32)
        squares += v * v
    scale = tl.rsqrt(tl.sum(squares, axis=1) / cols.to(tl.float32) + EPS)[:, None]
    for c0 in range(0, cols, BLOCK_N):
        mask = (r < rows) & (c0 + c < cols)
        v = tl.load(x_ptr + c0 + c, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(w_ptr + c0 + c, mask=c0 + c < cols, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            tl.store(out_ptr + c0 + c, rounded((1.0 + g) * (v * scale), X_DTYPE), mask=mask)
        else:
            normed = rounded(v * scale, X_DTYPE).to(tl.float32)
            tl.store(out_ptr + c0 + c, rounded(g * normed, X_DTYPE), mask=mask)


def _reference(heap, task) -> None:
    rows, cols, segments = task.rows, task.cols, task.segments
    x = heap.tensor(task.x, task.X_DTYPE, rows // segments, cols * segments, task.x_stride)
    w = heap.tensor(task.w, task.W_DTYPE, 1, cols, cols)
    out = heap.tensor(task.out, task.X_DTYPE, rows // segments, cols * segments, task.out_stride)
    if segments == 1 and not task.UNIT_OFFSET:
        # whole rows, the common case, in two torch calls (a torch backend's tile costs its calls): torch's
        # RMSNorm computes in float32 and rounds ``normed`` once to x's dtype, as the tile (and transformers)
        # do; then w * normed, rounded once
        torch.mul(torch.rms_norm(x, (cols,), eps=task.EPS), w, out=out)
        return
    normed = torch.rms_norm(x.float().reshape(rows, cols), (cols,), eps=task.EPS)  # v * rsqrt(mean(v^2) + eps)
    w = w.float()
    if task.UNIT_OFFSET:
        out.copy_(((1 + w) * normed).reshape(out.shape))
    else:
        out.copy_((w * (normed if x.dtype == torch.float32 else normed.to(x.dtype).float())).reshape(out.shape))


def rms_norm(g, x, weight, eps: float = 1e-6, head_dim: int | None = None, unit_offset: bool = False):
    """RMSNorm of each row of ``x`` [M, N] with ``weight`` [N], or of each ``head_dim`` segment with
    ``weight`` [head_dim]; the output has x's dtype. ``unit_offset``: scale by ``1 + weight`` (Gemma)."""
    g.require(x.ndim in (1, 2), f"rms_norm: x must be 1-D or 2-D, got shape {x.shape}")
    size = x.cols if head_dim is None else head_dim
    g.require(weight.ndim == 1 and weight.shape[0] == size and x.cols % size == 0,
              f"rms_norm: weight has shape {weight.shape}, x has shape {x.shape}; expected weight ({size},)")
    g.require(is_number(eps) and 0 < eps < float("inf"),
              f"rms_norm: eps must be a positive number, got {eps!r}")
    require_float(g, "rms_norm", x=x, weight=weight)
    out = g.new_tensor(x.shape, x.dtype)
    segments = x.cols // size
    rows_per_tile = (ceil_div(x.rows, g.parallelism) if g.few_tiles  # a tile holds whole rows
                     else min(x.rows, max(1, ROWS_PER_TILE // segments)))
    block_m = triton.next_power_of_2(rows_per_tile * segments)
    block_n = min(triton.next_power_of_2(size), MAX_BLOCK_N)
    opcode = g.opcode(RMS_NORM, EPS=float(eps), UNIT_OFFSET=bool(unit_offset), X_DTYPE=x.dtype, W_DTYPE=weight.dtype, BLOCK_M=block_m,
                      BLOCK_N=block_n)
    src, dst = x.block(), out.block()
    for r0 in range(0, x.rows, rows_per_tile):
        m = min(rows_per_tile, x.rows - r0)
        g.add_task(opcode, out=dst.addr(r0, 0), x=src.addr(r0, 0), w=weight.addr(0, 0), rows=m * segments, cols=size,
                   out_stride=dst.row_stride, x_stride=src.row_stride, segments=segments,
                   reads=(src.region(r0, m, 0, x.cols), weight.region(0, 1, 0, size)),
                   writes=(dst.region(r0, m, 0, x.cols),),
                   bytes=3 * m * x.cols * x.element_size, flops=4 * m * x.cols)
    return out


def _example(g):
    """Whole rows (bfloat16 x, float32 weight) and per-head segments (Qwen3's q/k norm)."""
    x = g.input("rms_norm.x", (2, 96), torch.bfloat16)
    return (g.rms_norm(x, g.input("rms_norm.w", (96,), torch.float32), 1e-6),
            g.rms_norm(x, g.input("rms_norm.head_w", (48,), torch.bfloat16), 1e-6, head_dim=48),
            g.rms_norm(x, g.input("rms_norm.gemma_w", (96,), torch.bfloat16), 1e-6, unit_offset=True))


RMS_NORM = TaskType("rms_norm", rms_norm_tile, _reference, _example)
TASK_TYPES = (RMS_NORM,)
OPS = {"rms_norm": rms_norm}
