"""Rotary position embedding at a position held in a device scalar (Llama's rotate-half convention).

The same compiled graph serves every decode step: the position is read from the heap, not baked
into the tile, and the inverse frequencies are an input (so they match the model's exactly).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import heap_ptr
from .common import HeapView, TaskType, next_power_of_2, rounded


@triton.jit
def rope_tile(base, args, DTYPE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_D: tl.constexpr):
    """One row of ``heads`` heads: ``out = x * cos(p f) + rotate_half(x) * sin(p f)``, p = *pos, f = inv_freq."""
    out, x, inv_freq, pos = tl.load(args + 0), tl.load(args + 1), tl.load(args + 2), tl.load(args + 3)
    heads = tl.load(args + 4)
    half: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < half)
    position = tl.load(heap_ptr(base, pos, tl.int64)).to(tl.float32)
    angle = position * tl.load(heap_ptr(base, inv_freq, tl.float32) + d, mask=d < half, other=0.0)
    cos, sin = tl.cos(angle), tl.sin(angle)
    x_ptr = heap_ptr(base, x, DTYPE) + h * HEAD_DIM + d
    out_ptr = heap_ptr(base, out, DTYPE) + h * HEAD_DIM + d
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr, rounded(x1 * cos - x2 * sin, DTYPE), mask=mask)
    tl.store(out_ptr + half, rounded(x2 * cos + x1 * sin, DTYPE), mask=mask)


ARGS = ("out", "x", "inv_freq", "pos", "heads")


def _reference(heap: HeapView, args: dict[str, int], consts: dict) -> None:
    hd = consts["HEAD_DIM"]
    heads = args["heads"]
    x = heap.tensor(args["x"], consts["DTYPE"], heads, hd, hd).float()
    inv_freq = heap.tensor(args["inv_freq"], torch.float32, 1, hd // 2, hd // 2)
    position = heap.tensor(args["pos"], torch.int64, 1, 1, 1).float()
    angle = position * inv_freq
    cos, sin = torch.cat([angle.cos(), angle.cos()], -1), torch.cat([angle.sin(), angle.sin()], -1)
    rotated = torch.cat([-x[:, hd // 2:], x[:, : hd // 2]], -1)
    heap.tensor(args["out"], consts["DTYPE"], heads, hd, hd).copy_(x * cos + rotated * sin)


ROPE = TaskType("rope", rope_tile, ARGS, _reference)


def rope(g, x, inv_freq, pos, head_dim: int):
    """Rotate every ``head_dim`` head of each row of ``x`` [B, heads * head_dim] by position ``*pos``.

    ``inv_freq`` is float32 [head_dim / 2]; ``pos`` an int64 tensor of one element.
    """
    g.check(head_dim % 2 == 0 and x.cols % head_dim == 0,
            f"rope: x has shape {x.shape}; its rows must be whole heads of even size {head_dim}")
    g.check(inv_freq.shape == (head_dim // 2,) and inv_freq.dtype == torch.float32,
            f"rope: inv_freq must be float32 of shape ({head_dim // 2},), got {inv_freq.shape} {inv_freq.dtype}")
    g.check(pos.shape in ((1,), (1, 1)) and pos.dtype == torch.int64,
            f"rope: pos must be one int64 element, got {pos.shape} {pos.dtype}")
    heads = x.cols // head_dim
    out = g.new_tensor(x.shape, x.dtype)
    opcode = g.opcode(ROPE, DTYPE=x.dtype, HEAD_DIM=head_dim, BLOCK_H=next_power_of_2(heads),
                      BLOCK_D=next_power_of_2(head_dim // 2))
    rows = x.block()
    for r in range(rows.rows):
        g.add_task(opcode, (out.block().addr(r, 0), rows.addr(r, 0), inv_freq.addr(0, 0), pos.addr(0, 0), heads),
                   reads=(rows.region(r, 1, 0, rows.cols), inv_freq.region(0, 1, 0, head_dim // 2),
                          pos.region(0, 1, 0, 1)),
                   writes=(out.block().region(r, 1, 0, rows.cols),),
                   bytes=2 * x.cols * x.element_size, flops=6 * x.cols)
    return out


TASK_TYPES = (ROPE,)
OPS = {"rope": rope}
