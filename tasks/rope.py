"""Rotary position embedding at a position held in a device scalar (Llama's rotate-half convention).

The same compiled graph serves every decode step: the position is read from the heap, not baked
into the tile, and the inverse frequencies are an input (so they match the model's exactly, whatever
its rope type computed them from; a type whose frequencies follow the sequence length rebinds them).
``SCALING`` multiplies cos and sin (the attention factor of YaRN and LongRoPE; 1 otherwise).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import heap_ptr
from ..errors import is_number
from .common import TaskType, position_runs, require_float, rounded


@triton.jit
def rope_tile(base,
              out, x,               # heap offsets of the first of ``rows`` rows of heads * HEAD_DIM elements
              out_stride, x_stride,  # row strides, in elements
              inv_freq,             # heap offset of HEAD_DIM / 2 float32 inverse frequencies
              pos,                  # heap offset of the first row's int64 position
              pos_step,             # bytes from one row's position to the next (0: one position for every row)
              rows, heads,          # rows of the tile (one on a GPU; ``Graph.few_tiles``: more), heads per row <= BLOCK_H
              DTYPE: tl.constexpr, HEAD_DIM: tl.constexpr, SCALING: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """``out = x * s cos(p f) + rotate_half(x) * s sin(p f)`` for every head of every row, p the row's
    position, f = inv_freq, s = SCALING."""
    half: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < half)
    frequencies = tl.load(heap_ptr(base, inv_freq, tl.float32) + d, mask=d < half, other=0.0)
    for r in range(0, rows):
        angle = tl.load(heap_ptr(base, pos + r * pos_step, tl.int64)).to(tl.float32) * frequencies
        cos, sin = tl.cos(angle), tl.sin(angle)
        if SCALING != 1.0:
            cos, sin = cos * SCALING, sin * SCALING
        x_ptr = heap_ptr(base, x, DTYPE) + r * x_stride + h * HEAD_DIM + d
        out_ptr = heap_ptr(base, out, DTYPE) + r * out_stride + h * HEAD_DIM + d
        x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr, rounded(x1 * cos - x2 * sin, DTYPE), mask=mask)
        tl.store(out_ptr + half, rounded(x2 * cos + x1 * sin, DTYPE), mask=mask)


def _reference(heap, task) -> None:
    """In few torch calls (a torch backend's tile costs its calls): both halves of every head times cos, then
    each half's rotated partner times sin added in place."""
    half, heads, rows = task.HEAD_DIM // 2, task.heads, task.rows
    x = heap.tensor(task.x, task.DTYPE, rows, heads * 2 * half, task.x_stride).float().view(rows, heads, 2, half)
    positions = (heap.tensor(task.pos, torch.int64, rows, 1, task.pos_step // 8) if task.pos_step
                 else heap.tensor(task.pos, torch.int64, 1, 1, 1))
    angle = positions.float() * heap.tensor(task.inv_freq, torch.float32, 1, half, half)  # [rows or 1, half]
    cos, sin = angle.cos()[:, None, None], angle.sin()                                  # [.., 1, 1, half], [.., half]
    if task.SCALING != 1.0:
        cos, sin = cos * task.SCALING, sin * task.SCALING
    out = heap.tensor(task.out, task.DTYPE, rows, heads * 2 * half, task.out_stride).view(rows, heads, 2, half)
    turned = torch.mul(x, cos, out=out) if out.dtype == torch.float32 else x * cos  # [rows, heads, 2, half]
    sin = sin[:, None]
    turned[:, :, 0].addcmul_(x[:, :, 1], sin, value=-1)  # x1 cos - x2 sin
    turned[:, :, 1].addcmul_(x[:, :, 0], sin)            # x2 cos + x1 sin
    if turned is not out:  # rounded once
        out.copy_(turned)


def rope(g, x, inv_freq, pos, head_dim: int, scaling: float = 1.0):
    """Rotate every ``head_dim`` head of each row of ``x`` [B, heads * head_dim] by position ``*pos``.

    ``inv_freq`` is float32 [head_dim / 2]; ``pos`` an int64 tensor of one element, or one per row
    (``common.position_runs``); ``scaling`` multiplies cos and sin. A tile per row (``Graph.few_tiles``:
    per worker's run of rows).
    """
    g.require(is_number(scaling) and 0 < scaling < float("inf"),
              f"rope: scaling must be a positive number, got {scaling!r}")
    g.require(head_dim % 2 == 0 and x.cols % head_dim == 0,
              f"rope: x has shape {x.shape}; its rows must be whole heads of even size {head_dim}")
    require_float(g, "rope", x=x)
    g.require(inv_freq.shape == (head_dim // 2,) and inv_freq.dtype == torch.float32,
              f"rope: inv_freq must be float32 of shape ({head_dim // 2},), got {inv_freq.shape} {inv_freq.dtype}")
    heads = x.cols // head_dim
    out = g.new_tensor(x.shape, x.dtype)
    opcode = g.opcode(ROPE, DTYPE=x.dtype, HEAD_DIM=head_dim, SCALING=float(scaling),
                      BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(head_dim // 2))
    src, dst = x.block(), out.block()
    for run in position_runs(g, "rope", pos, src.rows):
        g.add_task(opcode, out=dst.addr(run.row, 0), x=src.addr(run.row, 0), out_stride=dst.row_stride,
                   x_stride=src.row_stride, inv_freq=inv_freq.addr(0, 0), pos=run.pos, pos_step=run.pos_step,
                   rows=run.rows, heads=heads,
                   reads=(src.region(run.row, run.rows, 0, src.cols), inv_freq.region(0, 1, 0, head_dim // 2),
                          run.region),
                   writes=(dst.region(run.row, run.rows, 0, src.cols),),
                   bytes=2 * run.rows * x.cols * x.element_size, flops=6 * run.rows * x.cols)
    return out


def _example(g):
    x = g.input("rope.x", (2, 96), torch.bfloat16)
    inv_freq, pos = g.input("rope.inv_freq", (24,), torch.float32), g.input("rope.pos", (1,), torch.int64)
    return g.rope(x, inv_freq, pos, 48), g.rope(x, inv_freq, pos, 48, scaling=1.25)


ROPE = TaskType("rope", rope_tile, _reference, _example)
TASK_TYPES = (ROPE,)
OPS = {"rope": rope}
