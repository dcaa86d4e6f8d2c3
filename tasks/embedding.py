"""Embedding lookup: row ``tokens[b]`` of the table, for each batch row b (token ids on the heap)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import heap_ptr
from .common import HeapView, TaskType, copy_row, next_power_of_2

MAX_BLOCK_N = 1024


@triton.jit
def embedding_tile(base, args, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Copy table row ``*token`` (``cols`` elements) to one output row."""
    out, table, token = tl.load(args + 0), tl.load(args + 1), tl.load(args + 2)
    cols, table_stride = tl.load(args + 3), tl.load(args + 4)
    row = tl.load(heap_ptr(base, token, tl.int64))
    copy_row(base, out, table + row * table_stride * DTYPE.primitive_bitwidth // 8, cols, DTYPE, BLOCK_N)


ARGS = ("out", "table", "token", "cols", "table_stride")


def _reference(heap: HeapView, args: dict[str, int], consts: dict) -> None:
    row = int(heap.tensor(args["token"], torch.int64, 1, 1, 1))
    cols, stride = args["cols"], args["table_stride"]
    size = torch.empty((), dtype=getattr(torch, consts["DTYPE"])).element_size()
    source = heap.tensor(args["table"] + row * stride * size, consts["DTYPE"], 1, cols, stride)
    heap.tensor(args["out"], consts["DTYPE"], 1, cols, cols).copy_(source)


EMBEDDING = TaskType("embedding", embedding_tile, ARGS, _reference)


def embedding(g, tokens, table):
    """``table[tokens]``: tokens int64 [B], table [vocab, hidden] -> [B, hidden]."""
    g.check(tokens.ndim == 1 and tokens.dtype == torch.int64,
            f"embedding: tokens must be 1-D int64, got {tokens.shape} {tokens.dtype}")
    g.check(table.ndim == 2, f"embedding: table must be 2-D, got {table.shape}")
    batch = tokens.cols
    out = g.new_tensor((batch, table.cols), table.dtype)
    opcode = g.opcode(EMBEDDING, DTYPE=table.dtype, BLOCK_N=min(next_power_of_2(table.cols), MAX_BLOCK_N))
    for b in range(batch):
        g.add_task(opcode, (out.addr(b, 0), table.addr(0, 0), tokens.addr(0, b), table.cols, table.row_stride),
                   reads=(tokens.region(0, 1, b, 1), table.region(0, table.rows, 0, table.cols)),
                   writes=(out.region(b, 1, 0, table.cols),),
                   bytes=2 * table.cols * table.element_size, flops=0)
    return out


TASK_TYPES = (EMBEDDING,)
OPS = {"embedding": embedding}
