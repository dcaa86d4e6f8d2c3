"""Config fields that change the math: ``config_of`` honours them as transformers does, or refuses them by
name; never a model that decodes other tokens than transformers' (no kernel is compiled here)."""
import time

import pytest
import torch
import transformers
from transformers import (GemmaConfig, GemmaForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM)

from megakernel.errors import GraphError
from megakernel.models import DecoderConfig, ServingConfig
from megakernel.models.hf import config_of
from megakernel.serving import from_hf, from_pretrained

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=64)


def tiny(config_class, model_class, **fields):
    torch.manual_seed(0)
    return model_class(config_class(**{**TINY, **fields})).eval()


@pytest.mark.parametrize("model,field,value", [
    (lambda: tiny(LlamaConfig, LlamaForCausalLM, hidden_act="relu"), "hidden_act", "'relu'"),
    (lambda: tiny(LlamaConfig, LlamaForCausalLM, hidden_act="gelu_pytorch_tanh"), "hidden_act", "'gelu_pytorch_tanh'"),
    (lambda: tiny(GemmaConfig, GemmaForCausalLM, hidden_act="silu"), "hidden_act", "'silu'"),
    (lambda: tiny(GemmaConfig, GemmaForCausalLM, hidden_act="gelu_python"), "hidden_act", "'gelu_python'"),  # erf
    (lambda: tiny(Phi3Config, Phi3ForCausalLM, pad_token_id=0, partial_rotary_factor=0.5), "partial_rotary_factor", "0.5"),
    (lambda: tiny(GemmaConfig, GemmaForCausalLM, use_bidirectional_attention=True), "use_bidirectional_attention", "True"),
    (lambda: tiny(LlamaConfig, LlamaForCausalLM, is_causal=False), "is_causal", "False"),
])
def test_a_field_that_changes_the_math_and_is_not_built_is_refused_by_name(model, field, value):
    with pytest.raises(GraphError, match=rf"{field}={value}.*supported"):
        config_of(model(), ServingConfig(max_seq_len=32, max_batch=1))


@pytest.mark.parametrize("model", [
    lambda: tiny(LlamaConfig, LlamaForCausalLM, hidden_act="swish"),
    lambda: tiny(GemmaConfig, GemmaForCausalLM, hidden_act="gelu_new"),
    lambda: tiny(GemmaConfig, GemmaForCausalLM, use_bidirectional_attention=False),
    lambda: tiny(LlamaConfig, LlamaForCausalLM, is_causal=True),
    lambda: tiny(LlamaConfig, LlamaForCausalLM, partial_rotary_factor=0.5),  # Llama's default rope ignores it
])
def test_values_that_mean_what_is_built_are_taken(model):
    config_of(model(), ServingConfig(max_seq_len=32, max_batch=1))


def phi3_longrope():
    head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    return tiny(Phi3Config, Phi3ForCausalLM, pad_token_id=0, original_max_position_embeddings=8,
                rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * (head_dim // 2),
                                  long_factor=[1.0 + i for i in range(head_dim // 2)]))


def test_phi3_longrope_past_the_original_context_is_refused():
    """Phi-3's generate prefills again with the long factors past the original context (the cached keys
    rotated anew); the decode step keeps its cached keys, so it would decode other logits there."""
    model = phi3_longrope()
    config_of(model, ServingConfig(max_seq_len=8, max_batch=1))
    with pytest.raises(GraphError, match="max_seq_len=9 > original_max_position_embeddings=8"):
        config_of(model, ServingConfig(max_seq_len=9, max_batch=1))


def test_windows_and_mlp_biases_are_read_where_transformers_reads_them():
    layers = dict(num_hidden_layers=2, sliding_window=4)
    # Llama and Gemma read no sliding_window: a stray one changes nothing in transformers
    assert config_of(tiny(LlamaConfig, LlamaForCausalLM, **layers), ServingConfig(max_seq_len=32)).windows == ()
    assert config_of(tiny(GemmaConfig, GemmaForCausalLM, **layers), ServingConfig(max_seq_len=32)).windows == ()
    # Mistral windows every layer whatever layer_types says; Qwen2 the layers layer_types marks
    mistral = tiny(MistralConfig, MistralForCausalLM, **layers, layer_types=["full_attention", "sliding_attention"])
    assert config_of(mistral, ServingConfig(max_seq_len=32)).windows == (4, 4)
    qwen2 = tiny(Qwen2Config, Qwen2ForCausalLM, **layers, use_sliding_window=True, max_window_layers=1)
    assert config_of(qwen2, ServingConfig(max_seq_len=32)).windows == (None, 4)
    # mlp_bias makes biases in Llama's MLP only
    assert config_of(tiny(LlamaConfig, LlamaForCausalLM, mlp_bias=True), ServingConfig(max_seq_len=32)).mlp_bias
    assert not config_of(tiny(MistralConfig, MistralForCausalLM, mlp_bias=True), ServingConfig(max_seq_len=32)).mlp_bias


def test_a_checkpoint_is_refused_by_name_too(tmp_path):
    transformers.logging.set_verbosity_error()
    tiny(LlamaConfig, LlamaForCausalLM, hidden_act="relu").save_pretrained(tmp_path)
    with pytest.raises(GraphError, match="hidden_act='relu'"):
        from_pretrained(tmp_path, max_seq_len=32)


@pytest.mark.parametrize("sizes,message", [
    (dict(max_seq_len=10**9), r"layers.0.k_cache \(1000000016, 32\) .* the largest heap this machine can hold"),
    (dict(max_seq_len=64, page_size=10**9), r"layers.0.k_cache .* the largest heap this machine can hold"),
    (dict(max_seq_len=64, prefill_chunk=10**6), "prefill_chunk=1,000,000 is more than a decode step holds"),
    (dict(max_seq_len=64, max_batch=10**6), "max_batch=1,000,000 is more than a decode step holds"),
])
def test_sizes_past_what_a_step_can_hold_are_refused_before_anything_is_built(sizes, message):
    """Each of these built for minutes, or without end, before a check (issue 25, finding 3)."""
    model = tiny(LlamaConfig, LlamaForCausalLM)
    start = time.monotonic()
    with pytest.raises(GraphError, match=message):
        from_hf(model, **sizes)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("fields,message", [
    (dict(serving=ServingConfig(max_seq_len=32)), r"serving must be a ServingConfig whose prefill_chunk is resolved"),
    (dict(heads=3), "3 query heads do not divide into groups of 2 KV heads"),
    (dict(vocab=4, serving=ServingConfig(max_seq_len=32, prefill_chunk=0, max_logprobs=5)),
     r"max_logprobs must be an int in \[0, 4\]"),
    (dict(windows=(4, 4)), "windows has 2 entries for 1 layers"),
    (dict(moe=(True,), experts=2, top_k=3), "a sparse MLP needs 1 <= top_k <= experts"),
])
def test_a_decoder_config_is_checked_where_it_is_made(fields, message):
    """``DecoderConfig`` holds the ``ServingConfig`` its step serves (no copied fields) and refuses what no
    step could be built from, by name, before any graph."""
    base = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, layers=1, vocab=128, eps=1e-6,
                qk_norm=False, serving=ServingConfig(max_seq_len=32, max_batch=2, prefill_chunk=0))
    config = DecoderConfig(**base)
    assert (config.batch, config.max_seq_len, config.prefill_chunk) == (2, 32, 0)  # the serving fields, read there
    with pytest.raises(GraphError, match=message):
        DecoderConfig(**{**base, **fields})


def test_a_loader_refuses_an_option_that_is_neither_the_serving_configs_nor_the_kernels_by_name():
    with pytest.raises(GraphError, match=r"unknown option wrokers: a loader takes the ServingConfig's fields and the "
                                         r"kernel's \(backend, workers, policy, timeout, trace, pool\)"):
        from_hf(tiny(LlamaConfig, LlamaForCausalLM), max_seq_len=32, wrokers=2)
    with pytest.raises(GraphError, match="workers must be a positive integer, got 0"):
        from_hf(tiny(LlamaConfig, LlamaForCausalLM), max_seq_len=32, workers=0)
