"""Sampling on the device: greedy ``argmax`` into a token history, and ``advance`` of the position.

A decode loop that never leaves the device keeps its tokens on the heap: a history ``[batch,
max_seq_len]`` of int64 token ids into which the host writes the prompt. A step embeds
``history[pos]`` (``embedding(history, table, pos=pos)``), runs the model, writes its argmax into
``history[pos + 1]`` once past the prompt, and ends by advancing ``pos``. With tensor parallelism every
rank holds the same all-gathered logits, so every rank samples the same token with no exchange.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import NO_SEQUENCE, heap_ptr
from .common import TaskType, require_float, row_positions

MAX_BLOCK_N = 1024


@triton.jit
def argmax_tile(base,
                history,       # heap offset of the batch row's history
                logits,        # heap offset of the batch row's logits
                pos,           # heap offset of the int64 position
                prompt_len,    # heap offset of the int64 prompt length
                cols,          # logits of the row (the vocabulary)
                history_cols,  # positions of the history
                DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """``history[pos + 1] = argmax(logits)`` when ``prompt_len <= pos + 1 < history_cols``: the lowest index
    of the largest logit, as ``torch.argmax`` (NaN-free logits), BLOCK_N logits at a time."""
    c = tl.arange(0, BLOCK_N)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int64)
    for c0 in range(0, cols, BLOCK_N):
        block = tl.load(heap_ptr(base, logits, DTYPE) + c0 + c, mask=c0 + c < cols, other=float("-inf")).to(tl.float32)
        top = tl.max(block, axis=0)
        first = tl.min(tl.where(block == top, c0 + c, cols), axis=0).to(tl.int64)
        if top > best:  # strictly: an equal maximum in a later block keeps the earlier index
            best, best_index = top, first
    target = tl.load(heap_ptr(base, pos, tl.int64)) + 1  # position 0 is the prompt's: a row of no sequence writes nothing
    write = (target >= tl.load(heap_ptr(base, prompt_len, tl.int64))) & (target >= 1) & (target < history_cols)
    tl.store(heap_ptr(base, history, tl.int64) + target, best_index, mask=write)


def _argmax_reference(heap, task) -> None:
    target = heap.word(task.pos) + 1
    if heap.word(task.prompt_len) <= target < task.history_cols and target >= 1:
        logits = heap.tensor(task.logits, task.DTYPE, 1, task.cols, task.cols).float()
        heap.tensor(task.history, torch.int64, 1, task.history_cols, task.history_cols)[0, target] = logits.argmax()


def sample_greedy(g, logits, history, pos, prompt_len, vocab: int | None = None):
    """Per batch row b: ``history[b, pos_b + 1] = argmax(logits[b, :vocab])`` once past the prompt
    (``pos_b + 1 >= prompt_len_b``) and inside the history; returns ``history``. ``pos`` and ``prompt_len``:
    one int64 element, or one per row (``common.row_positions``); ``vocab``: the logits to consider (the
    first ones; all by default: tensor-parallel logits may end with padding)."""
    require_float(g, "sample_greedy", logits=logits)
    vocab = logits.cols if vocab is None else vocab
    g.require(logits.ndim == 2 and history.ndim == 2 and history.dtype == torch.int64 and history.rows == logits.rows,
              f"sample_greedy: logits must be [batch, vocab] and history int64 [batch, positions], got {logits.shape} "
              f"and {history.shape} {history.dtype}")
    g.require(0 < vocab <= logits.cols, f"sample_greedy: vocab {vocab} is outside [1, {logits.cols}]")
    positions = row_positions(g, "sample_greedy", pos, logits.rows)
    lengths = row_positions(g, "sample_greedy", prompt_len, logits.rows)
    opcode = g.opcode(ARGMAX, DTYPE=logits.dtype, BLOCK_N=min(triton.next_power_of_2(vocab), MAX_BLOCK_N))
    for b, ((position, position_region), (length, length_region)) in enumerate(zip(positions, lengths)):
        g.add_task(opcode, history=history.addr(b, 0), logits=logits.addr(b, 0), pos=position,
                   prompt_len=length, cols=vocab, history_cols=history.cols,
                   reads=(logits.region(b, 1, 0, vocab), position_region, length_region),
                   writes=(history.region(b, 1, 0, history.cols),), bytes=vocab * logits.element_size, flops=vocab)
    return history


@triton.jit
def advance_tile(base,
                 counter,   # heap offset of the int64 position
                 by,        # what to add
                 limit):    # a position that reaches it ends its sequence
    """``*counter += by``, the position of a decode loop's row at the end of its step; a row of no sequence
    (-1) stays so, and one that reaches ``limit`` becomes one (it has no room left)."""
    ptr = heap_ptr(base, counter, tl.int64)
    position = tl.load(ptr)
    moved = tl.where(position + by >= limit, NO_SEQUENCE, position + by)
    tl.store(ptr, tl.where(position == NO_SEQUENCE, NO_SEQUENCE, moved))


def _advance_reference(heap, task) -> None:
    position = heap.tensor(task.counter, torch.int64, 1, 1, 1)
    if int(position) != NO_SEQUENCE.value:
        position.fill_(NO_SEQUENCE.value if int(position) + task.by >= task.limit else int(position) + task.by)


def advance(g, pos, by: int = 1, limit: int = 2**62):
    """``pos += by`` for each element of ``pos`` (int64 positions, one per batch row or one for all), after
    every task of the step that reads it: -1 (a row of no sequence) stays -1, and a position that
    reaches ``limit`` becomes -1 (the sequence has no room left). Returns ``pos``."""
    g.require(pos.ndim == 1 and pos.dtype == torch.int64, f"advance: pos must be 1-D int64, got {pos.shape} {pos.dtype}")
    opcode = g.opcode(ADVANCE)
    for r in range(pos.cols):
        g.add_task(opcode, counter=pos.addr(0, r), by=by, limit=limit, reads=(), writes=(pos.region(0, 1, r, 1),),
                   bytes=16, flops=1)
    return pos


def _example(g):
    logits = g.input("argmax.logits", (2, 1500), torch.bfloat16)
    history = g.input("argmax.history", (2, 45), torch.int64)
    pos, prompt_len = g.input("argmax.pos", (1,), torch.int64), g.input("argmax.prompt_len", (1,), torch.int64)
    return g.sample_greedy(logits, history, pos, prompt_len, vocab=1400), g.advance(pos)


ARGMAX = TaskType("argmax", argmax_tile, _argmax_reference, _example)
ADVANCE = TaskType("advance", advance_tile, _advance_reference, _example)
TASK_TYPES = (ARGMAX, ADVANCE)
OPS = {"sample_greedy": sample_greedy, "advance": advance}
