"""Llama / Mistral / Qwen3 decoder layers and whole decode steps as megakernel graphs, tensor-parallel.

Per rank: column-parallel fused QKV and gate/up projections (this rank's heads and intermediate
columns; in a sparse MLP, every expert's share of its columns, or with ``expert_parallel`` its own
experts whole, their parts combined over the ranks), row-parallel O and down projections
followed by a tile-granular all-reduce, and a
vocabulary-parallel LM head followed by an all-gather, so every rank ends with the full logits. The
KV cache, the token history and the position are on the heap: one graph, compiled once, serves every
decode step, and a step feeds the next (it embeds ``history[pos]``, writes its greedy token into
``history[pos + 1]`` once past the prompt, and advances ``pos``), so that one launch runs many steps.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import GraphError
from ..graph import Graph, Tensor
from ..tasks.formats import Format, Quantized, quantized_input, rows_of
from ..tasks.expert_parallel import Held
from ..tasks.sampling import PARAMS
from ..tasks.speculation import STATS
from .decoder_config import DecoderConfig
from .packed import concat
from .schema import EMBED, HEAD, NORM, Stored, Weight, head_in_embedding, layer_weights, part_name


@dataclass(frozen=True)
class Share:
    """A rank's share of a dimension split among ranks: entries ``start .. start + real`` of the whole,
    then zeros up to ``size`` entries, so that every rank has the same shapes whatever the division
    leaves (a zero head, intermediate column or vocabulary row adds nothing)."""

    start: int
    real: int
    size: int

    @classmethod
    def even(cls, total: int, rank: int, world: int) -> "Share":
        size = -(-total // world)
        return cls(rank * size, max(0, min(size, total - rank * size)), size)

    def take(self, weight: torch.Tensor, unit: int = 1, dim: int = 0) -> torch.Tensor:
        """This share of ``weight`` along ``dim``, in entries of ``unit`` rows or columns (``weight`` a tensor
        or anything with ``narrow``, ``shape``, ``new_zeros`` and ``contiguous``: a checkpoint's lazy slice, a
        ``Packed`` quantized weight)."""
        part = weight.narrow(dim, self.start * unit if self.real else 0, self.real * unit).contiguous()
        if self.size == self.real:
            return part
        shape = list(weight.shape)
        shape[dim] = (self.size - self.real) * unit
        return concat([part, weight.new_zeros(shape)], dim)


@dataclass(frozen=True)
class Shard:
    """What rank ``rank`` of ``world`` holds: its query heads, KV heads, MLP columns and vocabulary rows.

    KV heads are split among the ranks with their groups of query heads (padded with all-zero groups to
    a multiple of the ranks), or, with fewer KV heads than ranks and the ranks a multiple of them, each
    shared by ``world / kv_heads`` ranks that split its group (padded with zero query heads); the MLP
    columns and the vocabulary are split evenly, padded with zeros at the end. The padded logits are
    the last columns of the gathered logits: ``DecodeModel`` drops them.
    """

    rank: int
    world: int
    q: Share       # query heads
    kv: Share      # KV heads
    mlp: Share     # intermediate columns
    lm: Share      # vocabulary rows
    moe: Share     # each expert's intermediate columns (all of them under expert parallelism)
    experts: Held  # the experts whose columns it holds (all of them, but under expert parallelism)

    @classmethod
    def of(cls, c: DecoderConfig, rank: int, world: int) -> "Shard":
        group = c.heads // c.kv_heads
        if c.kv_heads < world and world % c.kv_heads == 0:  # each KV head shared by `sharing` ranks
            sharing = world // c.kv_heads
            kv_head, part = divmod(rank, sharing)
            per_rank = -(-group // sharing)
            kv = Share(kv_head, 1, 1)
            q = Share(kv_head * group + part * per_rank, max(0, min(per_rank, group - part * per_rank)), per_rank)
        else:
            kv = Share.even(c.kv_heads, rank, world)
            q = Share(kv.start * group, kv.real * group, kv.size * group)
        if c.expert_parallel and c.experts:
            if world > c.experts:
                raise GraphError(f"expert_parallel: {c.experts} experts cannot be held whole by {world} ranks (at most "
                                 "one rank per expert)")
            moe, experts = Share(0, c.moe_intermediate, c.moe_intermediate), Held.balanced(c.experts, rank, world)
        else:
            moe, experts = Share.even(c.moe_intermediate, rank, world), Held.every(c.experts)
        return cls(rank, world, q, kv, Share.even(c.intermediate, rank, world), Share.even(c.vocab, rank, world), moe,
                   experts)


@dataclass(frozen=True)
class KVCache:
    """A layer's KV cache: pools of ``page_size``-position pages and the block table of each row (of each
    ``rows_per_sequence`` rows: a sequence's verification rows)."""

    k: Tensor
    v: Tensor
    table: Tensor
    page_size: int
    rows_per_sequence: int = 1


def layer_inputs(g: Graph, c: DecoderConfig, s: Shard, i: int) -> dict[str, Tensor]:
    """Layer ``i``'s weights as graph inputs ``layers.{i}.*``, by short name (``schema.layer_weights``)."""
    return {w.name: weight_input(g, c, s, w, f"layers.{i}.") for w in layer_weights(c, i)}


def weight_input(g: Graph, c: DecoderConfig, s: Shard, w: Weight, prefix: str = "") -> Tensor | Quantized:
    """The graph input of the schema's weight ``w`` on rank ``s``, named ``prefix + w.name``: its packed
    bytes (and scales) when the config keeps it quantized."""
    name = prefix + w.name
    format = c.format_of(name)
    if c.format_of(part_name(name, 0)) is not None:  # parts in formats of their own (``project``)
        return tuple(quantized_input(g, part_name(name, i), part.rank_shape(c, s), c.format_of(part_name(name, i)),
                                     c.dtype, *scale_layout(c.format_of(part_name(name, i)), part, c, s))
                     for i, part in enumerate(w.parts))
    if format is None:
        return g.input(name, w.shape(c, s), c.dtype)
    return quantized_input(g, name, w.shape(c, s), format, c.dtype, *scale_layout(format, w.parts[0], c, s))


def scale_layout(format: Format, stored: Stored, c: DecoderConfig, s: Shard) -> tuple[int, int | None]:
    """``quantized_input``'s scale offset and blocks of rank ``s``'s slice of ``stored`` (``Stored.scale_layout``
    for fp8_block; the parts of a weight share their columns)."""
    return stored.scale_layout(c, s) if format.scales == "block" else (0, None)


def project(g: Graph, x: Tensor, w: Tensor | Quantized | tuple, pos: Tensor | None = None) -> Tensor:
    """``x @ w.T`` (zero in the rows at position -1 of ``pos``, if given: ``tasks.linear``); a weight whose
    parts are inputs of their own (kept in different formats) projects into each part's columns of one
    output."""
    if not isinstance(w, tuple):
        return g.linear(x, w, pos=pos)
    y = g.new_tensor((x.rows, sum(part.rows for part in w)), x.dtype)
    start = 0
    for part in w:
        g.linear(x, part, out=y[:, start:start + part.rows], pos=pos)
        start += part.rows
    return y


def decoder_layer(g: Graph, c: DecoderConfig, s: Shard, x: Tensor, pos: Tensor, inv_freq: Tensor, i: int,
                  w: dict[str, Tensor] | None = None, kv: KVCache | None = None, row0: int = 0,
                  consecutive: bool = False, kv_only: bool = False, expert_passes: Tensor | None = None
                  ) -> Tensor | None:
    """One pre-norm decoder layer over the residual stream ``x`` [rows, hidden]; returns the new stream.

    ``w``: the layer's inputs (``layer_inputs``; made here by default), ``kv``: its paged cache (by
    default a contiguous one made here, ``max_seq_len`` positions per row), ``row0``: the first row of
    the biases that ``x``'s rows use; ``consecutive``: the rows hold runs of a sequence's consecutive
    positions (a prefill chunk, verification rows: ``chunk_attention``) rather than one position per sequence;
    ``kv_only``: stop after the KV cache append and return None (a prefill chunk's last layer, whose
    output nothing reads); ``expert_passes``: int64 [experts], where a sparse MLP counts its experts'
    weight passes (``tasks.moe.grouped_experts``). With a position per row, the dense projections do not
    multiply the rows at -1 (no sequence): their outputs are zero (``tasks.linear``)."""
    hd, q_cols, kv_cols = c.head_dim, s.q.size * c.head_dim, s.kv.size * c.head_dim
    g.require(not consecutive or kv is not None, "decoder_layer: consecutive rows need a paged cache (kv)")
    w = w or layer_inputs(g, c, s, i)
    bias = lambda name: w[name][row0:row0 + x.rows]  # noqa: E731
    rows_pos = pos if pos.shape == (x.rows,) else None  # (one position for every row: every row holds it)
    h = g.rms_norm(x, w["input_norm"], c.eps, unit_offset=c.norm_unit_offset)
    qkv = project(g, h, w["qkv"], rows_pos)
    if c.qkv_bias:
        qkv = g.add(qkv, bias("qkv_bias"))
    q, k, v = qkv[:, :q_cols], qkv[:, q_cols:q_cols + kv_cols], qkv[:, q_cols + kv_cols:]
    if c.qk_norm:
        q = g.rms_norm(q, w["q_norm"], c.eps, head_dim=hd)
        k = g.rms_norm(k, w["k_norm"], c.eps, head_dim=hd)
        q, k = g.rope(q, inv_freq, pos, hd, c.rope_scaling), g.rope(k, inv_freq, pos, hd, c.rope_scaling)
    else:  # q and k side by side in qkv's rows: one op rotates both
        qk = g.rope(qkv[:, :q_cols + kv_cols], inv_freq, pos, hd, c.rope_scaling)
        q, k = qk[:, :q_cols], qk[:, q_cols:]
    if kv is None:
        k_cache, v_cache = (g.new_tensor((x.rows * c.max_seq_len, kv_cols), c.dtype, name=f"layers.{i}.{name}")
                            for name in ("k_cache", "v_cache"))
        paging = {}
    else:
        k_cache, v_cache, paging = kv.k, kv.v, {"table": kv.table, "page_size": kv.page_size}
        if kv.rows_per_sequence > 1:
            paging["rows_per_sequence"] = kv.rows_per_sequence
    k_cache = g.kv_append(k_cache, k, pos, x.rows, **paging)
    v_cache = g.kv_append(v_cache, v, pos, x.rows, **paging)
    if kv_only:
        return None
    window = c.windows[i] if c.windows else None
    attn = (g.chunk_attention(q, k_cache, v_cache, pos, hd, window=window, **paging) if consecutive
            else g.decode_attention(q, k_cache, v_cache, pos, x.rows, hd, window=window, **paging))
    out = _row_parallel(g, s, g.linear(attn, w["o"], pos=rows_pos))
    x = g.add(x, g.add(out, bias("o_bias")) if c.o_bias else out)  # a row-parallel bias: once, after
    h = g.rms_norm(x, w["post_norm"], c.eps, unit_offset=c.norm_unit_offset)
    if c.moe and c.moe[i]:
        # tensor-parallel: every expert's share of columns on each rank, the partial sums all-reduced; expert-
        # parallel: each rank its experts whole, the parts combined (tasks.expert_parallel.combine)
        out = g.moe_mlp(h, w["router"], w["experts.gate_up"], w["experts.down"], c.top_k, c.norm_topk,
                        c.router_weight_dtype, passes=expert_passes, expert_parallel=c.expert_parallel)
        return g.add(x, out if c.expert_parallel else _row_parallel(g, s, out))
    gate_up = project(g, h, w["gate_up"], rows_pos)
    if c.mlp_bias:
        gate_up = g.add(gate_up, bias("gate_up_bias"))
    gated = {"silu": g.silu_mul, "gelu_tanh": g.gelu_tanh_mul}[c.activation]
    act = gated(gate_up[:, :s.mlp.size], gate_up[:, s.mlp.size:])
    out = _row_parallel(g, s, g.linear(act, w["down"], pos=rows_pos))
    return g.add(x, g.add(out, bias("down_bias")) if c.mlp_bias else out)


def _row_parallel(g: Graph, s: Shard, partial: Tensor) -> Tensor:
    return g.all_reduce(partial) if s.world > 1 else partial


def decode_step(c: DecoderConfig, g: Graph | None = None, parallelism: int = 1) -> Graph:
    """Embedding of ``history[b, pos_b]`` -> layers -> final norm -> LM head: logits [batch, vocab] of one
    token per batch row (the output "logits"), a token drawn from them into ``history[b, pos_b + 1]`` once
    ``pos_b + 1`` reaches ``prompt_len_b`` (greedy, or with the row's ``sampling`` params and ``seed``:
    ``tasks.sampling``; its log-probability into the output "logprobs" [batch, max_seq_len], the
    ``max_logprobs`` most likely tokens' into "top_ids" and "top_logprobs"), and ``pos_b + 1`` (the
    output "history" is the whole history).
    Every row has its own position and prompt length (the inputs ``pos`` and ``prompt_len``, [batch]);
    a row at position -1 holds no sequence and does no attention work, and one that reaches
    ``max_seq_len`` ends (-1).

    The KV cache of a layer is a pool of ``kv_pages + 1`` pages of ``page_size`` positions (the last one
    takes the writes of positions a row was given no page for), and ``block_table`` [rows, max_pages]
    maps each row's positions to pages (``tasks.kv_cache``). With ``prefill_chunk`` C > 0, the step
    also runs C more rows in each layer, guarded (``Graph.guarded``) by ``prefill_pos[0]``: prompt
    tokens ``prefill_tokens`` at positions ``prefill_pos`` [C] (-1: unused), each with its sequence's
    pages in block table row ``batch + j``, a sequence's rows starting at a multiple of
    ``chunk_attention.BLOCK_ROWS``. They write the KV cache of those positions before the batch
    rows' attention of the same layer reads it (in the last layer they stop there), make no logits, and
    are off (-1) after the step: one launch prefills up to C prompt tokens, the last prompt token of a
    sequence then runs in its batch row.

    With ``draft_tokens`` K > 0 (``tasks.speculation``), each batch row runs K + 1 verification rows
    instead of one: ``draft`` gives them positions ``pos_b ..`` and the known or drafted tokens, they run
    through every layer as a prefill chunk of their sequence (block table row b) into logits [batch *
    (K + 1), vocab], ``sample`` writes each row's token into "verified", and ``accept`` keeps the run the
    model agrees with, advancing ``pos_b`` by 1 .. K + 1; a row whose position reaches ``end_b`` (the
    input "end", [batch]) ends (-1), and a step where no batch row runs skips all but its draft and
    prefill tasks. The int64 input "draft_stats" counts (``speculation.STATS``).

    Built in parts by a ``Step``: the inputs and the drafts (``Step.begun``), the embeddings, the layers,
    the head and the sampling. Built into ``g``, or a new ``Graph(parallelism=parallelism)``: the number of
    workers the step is meant for, which sizes its tiles (split-K linears, attention splits).
    """
    g = g or Graph(parallelism=parallelism)
    step = Step.begun(g, c)
    x, prefill = step.embeddings()
    x = step.layers(x, prefill)
    step.sampling(step.head(x), prefill)
    return g


# The parts of ``decode_step``, in the order it builds them: the order of its inputs, buffers and tasks (the
# heap's layout, what ranks compare before a launch) is theirs.

@dataclass(frozen=True)
class StepInputs:
    """What the parts of a step share: rank ``s``'s shard, the sequences' state (``history``, ``pos``,
    ``prompt_len``), the paged cache's block ``table``, RoPE's ``inv_freq``, the embedding and its scale
    (None: the class does not scale embeddings)."""

    s: Shard
    history: Tensor
    pos: Tensor
    prompt_len: Tensor
    table: Tensor
    inv_freq: Tensor
    embed: Tensor | Quantized
    scale: Tensor | None


@dataclass(frozen=True)
class BatchRows:
    """The batch's rows of a step: each row's position (with drafts, each verification row's), ``guard``: the
    context their tasks are built in; with drafts, the rows' tokens and each sequence's ``end``."""

    pos: Tensor
    guard: Callable[[], contextlib.AbstractContextManager]
    tokens: Tensor | None = None
    end: Tensor | None = None


@dataclass(frozen=True)
class Prefill:
    """A step's prefill chunk: its rows' positions (the input "prefill_pos", -1: unused; its first entry
    guards the chunk's tasks) and their embedded tokens."""

    pos: Tensor
    x: Tensor


class Step:
    """A decode step being built into graph ``g`` for config ``c``: its inputs and its batch rows, which
    every part reads; one method per part, in the order ``decode_step`` builds them."""

    def __init__(self, g: Graph, c: DecoderConfig, inputs: StepInputs, rows: BatchRows):
        self.g, self.c, self.inputs, self.rows = g, c, inputs, rows

    @classmethod
    def begun(cls, g: Graph, c: DecoderConfig) -> "Step":
        """The step's inputs and its batch rows (the drafts) built into ``g``: the parts after them read both."""
        inputs = cls._inputs(g, c)
        return cls(g, c, inputs, cls._rows(g, c, inputs))

    @staticmethod
    def _inputs(g: Graph, c: DecoderConfig) -> StepInputs:
        """The inputs every step reads, and the embedding's (``embed_scale``: sqrt(hidden) in the dtype, for
        every row, where the class scales embeddings)."""
        s = Shard.of(c, g.rank, g.world_size)
        history = g.input("history", (c.batch, c.max_seq_len), torch.int64)
        pos = g.input("pos", (c.batch,), torch.int64)
        prompt_len = g.input("prompt_len", (c.batch,), torch.int64)
        table = g.input("block_table", (c.table_rows, c.max_pages), torch.int64)
        inv_freq = g.input("inv_freq", (c.head_dim // 2,), torch.float32)
        embed = weight_input(g, c, s, EMBED)
        scale = g.input("embed_scale", (c.rows, c.hidden), c.dtype) if c.embed_scaled else None
        return StepInputs(s, history, pos, prompt_len, table, inv_freq, embed, scale)

    @staticmethod
    def _rows(g: Graph, c: DecoderConfig, inputs: StepInputs) -> BatchRows:
        """The drafts: without them, a row per sequence at its position, unguarded; with ``draft_tokens`` K,
        ``draft``'s K + 1 verification rows per sequence (positions ``pos_b ..``, the known or drafted tokens),
        whose tasks are skipped once every row ended."""
        if not c.draft_tokens:
            return BatchRows(inputs.pos, contextlib.nullcontext)
        end = g.input("end", (c.batch,), torch.int64)
        with g.scope("draft"):
            tokens, pos, live = g.draft(inputs.history, inputs.pos, inputs.prompt_len, end, c.rows_per_sequence)
        return BatchRows(pos, functools.partial(g.guarded, live), tokens, end)

    def embeddings(self) -> tuple[Tensor, Prefill | None]:
        """The batch rows' tokens embedded (``history[pos]``, or the verification rows' tokens), then the
        prefill chunk's (the input "prefill_tokens"; None without a chunk), scaled where the class scales
        embeddings."""
        g, c, inputs, rows = self.g, self.c, self.inputs, self.rows
        with rows.guard():
            x = (g.embedding(rows.tokens, inputs.embed) if c.draft_tokens
                 else g.embedding(inputs.history, inputs.embed, pos=inputs.pos))
            if inputs.scale is not None:
                x = g.mul(x, inputs.scale[:c.batch_rows])
        if not c.prefill_chunk:
            return x, None
        prefill_pos = g.input("prefill_pos", (c.prefill_chunk,), torch.int64)
        with g.guarded(prefill_pos[0]):
            chunk = g.embedding(g.input("prefill_tokens", (c.prefill_chunk,), torch.int64), inputs.embed)
            if inputs.scale is not None:
                chunk = g.mul(chunk, inputs.scale[c.batch_rows:])
        return x, Prefill(prefill_pos, chunk)

    def layers(self, x: Tensor, prefill: Prefill | None) -> Tensor:
        """Every decoder layer over the batch rows' stream ``x``, with the layer's paged KV cache (a pool of
        ``kv_pages + 1`` pages); a prefill chunk's rows go through each layer first, so that they write the
        cache that the batch rows' attention of the layer reads (in the last layer they stop there)."""
        g, c, inputs, rows = self.g, self.c, self.inputs, self.rows
        s, table = inputs.s, inputs.table
        pool_rows = (c.pool_pages + 1) * c.page_size
        chunk = prefill.x if prefill is not None else None
        # the (layer, expert) weight passes of the batch rows (row 2i) and of the prefill chunk (2i + 1)
        passes = g.input("expert_passes", (2 * c.layers, c.experts), torch.int64) if any(c.moe) else None
        for i in range(c.layers):
            with g.scope(f"layer{i}"):
                w = layer_inputs(g, c, s, i)
                k, v = (g.new_tensor((pool_rows, s.kv.size * c.head_dim), c.dtype, name=f"layers.{i}.{name}")
                        for name in ("k_cache", "v_cache"))
                if prefill is not None:
                    with g.scope("prefill"), g.guarded(prefill.pos[0]):
                        chunk = decoder_layer(g, c, s, chunk, prefill.pos, inputs.inv_freq, i, w,
                                              KVCache(k, v, table[c.batch:], c.page_size), row0=c.batch_rows,
                                              consecutive=True, kv_only=i == c.layers - 1,
                                              expert_passes=None if passes is None else passes[2 * i + 1])
                with rows.guard():
                    x = decoder_layer(g, c, s, x, rows.pos, inputs.inv_freq, i, w,
                                      KVCache(k, v, table[:c.batch], c.page_size, c.rows_per_sequence),
                                      consecutive=bool(c.draft_tokens),
                                      expert_passes=None if passes is None else passes[2 * i])
        return x

    def head(self, x: Tensor) -> Tensor:
        """The final norm and the LM head (the embedding's rows where the model ties them and the ranks' shares
        allow): this rank's vocabulary columns of the logits, all-gathered into the output "logits"."""
        g, c, inputs, rows = self.g, self.c, self.inputs, self.rows
        s = inputs.s
        with g.scope("head"), rows.guard():
            h = g.rms_norm(x, weight_input(g, c, s, NORM), c.eps, unit_offset=c.norm_unit_offset)
            head = (rows_of(inputs.embed, s.lm.start, s.lm.size) if head_in_embedding(c, s)
                    else weight_input(g, c, s, HEAD))
            logits = g.linear(h, head, pos=rows.pos)
            logits = g.all_gather(logits, dim=1) if s.world > 1 else logits
            g.output("logits", logits)
        return logits

    def sampling(self, logits: Tensor, prefill: Prefill | None) -> None:
        """A token drawn from each row's logits into the history and the position advanced (with drafts: into
        "verified", and the run the model agrees with accepted), its log-probabilities into the outputs
        "logprobs" (and "top_ids", "top_logprobs"); the prefill chunk turned off once done."""
        g, c, inputs, rows = self.g, self.c, self.inputs, self.rows
        with g.scope("sample"):
            sampling = g.input("sampling", (c.batch, len(PARAMS)), torch.float32)
            seed = g.input("seed", (c.batch,), torch.int64)
            logprobs = g.new_tensor((c.batch, c.max_seq_len), torch.float32, name="logprobs")
            top = tuple(g.new_tensor((c.batch, c.max_seq_len * c.max_logprobs), dtype, name=name)
                        for name, dtype in (("top_ids", torch.int64), ("top_logprobs", torch.float32))) \
                if c.max_logprobs else None
            if c.draft_tokens:
                verified = g.new_tensor((c.batch, c.max_seq_len), torch.int64, name="verified")
                stats = g.input("draft_stats", (len(STATS),), torch.int64)
                with rows.guard():
                    g.sample(logits, verified, rows.pos, inputs.prompt_len, sampling, seed, logprobs, top,
                             vocab=c.vocab, rows_per_sequence=c.rows_per_sequence)
                    g.output("history", g.accept(inputs.history, verified, rows.tokens, rows.pos, inputs.pos,
                                                 inputs.prompt_len, rows.end, stats))
            else:
                g.output("history", g.sample(logits, inputs.history, inputs.pos, inputs.prompt_len, sampling, seed,
                                             logprobs, top, vocab=c.vocab))
                g.advance(inputs.pos, limit=c.max_seq_len)
            g.output("logprobs", logprobs)
            if top is not None:
                g.output("top_ids", top[0])
                g.output("top_logprobs", top[1])
            if prefill is not None:
                g.advance(prefill.pos, limit=0)  # the chunk is done: off until the host gives another

