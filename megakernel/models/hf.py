"""``from_hf``: a ``transformers`` Llama, Mistral, Qwen2, Qwen3 or Phi-3 causal LM as a megakernel decode model.

The architectures differ in what the decode step builds (``DecoderConfig``: Qwen3's q/k norms, biases
on q/k/v (Qwen2, Llama's ``attention_bias``), on o (``attention_bias``) and on the MLP (Llama's
``mlp_bias``), sliding windows (Mistral's ``sliding_window`` on every layer, Qwen2's per ``layer_types``),
sparse MLPs) and in how the weights are stored (Phi-3 fuses q/k/v and gate/up): the weights, wherever
stored, are ``schema``'s; this module translates a model's config into a ``DecoderConfig``, reading a
field only where the class's transformers code reads it, and refuses by name a config field that changes
the math in a way the decode step does not build (``BUILT_ONE_WAY``, ``_check_rope``).

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
from dataclasses import replace
from typing import Any, Callable, Mapping

import torch
from huggingface_hub.errors import StrictDataclassError

from ..bootstrap import current_world
from ..errors import GraphError, is_count, is_int, is_number
from ..tasks.chunk_attention import BLOCK_ROWS
from .decoder import DecoderConfig, Shard
from .engine import DecodeModel
from .schema import shard_weights

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
             "GemmaForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
MOE = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
LENGTH_DEPENDENT_ROPE = ("longrope", "dynamic")  # frequencies that follow the sequence length
MAX_BATCH, MAX_PREFILL_CHUNK = 4096, 65536  # rows of a decode step: each has tiles in every layer
MAX_DRAFT_TOKENS = BLOCK_ROWS - 1  # a sequence's verification rows are one block of chunk attention
MAX_LOGPROBS = 20  # the most likely tokens a step can report per row (OpenAI's top_logprobs allows 20)
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

# Config fields that change the math but that the decode step builds one way only: field -> (its value when
# the config lacks it, the values that mean what is built), per class. Any other value is refused by name
# rather than decoded as if it were the built one. The activation names are transformers' ACT2FN names of
# exactly SiLU, or of GELU with the tanh approximation (gelu_fast's truncated constant: within 1e-12).
SILU = ("silu", "swish")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new", "gelu_fast", "gelu_python_tanh", "gelu_accurate")
CAUSAL = {"is_causal": (True, (True,))}  # transformers' masks read it off any config
BUILT_ONE_WAY: dict[str, dict[str, tuple[Any, tuple]]] = {
    **{name: {"hidden_act": ("silu", SILU), **CAUSAL} for name in SUPPORTED},
    # Gemma's attention drops its causal mask under sdpa when use_bidirectional_attention is set
    "GemmaForCausalLM": {"hidden_act": ("gelu_pytorch_tanh", GELU_TANH), **CAUSAL,
                         "use_bidirectional_attention": (None, (None, False))},
}
# Which classes' transformers code reads sliding_window (every layer, or the layers layer_types marks:
# Mistral's, Mixtral's, Phi-3's, Qwen3-MoE's ignore layer_types; Llama's and Gemma's ignore the window)
# and mlp_bias (Llama's only): a field read where transformers does not read it would decode differently.
WINDOW_ON_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen3MoeForCausalLM")
WINDOW_BY_LAYER_TYPES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
MLP_BIAS = ("LlamaForCausalLM",)


_IMPORTING = threading.Lock()


def auto_classes():
    """transformers' ``AutoConfig`` and ``AutoModelForCausalLM``, imported under a lock: virtual ranks are
    threads of one process, and transformers' lazy imports are not thread-safe (two ranks importing at
    once can find a half-made module)."""
    with _IMPORTING:
        from transformers import AutoConfig, AutoModelForCausalLM
    return AutoConfig, AutoModelForCausalLM


def config_of(model, max_seq_len: int, max_batch: int, page_size: int = 16, kv_pages: int | None = None,
              prefill_chunk: int = 0, max_logprobs: int = 0, draft_tokens: int = 0) -> DecoderConfig:
    name = type(model).__name__
    if name not in SUPPORTED:
        raise GraphError(f"from_hf supports {', '.join(SUPPORTED)}, got {name}")
    cfg = model.config
    for field, (absent, built) in BUILT_ONE_WAY[name].items():
        value = getattr(cfg, field, absent)
        if value not in built:
            raise GraphError(f"{name}: {field}={value!r} is not supported; supported: "
                             f"{', '.join(repr(v) for v in built)}")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = model.model.layers[0].self_attn
    qkv_bias = getattr(attention, "q_proj", None) is not None and attention.q_proj.bias is not None
    o_bias = attention.o_proj.bias is not None
    mlp_bias = name in MLP_BIAS and bool(getattr(cfg, "mlp_bias", False))
    window = getattr(cfg, "sliding_window", None) if name in WINDOW_ON_EVERY_LAYER + WINDOW_BY_LAYER_TYPES else None
    if window is not None and not (is_int(window) and window > 0):
        raise GraphError(f"{name}: sliding_window={window!r} is not supported; supported: a positive int, or null")
    eps = getattr(cfg, "rms_norm_eps", None)
    if not (is_number(eps) and math.isfinite(eps) and eps > 0):
        raise GraphError(f"{name}: rms_norm_eps={eps!r} is not supported; supported: a finite positive number")
    layer_types = (getattr(cfg, "layer_types", None) if name in WINDOW_BY_LAYER_TYPES else None) \
        or ["sliding_attention"] * cfg.num_hidden_layers
    windows = tuple(window if window and window < max_seq_len and kind == "sliding_attention" else None
                    for kind in layer_types)
    _check_rope(model, name, head_dim, max_seq_len)
    moe = _moe_config(model) if name in MOE else {}
    return DecoderConfig(**moe, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                         kv_heads=cfg.num_key_value_heads, head_dim=head_dim, intermediate=cfg.intermediate_size,
                         layers=cfg.num_hidden_layers, vocab=cfg.vocab_size, eps=float(cfg.rms_norm_eps),
                         qk_norm=name in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), max_seq_len=max_seq_len,
                         batch=max_batch,
                         dtype=model.dtype, rope_scaling=float(model.model.rotary_emb.attention_scaling),
                         qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
                         windows=windows if any(windows) else (), gemma=name == "GemmaForCausalLM",
                         **_serving(max_seq_len, max_batch, page_size, kv_pages, prefill_chunk, max_logprobs,
                                    draft_tokens, cfg.vocab_size))


def config_of_file(where, model, *args) -> DecoderConfig:
    """``config_of`` for a loader of file or folder ``where``: a refusal names it."""
    try:
        return config_of(model, *args)
    except GraphError as error:
        raise GraphError(f"{where}: {error}") from None


def _check_rope(model, name: str, head_dim: int, max_seq_len: int) -> None:
    """Refuse what the rotary embedding of the decode step does not build: a base that is not a finite
    positive number, a rope type it does not know,
    a partial rotary (the whole head is rotated), and a Phi-3 longrope sequence past the original context."""
    rotary, cfg = model.model.rotary_emb, model.config
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
    if name == "Phi3ForCausalLM" and rotary.rope_type == "longrope" and original and max_seq_len > original:
        # Phi-3's generate drops its cache there and prefills the whole sequence again with the long
        # factors; the decode step keeps the keys it cached, rotated with the short ones
        raise GraphError(f"{name} with longrope: max_seq_len={max_seq_len} > original_max_position_embeddings="
                         f"{original} is not supported (transformers re-rotates the cached keys with the long "
                         f"factors there, the decode step keeps them); supported: max_seq_len <= {original}")


def _serving(max_seq_len: int, max_batch: int, page_size, kv_pages, prefill_chunk, max_logprobs, draft_tokens,
             vocab: int) -> dict:
    """The KV cache's, the prefill chunk's, the log-probabilities' and the drafts' fields of a ``DecoderConfig``, checked
    (before anything is built: the graph's tiles grow with max_batch and prefill_chunk, its buffers with
    the rest)."""
    for name, value in (("max_seq_len", max_seq_len), ("max_batch", max_batch), ("page_size", page_size)):
        if not is_count(value):
            raise GraphError(f"{name} must be a positive int, got {value!r}")
    if kv_pages is not None and not is_count(kv_pages):
        raise GraphError(f"kv_pages must be a positive int or None (every row at max_seq_len), got {kv_pages!r}")
    if not (is_int(prefill_chunk) and prefill_chunk >= 0):
        raise GraphError(f"prefill_chunk must be a non-negative int, got {prefill_chunk!r}")
    if not (is_int(max_logprobs) and 0 <= max_logprobs <= min(MAX_LOGPROBS, vocab)):
        raise GraphError(f"max_logprobs must be an int in [0, {min(MAX_LOGPROBS, vocab)}], got {max_logprobs!r}")
    if not (is_int(draft_tokens) and 0 <= draft_tokens <= MAX_DRAFT_TOKENS):
        raise GraphError(f"draft_tokens must be an int in [0, {MAX_DRAFT_TOKENS}] (0: no drafts), got {draft_tokens!r}")
    for name, value, most in (("max_batch", max_batch * (draft_tokens + 1), MAX_BATCH),
                              ("prefill_chunk", prefill_chunk, MAX_PREFILL_CHUNK)):
        if value > most:
            raise GraphError(f"{name}={value:,} is more than a decode step holds; at most {most:,}"
                             + (" batch rows x (draft_tokens + 1)" if name == "max_batch" else ""))
    return dict(page_size=page_size, kv_pages=kv_pages or 0, prefill_chunk=prefill_chunk, max_logprobs=max_logprobs,
                draft_tokens=draft_tokens)


def _moe_config(model) -> dict:
    """The sparse MLPs of a Qwen3-MoE or Mixtral model: which layers, how many experts, top-k, routing."""
    cfg, layers = model.config, model.model.layers
    shared = [i for i, layer in enumerate(layers) if hasattr(layer.mlp, "shared_expert")]
    if shared:
        raise GraphError(f"layer {shared[0]} has a shared expert: sparse MLPs with shared experts are not built")
    mixtral = type(model).__name__ == "MixtralForCausalLM"
    return dict(moe=tuple(hasattr(layer.mlp, "experts") for layer in layers),
                experts=cfg.num_local_experts if mixtral else cfg.num_experts, top_k=cfg.num_experts_per_tok,
                moe_intermediate=cfg.intermediate_size if mixtral else cfg.moe_intermediate_size,
                norm_topk=True if mixtral else bool(cfg.norm_topk_prob),
                router_weight_dtype=torch.float32 if mixtral else model.dtype)  # as each model applies them


def from_hf(model, *, max_seq_len: int, max_batch: int = 1, page_size: int = 16, kv_pages: int | None = None,
            prefill_chunk: int = 0, max_logprobs: int = 0, draft_tokens: int = 0, parallelism: int | str = "auto",
            **kernel_options) -> DecodeModel:
    """Shard ``model`` (already in memory; nothing is downloaded) for this rank and compile its decode step.

    The KV cache is a pool of ``kv_pages`` pages of ``page_size`` positions (None: enough for every batch
    row at ``max_seq_len``); ``prefill_chunk``: prompt tokens a launch prefills besides the batch rows
    (0: a prompt goes through its batch row a token per step); ``max_logprobs``: the most likely tokens
    whose log-probabilities each step reports (``Sequence.top``); ``draft_tokens`` K: each step drafts up
    to K tokens per sequence from its own history and verifies them (``tasks.speculation``: the same
    tokens, in fewer steps where the text repeats itself; 0: none). ``parallelism``: the number of workers
    the step's tiles are sized for; "auto" (see ``DecodeModel``).
    """
    config = config_of(model, max_seq_len, max_batch, page_size, kv_pages, prefill_chunk, max_logprobs, draft_tokens)
    # a copy: following the sequence length updates the rotary module's frequencies, not the model's
    rotary = copy.deepcopy(model.model.rotary_emb)
    return decode_model(config, model.state_dict(), rotary, bool(model.config.tie_word_embeddings), parallelism,
                        **kernel_options)


def decode_model(config: DecoderConfig, tensors: Mapping[str, Any], rotary, tied: bool, parallelism: int | str,
                 **kernel_options) -> DecodeModel:
    """This rank's ``DecodeModel`` of a model of ``config`` (``config_of``), its weights taken from
    ``tensors`` (by state-dict name, see ``shard_weights``; ``tied``: the LM head is the embedding), its
    RoPE frequencies from ``rotary`` (a transformers rotary module of its own, which
    ``rope_frequencies`` may update)."""
    world, rank = current_world()
    config = replace(config, tied=tied)
    weights = shard_weights(tensors, config, Shard.of(config, rank, world), rotary.inv_freq, tied)
    rope_at = rope_frequencies(rotary) if rotary.rope_type in LENGTH_DEPENDENT_ROPE else None
    return DecodeModel(config, weights, parallelism, rope_at, **kernel_options)


def rope_frequencies(rotary) -> Callable[[int], torch.Tensor]:
    """The inverse frequencies ``rotary`` (a transformers rotary module, this model's own copy) uses for
    a token at ``pos``: its forward updates them for the sequence length, as in a decode step."""
    probe = torch.zeros(1, dtype=torch.float32, device=rotary.inv_freq.device)

    def at(pos: int) -> torch.Tensor:
        with torch.no_grad():
            rotary(probe, torch.tensor([[pos]], device=probe.device))
        return rotary.inv_freq.detach().float().clone()  # transformers updates the buffer in place
    return at
