"""``DecoderConfig``: a decoder's architecture and the ``ServingConfig`` its decode step serves, checked where
it is made (``decoder.decode_step`` builds the step from it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import GraphError, is_count
from ..tasks.formats import FORMATS, Format
from .schema import Packing
from .serving_config import MAX_LOGPROBS, ServingConfig


@dataclass(frozen=True)
class DecoderConfig:
    """A decoder's architecture (its shapes and what its class decides) and what its decode step serves
    (``serving``: context, batch rows, KV pages, prefill rows, log-probabilities, drafts, expert
    parallelism), checked where it is made. The serving fields it reads are ``serving``'s, by the names
    below (``batch`` is ``serving.max_batch``)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    vocab: int
    eps: float
    qk_norm: bool          # Qwen3: RMSNorm of every q and k head before RoPE
    serving: ServingConfig  # its prefill_chunk resolved (``ServingConfig.for_backend``), not None
    dtype: torch.dtype = torch.float32
    rope_scaling: float = 1.0  # multiplies RoPE's cos and sin (YaRN's and LongRoPE's attention factor)
    qkv_bias: bool = False     # Qwen2, Llama's attention_bias: biases on the q, k and v projections
    o_bias: bool = False       # Llama's attention_bias: a bias on the output projection
    mlp_bias: bool = False     # Llama's mlp_bias: biases on the gate, up and down projections
    windows: tuple[int | None, ...] = ()  # per layer: a sliding attention window, or None (all positions)
    # what a class's record decides besides qk_norm (``architectures.Architecture``; Gemma's three)
    activation: str = "silu"   # the gated MLP's: "silu" (SwiGLU) or "gelu_tanh" (GeGLU: GELU's tanh approximation)
    norm_unit_offset: bool = False  # RMSNorms scale by 1 + w
    embed_scaled: bool = False  # embeddings multiplied by sqrt(hidden), as the dtype holds it (the input embed_scale)
    moe: tuple[bool, ...] = ()  # per layer: a sparse (mixture-of-experts) MLP instead of the dense one
    experts: int = 0           # experts per sparse MLP, each of ``moe_intermediate`` columns
    top_k: int = 0             # experts chosen per token
    moe_intermediate: int = 0
    norm_topk: bool = False    # the k weights divided by their sum (Qwen3-MoE's norm_topk_prob, Mixtral)
    router_weight_dtype: torch.dtype = torch.float32  # the dtype the weights are applied in (Qwen3-MoE: the model's)
    formats: tuple[tuple[str, str], ...] = ()  # (weight input, format) of the weights kept quantized (tasks.formats)
    tied: bool = False         # the LM head is the embedding: read from its rows where a rank's share allows
    packings: tuple[Packing, ...] = ()  # other ways a state dict may keep the weights (Phi-3's fused projections, ...)

    def __post_init__(self):
        for name in ("hidden", "heads", "kv_heads", "head_dim", "layers", "vocab"):
            if not is_count(getattr(self, name)):
                raise GraphError(f"DecoderConfig: {name} must be a positive int, got {getattr(self, name)!r}")
        if self.heads % self.kv_heads:
            raise GraphError(f"DecoderConfig: {self.heads} query heads do not divide into groups of {self.kv_heads} "
                             "KV heads")
        if not isinstance(self.serving, ServingConfig) or self.serving.prefill_chunk is None:
            raise GraphError(f"DecoderConfig: serving must be a ServingConfig whose prefill_chunk is resolved "
                             f"(ServingConfig.for_backend), got {self.serving!r}")
        for name, per_layer in (("windows", self.windows), ("moe", self.moe)):
            if len(per_layer) not in (0, self.layers):
                raise GraphError(f"DecoderConfig: {name} has {len(per_layer)} entries for {self.layers} layers")
        if any(self.moe) and not (is_count(self.experts) and is_count(self.top_k) and self.top_k <= self.experts):
            raise GraphError(f"DecoderConfig: a sparse MLP needs 1 <= top_k <= experts, got top_k={self.top_k!r}, "
                             f"experts={self.experts!r}")
        self.serving.check_logprobs(min(MAX_LOGPROBS, self.vocab))

    # the serving fields the step reads
    @property
    def max_seq_len(self) -> int:
        return self.serving.max_seq_len

    @property
    def batch(self) -> int:
        """Sequences a step decodes (``serving.max_batch``)."""
        return self.serving.max_batch

    @property
    def page_size(self) -> int:
        return self.serving.page_size

    @property
    def prefill_chunk(self) -> int:
        return self.serving.prefill_chunk

    @property
    def max_logprobs(self) -> int:
        return self.serving.max_logprobs

    @property
    def draft_tokens(self) -> int:
        return self.serving.draft_tokens

    @property
    def expert_parallel(self) -> bool:
        return self.serving.expert_parallel

    def format_of(self, name: str) -> Format | None:
        """The format weight input ``name`` is kept in on the heap; None: elements of ``dtype``."""
        return next((FORMATS[f] for n, f in self.formats if n == name), None)

    @property
    def max_pages(self) -> int:
        """Entries of a block table row: pages for ``max_seq_len`` positions."""
        return -(-self.max_seq_len // self.page_size)

    @property
    def pool_pages(self) -> int:
        """The pages sequences get (``kv_pages``, or every batch row at ``max_seq_len``)."""
        return self.serving.kv_pages or self.batch * self.max_pages

    @property
    def rows_per_sequence(self) -> int:
        """Rows a sequence takes in a step: its batch row, or ``draft_tokens + 1`` verification rows."""
        return self.serving.rows_per_sequence

    @property
    def batch_rows(self) -> int:
        """Rows a step runs for its batch."""
        return self.serving.batch_rows

    @property
    def rows(self) -> int:
        """Rows of a step: the batch's, then the prefill chunk's (biases are inputs of this many rows)."""
        return self.batch_rows + self.prefill_chunk

    @property
    def table_rows(self) -> int:
        """Block table rows: a batch row's (its verification rows share it), then each prefill row's."""
        return self.batch + self.prefill_chunk
