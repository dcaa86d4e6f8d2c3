"""``build_hf``: a ``transformers`` Llama, Mistral, Qwen2, Qwen3 or Phi-3 causal LM as this rank's share of a
megakernel decode step (a ``ModelBuild``, which ``serving.from_hf`` compiles into a ``DecodeModel``).

The architectures differ in what the decode step builds (``DecoderConfig``: Qwen3's q/k norms, biases
on q/k/v (Qwen2, Llama's ``attention_bias``), on o (``attention_bias``) and on the MLP (Llama's
``mlp_bias``), sliding windows (Mistral's ``sliding_window`` on every layer, Qwen2's per ``layer_types``),
Gemma's norms, embedding scale and GeGLU, sparse MLPs) and in how the weights are stored (Phi-3 fuses
q/k/v and gate/up): each class's record says which (``architectures``), the weights, wherever stored, are
``schema``'s; this module translates a model's config into a ``DecoderConfig`` through its record, reading
a field only where the class's transformers code reads it, and refuses by name a config field that changes
the math in a way the decode step does not build (``Architecture.built_one_way``, ``_check_rope``).

RoPE comes from the model's own rotary module: its inverse frequencies and attention scaling are what
``transformers`` computed for the rope type (``default``, ``linear``, ``llama3``, ``yarn``,
``longrope``, ``dynamic``), nothing is re-derived. ``dynamic`` and ``longrope`` frequencies follow the
sequence length: before each step the module is asked for the frequencies at that position (as
``transformers`` does while it decodes) and they are rebound when they changed, between launches.
"""
from __future__ import annotations

import copy
import math
import threading
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch
from huggingface_hub.errors import StrictDataclassError

from ..bootstrap import current_world
from ..errors import GraphError, is_int, is_number
from .architectures import ARCHITECTURES, Architecture, Window, architecture_of
from .decoder import Shard
from .decoder_config import DecoderConfig
from .schema import shard_weights
from .serving_config import ServingConfig

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
LENGTH_DEPENDENT_ROPE = ("longrope", "dynamic")  # frequencies that follow the sequence length
# Caps on a config's sizes, well past any released model, far below what would exhaust memory while the
# model's modules are made (num_hidden_layers=1e6 grew a meta model by gigabytes; head_dim=2**31 asks 8.6 GB
# of RoPE frequencies): field -> (required, cap). A checkpoint's config.json and a GGUF file's metadata are
# checked against them before transformers reads them.
CONFIG_SIZES = {"num_hidden_layers": (True, 1 << 10), "hidden_size": (True, 1 << 17), "vocab_size": (True, 1 << 23),
                "num_attention_heads": (True, 1 << 10), "intermediate_size": (False, 1 << 20),
                "num_key_value_heads": (False, 1 << 10), "head_dim": (False, 1 << 12),
                "moe_intermediate_size": (False, 1 << 20), "num_experts": (False, 1 << 12),
                "num_local_experts": (False, 1 << 12), "max_position_embeddings": (False, 1 << 24)}
# What transformers raises making a config, or a model of it, that it refuses: its strict dataclasses'
# validation errors (hidden_size not a multiple of the heads, a field of the wrong type), and the plain errors
# of a value of the wrong type or an unknown name (an unknown rope type is a KeyError)
CONFIG_ERRORS = (ValueError, KeyError, TypeError, IndexError, OSError, StrictDataclassError)


_IMPORTING = threading.Lock()


def auto_classes():
    """transformers' ``AutoConfig`` and ``AutoModelForCausalLM``, imported under a lock: virtual ranks are
    threads of one process, and transformers' lazy imports are not thread-safe (two ranks importing at
    once can find a half-made module)."""
    with _IMPORTING:
        from transformers import AutoConfig, AutoModelForCausalLM
    return AutoConfig, AutoModelForCausalLM


def config_of(model, serving: ServingConfig) -> DecoderConfig:
    """The ``DecoderConfig`` of ``model`` (a transformers causal LM, its modules on any device) built for
    ``serving``, or a ``GraphError`` naming what the decode step does not build."""
    name = type(model).__name__
    max_seq_len = serving.max_seq_len
    arch = architecture_of(name, "from_hf")
    cfg = model.config
    for field, (absent, built) in arch.built_one_way().items():
        value = getattr(cfg, field, absent)
        if value not in built:
            raise GraphError(f"{name}: {field}={value!r} is not supported; supported: "
                             f"{', '.join(repr(v) for v in built)}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = model.model.layers[0].self_attn
    qkv_bias = getattr(attention, "q_proj", None) is not None and attention.q_proj.bias is not None
    o_bias = attention.o_proj.bias is not None
    mlp_bias = arch.mlp_bias and bool(getattr(cfg, "mlp_bias", False))
    window = getattr(cfg, "sliding_window", None) if arch.window is not Window.NONE else None
    if window is not None and not (is_int(window) and window > 0):
        raise GraphError(f"{name}: sliding_window={window!r} is not supported; supported: a positive int, or null")
    eps = getattr(cfg, "rms_norm_eps", None)
    if not (is_number(eps) and math.isfinite(eps) and eps > 0):
        raise GraphError(f"{name}: rms_norm_eps={eps!r} is not supported; supported: a finite positive number")
    layer_types = (getattr(cfg, "layer_types", None) if arch.window is Window.BY_LAYER_TYPES else None) \
        or ["sliding_attention"] * cfg.num_hidden_layers
    windows = tuple(window if window and window < max_seq_len and kind == "sliding_attention" else None
                    for kind in layer_types)
    _check_rope(model, arch, head_dim, max_seq_len)
    moe = _moe_config(model) if arch.moe else {}
    return DecoderConfig(**moe, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                         kv_heads=cfg.num_key_value_heads, head_dim=head_dim, intermediate=cfg.intermediate_size,
                         layers=cfg.num_hidden_layers, vocab=cfg.vocab_size, eps=float(cfg.rms_norm_eps),
                         **arch.decoder_fields(), dtype=model.dtype,
                         rope_scaling=float(model.model.rotary_emb.attention_scaling),
                         qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
                         windows=windows if any(windows) else (), serving=serving.for_backend(True))


def config_of_file(where, model, serving: ServingConfig) -> DecoderConfig:
    """``config_of`` for a loader of file or folder ``where``: a refusal names it."""
    try:
        return config_of(model, serving)
    except GraphError as error:
        raise GraphError(f"{where}: {error}") from None


def _check_rope(model, arch: Architecture, head_dim: int, max_seq_len: int) -> None:
    """Refuse what the rotary embedding of the decode step does not build: a base that is not a finite
    positive number, a rope type it does not know,
    a partial rotary (the whole head is rotated), and a longrope sequence past the original context where
    the class re-rotates its cache there (``Architecture.longrope_within_original``: Phi-3)."""
    rotary, cfg, name = model.model.rotary_emb, model.config, arch.name
    # the base, not the frequencies: a loader's model is made on the meta device
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", None))
    if not (is_number(theta) and math.isfinite(theta) and theta > 0):
        raise GraphError(f"{name}: rope_theta={theta!r} is not supported; supported: a finite positive number "
                         f"(the RoPE frequencies are not finite otherwise)")
    if rotary.rope_type not in ROPE_TYPES:
        raise GraphError(f"rope type {rotary.rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    # the module's frequencies, not the config, say whether it is partial: most classes' default rope
    # ignores partial_rotary_factor, Phi-3's honours it
    if rotary.inv_freq.numel() != head_dim // 2:
        factor = (getattr(cfg, "rope_parameters", None) or {}).get("partial_rotary_factor",
                                                                   getattr(cfg, "partial_rotary_factor", None))
        raise GraphError(f"{name}: partial_rotary_factor={factor!r} ({2 * rotary.inv_freq.numel()} of {head_dim} "
                         f"head dims rotated) is not supported; supported: 1.0 (the whole head rotated)")
    original = getattr(cfg, "original_max_position_embeddings", None)
    if arch.longrope_within_original and rotary.rope_type == "longrope" and original and max_seq_len > original:
        raise GraphError(f"{name} with longrope: max_seq_len={max_seq_len} > original_max_position_embeddings="
                         f"{original} is not supported (transformers re-rotates the cached keys with the long "
                         f"factors there, the decode step keeps them); supported: max_seq_len <= {original}")


def _moe_config(model) -> dict:
    """The sparse MLPs of a Qwen3-MoE or Mixtral model: which layers, how many experts, top-k, routing (the
    fields its record's ``MoEReader`` names)."""
    cfg, layers, reader = model.config, model.model.layers, ARCHITECTURES[type(model).__name__].moe
    shared = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "shared_expert")]
    if shared:
        raise GraphError(f"layer {shared[0]} has a shared expert: sparse MLPs with shared experts are not built")
    return dict(moe=tuple(hasattr(layer.mlp, "experts") for layer in layers),
                experts=getattr(cfg, reader.experts), top_k=cfg.num_experts_per_tok,
                moe_intermediate=getattr(cfg, reader.intermediate),
                norm_topk=bool(getattr(cfg, reader.norm_topk)) if reader.norm_topk else True,
                router_weight_dtype=torch.float32 if reader.router_in_float32 else model.dtype)


def build_hf(model, serving: ServingConfig) -> ModelBuild:
    """This rank's share of ``model`` (already in memory; nothing is downloaded) for a decode step built for
    ``serving``."""
    config = config_of(model, serving)
    # a copy: following the sequence length updates the rotary module's frequencies, not the model's
    rotary = copy.deepcopy(model.model.rotary_emb)
    return build(config, model.state_dict(), rotary, bool(model.config.tie_word_embeddings))


@dataclass(frozen=True)
class ModelBuild:
    """This rank's share of a model, ready to compile (``serving.DecodeModel``): its decode step's config,
    its weights by input name (packed ones as stored), ``rope_at(pos)``: the inverse frequencies for the
    step at ``pos``, for rope types whose frequencies follow the sequence length (None: fixed), and the
    bytes of a checkpoint read for it (0: none read)."""

    config: DecoderConfig
    weights: dict[str, torch.Tensor]
    rope_at: Callable[[int], torch.Tensor] | None = None
    bytes_read: int = 0


def build(config: DecoderConfig, tensors: Mapping[str, Any], rotary, tied: bool) -> ModelBuild:
    """This rank's share of a model of ``config`` (``config_of``), its weights taken from ``tensors`` (by
    state-dict name, see ``shard_weights``; ``tied``: the LM head is the embedding), its RoPE frequencies
    from ``rotary`` (a transformers rotary module of its own, which ``rope_frequencies`` may update)."""
    world, rank = current_world()
    config = replace(config, tied=tied)
    weights = shard_weights(tensors, config, Shard.of(config, rank, world), rotary.inv_freq, tied)
    rope_at = rope_frequencies(rotary) if rotary.rope_type in LENGTH_DEPENDENT_ROPE else None
    return ModelBuild(config, weights, rope_at)


DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what a model's weights and activations may be kept in


def in_dtype(model: ModelBuild, dtype: torch.dtype | None) -> ModelBuild:
    """``model`` with its weights and activations in ``dtype`` (None: as they are): each floating weight kept
    in the model's dtype cast to it, as transformers' ``from_pretrained(dtype=...)`` casts them; packed
    weights, FP8 scales and the RoPE frequencies stay as they are, a router applied in float32 stays so."""
    c = model.config
    if dtype is None or dtype == c.dtype:
        return model
    if dtype not in DTYPES:
        raise GraphError(f"dtype must be one of {', '.join(map(str, DTYPES))}, got {dtype!r}")
    weights = {name: w.to(dtype) if w.dtype == c.dtype and name != "inv_freq" and not name.endswith(".scales") else w
               for name, w in model.weights.items()}
    if c.embed_scaled:  # sqrt(hidden) as the new dtype holds it, not a rounding of the old one's
        weights["embed_scale"] = torch.full((c.rows, c.hidden), c.hidden ** 0.5, dtype=dtype)
    router = dtype if c.router_weight_dtype == c.dtype else c.router_weight_dtype
    return replace(model, config=replace(c, dtype=dtype, router_weight_dtype=router), weights=weights)


def rope_frequencies(rotary) -> Callable[[int], torch.Tensor]:
    """The inverse frequencies ``rotary`` (a transformers rotary module, this model's own copy) uses for
    a token at ``pos``: its forward updates them for the sequence length, as in a decode step."""
    probe = torch.zeros(1, dtype=torch.float32, device=rotary.inv_freq.device)

    def at(pos: int) -> torch.Tensor:
        with torch.no_grad():
            rotary(probe, torch.tensor([[pos]], device=probe.device))
        return rotary.inv_freq.detach().float().clone()  # transformers updates the buffer in place
    return at
