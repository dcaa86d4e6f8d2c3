"""Embedding lookup: row ``tokens[b]`` of the table, for each batch row b (token ids on the heap)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import checked_index, heap_ptr
from .common import TaskType, copy_row, heap_index

MAX_BLOCK_N = 1024


@triton.jit
def embedding_tile(base, status,
                   out, table,     # heap offsets: the output row, the table's first row
                   token,          # heap offset of the int64 token id
                   rows, cols,     # the table's shape
                   table_stride,   # the table's row stride, in elements
                   DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Copy table row ``*token`` to the output row (a token id outside the table: row 0, reported)."""
    row = checked_index(status, tl.load(heap_ptr(base, token, tl.int64)), rows)
    copy_row(base, out, table + row * table_stride * DTYPE.primitive_bitwidth // 8, cols, DTYPE, BLOCK_N)


def _reference(heap, task) -> None:
    row = heap_index(heap, task.token, task.rows)
    size = getattr(torch, task.DTYPE).itemsize
    source = heap.tensor(task.table + row * task.table_stride * size, task.DTYPE, 1, task.cols, task.table_stride)
    heap.tensor(task.out, task.DTYPE, 1, task.cols, task.cols).copy_(source)


def embedding(g, tokens, table):
    """``table[tokens]``: tokens int64 [B], table [vocab, hidden] -> [B, hidden]."""
    g.check(tokens.ndim == 1 and tokens.dtype == torch.int64,
            f"embedding: tokens must be 1-D int64, got {tokens.shape} {tokens.dtype}")
    g.check(table.ndim == 2, f"embedding: table must be 2-D, got {table.shape}")
    batch = tokens.cols
    out = g.new_tensor((batch, table.cols), table.dtype)
    opcode = g.opcode(EMBEDDING, DTYPE=table.dtype, BLOCK_N=min(triton.next_power_of_2(table.cols), MAX_BLOCK_N))
    for b in range(batch):
        g.add_task(opcode, out=out.addr(b, 0), table=table.addr(0, 0), token=tokens.addr(0, b), rows=table.rows,
                   cols=table.cols,
                   table_stride=table.row_stride,
                   reads=(tokens.region(0, 1, b, 1), table.region(0, table.rows, 0, table.cols)),
                   writes=(out.region(b, 1, 0, table.cols),),
                   bytes=2 * table.cols * table.element_size, flops=0)
    return out


def _example(g):
    return (g.embedding(g.input("embedding.tokens", (2,), torch.int64),
                        g.input("embedding.table", (50, 96), torch.bfloat16)),)


EMBEDDING = TaskType("embedding", embedding_tile, _reference, _example)
TASK_TYPES = (EMBEDDING,)
OPS = {"embedding": embedding}
