"""Elementwise ops over two tensors of one shape: ``add``, ``mul``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import HeapView, TaskType, load_block, next_power_of_2, store_block

BLOCK_ELEMENTS = 1024  # elements per tile; the tile is at most 8 rows high


@triton.jit
def binary_tile(base, args, OP: tl.constexpr, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``out = a OP b`` over one tile of ``rows x cols <= BLOCK_M x BLOCK_N``, computed in float32."""
    out, a, b = tl.load(args + 0), tl.load(args + 1), tl.load(args + 2)
    rows, cols = tl.load(args + 3), tl.load(args + 4)
    out_stride, a_stride, b_stride = tl.load(args + 5), tl.load(args + 6), tl.load(args + 7)
    x = load_block(base, a, a_stride, rows, cols, DTYPE, BLOCK_M, BLOCK_N)
    y = load_block(base, b, b_stride, rows, cols, DTYPE, BLOCK_M, BLOCK_N)
    if OP == "add":
        z = x + y
    elif OP == "mul":
        z = x * y
    else:  # "silu_mul": silu(x) * y, the gated activation of a SwiGLU MLP
        z = x / (1.0 + tl.exp(-x)) * y
    store_block(base, out, out_stride, rows, cols, z, DTYPE, BLOCK_M, BLOCK_N)


BINARY_ARGS = ("out", "a", "b", "rows", "cols", "out_stride", "a_stride", "b_stride")


def _binary_reference(heap: HeapView, args: dict[str, int], consts: dict) -> None:
    dtype = consts["DTYPE"]
    rows, cols = args["rows"], args["cols"]
    x = heap.tensor(args["a"], dtype, rows, cols, args["a_stride"]).float()
    y = heap.tensor(args["b"], dtype, rows, cols, args["b_stride"]).float()
    op = consts["OP"]
    z = x + y if op == "add" else x * y if op == "mul" else x * torch.sigmoid(x) * y
    heap.tensor(args["out"], dtype, rows, cols, args["out_stride"]).copy_(z)


BINARY = TaskType("binary", binary_tile, BINARY_ARGS, _binary_reference)


def binary(g, op: str, a, b):
    """Split ``a OP b`` (same shape and dtype) into tiles of at most BLOCK_ELEMENTS elements."""
    g.check(a.shape == b.shape, f"{op}: shapes differ: a {a.shape}, b {b.shape}")
    g.check(a.dtype == b.dtype, f"{op}: dtypes differ: a {a.dtype}, b {b.dtype}")
    out = g.new_tensor(a.shape, a.dtype)
    rows, cols = out.rows, out.cols
    block_m = min(next_power_of_2(rows), 8)
    block_n = min(next_power_of_2(cols), BLOCK_ELEMENTS // block_m)
    opcode = g.opcode(BINARY, OP=op, DTYPE=a.dtype, BLOCK_M=block_m, BLOCK_N=block_n)
    size = a.element_size
    for r0 in range(0, rows, block_m):
        m = min(block_m, rows - r0)
        for c0 in range(0, cols, block_n):
            n = min(block_n, cols - c0)
            g.add_task(opcode,
                       (out.addr(r0, c0), a.addr(r0, c0), b.addr(r0, c0), m, n,
                        out.row_stride, a.row_stride, b.row_stride),
                       reads=(a.region(r0, m, c0, n), b.region(r0, m, c0, n)),
                       writes=(out.region(r0, m, c0, n),),
                       bytes=3 * m * n * size, flops=m * n)
    return out


def add(g, a, b):
    """Elementwise ``a + b``."""
    return binary(g, "add", a, b)


def mul(g, a, b):
    """Elementwise ``a * b``."""
    return binary(g, "mul", a, b)


TASK_TYPES = (BINARY,)
OPS = {"add": add, "mul": mul}
