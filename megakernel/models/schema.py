"""The weights of a decoder model, each declared once: the graph input a decode step binds (``Weight``: its
name, its shape on a rank, the config flag it exists under, how it is stored), made of tensors as
``transformers`` names and shapes them (``Stored``: where a state dict or checkpoint keeps it, how ranks
split it), and the other ways a state dict may keep those (``Packing``: Phi-3's fused q/k/v and gate/up,
every expert in one tensor, Mixtral's names; a class's record lists those it reads, ``architectures``).

The tables, one per layer kind: ``MODEL`` (embedding, final norm, LM head), ``LAYER`` (every decoder
layer: norms and attention), ``DENSE_MLP`` and ``SPARSE_MLP`` (a mixture of experts). The decode graph's
inputs (``decoder.layer_inputs``, ``decode_step``), a rank's slices of a model (``shard_weights``: from
``from_hf``'s state dict or ``from_pretrained``'s lazy checkpoint) and the benchmarks' random weights all
come from them: an architecture variant is its entries here plus its record (``architectures``).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from ..errors import GraphError
from ..tasks.common import ceil_div
from ..tasks.formats import FP8_SCALE_BLOCK
from ..tasks.expert_parallel import Held
from .packed import Packed, concat

if TYPE_CHECKING:
    from ..tasks.formats import Format
    from .decoder import Shard
    from .decoder_config import DecoderConfig


@dataclass(frozen=True)
class Dim:
    """A dimension of a stored tensor: ``count`` entries of ``unit`` rows or columns each (``DecoderConfig``
    fields; no unit: 1). Ranks that split along it each hold their ``Shard``'s ``span`` of the entries
    (zero-padded to the same size on every rank); no span: ranks never split it."""

    count: str
    unit: str | None = None
    span: str | None = None

    def per_entry(self, c: DecoderConfig) -> int:
        return getattr(c, self.unit) if self.unit else 1

    def whole(self, c: DecoderConfig) -> int:
        return getattr(c, self.count) * self.per_entry(c)

    def on_rank(self, c: DecoderConfig, s: Shard) -> int:
        return getattr(s, self.span).size * self.per_entry(c)


HIDDEN = Dim("hidden")
HEAD_DIM = Dim("head_dim")
Q_HEADS = Dim("heads", "head_dim", span="q")
KV_HEADS = Dim("kv_heads", "head_dim", span="kv")
INTERMEDIATE = Dim("intermediate", span="mlp")
EXPERT_INTERMEDIATE = Dim("moe_intermediate", span="moe")
EXPERTS = Dim("experts")
VOCAB = Dim("vocab", span="lm")


class Partition(Enum):
    """How ranks partition a stored tensor; the value is the dimension each rank holds a span of."""

    REPLICATED = None  # every rank holds it whole
    COLUMN = 0         # column-parallel: each rank its output rows (its heads, MLP columns, vocabulary rows)
    ROW = 1            # row-parallel: each rank its input columns; the partial sums are all-reduced


@dataclass(frozen=True)
class Stored:
    """A tensor as ``transformers`` names and shapes it, whole: ``key`` in its state dict (``{i}``: the
    layer, ``{e}``: the expert), ``shape`` [out, in] for a projection, how ranks split it, and ``gguf``:
    its name in a GGUF file (llama.cpp's)."""

    key: str
    shape: tuple[Dim, ...]
    partition: Partition = Partition.REPLICATED
    gguf: str | None = None

    def __post_init__(self):
        if self.partition is not Partition.REPLICATED and self.shape[self.partition.value].span is None:
            raise ValueError(f"{self.key}: partitioned along a dimension ranks do not split")

    def whole_shape(self, c: DecoderConfig) -> tuple[int, ...]:
        return tuple(d.whole(c) for d in self.shape)

    def rank_shape(self, c: DecoderConfig, s: Shard) -> tuple[int, ...]:
        return tuple(d.on_rank(c, s) if k == self.partition.value else d.whole(c) for k, d in enumerate(self.shape))

    def first_column(self, c: DecoderConfig, s: Shard) -> int:
        """The column of the whole tensor rank ``s``'s first column is (0 unless ranks split its columns)."""
        if self.partition is not Partition.ROW:
            return 0
        dim = self.shape[self.partition.value]
        span = getattr(s, dim.span)
        return span.start * dim.per_entry(c) if span.real else 0

    def scale_layout(self, c: DecoderConfig, s: Shard) -> tuple[int, int]:
        """(scale offset, scale blocks) of rank ``s``'s slice kept with fp8_block scales: where in its first
        128-column block its columns start, and the scale columns every rank holds (those of the rank
        whose columns start deepest into a block: the ranks' graphs have the same shapes)."""
        cols = self.rank_shape(c, s)[-1]
        offsets = [self.first_column(c, s.of(c, r, s.world)) % FP8_SCALE_BLOCK for r in range(s.world)]
        return offsets[s.rank], max(ceil_div(offset + cols, FP8_SCALE_BLOCK) for offset in offsets)

    def take(self, tensor: Any, c: DecoderConfig, s: Shard) -> Any:
        """Rank ``s``'s slice of ``tensor`` (this stored tensor, whole: a tensor or a lazy checkpoint slice)."""
        if self.partition is Partition.REPLICATED:
            return tensor
        dim = self.shape[self.partition.value]
        part = getattr(s, dim.span).take(tensor, dim.per_entry(c), self.partition.value)
        if isinstance(part, Packed) and part.format.scales == "block":
            offset, blocks = self.scale_layout(c, s)
            if part.scale_offset != offset:
                raise GraphError(f"{part.name}: rank {s.rank}'s columns start {part.scale_offset} columns into a scale "
                                 f"block, its graph says {offset}")
            part = part.with_scale_blocks(blocks)
        return part


@dataclass(frozen=True)
class Packing:
    """Another way a state dict keeps stored tensors: one tensor ``key`` holding ``holds`` concatenated
    along dim 0 (a renaming holds one); ``stacked``: the tensor is [experts, ...], expert e's at index e."""

    key: str
    holds: tuple[Stored, ...]
    stacked: bool = False

    def unpack(self, packed: Any, stored: Stored, c: DecoderConfig, expert: int) -> Any:
        """``stored``'s part of ``packed`` (``expert``'s, when stacked): narrowed, so that a lazy checkpoint
        slice reads only what a rank takes of it (a stacked one reads the expert's part here)."""
        offset = sum(part.shape[0].whole(c) for part in self.holds[:self.holds.index(stored)])
        rows = stored.shape[0].whole(c)
        if self.stacked:
            return packed.narrow(0, expert, 1).narrow(1, offset, rows).reshape(stored.whole_shape(c))
        return packed.narrow(0, offset, rows)


@dataclass(frozen=True)
class Weight:
    """A graph input of the decode step: this rank's slices of ``parts``, concatenated along dim 0 (named
    ``layers.{i}.{name}`` for a layer's, ``name`` for the model's)."""

    name: str
    parts: tuple[Stored, ...]
    flag: str | None = None   # the ``DecoderConfig`` flag it exists under (None: always)
    per_row: bool = False     # a bias: [rows, n], the same row for every step row (a step adds it row by row)
    per_expert: bool = False  # ``parts`` for each expert in turn: [experts * rows of the parts, ...]
    packable: bool = False    # a matrix a checkpoint may keep quantized (``DecoderConfig.formats``): the graph
                              # input is then its packed bytes, and scales (``tasks.formats``)

    def shape(self, c: DecoderConfig, s: Shard) -> tuple[int, ...]:
        """Its shape on rank ``s``: the same on every rank (shares are zero-padded)."""
        parts = [part.rank_shape(c, s) for part in self.parts] * (s.experts.stacked if self.per_expert else 1)
        shape = (sum(part[0] for part in parts), *parts[0][1:])
        return (c.rows, *shape) if self.per_row else shape


def _layer(key: str) -> str:
    return f"model.layers.{{i}}.{key}"


def _block(key: str) -> str:
    return f"blk.{{i}}.{key}"


EMBED_TOKENS = Stored("model.embed_tokens.weight", (VOCAB, HIDDEN), gguf="token_embd.weight")
FINAL_NORM = Stored("model.norm.weight", (HIDDEN,), gguf="output_norm.weight")
LM_HEAD = Stored("lm_head.weight", (VOCAB, HIDDEN), Partition.COLUMN, gguf="output.weight")  # vocabulary-parallel
TIED = {LM_HEAD: EMBED_TOKENS}  # what tie_word_embeddings stores as what

INPUT_NORM = Stored(_layer("input_layernorm.weight"), (HIDDEN,), gguf=_block("attn_norm.weight"))
POST_NORM = Stored(_layer("post_attention_layernorm.weight"), (HIDDEN,), gguf=_block("ffn_norm.weight"))
Q_PROJ = Stored(_layer("self_attn.q_proj.weight"), (Q_HEADS, HIDDEN), Partition.COLUMN, gguf=_block("attn_q.weight"))
K_PROJ = Stored(_layer("self_attn.k_proj.weight"), (KV_HEADS, HIDDEN), Partition.COLUMN, gguf=_block("attn_k.weight"))
V_PROJ = Stored(_layer("self_attn.v_proj.weight"), (KV_HEADS, HIDDEN), Partition.COLUMN, gguf=_block("attn_v.weight"))
O_PROJ = Stored(_layer("self_attn.o_proj.weight"), (HIDDEN, Q_HEADS), Partition.ROW, gguf=_block("attn_output.weight"))
Q_BIAS = Stored(_layer("self_attn.q_proj.bias"), (Q_HEADS,), Partition.COLUMN, gguf=_block("attn_q.bias"))
K_BIAS = Stored(_layer("self_attn.k_proj.bias"), (KV_HEADS,), Partition.COLUMN, gguf=_block("attn_k.bias"))
V_BIAS = Stored(_layer("self_attn.v_proj.bias"), (KV_HEADS,), Partition.COLUMN, gguf=_block("attn_v.bias"))
O_BIAS = Stored(_layer("self_attn.o_proj.bias"), (HIDDEN,))  # added once, after the all-reduce
Q_NORM = Stored(_layer("self_attn.q_norm.weight"), (HEAD_DIM,), gguf=_block("attn_q_norm.weight"))
K_NORM = Stored(_layer("self_attn.k_norm.weight"), (HEAD_DIM,), gguf=_block("attn_k_norm.weight"))
GATE_PROJ = Stored(_layer("mlp.gate_proj.weight"), (INTERMEDIATE, HIDDEN), Partition.COLUMN,
                   gguf=_block("ffn_gate.weight"))
UP_PROJ = Stored(_layer("mlp.up_proj.weight"), (INTERMEDIATE, HIDDEN), Partition.COLUMN, gguf=_block("ffn_up.weight"))
DOWN_PROJ = Stored(_layer("mlp.down_proj.weight"), (HIDDEN, INTERMEDIATE), Partition.ROW,
                   gguf=_block("ffn_down.weight"))
GATE_BIAS = Stored(_layer("mlp.gate_proj.bias"), (INTERMEDIATE,), Partition.COLUMN)
UP_BIAS = Stored(_layer("mlp.up_proj.bias"), (INTERMEDIATE,), Partition.COLUMN)
DOWN_BIAS = Stored(_layer("mlp.down_proj.bias"), (HIDDEN,))  # added once, after the all-reduce
ROUTER = Stored(_layer("mlp.gate.weight"), (EXPERTS, HIDDEN))
EXPERT_GATE = Stored(_layer("mlp.experts.{e}.gate_proj.weight"), (EXPERT_INTERMEDIATE, HIDDEN), Partition.COLUMN)
EXPERT_UP = Stored(_layer("mlp.experts.{e}.up_proj.weight"), (EXPERT_INTERMEDIATE, HIDDEN), Partition.COLUMN)
EXPERT_DOWN = Stored(_layer("mlp.experts.{e}.down_proj.weight"), (HIDDEN, EXPERT_INTERMEDIATE), Partition.ROW)

# The other ways a state dict keeps stored tensors, by the classes that keep them so (``architectures``: a
# record's ``packings``, copied into ``DecoderConfig.packings``).
# Phi-3's: q, k and v rows in one projection, gate and up rows in another
FUSED_PROJECTIONS = (
    Packing(_layer("self_attn.qkv_proj.weight"), (Q_PROJ, K_PROJ, V_PROJ)),
    Packing(_layer("self_attn.qkv_proj.bias"), (Q_BIAS, K_BIAS, V_BIAS)),
    Packing(_layer("mlp.gate_up_proj.weight"), (GATE_PROJ, UP_PROJ)),
    Packing(_layer("mlp.gate_up_proj.bias"), (GATE_BIAS, UP_BIAS)),
)
# sparse MLPs as transformers holds them in memory: every expert in one tensor
STACKED_EXPERTS = (
    Packing(_layer("mlp.experts.gate_up_proj"), (EXPERT_GATE, EXPERT_UP), stacked=True),
    Packing(_layer("mlp.experts.down_proj"), (EXPERT_DOWN,), stacked=True),
)
# Mixtral's checkpoints: w1 the gate, w3 the up, w2 the down projection
MIXTRAL_EXPERTS = (
    Packing(_layer("block_sparse_moe.gate.weight"), (ROUTER,)),
    Packing(_layer("block_sparse_moe.experts.{e}.w1.weight"), (EXPERT_GATE,)),
    Packing(_layer("block_sparse_moe.experts.{e}.w3.weight"), (EXPERT_UP,)),
    Packing(_layer("block_sparse_moe.experts.{e}.w2.weight"), (EXPERT_DOWN,)),
)

# Each table in the order the decode step declares its inputs (the heap's layout).
EMBED = Weight("embed", (EMBED_TOKENS,), packable=True)
NORM = Weight("norm", (FINAL_NORM,))
HEAD = Weight("lm_head", (LM_HEAD,), packable=True)
MODEL = (EMBED, NORM, HEAD)
LAYER = (Weight("input_norm", (INPUT_NORM,)),
         Weight("qkv", (Q_PROJ, K_PROJ, V_PROJ), packable=True),
         Weight("o", (O_PROJ,), packable=True),
         Weight("post_norm", (POST_NORM,)),
         Weight("qkv_bias", (Q_BIAS, K_BIAS, V_BIAS), flag="qkv_bias", per_row=True),  # Qwen2, attention_bias
         Weight("q_norm", (Q_NORM,), flag="qk_norm"),  # Qwen3
         Weight("k_norm", (K_NORM,), flag="qk_norm"),
         Weight("o_bias", (O_BIAS,), flag="o_bias", per_row=True))  # Llama's attention_bias
DENSE_MLP = (Weight("gate_up", (GATE_PROJ, UP_PROJ), packable=True),
             Weight("down", (DOWN_PROJ,), packable=True),
             Weight("gate_up_bias", (GATE_BIAS, UP_BIAS), flag="mlp_bias", per_row=True),  # Llama's mlp_bias
             Weight("down_bias", (DOWN_BIAS,), flag="mlp_bias", per_row=True))
SPARSE_MLP = (Weight("router", (ROUTER,)),
              Weight("experts.gate_up", (EXPERT_GATE, EXPERT_UP), per_expert=True, packable=True),  # gate, then up
              Weight("experts.down", (EXPERT_DOWN,), per_expert=True, packable=True))


def layer_weights(c: DecoderConfig, i: int) -> list[Weight]:
    """Layer ``i``'s weights under ``c``: its norms and attention, then its dense or sparse MLP."""
    mlp = SPARSE_MLP if c.moe and c.moe[i] else DENSE_MLP
    return [w for w in (*LAYER, *mlp) if w.flag is None or getattr(c, w.flag)]


def stored_formats(format_of: Callable[[str], Format | None], c: DecoderConfig, tied: bool, where: Any) -> tuple:
    """``DecoderConfig.formats`` of a checkpoint that keeps the tensor of state-dict key ``k`` in
    ``format_of(k)`` (None: as floats): each weight input whose parts it keeps in one quantized format. A
    weight whose parts are kept in different ones, or that the tiles read only as floats, is an error
    naming it (``where``: the checkpoint)."""
    formats = []
    for prefix, weights in (("", MODEL), *((f"layers.{i}.", layer_weights(c, i)) for i in range(c.layers))):
        layer = int(prefix.split(".")[1]) if prefix else 0
        for weight in weights:
            keys = [(TIED.get(p, p) if tied else p).key.format(i=layer, e=e)
                    for e in (range(c.experts) if weight.per_expert else (0,)) for p in weight.parts]
            kinds = [format_of(key) for key in keys]
            if not any(kinds):
                continue
            if not weight.packable:
                raise GraphError(f"{where}: {prefix}{weight.name} is kept in {kinds[0].name}; the tiles read it "
                                 f"only as floats")
            if len(set(kinds)) == 1:
                formats.append((prefix + weight.name, kinds[0].name))
            elif None in kinds or weight.per_expert:
                raise GraphError(f"{where}: the parts of {prefix}{weight.name} ({', '.join(keys)}) are kept in "
                                 f"{', '.join(k.name if k else 'floats' for k in kinds)}; a fused weight in several "
                                 f"formats must have every part quantized and no experts")
            else:  # Q4_K_M's q and k in Q4_K, v in Q6_K: a graph input per part (``part_name``)
                formats += [(part_name(prefix + weight.name, i), kind.name) for i, kind in enumerate(kinds)]
    return tuple(formats)


def part_name(name: str, index: int) -> str:
    """The graph input of part ``index`` of weight input ``name`` when its parts are kept in different
    formats (the decode step then projects into each part's columns: ``decoder.project``)."""
    return f"{name}.part{index}"


def head_in_embedding(c: DecoderConfig, s: Shard) -> bool:
    """The LM head is rows of the embedding's table, not an input of its own: the model ties them and the
    ranks split the vocabulary evenly (a padded span would need zero rows the table does not have; then
    every rank keeps a copy, so that all ranks build the same graph)."""
    return c.tied and c.vocab % s.world == 0


def shard_weights(tensors: Mapping[str, Any], c: DecoderConfig, s: Shard, inv_freq: torch.Tensor, tied: bool
                  ) -> dict[str, torch.Tensor]:
    """Rank ``s``'s slices of a model's weights, named as the decode graph's inputs, and its RoPE
    frequencies (float32).

    ``tensors``: the model's weights by their ``transformers`` state-dict names (``Stored``, or any of
    ``c.packings``), as tensors (``from_hf``) or as lazy slices of a checkpoint (``from_pretrained``: only
    what is taken here is read; a missing tensor is the mapping's error, naming it), or as ``Packed``
    quantized weights (the inputs ``name`` and ``name.scales``, as ``c.formats`` says). ``tied``: the LM
    head is the embedding.
    """
    def rank_slice(weight: Weight, layer: int = 0, name: str = "") -> torch.Tensor | tuple:
        held = s.experts if weight.per_expert else Held(0, 1, 1)
        slices = [part.take(_find(tensors, TIED.get(part, part) if tied else part, c, layer, expert), c, s)
                  for expert in range(held.first, held.first + held.count) for part in weight.parts]
        slices += [p.new_zeros(p.shape) for p in slices[:len(weight.parts)]] * (held.stacked - held.count)
        if c.format_of(part_name(name or weight.name, 0)) is not None:
            return tuple(slices)  # parts in formats of their own: an input each
        value = slices[0] if len(slices) == 1 else concat(slices)
        return value.reshape(1, -1).expand(c.rows, -1) if weight.per_row else value

    weights = {w.name: rank_slice(w) for w in MODEL if w is not HEAD or not head_in_embedding(c, s)}
    weights["inv_freq"] = inv_freq.float()
    if c.embed_scaled:  # the embedding's scale, sqrt(hidden), as the model's dtype holds it, for every batch row
        weights["embed_scale"] = torch.full((c.rows, c.hidden), c.hidden ** 0.5, dtype=c.dtype)
    for i in range(c.layers):
        weights.update({f"layers.{i}.{w.name}": rank_slice(w, i, f"layers.{i}.{w.name}") for w in layer_weights(c, i)})
    for name in [name for name, w in weights.items() if isinstance(w, tuple)]:
        weights.update({part_name(name, i): part for i, part in enumerate(weights.pop(name))})
    inputs = {}
    for name, w in weights.items():
        w = w.detach().contiguous()
        kept, said = (w.format if isinstance(w, Packed) else None), c.format_of(name)
        if kept is not said:
            raise GraphError(f"{name}: kept as {kept.name if kept else w.dtype}, the config says "
                             f"{said.name if said else c.dtype}")
        inputs[name] = w.data if isinstance(w, Packed) else w
        if isinstance(w, Packed) and w.scales is not None:
            inputs[name + ".scales"] = w.scales
    return inputs


def _find(tensors: Mapping[str, Any], stored: Stored, c: DecoderConfig, layer: int, expert: int) -> Any:
    """``stored`` of layer ``layer`` (and expert ``expert``), whole, wherever ``tensors`` keeps it."""
    key = stored.key.format(i=layer, e=expert)
    tensor = tensors.get(key)
    if tensor is not None:
        return tensor
    for packing in c.packings:
        packed = tensors.get(packing.key.format(i=layer, e=expert)) if stored in packing.holds else None
        if packed is not None:
            return packing.unpack(packed, stored, c, expert)
    return tensors[key]  # kept nowhere: the mapping's error names the tensor
