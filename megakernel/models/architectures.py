"""The transformers classes a decode model is built from: one record each (``Architecture``), by class name.

A record says what the class's transformers code computes that the decode step builds (the MLP's
activation, the norms' scale, q/k norms, the embedding's scale), which of its config fields that code
reads (``mlp_bias``, ``sliding_window`` and ``layer_types``, the sparse MLP's sizes and routing), the
other ways its state dicts and checkpoints keep the weights (``schema.Packing``: fused projections,
stacked or renamed experts), and the config fields it builds one way only. ``hf.config_of`` reads a
model's config through its record into a ``DecoderConfig``; no other module names a class, so that a
class is added, or a variant of one, by its record here (and, for math the step does not build yet, its
``DecoderConfig`` field, its ops in ``decoder`` and its weights in ``schema``).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..errors import GraphError
from .schema import FUSED_PROJECTIONS, MIXTRAL_EXPERTS, STACKED_EXPERTS, Packing


class Window(Enum):
    """The layers a class's transformers code gives ``config.sliding_window``: a field read where that code
    does not read it would decode differently."""

    NONE = "none"                  # the class ignores sliding_window (Llama's, Gemma's)
    EVERY_LAYER = "every layer"    # and ignores layer_types (Mistral's, Mixtral's, Phi-3's, Qwen3-MoE's)
    BY_LAYER_TYPES = "layer_types"  # the layers layer_types marks "sliding_attention" (Qwen2's, Qwen3's)


@dataclass(frozen=True)
class Activation:
    """A gated MLP's activation: the op the decode step builds (``DecoderConfig.activation``), the
    ``hidden_act`` of a config that lacks the field, and transformers' ACT2FN names of exactly this
    function (any other ``hidden_act`` is refused by name rather than decoded as this one)."""

    op: str
    default: str
    names: tuple[str, ...]


SILU = Activation("silu", "silu", ("silu", "swish"))
# GELU with the tanh approximation (gelu_fast's truncated constant: within 1e-12)
GELU_TANH = Activation("gelu_tanh", "gelu_pytorch_tanh",
                       ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh", "gelu_accurate"))


@dataclass(frozen=True)
class MoEReader:
    """Where a class's config keeps its sparse MLPs' sizes and routing, and the dtype its router applies
    the chosen experts' weights in (as each model applies them)."""

    experts: str                # the field of experts per sparse MLP
    intermediate: str           # the field of each expert's intermediate columns
    norm_topk: str | None       # the field that says whether the k weights are divided by their sum; None: always
    router_in_float32: bool     # the weights applied in float32 (else in the model's dtype)


# (field, its value when the config lacks it, the values that mean what is built): transformers' masks read
# is_causal off any config
CAUSAL = (("is_causal", True, (True,)),)


@dataclass(frozen=True)
class Architecture:
    """What the decode step builds for transformers class ``name``, and how its config and weights are read.

    ``activation``, ``norm_unit_offset``, ``embed_scaled`` and ``qk_norm`` are the class's math, the same
    for every config of it (``decoder_fields``); the rest say what ``hf.config_of`` reads off a config:
    ``mlp_bias``, the window rule, the sparse MLP (q/k/v and o biases are read off the model's modules,
    whatever the class); ``fixed``: config fields besides ``hidden_act`` and ``is_causal`` that the step
    builds one way only; ``longrope_within_original``: a longrope model decodes only up to
    ``original_max_position_embeddings`` (Phi-3's generate drops its cache past it and prefills the whole
    sequence again with the long factors; the decode step keeps the keys it cached, rotated with the short
    ones).
    """

    name: str
    activation: Activation = SILU
    norm_unit_offset: bool = False   # RMSNorms scale by 1 + w, rounded once (Gemma's)
    embed_scaled: bool = False       # embeddings multiplied by sqrt(hidden) as the dtype holds it (Gemma's)
    qk_norm: bool = False            # an RMSNorm of every q and k head before RoPE (Qwen3's)
    mlp_bias: bool = False           # config.mlp_bias puts biases on gate, up and down (Llama's)
    window: Window = Window.NONE
    moe: MoEReader | None = None     # sparse MLPs on the layers whose mlp has experts
    packings: tuple[Packing, ...] = ()  # other ways its weights are kept (``schema.Stored``'s names are read always)
    fixed: tuple[tuple[str, Any, tuple], ...] = ()
    longrope_within_original: bool = False

    def built_one_way(self) -> dict[str, tuple[Any, tuple]]:
        """The config fields that change the math but that the decode step builds one way only: field ->
        (its value when the config lacks it, the values that mean what is built)."""
        fields = (("hidden_act", self.activation.default, self.activation.names), *CAUSAL, *self.fixed)
        return {field: (absent, built) for field, absent, built in fields}

    def decoder_fields(self) -> dict[str, Any]:
        """The ``DecoderConfig`` fields that the class alone decides."""
        return dict(activation=self.activation.op, norm_unit_offset=self.norm_unit_offset,
                    embed_scaled=self.embed_scaled, qk_norm=self.qk_norm, packings=self.packings)


ARCHITECTURES: dict[str, Architecture] = {}


def register(architecture: Architecture) -> None:
    """Add ``architecture`` to ``ARCHITECTURES`` under its class name (once: a second record of a class would
    make which one decodes it depend on import order)."""
    if architecture.name in ARCHITECTURES:
        raise ValueError(f"{architecture.name} is registered twice")
    ARCHITECTURES[architecture.name] = architecture


def architecture_of(name: str, loader: str) -> Architecture:
    """The record of class ``name``; a class without one is refused by ``loader``, naming those it takes."""
    architecture = ARCHITECTURES.get(name)
    if architecture is None:
        raise GraphError(f"{loader} supports {', '.join(ARCHITECTURES)}, got {name}")
    return architecture


# In the order a refusal lists them.
register(Architecture("LlamaForCausalLM", mlp_bias=True))
register(Architecture("MistralForCausalLM", window=Window.EVERY_LAYER))
register(Architecture("Qwen2ForCausalLM", window=Window.BY_LAYER_TYPES))
register(Architecture("Qwen3ForCausalLM", qk_norm=True, window=Window.BY_LAYER_TYPES))
register(Architecture("Phi3ForCausalLM", window=Window.EVERY_LAYER, packings=FUSED_PROJECTIONS,
                      longrope_within_original=True))
# Gemma's attention drops its causal mask under sdpa when use_bidirectional_attention is set
register(Architecture("GemmaForCausalLM", activation=GELU_TANH, norm_unit_offset=True, embed_scaled=True,
                      fixed=(("use_bidirectional_attention", None, (None, False)),)))
register(Architecture("Qwen3MoeForCausalLM", qk_norm=True, window=Window.EVERY_LAYER,
                      moe=MoEReader("num_experts", "moe_intermediate_size", "norm_topk_prob", False),
                      packings=STACKED_EXPERTS))
register(Architecture("MixtralForCausalLM", window=Window.EVERY_LAYER,
                      moe=MoEReader("num_local_experts", "intermediate_size", None, True),
                      packings=STACKED_EXPERTS + MIXTRAL_EXPERTS))
