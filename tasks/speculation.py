"""Speculative decoding on the device: drafts from each sequence's own history, verified and accepted in
the same step.

With ``draft_tokens`` K a decode step runs K + 1 *verification rows* per batch row instead of one: row j
at position ``pos + j``, fed the token known or guessed for that position. ``draft`` (one task a step,
every batch row) fills them: a position up to the last known one (the prompt's last, or ``pos``) gets its
token; a later one a *prompt-lookup* draft, the tokens that followed the most recent earlier occurrence
of the last n known tokens (n from NGRAM down to 1), repeated with that period where they run into the
present (a loop the sequence is in); with no occurrence there is no draft, and those rows are off (-1).
The rows run through every layer as a prefill chunk of their sequence (``chunk_attention``), and
``sample`` puts each row's next token into ``verified`` at its position + 1. ``accept`` (one task a step)
then keeps, per batch row, the longest run of rows whose successor was fed the token the model (or the
prompt) puts there, and the model's token after the run: it writes the model's tokens into the history
and advances ``pos`` past them, 1 .. K + 1 positions a step.

The tokens are those of decoding without drafts: a kept token is the model's given exactly the tokens
before it, and so is a drawn one, since a draw is a function of the logits, the seed and the position
alone (``tasks.sampling``) — up to floating-point rounding: a verification row computes its logits with
another summation order than a decode row (``chunk_attention``, linears tiled for more rows), within a
few float32 ulps (bfloat16: a rounding step), so a token can differ only where two logits tie that
closely. The KV cache written by rows past the kept ones is never read: the row that next reaches such
a position writes it again first (``kv_append`` before ``chunk_attention``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import NO_SEQUENCE, heap_ptr
from ..errors import is_count
from .common import TaskType, next_power_of_2

NGRAM = 3          # the longest suffix looked up (then shorter ones, down to one token)
BLOCK_N = 256      # history positions compared at a time
STATS = ("steps", "row_steps", "tokens", "drafted", "accepted")  # ``accept``'s int64 counters, in this order


@triton.jit
def prompt_lookup(row, last, NGRAM: tl.constexpr, BLOCK_N: tl.constexpr):
    """The end ``i < last`` of the most recent earlier occurrence of ``row[last - n + 1 .. last]`` for the
    largest ``n <= NGRAM`` that has one, or -1. ``row``: a pointer to a history row's int64 tokens."""
    found = tl.full((), -1, tl.int64)
    for n in tl.static_range(NGRAM, 0, -1):
        if found < 0:  # a shorter suffix only where the longer ones never occurred
            for i0 in range(0, last, BLOCK_N):
                i = i0 + tl.arange(0, BLOCK_N)
                same = (i >= n - 1) & (i < last)
                for t in tl.static_range(n):
                    same = same & (tl.load(row + i - t, mask=same, other=-1) == tl.load(row + tl.maximum(last - t, 0)))
                found = tl.maximum(found, tl.max(tl.where(same, i, -1), axis=0))
    return found


@triton.jit
def lanes(x, BLOCK: tl.constexpr):
    """The scalar ``x`` in each of BLOCK lanes."""
    return x + tl.zeros((BLOCK,), x.dtype)


@triton.jit
def draft_tile(base,
               history,                # heap offset of the int64 history [batch, history_cols]
               pos, prompt_len, end,   # heap offsets of the batch rows' int64 positions, prompt lengths, ends
               tokens, positions,      # heap offsets of the verification rows' int64 tokens and positions
               live,                   # heap offset of the int64 flag of the step: 0 if a row runs, else -1
               batch, history_cols,
               ROWS: tl.constexpr, BLOCK_R: tl.constexpr, NGRAM: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per batch row b at ``p = pos[b]`` (a row of no sequence, or at its ``end``: off), its ROWS
    verification rows ``b * ROWS + j``: position ``p + j`` (-1: off, from the first position at ``end``
    or past the known ones with no draft) and its token, known or drafted (module docstring). ``live``:
    -1 when no batch row runs (the step's guarded tasks skip)."""
    j = tl.arange(0, BLOCK_R)
    running = tl.full((), 0, tl.int32)
    for b in range(batch):
        p = tl.load(heap_ptr(base, pos, tl.int64) + b)
        stop = tl.minimum(tl.load(heap_ptr(base, end, tl.int64) + b), history_cols)
        known = tl.minimum(tl.maximum(p, tl.load(heap_ptr(base, prompt_len, tl.int64) + b) - 1), history_cols - 1)
        row = heap_ptr(base, history, tl.int64) + b * history_cols
        on = (p >= 0) & (p < stop)
        match = tl.full((), -1, tl.int64)
        if on & (p + ROWS - 1 > known):
            match = prompt_lookup(row, known, NGRAM, BLOCK_N)
        q = p + j
        # masks of blocks only: the interpreter broadcasts a scalar bool into an int32 block, no mask
        row_on = (j < ROWS) & (lanes(p, BLOCK_R) >= 0) & (q < stop) & ((q <= known) | (lanes(match, BLOCK_R) >= 0))
        # the remainder in 32 bits (positions are): a 64-bit one is a subroutine call on NVIDIA GPUs
        period = tl.maximum(known - match, 1).to(tl.int32)
        source = tl.where(q <= known, q, match + 1 + (q - known - 1).to(tl.int32) % period)
        token = tl.load(row + source, mask=row_on, other=0)
        tl.store(heap_ptr(base, tokens, tl.int64) + b * ROWS + j, token, mask=j < ROWS)
        tl.store(heap_ptr(base, positions, tl.int64) + b * ROWS + j, tl.where(row_on, q, -1), mask=j < ROWS)
        running = tl.maximum(running, on.to(tl.int32))
    tl.store(heap_ptr(base, live, tl.int64), tl.where(running > 0, 0, NO_SEQUENCE))


@triton.jit
def accept_tile(base,
                history, verified,      # heap offsets of int64 [batch, history_cols]: the tokens, the model's
                tokens, positions,      # heap offsets of the verification rows' int64 tokens and positions
                pos, prompt_len, end,   # heap offsets of the batch rows' int64 positions, prompt lengths, ends
                stats,                  # heap offset of the int64 counters STATS
                batch, history_cols,
                ROWS: tl.constexpr, BLOCK_R: tl.constexpr):
    """Per batch row whose first verification row runs: ``a`` = the first row j whose successor was not
    fed the token at ``p + j + 1`` (the prompt's, or ``verified``'s), the model's tokens of rows ``0 .. a``
    past the prompt into the history, ``pos = p + a + 1`` (-1 from ``end`` on); the counters advanced."""
    j = tl.arange(0, BLOCK_R)
    steps = tl.zeros((), tl.int64)
    row_steps = tl.zeros((), tl.int64)
    made = tl.zeros((), tl.int64)
    drafted = tl.zeros((), tl.int64)
    accepted = tl.zeros((), tl.int64)
    for b in range(batch):
        rows = heap_ptr(base, positions, tl.int64) + b * ROWS
        if tl.load(rows) >= 0:
            p = tl.load(heap_ptr(base, pos, tl.int64) + b)
            start = tl.load(heap_ptr(base, prompt_len, tl.int64) + b)
            q = p + j
            on = tl.load(rows + j, mask=j < ROWS, other=-1) >= 0
            next_on = tl.load(rows + j + 1, mask=j + 1 < ROWS, other=-1) >= 0
            fed = tl.load(heap_ptr(base, tokens, tl.int64) + b * ROWS + j + 1, mask=j + 1 < ROWS, other=-1)
            sampled = on & (q + 1 >= start) & (q + 1 < history_cols)
            model = tl.load(heap_ptr(base, verified, tl.int64) + b * history_cols + q + 1, mask=sampled, other=-1)
            agrees = next_on & ((q + 1 < start) | (model == fed))
            a = tl.min(tl.where(agrees, BLOCK_R, j), axis=0)
            kept = sampled & (j <= a)
            tl.store(heap_ptr(base, history, tl.int64) + b * history_cols + q + 1, model, mask=kept)
            moved = p + a + 1
            stop = tl.minimum(tl.load(heap_ptr(base, end, tl.int64) + b), history_cols)
            tl.store(heap_ptr(base, pos, tl.int64) + b, tl.where(moved >= stop, NO_SEQUENCE, moved))
            guessed = on & (j >= 1) & (q >= start)
            steps = tl.maximum(steps, 1)
            row_steps += 1
            made += tl.sum(kept.to(tl.int64), axis=0)
            drafted += tl.sum(guessed.to(tl.int64), axis=0)
            accepted += tl.sum((guessed & (j <= a)).to(tl.int64), axis=0)
    k = tl.arange(0, 8)  # a lane per counter of STATS (5)
    counters = heap_ptr(base, stats, tl.int64) + k
    added = tl.where(k == 0, steps, tl.where(k == 1, row_steps, tl.where(k == 2, made, tl.where(k == 3, drafted,
                                                                                                  accepted))))
    tl.store(counters, tl.load(counters, mask=k < 5) + added, mask=k < 5)


def lookup(row: torch.Tensor, last: int) -> int:
    """The host's ``prompt_lookup`` over the int64 tokens ``row``."""
    for n in range(NGRAM, 0, -1):
        if last >= n:
            windows = row[:last].unfold(0, n, 1)   # windows[s] ends at s + n - 1 < last
            ends = torch.nonzero((windows == row[last - n + 1:last + 1]).all(dim=1)).flatten()
            if ends.numel():
                return int(ends[-1]) + n - 1
    return -1


def _vector(heap, offset: int, count: int) -> torch.Tensor:
    return heap.tensor(offset, torch.int64, 1, count, count)[0]


def _draft_reference(heap, task) -> None:
    rows, cols = task.ROWS, task.history_cols
    history = heap.tensor(task.history, torch.int64, task.batch, cols, cols)
    pos, prompt_len, end = (_vector(heap, at, task.batch).tolist() for at in (task.pos, task.prompt_len, task.end))
    tokens, positions = _vector(heap, task.tokens, task.batch * rows), _vector(heap, task.positions, task.batch * rows)
    running = False
    for b in range(task.batch):
        p, stop = pos[b], min(end[b], cols)
        known = min(max(p, prompt_len[b] - 1), cols - 1)
        on = 0 <= p < stop
        match = lookup(history[b], known) if on and p + rows - 1 > known else -1
        for j in range(rows):
            q = p + j
            row_on = on and q < stop and (q <= known or match >= 0)
            source = q if q <= known else match + 1 + (q - known - 1) % max(known - match, 1)
            tokens[b * rows + j] = int(history[b, source]) if row_on else 0
            positions[b * rows + j] = q if row_on else -1
        running |= on
    _vector(heap, task.live, 1)[0] = 0 if running else NO_SEQUENCE.value


def _accept_reference(heap, task) -> None:
    rows, cols, batch = task.ROWS, task.history_cols, task.batch
    history = heap.tensor(task.history, torch.int64, batch, cols, cols)
    verified = heap.tensor(task.verified, torch.int64, batch, cols, cols)
    tokens, positions = (_vector(heap, at, batch * rows).tolist() for at in (task.tokens, task.positions))
    pos = _vector(heap, task.pos, batch)
    prompt_len, end = (_vector(heap, at, batch).tolist() for at in (task.prompt_len, task.end))
    counts = dict.fromkeys(STATS, 0)
    for b in range(batch):
        if positions[b * rows] < 0:
            continue
        p, start = int(pos[b]), prompt_len[b]
        on = [positions[b * rows + j] >= 0 for j in range(rows)] + [False]

        def agrees(j: int) -> bool:  # row j + 1 was fed the token the prompt or the model puts at p + j + 1
            return on[j + 1] and (p + j + 1 < start or int(verified[b, p + j + 1]) == tokens[b * rows + j + 1])
        a = next(j for j in range(rows) if not agrees(j))
        for t in range(max(p + 1, start), min(p + a + 2, cols)):
            history[b, t] = verified[b, t]
            counts["tokens"] += 1
        pos[b] = NO_SEQUENCE.value if p + a + 1 >= min(end[b], cols) else p + a + 1
        guessed = [j for j in range(1, rows) if on[j] and p + j >= start]
        counts["steps"] = 1
        counts["row_steps"] += 1
        counts["drafted"] += len(guessed)
        counts["accepted"] += sum(j <= a for j in guessed)
    _vector(heap, task.stats, len(STATS)).add_(torch.tensor(list(counts.values())))


def _rows_of(g, op: str, batch: int, **vectors) -> None:
    for name, t in vectors.items():
        g.require(t.shape == (batch,) and t.dtype == torch.int64,
                  f"{op}: {name} must be int64 [{batch}] (one per batch row), got {t.shape} {t.dtype}")


def _whole(t):
    return t.region(0, t.rows, 0, t.cols)


def draft(g, history, pos, prompt_len, end, rows: int):
    """The verification rows of a step (module docstring): ``rows`` (K + 1) per batch row of
    ``history`` (int64 [batch, positions]) at ``pos`` (int64 [batch], -1: no sequence) with ``prompt_len``
    and ``end`` (int64 [batch]: a row whose position reaches it is off). Returns (tokens, positions),
    int64 [batch * rows] each, and ``live``: an int64 [1] flag for ``Graph.guarded``, -1 in a step where
    no batch row runs."""
    batch = history.rows
    g.require(history.ndim == 2 and history.dtype == torch.int64,
              f"draft: history must be int64 [batch, positions], got {history.shape} {history.dtype}")
    g.require(is_count(rows), f"draft: rows must be a positive int, got {rows!r}")
    _rows_of(g, "draft", batch, pos=pos, prompt_len=prompt_len, end=end)
    tokens, positions = (g.new_tensor((batch * rows,), torch.int64) for _ in range(2))
    live = g.new_tensor((1,), torch.int64)
    opcode = g.opcode(DRAFT, ROWS=rows, BLOCK_R=next_power_of_2(rows), NGRAM=NGRAM, BLOCK_N=BLOCK_N)
    g.add_task(opcode, history=history.addr(0, 0), pos=pos.addr(0, 0), prompt_len=prompt_len.addr(0, 0),
               end=end.addr(0, 0), tokens=tokens.addr(0, 0), positions=positions.addr(0, 0), live=live.addr(0, 0),
               batch=batch, history_cols=history.cols,
               reads=(_whole(history), _whole(pos), _whole(prompt_len), _whole(end)),
               writes=(_whole(tokens), _whole(positions), _whole(live)),
               bytes=8 * batch * (NGRAM * history.cols + 2 * rows), flops=NGRAM * NGRAM * batch * history.cols)
    return tokens, positions, live


def accept(g, history, verified, tokens, positions, pos, prompt_len, end, stats):
    """Keep what the model agrees with (module docstring): ``verified`` (int64, like ``history``) holds the
    model's token at each verification row's position + 1 (``sample`` with ``rows_per_sequence``);
    ``tokens`` and ``positions`` are ``draft``'s. Writes the kept tokens into ``history``, advances ``pos``
    and adds to ``stats`` (int64 [len(STATS)]: the steps with a row running, the batch rows' steps, the
    tokens made, the drafted tokens and the accepted ones). Returns ``history``."""
    batch = history.rows
    g.require(verified.shape == history.shape and verified.dtype == history.dtype == torch.int64,
              f"accept: history and verified must be int64 of one shape, got {history.shape} {history.dtype} and "
              f"{verified.shape} {verified.dtype}")
    g.require(tokens.ndim == 1 and tokens.cols % batch == 0 and positions.shape == tokens.shape,
              f"accept: tokens and positions must be draft's [batch * rows], got {tokens.shape} and {positions.shape}")
    g.require(stats.shape == (len(STATS),) and stats.dtype == torch.int64,
              f"accept: stats must be int64 [{len(STATS)}], got {stats.shape} {stats.dtype}")
    _rows_of(g, "accept", batch, pos=pos, prompt_len=prompt_len, end=end)
    rows = tokens.cols // batch
    opcode = g.opcode(ACCEPT, ROWS=rows, BLOCK_R=next_power_of_2(rows))
    g.add_task(opcode, history=history.addr(0, 0), verified=verified.addr(0, 0), tokens=tokens.addr(0, 0),
               positions=positions.addr(0, 0), pos=pos.addr(0, 0), prompt_len=prompt_len.addr(0, 0),
               end=end.addr(0, 0), stats=stats.addr(0, 0), batch=batch, history_cols=history.cols,
               reads=(_whole(verified), _whole(tokens), _whole(positions), _whole(prompt_len), _whole(end)),
               writes=(_whole(history), _whole(pos), _whole(stats)),
               bytes=8 * batch * 4 * rows, flops=batch * rows)
    return history


def _example(g):
    """Two batch rows of 48 positions, 4 verification rows each (every index input is below 40)."""
    history, verified = (g.input(f"draft.{name}", (2, 48), torch.int64) for name in ("history", "verified"))
    pos, prompt_len, end = (g.input(f"draft.{name}", (2,), torch.int64) for name in ("pos", "prompt_len", "end"))
    stats = g.input("draft.stats", (len(STATS),), torch.int64)
    tokens, positions, live = g.draft(history, pos, prompt_len, end, 4)
    return g.accept(history, verified, tokens, positions, pos, prompt_len, end, stats), tokens, positions, live


DRAFT = TaskType("draft", draft_tile, _draft_reference, _example)
ACCEPT = TaskType("accept", accept_tile, _accept_reference, _example)
TASK_TYPES = (DRAFT, ACCEPT)
OPS = {"draft": draft, "accept": accept}
