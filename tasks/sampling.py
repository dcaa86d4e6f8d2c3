"""Sampling on the device: a token per batch row into its history, greedy or drawn, and ``advance`` of the position.

A decode loop that never leaves the device keeps its tokens on the heap: a history ``[batch,
max_seq_len]`` of int64 token ids into which the host writes the prompt. A step embeds
``history[pos]`` (``embedding(history, table, pos=pos)``), runs the model, writes its token into
``history[pos + 1]`` once past the prompt, and ends by advancing ``pos``. With tensor parallelism every
rank holds the same all-gathered logits, so every rank samples the same token with no exchange.

``sample`` draws as an inference server's sampler does: the logits divided by the temperature T, then
the top-k, top-p and min-p filters, then a draw from the softmax of what they keep. The tile divides the
logits less the largest, ``z = (logit - max) / T`` (the same softmax): the largest z is 0 and every
other one is negative, so a tiny T sends the others to -inf (the argmax, ties drawn among) instead of
overflowing the largest to inf. The draw is the
Gumbel-max trick, ``argmax_i z_i - log(-log u_i)`` over the kept tokens, which picks token i with
probability softmax(z)_i among them with no sort and no normalization. The uniforms ``u`` come from
Philox-4x32-10 (``tl.philox``) with the token id and the position as counter and the row's seed as key:
a function of the request's seed and the position alone, so a seeded request draws the same tokens
whatever its batch row, tensor-parallel degree or launch. Temperature 0 is the greedy argmax (the lowest
index of the largest logit, as ``torch.argmax``).

The filters' thresholds are found without a sort, by bisection over the float32 bit patterns in their
order (``ordered_key``), one pass over the vocabulary per halving: top-k keeps the z at or above the k-th
largest (ties included, as transformers' warper), top-p keeps, among those, the z whose strictly larger
ones' probability mass has not reached ``top_p`` (the fewest most likely tokens holding ``top_p``, ties
included), min-p the z at or above ``log(min_p)``. Log-probabilities are the model's: the
log-softmax of the logits as they are, before temperature and filters (what vLLM reports by default).

A row of logits that is not finite (a NaN, an infinity: a model that overflowed, a checkpoint holding
NaN) has no distribution to draw from: the tile reports it in the worker's status record (``NOT_FINITE``,
with the batch row and the position), as an index out of range is, and the host raises after the run.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ..device import NO_SEQUENCE, NOT_FINITE, heap_ptr, record_fault
from .common import TaskType, require_float, row_positions

MAX_BLOCK_N = 1024
PARAMS = ("temperature", "top_k", "top_p", "min_p")  # a row of ``sample``'s float32 params, in this order
UNIFORM_BITS = 23  # of a Philox word, per uniform: (n + 0.5) / 2^23 is neither 0 nor 1 in float32


@triton.jit
def ordered_key(x):
    """The int32 whose order is float32 ``x``'s: a negative float's magnitude bits reversed."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def uniform(seed, token, position):
    """Uniform float32s in (0, 1) of the ``token`` ids (a block) at ``position``: Philox-4x32-10's first word
    of the counter (token, position, 0, 0) under key ``seed`` (int64), its top 23 bits centred."""
    word, _, _, _ = tl.philox(seed, token.to(tl.uint32), position.to(tl.uint32), 0, 0)
    return ((word >> 9).to(tl.int32).to(tl.float32) + 0.5) * (1.0 / 8388608)


@triton.jit
def logits_block(base, logits, c0, cols, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Logits ``c0 .. c0 + BLOCK_N`` of the row in float32 (-inf past ``cols``), and their indices."""
    c = c0 + tl.arange(0, BLOCK_N)
    return tl.load(heap_ptr(base, logits, DTYPE) + c, mask=c < cols, other=float("-inf")).to(tl.float32), c


@triton.jit
def argmax_logsumexp(base, logits, cols, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, TOTAL: tl.constexpr):
    """The lowest index of the largest logit, the largest logit, (with ``TOTAL``) log(sum(exp(logits))) and
    how many logits are not finite, in one pass (the sum rescaled as the maximum grows)."""
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int64)
    total = tl.full((), 0.0, tl.float32)
    not_finite = tl.full((), 0, tl.int32)
    for c0 in range(0, cols, BLOCK_N):
        block, c = logits_block(base, logits, c0, cols, DTYPE, BLOCK_N)
        not_finite += tl.sum((((block != block) | (tl.abs(block) == float("inf"))) & (c < cols)).to(tl.int32), axis=0)
        top = tl.max(block, axis=0)
        first = tl.min(tl.where(block == top, c, cols), axis=0).to(tl.int64)
        if TOTAL:
            grown = tl.maximum(best, top)
            total = total * tl.exp(best - grown) + tl.sum(tl.exp(block - grown), axis=0)
        if top > best:  # strictly: an equal maximum in a later block keeps the earlier index
            best, best_index = top, first
    return best_index, best, best + tl.log(total), not_finite


@triton.jit
def tempered(block, top, temperature):
    """z = (logit - top) / T, correctly rounded: 0 for the largest logit ``top``, below 0 for the others."""
    return tl.math.div_rn(block - top, temperature)


@triton.jit
def weight_at_least(base, logits, cols, temperature, top, key, mass, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """How many z (``tempered``) have an ordered key of at least ``key`` or, with ``mass`` (not 0), the sum
    of their exp(z); float32 (a count is exact below 2^24). ``mass`` is a value, not a constexpr: the two
    filters share one copy of this code (and of ``threshold_key``'s), which keeps the tile's registers down."""
    total = tl.full((), 0.0, tl.float32)
    for c0 in range(0, cols, BLOCK_N):
        block, c = logits_block(base, logits, c0, cols, DTYPE, BLOCK_N)
        z = tempered(block, top, temperature)
        reach = (ordered_key(z) >= key) & (c < cols)
        total += tl.sum(tl.where(reach, tl.where(mass != 0, tl.exp(z), 1.0), 0.0), axis=0)
    return total


@triton.jit
def threshold_key(base, logits, cols, temperature, top, floor, need, mass, DTYPE: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """The largest ordered key at or above ``floor`` whose z's (those reaching it) weigh at least ``need``
    (``weight_at_least``): bisection over [floor, key(0)] (0: the largest z), a pass over the logits per
    halving."""
    lo = floor.to(tl.int64)
    hi = tl.full((), 0, tl.int64)
    for _ in range(32):
        if lo < hi:
            mid = lo + (hi - lo + 1) // 2
            if weight_at_least(base, logits, cols, temperature, top, mid, mass, DTYPE, BLOCK_N) >= need:
                lo = mid
            else:
                hi = mid - 1
    return lo.to(tl.int32)


@triton.jit
def draw(base, logits, cols, params, seed, position, top, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """A token id drawn from softmax(logits / T) over the tokens the filters keep (module docstring);
    ``params`` points at the row's (temperature > 0, top_k, top_p, min_p), ``top`` is the largest logit."""
    temperature = tl.load(params)
    top_k = tl.load(params + 1).to(tl.int32)
    top_p = tl.load(params + 2)
    min_p = tl.load(params + 3)
    floor = tl.full((), -2147483648, tl.int32)  # the least ordered key kept: all of them
    for mass in range(2):  # one bisection, run for each filter in turn
        if mass == 0:  # top_k: the k-th largest z, the largest key that k z's reach
            active = (top_k > 0) & (top_k < cols)
            need = top_k.to(tl.float32)
        else:  # top_p: the largest key whose z's hold top_p of the mass of those top-k kept
            active = top_p < 1.0
            need = 0.0
            if active:
                need = top_p * weight_at_least(base, logits, cols, temperature, top, floor, 1, DTYPE, BLOCK_N)
        if active:
            floor = threshold_key(base, logits, cols, temperature, top, floor, need, mass, DTYPE, BLOCK_N)
    z_min = tl.log(min_p)  # min_p 0: -inf
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int64)
    for c0 in range(0, cols, BLOCK_N):
        block, c = logits_block(base, logits, c0, cols, DTYPE, BLOCK_N)
        z = tempered(block, top, temperature)
        kept = (ordered_key(z) >= floor) & (z >= z_min) & (c < cols)
        score = tl.where(kept, z - tl.log(-tl.log(uniform(seed, c, position))), float("-inf"))
        top_score = tl.max(score, axis=0)
        first = tl.min(tl.where(kept & (score == top_score), c, cols), axis=0).to(tl.int64)
        if top_score > best:
            best, best_index = top_score, first
    return best_index


@triton.jit
def next_largest(base, logits, cols, value, index, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The logit after (``value``, ``index``) in the order of descending logits, ties by ascending index,
    and its index."""
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), -1, tl.int64)
    for c0 in range(0, cols, BLOCK_N):
        block, c = logits_block(base, logits, c0, cols, DTYPE, BLOCK_N)
        after = ((block < value) | ((block == value) & (c > index))) & (c < cols)
        top = tl.max(tl.where(after, block, float("-inf")), axis=0)
        first = tl.min(tl.where(after & (block == top), c, cols), axis=0).to(tl.int64)
        if (top > best) | ((best_index < 0) & (first < cols)):
            best, best_index = top, first
    return best, best_index


@triton.jit
def sample_tile(base, status,
                row,           # the batch row (of the sequence), for a report of logits not finite
                history,       # heap offset of the batch row's history
                logits,        # heap offset of the batch row's logits
                pos,           # heap offset of the int64 position
                prompt_len,    # heap offset of the int64 prompt length
                params,        # heap offset of the row's float32 (temperature, top_k, top_p, min_p) (SAMPLED)
                seed,          # heap offset of the row's int64 seed (SAMPLED)
                logprobs,      # heap offset of the row's float32 log-probabilities, a column per position (LOGPROBS)
                top_ids,       # heap offsets of the row's TOP_N most likely tokens, TOP_N columns per position:
                top_logprobs,  # int64 ids and float32 log-probabilities
                cols,          # logits of the row (the vocabulary)
                history_cols,  # positions of the history
                DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, SAMPLED: tl.constexpr, LOGPROBS: tl.constexpr,
                TOP_N: tl.constexpr):
    """At ``target = pos + 1``, when ``prompt_len <= target < history_cols``: ``history[target]`` = a token
    drawn with the row's params and seed (``draw``), or the argmax of the logits without ``SAMPLED`` or at
    temperature 0; with ``LOGPROBS`` its log-probability into ``logprobs[target]`` and the ``TOP_N`` most
    likely tokens' into ``top_*[target * TOP_N ...]``. Position 0 is the prompt's: a row of no sequence
    (-1) writes nothing. Logits not finite are reported (``NOT_FINITE``: ``row``, ``target``), the argmax
    written."""
    target = tl.load(heap_ptr(base, pos, tl.int64)) + 1
    if (target >= tl.load(heap_ptr(base, prompt_len, tl.int64))) & (target >= 1) & (target < history_cols):
        token, top, total, not_finite = argmax_logsumexp(base, logits, cols, DTYPE, BLOCK_N, LOGPROBS)
        if not_finite > 0:
            record_fault(status, NOT_FINITE, row, target)
        if SAMPLED:
            if (tl.load(heap_ptr(base, params, tl.float32)) > 0) & (not_finite == 0):
                token = draw(base, logits, cols, heap_ptr(base, params, tl.float32),
                             tl.load(heap_ptr(base, seed, tl.int64)), target, top, DTYPE, BLOCK_N)
        tl.store(heap_ptr(base, history, tl.int64) + target, token)
        if LOGPROBS:
            chosen = tl.load(heap_ptr(base, logits, DTYPE) + token).to(tl.float32)
            tl.store(heap_ptr(base, logprobs, tl.float32) + target, chosen - total)
            value, index = tl.full((), float("inf"), tl.float32), tl.full((), -1, tl.int64)
            for j in range(TOP_N):  # a loop, not unrolled: one copy of next_largest (registers)
                value, index = next_largest(base, logits, cols, value, index, DTYPE, BLOCK_N)
                tl.store(heap_ptr(base, top_ids, tl.int64) + target * TOP_N + j, index)
                tl.store(heap_ptr(base, top_logprobs, tl.float32) + target * TOP_N + j, value - total)


def philox_uniform(seed: int, positions, count: int) -> torch.Tensor:
    """The host's ``uniform``, bit for bit: float32 [len(positions), count], token ids ``0 .. count`` at
    each of ``positions``. The words are uint64 holding 32 bits (a product of two is exact), updated in
    place: a round over a vocabulary costs ten passes, not twenty arrays."""
    mask, high = np.uint64(0xFFFFFFFF), np.uint64(32)
    key = np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
    k0, k1 = key & mask, key >> high
    positions = np.asarray(positions, dtype=np.int64).reshape(-1, 1)
    c0, c1, c2, c3, a, b = np.zeros((6, len(positions), count), dtype=np.uint64)
    c0[:] = np.arange(count, dtype=np.uint64)
    c1[:] = (positions & 0xFFFFFFFF).astype(np.uint64)
    round_a, round_b = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
    for _ in range(10):  # (c0, c1, c2, c3) = (hi(B c2) ^ c1 ^ k0, lo(B c2), hi(A c0) ^ c3 ^ k1, lo(A c0))
        np.multiply(c2, round_b, out=b)
        np.multiply(c0, round_a, out=a)
        np.right_shift(b, high, out=c0)
        c0 ^= c1
        c0 ^= k0
        np.bitwise_and(b, mask, out=c1)
        np.right_shift(a, high, out=c2)
        c2 ^= c3
        c2 ^= k1
        np.bitwise_and(a, mask, out=c3)
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    top = (c0 >> np.uint64(32 - UNIFORM_BITS)).astype(np.float32)
    return torch.from_numpy((top + np.float32(0.5)) * np.float32(2.0 ** -UNIFORM_BITS))


def kept(z: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Which of the tempered logits ``z`` (float32 [vocab], the largest 0) the filters keep (module
    docstring), by sorting."""
    keep = torch.ones_like(z, dtype=torch.bool)
    if 0 < top_k < z.numel():
        keep &= z >= torch.topk(z, top_k).values[-1]
    if top_p < 1:
        mass = torch.where(keep, torch.exp(z), 0.0)
        order = torch.sort(z, descending=True, stable=True).indices
        before = torch.cumsum(mass[order], 0) - mass[order]  # the mass of the z's before each, in order
        needed = (before < torch.tensor(top_p, dtype=torch.float32) * mass.sum()) & keep[order]
        needed[0] = True  # the most likely token, whatever top_p
        keep &= z >= z[order[needed]].min()
    return keep & (z >= torch.log(torch.tensor(min_p, dtype=torch.float32)))


def drawn(logits: torch.Tensor, params: torch.Tensor, seed: int, positions) -> torch.Tensor:
    """The host's ``draw``: the token ids the tile draws from float32 ``logits`` [vocab] with ``params``
    (float32 [4], temperature > 0) under ``seed`` at each of ``positions`` (int64 [len(positions)])."""
    temperature, top_k, top_p, min_p = params
    z = (logits - logits.max()) / temperature
    score = z - torch.log(-torch.log(philox_uniform(seed, positions, z.numel())))
    return torch.where(kept(z, int(top_k), float(top_p), float(min_p)), score, float("-inf")).argmax(dim=1)


def most_likely(logits: torch.Tensor, n: int) -> torch.Tensor:
    """The ids of the ``n`` largest ``logits`` [vocab], the largest first, ties by ascending id: a stable
    descending sort's first n, sorting only the logits at or above the n-th largest (the whole vocabulary
    where one is NaN: fewer than n compare at or above it)."""
    ids = (logits >= torch.topk(logits, n, sorted=False).values.min()).nonzero()[:, 0]
    if ids.numel() < n:
        ids = torch.arange(logits.numel())
    return ids[torch.sort(logits[ids], descending=True, stable=True).indices[:n]]


def _sample_reference(heap, task) -> None:
    target = heap.word(task.pos) + 1
    if not (heap.word(task.prompt_len) <= target < task.history_cols and target >= 1):
        return
    logits = heap.tensor(task.logits, task.DTYPE, 1, task.cols, task.cols)[0].float()
    token = int(logits.argmax())
    finite = bool(torch.isfinite(logits).all())
    if not finite:
        heap.not_finite(task.row, target, f"the logits at heap offset {task.logits}")
    if task.SAMPLED and finite:
        params = heap.tensor(task.params, torch.float32, 1, len(PARAMS), len(PARAMS))[0]
        if params[0] > 0:
            token = int(drawn(logits, params, heap.word(task.seed), [target])[0])
    heap.tensor(task.history, torch.int64, 1, task.history_cols, task.history_cols)[0, target] = token
    if task.LOGPROBS:
        logprobs = torch.log_softmax(logits, 0)
        heap.tensor(task.logprobs, torch.float32, 1, task.history_cols, task.history_cols)[0, target] = logprobs[token]
        if task.TOP_N:
            order = most_likely(logits, task.TOP_N)
            span = task.history_cols * task.TOP_N
            at = slice(target * task.TOP_N, (target + 1) * task.TOP_N)
            heap.tensor(task.top_ids, torch.int64, 1, span, span)[0, at] = order
            heap.tensor(task.top_logprobs, torch.float32, 1, span, span)[0, at] = logprobs[order]


def sample(g, logits, history, pos, prompt_len, params=None, seed=None, logprobs=None, top=None,
           vocab: int | None = None, rows_per_sequence: int = 1):
    """Per batch row b, once past the prompt (``pos_b + 1 >= prompt_len_b``) and inside the history:
    ``history[b, pos_b + 1]`` = a token of ``logits[b, :vocab]``: drawn with the row's ``params[b]``
    (float32 [batch, 4]: ``PARAMS``) and ``seed[b]`` (int64 [batch]), the argmax where the temperature
    is 0 or without params. ``logprobs`` (float32 [batch, positions]): its log-probability at column
    ``pos_b + 1``; ``top`` = (ids int64, logprobs float32), both [batch, positions * N]: the N most
    likely tokens at columns ``N * (pos_b + 1) ...``. ``pos``, ``prompt_len``: one int64 element or one
    per row (``common.row_positions``); ``vocab``: the logits to consider (the first ones; all by
    default: tensor-parallel logits may end with padding). With ``rows_per_sequence`` R, logits row r is
    a verification row of sequence r // R (``tasks.speculation``): ``pos`` has one position per logits
    row, the rest a row per sequence. Returns ``history``."""
    require_float(g, "sample", logits=logits)
    vocab = logits.cols if vocab is None else vocab
    g.require(isinstance(rows_per_sequence, int) and rows_per_sequence >= 1 and logits.rows % rows_per_sequence == 0,
              f"sample: rows_per_sequence must be a positive int dividing the logits' {logits.rows} rows, got "
              f"{rows_per_sequence!r}")
    group = rows_per_sequence
    batch = logits.rows // group
    g.require(logits.ndim == 2 and history.ndim == 2 and history.dtype == torch.int64 and history.rows == batch,
              f"sample: logits must be [batch, vocab] and history int64 [batch, positions], got {logits.shape} "
              f"and {history.shape} {history.dtype}")
    g.require(0 < vocab <= logits.cols, f"sample: vocab {vocab} is outside [1, {logits.cols}]")
    g.require((params is None) == (seed is None), "sample: params and seed go together")
    if params is not None:
        g.require(params.shape == (batch, len(PARAMS)) and params.dtype == torch.float32
                  and seed.shape == (batch,) and seed.dtype == torch.int64,
                  f"sample: params must be float32 [{batch}, {len(PARAMS)}] and seed int64 [{batch}], got "
                  f"{params.shape} {params.dtype} and {seed.shape} {seed.dtype}")
    top_n = 0
    if top is not None:
        g.require(logprobs is not None, "sample: top log-probabilities need logprobs")
        ids, values = top
        top_n = ids.cols // history.cols if ids.ndim == 2 else 0
        g.require(top_n > 0 and ids.shape == values.shape == (batch, history.cols * top_n) and ids.dtype == torch.int64
                  and values.dtype == torch.float32 and top_n <= vocab,
                  f"sample: top must be int64 ids and float32 logprobs [{batch}, {history.cols} * N], N <= {vocab}, "
                  f"got {ids.shape} {ids.dtype} and {values.shape} {values.dtype}")
    if logprobs is not None:
        g.require(logprobs.shape == history.shape and logprobs.dtype == torch.float32,
                  f"sample: logprobs must be float32 {history.shape}, got {logprobs.shape} {logprobs.dtype}")
    positions = row_positions(g, "sample", pos, logits.rows)
    lengths = row_positions(g, "sample", prompt_len, batch)
    opcode = g.opcode(SAMPLE, DTYPE=logits.dtype, BLOCK_N=min(triton.next_power_of_2(vocab), MAX_BLOCK_N),
                      SAMPLED=params is not None, LOGPROBS=logprobs is not None, TOP_N=top_n)

    def written(t, r: int):
        """The region row r declares it writes in ``t`` (a row per sequence): the sequence's row; of R rows
        per sequence, the column numbered like r among them, a stand-in for the one it writes (pos + 1,
        known only on the device): the rows of a sequence write distinct columns, and a reader declares
        the whole row, so it comes after all of them."""
        b = r // group
        return t.region(b, 1, 0, t.cols) if group == 1 else t.region(b, 1, r % group % t.cols, 1)

    for r, (position, position_region) in enumerate(positions):
        b = r // group
        length, length_region = lengths[b]
        reads, writes = [logits.region(r, 1, 0, vocab), position_region, length_region], [written(history, r)]
        words = dict(params=0, seed=0, logprobs=0, top_ids=0, top_logprobs=0)
        if params is not None:
            words.update(params=params.addr(b, 0), seed=seed.addr(0, b))
            reads += [params.region(b, 1, 0, len(PARAMS)), seed.region(0, 1, b, 1)]
        if logprobs is not None:
            words.update(logprobs=logprobs.addr(b, 0))
            writes.append(written(logprobs, r))
        if top_n:
            words.update(top_ids=ids.addr(b, 0), top_logprobs=values.addr(b, 0))
            writes += [written(ids, r), written(values, r)]
        g.add_task(opcode, row=b, history=history.addr(b, 0), logits=logits.addr(r, 0), pos=position, prompt_len=length,
                   cols=vocab, history_cols=history.cols, **words, reads=tuple(reads), writes=tuple(writes),
                   bytes=vocab * logits.element_size * (3 + top_n), flops=vocab * (3 + top_n))
    return history


def sample_greedy(g, logits, history, pos, prompt_len, vocab: int | None = None):
    """``sample`` without params: ``history[b, pos_b + 1] = argmax(logits[b, :vocab])`` once past the prompt."""
    return sample(g, logits, history, pos, prompt_len, vocab=vocab)


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
    logits = g.input("sample.logits", (2, 1500), torch.bfloat16)
    history = g.input("sample.history", (2, 45), torch.int64)
    pos, prompt_len = g.input("sample.pos", (1,), torch.int64), g.input("sample.prompt_len", (1,), torch.int64)
    g.sample_greedy(logits, history, pos, prompt_len, vocab=1400)
    params = g.input("sample.params", (2, len(PARAMS)), torch.float32)
    seed = g.input("sample.seed", (2,), torch.int64)
    logprobs = g.input("sample.logprobs", (2, 45), torch.float32)
    top = g.input("sample.top_ids", (2, 45 * 3), torch.int64), g.input("sample.top_logprobs", (2, 45 * 3), torch.float32)
    return g.sample(logits, history, pos, prompt_len, params, seed, logprobs, top, vocab=1400), g.advance(pos)


SAMPLE = TaskType("sample", sample_tile, _sample_reference, _example)
ADVANCE = TaskType("advance", advance_tile, _advance_reference, _example)
TASK_TYPES = (SAMPLE, ADVANCE)
OPS = {"sample": sample, "sample_greedy": sample_greedy, "advance": advance}
