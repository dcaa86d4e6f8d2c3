"""Embedding lookup: row ``tokens[b]`` of the table, for each batch row b (token ids on the heap), or
row ``history[b, pos]`` (a decode loop's token history and its position, both on the heap)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import checked_index, heap_ptr, row_position
from . import quantized
from .common import TaskType, copy_row, history_row, row_positions, token_row
from .formats import Quantized

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


@triton.jit
def embedding_at_tile(base, status,
                      out, table,     # heap offsets: the output row, the table's first row
                      history,        # heap offset of the batch row's int64 token history
                      pos,            # heap offset of the int64 position
                      history_cols,   # positions of the history
                      rows, cols,     # the table's shape
                      table_stride,   # the table's row stride, in elements
                      DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Copy table row ``history[*pos]`` to the output row (a position or a token out of range: entry or
    row 0, reported; a row of no sequence: row 0)."""
    at = row_position(status, heap_ptr(base, pos, tl.int64), history_cols)
    token = tl.load(heap_ptr(base, history, tl.int64) + tl.maximum(at, 0))
    row = checked_index(status, tl.where(at < 0, 0, token), rows)
    copy_row(base, out, table + row * table_stride * DTYPE.primitive_bitwidth // 8, cols, DTYPE, BLOCK_N)


def _reference(heap, task) -> None:
    _copy_row(heap, task, token_row(heap, task))


def _at_reference(heap, task) -> None:
    _copy_row(heap, task, history_row(heap, task))


def _copy_row(heap, task, row: int) -> None:
    size = getattr(torch, task.DTYPE).itemsize
    source = heap.tensor(task.table + row * task.table_stride * size, task.DTYPE, 1, task.cols, task.table_stride)
    heap.tensor(task.out, task.DTYPE, 1, task.cols, task.cols).copy_(source)


def embedding(g, tokens, table, pos=None):
    """``table[tokens]``: tokens int64 [B], table [vocab, hidden] -> [B, hidden]; with ``pos`` (one int64
    element, or one per row: ``common.row_positions``), ``table[tokens[b, pos_b]]`` for a history of
    tokens int64 [B, positions]. A ``Quantized`` table's rows are dequantized (``tasks.quantized``)."""
    if isinstance(table, Quantized):
        return quantized.embedding(g, tokens, table, pos)
    g.require(table.ndim == 2, f"embedding: table must be 2-D, got {table.shape}")
    block_n = min(triton.next_power_of_2(table.cols), MAX_BLOCK_N)
    if pos is not None:
        return _embedding_at(g, tokens, table, pos, block_n)
    g.require(tokens.ndim == 1 and tokens.dtype == torch.int64,
              f"embedding: tokens must be 1-D int64, got {tokens.shape} {tokens.dtype}")
    batch = tokens.cols
    out = g.new_tensor((batch, table.cols), table.dtype)
    opcode = g.opcode(EMBEDDING, DTYPE=table.dtype, BLOCK_N=block_n)
    for b in range(batch):
        g.add_task(opcode, out=out.addr(b, 0), table=table.addr(0, 0), token=tokens.addr(0, b), rows=table.rows,
                   cols=table.cols,
                   table_stride=table.row_stride,
                   reads=(tokens.region(0, 1, b, 1), table.region(0, table.rows, 0, table.cols)),
                   writes=(out.region(b, 1, 0, table.cols),),
                   bytes=2 * table.cols * table.element_size, flops=0)
    return out


def _embedding_at(g, history, table, pos, block_n: int):
    g.require(history.ndim == 2 and history.dtype == torch.int64,
              f"embedding: a history must be 2-D int64 [batch, positions], got {history.shape} {history.dtype}")
    out = g.new_tensor((history.rows, table.cols), table.dtype)
    opcode = g.opcode(EMBEDDING_AT, DTYPE=table.dtype, BLOCK_N=block_n)
    for b, (position, position_region) in enumerate(row_positions(g, "embedding", pos, history.rows)):
        g.add_task(opcode, out=out.addr(b, 0), table=table.addr(0, 0), history=history.addr(b, 0), pos=position,
                   history_cols=history.cols, rows=table.rows, cols=table.cols, table_stride=table.row_stride,
                   reads=(history.region(b, 1, 0, history.cols), position_region,
                          table.region(0, table.rows, 0, table.cols)),
                   writes=(out.region(b, 1, 0, table.cols),), bytes=2 * table.cols * table.element_size, flops=0)
    return out


def _example(g):
    table = g.input("embedding.table", (50, 96), torch.bfloat16)
    return (g.embedding(g.input("embedding.tokens", (2,), torch.int64), table),
            g.embedding(g.input("embedding.history", (2, 45), torch.int64), table, pos=g.input("embedding.pos", (1,),
                                                                                                torch.int64)))


EMBEDDING = TaskType("embedding", embedding_tile, _reference, _example)
EMBEDDING_AT = TaskType("embedding_at", embedding_at_tile, _at_reference, _example)
TASK_TYPES = (EMBEDDING, EMBEDDING_AT)
OPS = {"embedding": embedding}
