"""Linear layers ``y = x @ w.T`` (w is [out, in], as in torch), optionally split along K.

Small batches (M < DOT_MIN_M) use GEMV tiles: all M rows times BLOCK_N output columns, the product
formed by broadcasting. Larger batches use ``tl.dot`` tiles. With ``split_k = S`` each tile covers a
K-range and writes a float32 partial; one reduction tile per output block then adds the S partials
in a fixed order, so the result does not depend on which partial finished first.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import heap_ptr
from .common import HeapView, TaskType, next_power_of_2, store_block
from .reduction import sum_slices

DOT_MIN_M = 16
GEMV_BLOCK_N, GEMV_BLOCK_K = 32, 128
DOT_BLOCK_M, DOT_BLOCK_N, DOT_BLOCK_K = 32, 32, 32


@triton.jit
def linear_tile(base, args, X_DTYPE: tl.constexpr, W_DTYPE: tl.constexpr, Y_DTYPE: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr):
    """``y[:m, :n] = x[:m, :k] @ w[:n, :k].T`` for ``m <= BLOCK_M``, ``n <= BLOCK_N``, any k; float32 accumulation."""
    y, x, w = tl.load(args + 0), tl.load(args + 1), tl.load(args + 2)
    m, n, k = tl.load(args + 3), tl.load(args + 4), tl.load(args + 5)
    y_stride, x_stride, w_stride = tl.load(args + 6), tl.load(args + 7), tl.load(args + 8)
    rm = tl.arange(0, BLOCK_M)[:, None]
    rn = tl.arange(0, BLOCK_N)[:, None]
    rk = tl.arange(0, BLOCK_K)[None, :]
    x_ptr = heap_ptr(base, x, X_DTYPE) + rm * x_stride + rk
    w_ptr = heap_ptr(base, w, W_DTYPE) + rn * w_stride + rk
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, k, BLOCK_K):
        a = tl.load(x_ptr + k0, mask=(rm < m) & (k0 + rk < k), other=0.0).to(tl.float32)
        b = tl.load(w_ptr + k0, mask=(rn < n) & (k0 + rk < k), other=0.0).to(tl.float32)
        if USE_DOT:
            acc += tl.dot(a, tl.trans(b), input_precision="ieee")
        else:
            acc += tl.sum(a[:, None, :] * b[None, :, :], axis=2)
    store_block(base, y, y_stride, m, n, acc, Y_DTYPE, BLOCK_M, BLOCK_N)


LINEAR_ARGS = ("y", "x", "w", "m", "n", "k", "y_stride", "x_stride", "w_stride")


def _linear_reference(heap: HeapView, args: dict[str, int], consts: dict) -> None:
    m, n, k = args["m"], args["n"], args["k"]
    x = heap.tensor(args["x"], consts["X_DTYPE"], m, k, args["x_stride"]).float()
    w = heap.tensor(args["w"], consts["W_DTYPE"], n, k, args["w_stride"]).float()
    heap.tensor(args["y"], consts["Y_DTYPE"], m, n, args["y_stride"]).copy_(x @ w.T)


LINEAR = TaskType("linear", linear_tile, LINEAR_ARGS, _linear_reference)


def linear(g, x, w, split_k: int = 1):
    """``x [M, K] @ w [N, K].T -> [M, N]`` in x's dtype; ``split_k`` cuts K into that many ranges."""
    g.check(x.ndim == 2 and w.ndim == 2, f"linear: x {x.shape} and w {w.shape} must both be 2-D")
    g.check(x.cols == w.cols, f"linear: x has shape {x.shape} but w has shape {w.shape}; "
                              f"expected w of shape (N, {x.cols})")
    g.check(isinstance(split_k, int) and 1 <= split_k <= x.cols,
            f"linear: split_k must be an integer in [1, {x.cols}], got {split_k!r}")
    m_total, n_total, k_total = x.rows, w.rows, x.cols
    y = g.new_tensor((m_total, n_total), x.dtype)
    use_dot = m_total >= DOT_MIN_M
    block_m = DOT_BLOCK_M if use_dot else next_power_of_2(m_total)
    block_n = DOT_BLOCK_N if use_dot else GEMV_BLOCK_N
    block_k = DOT_BLOCK_K if use_dot else GEMV_BLOCK_K
    k_step = -(-k_total // split_k)
    k_ranges = [(k0, min(k_step, k_total - k0)) for k0 in range(0, k_total, k_step)]
    target = y if len(k_ranges) == 1 else g.new_tensor((len(k_ranges) * m_total, n_total), torch.float32)
    opcode = g.opcode(LINEAR, X_DTYPE=x.dtype, W_DTYPE=w.dtype, Y_DTYPE=target.dtype, BLOCK_M=block_m,
                      BLOCK_N=block_n, BLOCK_K=block_k, USE_DOT=use_dot)
    # A big graph has hundreds of thousands of these tiles: what does not change along a row of tiles
    # is computed once per row (the x tile and its Region, shared by the row's tasks), and the y and w
    # addresses advance by a fixed step per tile, instead of going through Tensor.addr each time.
    x_size, w_size, y_size = x.element_size, w.element_size, target.element_size
    strides = (target.row_stride, x.row_stride, w.row_stride)
    w_step = block_n * w.row_stride * w_size  # bytes from one tile's w rows to the next tile's
    add_task = g.add_task
    for s, (k0, k) in enumerate(k_ranges):
        for r0 in range(0, m_total, block_m):
            m = min(block_m, m_total - r0)
            row = s * m_total + r0
            y_addr, x_addr, w_addr = target.addr(row, 0), x.addr(r0, k0), w.addr(0, k0)
            x_tile = x.region(r0, m, k0, k)
            for c0 in range(0, n_total, block_n):
                n = min(block_n, n_total - c0)
                add_task(opcode, (y_addr + c0 * y_size, x_addr, w_addr, m, n, k, *strides),
                         reads=(x_tile, w.region(c0, n, k0, k)), writes=(target.region(row, m, c0, n),),
                         bytes=m * k * x_size + n * k * w_size + m * n * y_size, flops=2 * m * n * k)
                w_addr += w_step
    if target is y:
        return y
    sum_slices(g, y, target, len(k_ranges), m_total)
    return y


TASK_TYPES = (LINEAR,)
OPS = {"linear": linear}
