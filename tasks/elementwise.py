"""Elementwise ops over two tensors of one shape: ``add``, ``mul`` (and ``silu_mul``, ``gelu_tanh_mul``, in
activation)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import heap_ptr
from .common import TaskType, Tiling, block_at, block_count, load_block, require_float, store_block


@triton.jit
def binary_tile(base,
                out, a, b,                        # heap offsets of the tiles' first elements
                rows, cols,                       # the tile: rows x cols, blocks of BLOCK_M x BLOCK_N
                out_stride, a_stride, b_stride,   # row strides, in elements
                OP: tl.constexpr, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                MANY_BLOCKS: tl.constexpr):
    """``out = a OP b`` over one tile, computed in float32: one block, or with MANY_BLOCKS
    (``Tiling.many_blocks``) every block in turn."""
    if MANY_BLOCKS:
        for t in range(0, block_count(rows, cols, BLOCK_M, BLOCK_N)):
            r0, c0 = block_at(t, cols, BLOCK_M, BLOCK_N)
            _binary_block(base, out, a, b, r0, c0, rows, cols, out_stride, a_stride, b_stride, OP, DTYPE, BLOCK_M,
                          BLOCK_N)
    else:
        _binary_block(base, out, a, b, 0, 0, rows, cols, out_stride, a_stride, b_stride, OP, DTYPE, BLOCK_M, BLOCK_N)


@triton.jit
def _binary_block(base, out, a, b, r0, c0, rows, cols, out_stride, a_stride, b_stride, OP: tl.constexpr,
                  DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``binary_tile``'s block at row ``r0``, column ``c0`` of the tile."""
    x = load_block(heap_ptr(base, a, DTYPE) + r0 * a_stride + c0, a_stride, rows - r0, cols - c0, BLOCK_M, BLOCK_N)
    y = load_block(heap_ptr(base, b, DTYPE) + r0 * b_stride + c0, b_stride, rows - r0, cols - c0, BLOCK_M, BLOCK_N)
    store_block(heap_ptr(base, out, DTYPE) + r0 * out_stride + c0, out_stride, rows - r0, cols - c0,
                combined(x, y, OP), BLOCK_M, BLOCK_N)


@triton.jit
def combined(x, y, OP: tl.constexpr):
    """``x OP y`` of float32 blocks (OP: add, mul, silu_mul, gelu_tanh_mul)."""
    if OP == "add":
        z = x + y
    elif OP == "mul":
        z = x * y
    elif OP == "silu_mul":  # silu(x) * y, the gated activation of a SwiGLU MLP
        z = x / (1.0 + tl.exp(-x)) * y
    else:  # "gelu_tanh_mul": gelu(x) * y with gelu's tanh approximation (Gemma's GeGLU); tanh(u) = 1 - 2 / (e^2u + 1)
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)  # sqrt(2 / pi) (x + 0.044715 x^3)
        z = 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * u) + 1.0)) * y
    return z


def _reference(heap, task) -> None:
    a = heap.tensor(task.a, task.DTYPE, task.rows, task.cols, task.a_stride)
    b = heap.tensor(task.b, task.DTYPE, task.rows, task.cols, task.b_stride)
    out = heap.tensor(task.out, task.DTYPE, task.rows, task.cols, task.out_stride)
    if task.OP in ("add", "mul"):  # torch computes a 16-bit one in float32 and rounds once, as the tile
        getattr(torch, task.OP)(a, b, out=out)
    else:
        out.copy_(combined_reference(a.float(), b.float(), task.OP))


def combined_reference(x: torch.Tensor, y: torch.Tensor, op: str) -> torch.Tensor:
    """``combined`` in torch, of float32 ``x`` and ``y``."""
    if op == "add":
        return x + y
    if op == "mul":
        return x * y
    if op == "silu_mul":
        return torch.nn.functional.silu(x).mul_(y)
    return torch.nn.functional.gelu(x, approximate="tanh").mul_(y)  # "gelu_tanh_mul"


def binary(g, op: str, a, b):
    """Split ``a OP b`` (same shape and dtype) into tiles (``Tiling``)."""
    g.require(a.shape == b.shape, f"{op}: shapes differ: a {a.shape}, b {b.shape}")
    g.require(a.dtype == b.dtype, f"{op}: dtypes differ: a {a.dtype}, b {b.dtype}")
    require_float(g, op, a=a, b=b)
    out = g.new_tensor(a.shape, a.dtype)
    tiling = Tiling.of(g, out.rows, out.cols)
    opcode = g.opcode(BINARY, OP=op, DTYPE=a.dtype, BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n,
                      MANY_BLOCKS=tiling.many_blocks)
    for r0, m, c0, n in tiling:
        g.add_task(opcode, out=out.addr(r0, c0), a=a.addr(r0, c0), b=b.addr(r0, c0), rows=m, cols=n,
                   out_stride=out.row_stride, a_stride=a.row_stride, b_stride=b.row_stride,
                   reads=(a.region(r0, m, c0, n), b.region(r0, m, c0, n)), writes=(out.region(r0, m, c0, n),),
                   bytes=3 * m * n * a.element_size, flops=m * n)
    return out


def add(g, a, b):
    """Elementwise ``a + b``."""
    return binary(g, "add", a, b)


def mul(g, a, b):
    """Elementwise ``a * b``."""
    return binary(g, "mul", a, b)


def _example(g):
    a, b = g.input("binary.a", (3, 40), torch.bfloat16), g.input("binary.b", (3, 40), torch.bfloat16)
    return g.add(a, b), g.mul(a, b), g.silu_mul(a, b), g.gelu_tanh_mul(a, b)


BINARY = TaskType("binary", binary_tile, _reference, _example)
TASK_TYPES = (BINARY,)
OPS = {"add": add, "mul": mul}
