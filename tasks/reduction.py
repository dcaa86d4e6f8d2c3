"""Sums of equally shaped slices in a fixed order: split-K partials, all-reduce contributions.

Adding in slice order 0, 1, 2, ... on every rank and every run is what makes a reduction
deterministic: bitwise the same result whichever contribution arrived first.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .common import HeapView, TaskType, load_block, next_power_of_2, store_block

BLOCK_ELEMENTS = 1024  # elements per tile; the tile is at most 8 rows high


@triton.jit
def sum_slices_tile(base, args, P_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """``y = sum_s p[s]`` over one ``rows x cols`` block; slice s lies ``s * slice_bytes`` after slice 0."""
    y, p = tl.load(args + 0), tl.load(args + 1)
    rows, cols = tl.load(args + 2), tl.load(args + 3)
    y_stride, p_stride = tl.load(args + 4), tl.load(args + 5)
    slices, slice_bytes = tl.load(args + 6), tl.load(args + 7)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for s in range(0, slices):
        acc += load_block(base, p + s * slice_bytes, p_stride, rows, cols, P_DTYPE, BLOCK_M, BLOCK_N)
    store_block(base, y, y_stride, rows, cols, acc, Y_DTYPE, BLOCK_M, BLOCK_N)


ARGS = ("y", "p", "rows", "cols", "y_stride", "p_stride", "slices", "slice_bytes")


def _reference(heap: HeapView, args: dict[str, int], consts: dict) -> None:
    rows, cols = args["rows"], args["cols"]
    acc = 0.0
    for s in range(args["slices"]):
        acc = acc + heap.tensor(args["p"] + s * args["slice_bytes"], consts["P_DTYPE"], rows, cols,
                                args["p_stride"]).float()
    heap.tensor(args["y"], consts["Y_DTYPE"], rows, cols, args["y_stride"]).copy_(acc)


SUM_SLICES = TaskType("sum_slices", sum_slices_tile, ARGS, _reference)


def sum_slices(g, y, p, slices: int, slice_rows: int) -> None:
    """Tiles that write ``y = sum_s p[s*slice_rows : s*slice_rows + y.rows]`` (``p`` a 2-D tensor)."""
    rows, cols = y.rows, y.cols
    block_m = min(next_power_of_2(rows), 8)
    block_n = min(next_power_of_2(cols), BLOCK_ELEMENTS // block_m)
    opcode = g.opcode(SUM_SLICES, P_DTYPE=p.dtype, Y_DTYPE=y.dtype, BLOCK_M=block_m, BLOCK_N=block_n)
    slice_bytes = slice_rows * p.row_stride * p.element_size
    for r0 in range(0, rows, block_m):
        m = min(block_m, rows - r0)
        for c0 in range(0, cols, block_n):
            n = min(block_n, cols - c0)
            g.add_task(opcode, (y.addr(r0, c0), p.addr(r0, c0), m, n, y.row_stride, p.row_stride, slices,
                                slice_bytes),
                       reads=tuple(p.region(s * slice_rows + r0, m, c0, n) for s in range(slices)),
                       writes=(y.region(r0, m, c0, n),),
                       bytes=(slices * p.element_size + y.element_size) * m * n, flops=slices * m * n)


TASK_TYPES = (SUM_SLICES,)
OPS = {}
