"""Sums of equally shaped slices in a fixed order: split-K partials, all-reduce contributions.

Adding in slice order 0, 1, 2, ... on every rank and every run is what makes a reduction
deterministic: bitwise the same result whichever contribution arrived first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import heap_ptr
from .common import TaskType, Tiling, block_at, block_count, load_block, store_block


@triton.jit
def sum_slices_tile(base,
                    y, p,                  # heap offsets: the output tile, the tile in slice 0
                    rows, cols,            # the tile: rows x cols, blocks of BLOCK_M x BLOCK_N
                    y_stride, p_stride,    # row strides, in elements
                    slices, slice_bytes,   # slice s lies s * slice_bytes after slice 0
                    P_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    MANY_BLOCKS: tl.constexpr):
    """``y = sum_s p[s]`` over one tile, in slice order: one block, or with MANY_BLOCKS
    (``Tiling.many_blocks``) every block in turn."""
    if MANY_BLOCKS:
        for t in range(0, block_count(rows, cols, BLOCK_M, BLOCK_N)):
            r0, c0 = block_at(t, cols, BLOCK_M, BLOCK_N)
            _sum_block(base, y, p, r0, c0, rows, cols, y_stride, p_stride, slices, slice_bytes, P_DTYPE, Y_DTYPE,
                       BLOCK_M, BLOCK_N)
    else:
        _sum_block(base, y, p, 0, 0, rows, cols, y_stride, p_stride, slices, slice_bytes, P_DTYPE, Y_DTYPE, BLOCK_M,
                   BLOCK_N)


@triton.jit
def _sum_block(base, y, p, r0, c0, rows, cols, y_stride, p_stride, slices, slice_bytes, P_DTYPE: tl.constexpr,
               Y_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``sum_slices_tile``'s block at row ``r0``, column ``c0`` of the tile."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for s in range(0, slices):
        acc += load_block(heap_ptr(base, p + s * slice_bytes, P_DTYPE) + r0 * p_stride + c0, p_stride, rows - r0,
                          cols - c0, BLOCK_M, BLOCK_N)
    store_block(heap_ptr(base, y, Y_DTYPE) + r0 * y_stride + c0, y_stride, rows - r0, cols - c0, acc, BLOCK_M,
                BLOCK_N)


def _reference(heap, task) -> None:
    acc = 0.0
    for s in range(task.slices):
        acc = acc + heap.tensor(task.p + s * task.slice_bytes, task.P_DTYPE, task.rows, task.cols,
                                task.p_stride).float()
    heap.tensor(task.y, task.Y_DTYPE, task.rows, task.cols, task.y_stride).copy_(acc)


def sum_slices(g, y, p, slices: int, slice_rows: int) -> None:
    """Tiles that write ``y = sum_s p[s*slice_rows : s*slice_rows + y.rows]`` (``p`` a 2-D tensor)."""
    tiling = Tiling.of(g, y.rows, y.cols)
    opcode = g.opcode(SUM_SLICES, P_DTYPE=p.dtype, Y_DTYPE=y.dtype, BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n,
                      MANY_BLOCKS=tiling.many_blocks)
    slice_bytes = slice_rows * p.row_stride * p.element_size
    for r0, m, c0, n in tiling:
        g.add_task(opcode, y=y.addr(r0, c0), p=p.addr(r0, c0), rows=m, cols=n, y_stride=y.row_stride,
                   p_stride=p.row_stride, slices=slices, slice_bytes=slice_bytes,
                   reads=tuple(p.region(s * slice_rows + r0, m, c0, n) for s in range(slices)),
                   writes=(y.region(r0, m, c0, n),),
                   bytes=(slices * p.element_size + y.element_size) * m * n, flops=slices * m * n)


def _example(g):
    """A split-K linear: float32 partials summed into bfloat16."""
    x, w = g.input("sum_slices.x", (2, 96), torch.bfloat16), g.input("sum_slices.w", (40, 96), torch.bfloat16)
    return (g.linear(x, w, split_k=2),)


SUM_SLICES = TaskType("sum_slices", sum_slices_tile, _reference, _example)
TASK_TYPES = (SUM_SLICES,)
OPS = {}
