"""``from_hf``: a ``transformers`` Llama, Mistral, Qwen2, Qwen3 or Phi-3 causal LM as a megakernel decode model.

The architectures differ in what the decode step builds (``DecoderConfig``: Qwen3's q/k norms, biases
on q/k/v (Qwen2, Llama's ``attention_bias``), on o (``attention_bias``) and on the MLP (``mlp_bias``),
sliding windows per layer (Mistral's ``sliding_window``, ``layer_types``), sparse MLPs) and in how the
weights are stored (Phi-3 fuses q/k/v and gate/up): the weights, wherever stored, are ``schema``'s;
this module translates a model's config into a ``DecoderConfig``.

RoPE comes from the model's own rotary module: its inverse frequencies and attention scaling are what
``transformers`` computed for the rope type (``default``, ``linear``, ``llama3``, ``yarn``,
``longrope``, ``dynamic``), nothing is re-derived. ``dynamic`` and ``longrope`` frequencies follow the
sequence length: before each step the module is asked for the frequencies at that position (as
``transformers`` does while it decodes) and they are rebound when they changed, between launches.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Mapping

import torch

from ..bootstrap import current_world
from ..errors import GraphError, is_count
from .decoder import DecoderConfig, Shard
from .engine import DecodeModel
from .schema import shard_weights

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Phi3ForCausalLM",
             "GemmaForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
MOE = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")
LENGTH_DEPENDENT_ROPE = ("longrope", "dynamic")  # frequencies that follow the sequence length


def config_of(model, max_seq_len: int, max_batch: int, page_size: int = 16, kv_pages: int | None = None,
              prefill_chunk: int = 0) -> DecoderConfig:
    name = type(model).__name__
    if name not in SUPPORTED:
        raise GraphError(f"from_hf supports {', '.join(SUPPORTED)}, got {name}")
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attention = model.model.layers[0].self_attn
    qkv_bias = getattr(attention, "q_proj", None) is not None and attention.q_proj.bias is not None
    o_bias = attention.o_proj.bias is not None
    mlp_bias = bool(getattr(cfg, "mlp_bias", False))
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
    windows = tuple(window if window and window < max_seq_len and kind == "sliding_attention" else None
                    for kind in layer_types)
    rope_type = model.model.rotary_emb.rope_type
    if rope_type not in ROPE_TYPES:
        raise GraphError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    moe = _moe_config(model) if name in MOE else {}
    return DecoderConfig(**moe, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                         kv_heads=cfg.num_key_value_heads, head_dim=head_dim, intermediate=cfg.intermediate_size,
                         layers=cfg.num_hidden_layers, vocab=cfg.vocab_size, eps=float(cfg.rms_norm_eps),
                         qk_norm=name in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"), max_seq_len=max_seq_len,
                         batch=max_batch,
                         dtype=model.dtype, rope_scaling=float(model.model.rotary_emb.attention_scaling),
                         qkv_bias=qkv_bias, o_bias=o_bias, mlp_bias=mlp_bias,
                         windows=windows if any(windows) else (), gemma=name == "GemmaForCausalLM",
                         **_serving(max_seq_len, max_batch, page_size, kv_pages, prefill_chunk))


def _serving(max_seq_len: int, max_batch: int, page_size, kv_pages, prefill_chunk) -> dict:
    """The KV cache's and the prefill chunk's fields of a ``DecoderConfig``, checked."""
    for name, value in (("max_seq_len", max_seq_len), ("max_batch", max_batch), ("page_size", page_size)):
        if not is_count(value):
            raise GraphError(f"{name} must be a positive int, got {value!r}")
    if kv_pages is not None and not is_count(kv_pages):
        raise GraphError(f"kv_pages must be a positive int or None (every row at max_seq_len), got {kv_pages!r}")
    if not (isinstance(prefill_chunk, int) and not isinstance(prefill_chunk, bool) and prefill_chunk >= 0):
        raise GraphError(f"prefill_chunk must be a non-negative int, got {prefill_chunk!r}")
    return dict(page_size=page_size, kv_pages=kv_pages or 0, prefill_chunk=prefill_chunk)


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
            prefill_chunk: int = 0, parallelism: int | str = "auto", **kernel_options) -> DecodeModel:
    """Shard ``model`` (already in memory; nothing is downloaded) for this rank and compile its decode step.

    The KV cache is a pool of ``kv_pages`` pages of ``page_size`` positions (None: enough for every batch
    row at ``max_seq_len``); ``prefill_chunk``: prompt tokens a launch prefills besides the batch rows
    (0: a prompt goes through its batch row a token per step). ``parallelism``: the number of workers
    the step's tiles are sized for; "auto" (see ``DecodeModel``).
    """
    config = config_of(model, max_seq_len, max_batch, page_size, kv_pages, prefill_chunk)
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
