"""What every task type shares: its description, tile-shaped loads and stores, the torch heap view.

A task type is an opcode's meaning: a ``@triton.jit`` tile function ``tile(base, args, **constexprs)``
that reads its argument words from ``args`` (an int64 pointer into the task table) and addresses the
heap from ``base``; the names of those words; a torch reference that runs the same tile on a heap
tensor; and a host-side builder, registered as a graph op, that splits an op into tiles. A task type
that ``needs_peers`` (a remote store) gets the table of every rank's heap base too:
``tile(base, bases, args, ...)``, and its reference gets every rank's heap view.

Constexpr names ending in ``DTYPE`` hold a dtype name ("float32", "bfloat16", "float16").
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import triton
import triton.language as tl

from ..device import heap_ptr

DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.int64: "int64"}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


@dataclass(frozen=True)
class TaskType:
    name: str
    tile: Any                       # triton.JITFunction
    arg_names: tuple[str, ...]
    reference: Callable[..., None]  # (heap, args, constexprs[, peers: rank -> HeapView]) -> None
    needs_peers: bool = False


class HeapView:
    """Typed torch views of a heap (a flat uint8 tensor, host or device), for reference tiles and the runtime."""

    def __init__(self, heap: torch.Tensor):
        self.heap = heap
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def tensor(self, offset: int, dtype: torch.dtype | str, rows: int, cols: int, row_stride: int) -> torch.Tensor:
        dtype = TORCH_DTYPES.get(dtype, dtype)
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self.heap.view(dtype)
        size = torch.empty((), dtype=dtype).element_size()
        assert offset % size == 0, f"misaligned {dtype} at heap offset {offset}"
        # as_strided counts from the storage's start: a heap that is a slice of a larger one (virtual
        # ranks) begins at its own storage offset
        return torch.as_strided(typed, (rows, cols), (row_stride, 1), typed.storage_offset() + offset // size)


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """float32 ``x`` as ``DTYPE``, rounded to nearest even on every backend.

    The interpreter converts float32 to bfloat16 by truncation (the compiler rounds), a bias of up to
    one bfloat16 ulp per store that compounds through a model; rounding the bits first makes the
    conversion exact everywhere, at the cost of a few integer operations.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        x = tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN stays NaN
    return x.to(DTYPE)


@triton.jit
def copy_row(base, dst, src, cols, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Copy ``cols`` contiguous elements from heap offset ``src`` to ``dst``, BLOCK_N at a time."""
    c = tl.arange(0, BLOCK_N)
    for c0 in range(0, cols, BLOCK_N):
        v = tl.load(heap_ptr(base, src, DTYPE) + c0 + c, mask=c0 + c < cols)
        tl.store(heap_ptr(base, dst, DTYPE) + c0 + c, v, mask=c0 + c < cols)


@triton.jit
def load_block(base, offset, row_stride, rows, cols, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """The ``rows x cols`` tile at heap ``offset`` as a float32 ``BLOCK_M x BLOCK_N`` block (0 outside)."""
    r = tl.arange(0, BLOCK_M)[:, None]
    c = tl.arange(0, BLOCK_N)[None, :]
    ptr = heap_ptr(base, offset, DTYPE)
    return tl.load(ptr + r * row_stride + c, mask=(r < rows) & (c < cols), other=0.0).to(tl.float32)


@triton.jit
def store_block(base, offset, row_stride, rows, cols, block, DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):
    """Store the valid ``rows x cols`` part of a ``BLOCK_M x BLOCK_N`` block at heap ``offset``."""
    r = tl.arange(0, BLOCK_M)[:, None]
    c = tl.arange(0, BLOCK_N)[None, :]
    ptr = heap_ptr(base, offset, DTYPE)
    tl.store(ptr + r * row_stride + c, rounded(block, DTYPE), mask=(r < rows) & (c < cols))

