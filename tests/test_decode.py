"""Whole-layer decode against ``transformers`` itself, with the same random weights."""
import functools

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

import megakernel as mk
from megakernel.aot import compile_kernel
from megakernel.models import DecoderConfig, ServingConfig, decode_step
from megakernel.serving import from_hf

from helpers import assert_close

# decoder models end to end against transformers: on the torch backend (the Triton tiles are proven under the
# interpreter by test_ops and test_task_types, and composed into a tensor-parallel Llama by the demo, test_cli)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_backend")]

# Not powers of two on purpose: head dim 48, intermediate 200, one KV head (Llama) or two (Qwen3).
SHAPES = dict(hidden_size=96, head_dim=48, intermediate_size=200, num_hidden_layers=2, vocab_size=128,
              max_position_embeddings=64)


def hf_model(family: str, heads: int = 4, kv_heads: int = 1, dtype=torch.float32, seed: int = 0, layers: int = 2):
    torch.manual_seed(seed)
    if family == "llama":
        config = LlamaConfig(num_attention_heads=heads, num_key_value_heads=kv_heads, rope_theta=5000.0,
                             **{**SHAPES, "num_hidden_layers": layers})
        model = LlamaForCausalLM(config)
    elif family == "mistral":
        config = MistralConfig(num_attention_heads=heads, num_key_value_heads=kv_heads, rope_theta=1e6, **SHAPES)
        model = MistralForCausalLM(config)
    else:
        config = Qwen3Config(num_attention_heads=heads, num_key_value_heads=kv_heads, rope_theta=20000.0,
                             **{**SHAPES, "num_hidden_layers": layers})
        model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # norms start at one in transformers: make them random so that they are tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # greedy to the end, as DecodeModel.generate does
    return model.to(dtype).eval()


def prompt(batch: int, length: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, SHAPES["vocab_size"], (batch, length), generator=torch.Generator().manual_seed(seed))


def _tolerance(dtype) -> float:
    return 1e-4 if dtype == torch.float32 else 2e-2


@pytest.mark.parametrize("family,dtype,batch,parallelism", [
    ("llama", torch.float32, 1, 1), ("llama", torch.float32, 2, 1), ("qwen3", torch.float32, 2, 1),
    ("llama", torch.bfloat16, 1, 1), ("qwen3", torch.bfloat16, 1, 1), ("mistral", torch.float32, 1, 1),
    ("llama", torch.float32, 2, 24), ("qwen3", torch.bfloat16, 1, 24),  # tiles sized for 24 workers
])
def test_logits_over_consecutive_positions_match_transformers(family, dtype, batch, parallelism):
    model = hf_model(family, kv_heads=1 if family == "llama" else 2, dtype=dtype)
    ids = prompt(batch, length=6)
    with torch.no_grad():
        expected = model(ids).logits.float()  # causal attention over the whole prompt at once
    # 80 positions: two attention splits at parallelism 1, three of 32 at 24 (where the bfloat16 Qwen3
    # step also splits its down projection along K)
    m = from_hf(model, max_seq_len=80, max_batch=batch, workers=2, parallelism=parallelism)
    try:
        for pos in range(ids.shape[1]):
            logits = m.decode(ids[:, pos], pos)
            assert_close(logits, expected[:, pos], _tolerance(dtype),
                         f"{family} {dtype} batch {batch} parallelism {parallelism} pos {pos}")
    finally:
        m.close()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_greedy_generation_matches_transformers(family):
    model = hf_model(family, kv_heads=1 if family == "llama" else 2)
    ids = prompt(1)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    m = from_hf(model, max_seq_len=32, workers=2)
    try:
        assert torch.equal(m.generate(ids, max_new_tokens=12), expected)
    finally:
        m.close()


# Rope types as checkpoints ship them, sized so that a short generation crosses each type's original
# context of 8 positions (where llama3, yarn and longrope change regime and dynamic starts to rescale).
ROPES = {
    "linear": dict(factor=2.0),
    "llama3": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8),
    "yarn": dict(factor=4.0, original_max_position_embeddings=8),
    "longrope": dict(short_factor=[1.0 + 0.05 * i for i in range(24)], long_factor=[1.5 + 0.1 * i for i in range(24)],
                     original_max_position_embeddings=8),
    "dynamic": dict(factor=2.0),
}


@pytest.mark.parametrize("rope_type", sorted(ROPES))
def test_every_rope_type_matches_transformers(rope_type):
    """Frequencies and attention scaling from transformers' own rotary module; logits at every step of a
    greedy generation within 1e-4 of transformers' (decoding with its KV cache, one token a step, as
    generate does after the prompt) and the same tokens as its generate."""
    torch.manual_seed(0)
    config = LlamaConfig(**{**SHAPES, "vocab_size": 301, "max_position_embeddings": 8 if rope_type == "dynamic" else 32},
                         num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters=dict(rope_type=rope_type, rope_theta=500.0, **ROPES[rope_type]))
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 301, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=9, do_sample=False, pad_token_id=0)
    m = from_hf(model, max_seq_len=16, workers=2)
    try:
        assert m.config.rope_scaling == pytest.approx(model.model.rotary_emb.attention_scaling)
        cache = None
        with torch.no_grad():
            for pos in range(expected.shape[1] - 1):  # transformers one token at a step, its cache kept
                out = model(expected[:, pos:pos + 1], cache=cache, use_cache=True, position_ids=torch.tensor([[pos]]))
                cache = out.cache
                assert_close(m.decode(expected[:, pos], pos), out.logits[:, -1].float(), 1e-4, f"{rope_type} pos {pos}")
        assert torch.equal(m.generate(ids, max_new_tokens=9), expected)  # from position 0 again, the same kernel
    finally:
        m.close()


def architecture(name: str):
    """A small random model of each architecture from_hf takes beyond Llama/Mistral/Qwen3's defaults."""
    from transformers import GemmaConfig, GemmaForCausalLM, Phi3Config, Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    shapes = dict(SHAPES, vocab_size=301, num_attention_heads=4, num_key_value_heads=2)
    model = {
        "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**shapes)),                       # q/k/v biases
        "phi3": lambda: Phi3ForCausalLM(Phi3Config(**shapes, pad_token_id=0)),         # fused qkv, gate_up
        "llama_biases": lambda: LlamaForCausalLM(LlamaConfig(**shapes, attention_bias=True, mlp_bias=True)),
        "mistral_window": lambda: MistralForCausalLM(MistralConfig(**shapes, sliding_window=4)),
        "llama_tied": lambda: LlamaForCausalLM(LlamaConfig(**shapes, tie_word_embeddings=True)),
        "gemma": lambda: GemmaForCausalLM(GemmaConfig(**shapes)),  # 1 + w norms, scaled embeddings, GeGLU
    }[name]().eval()
    with torch.no_grad():  # biases and norms start constant in transformers: make them random so that they are tested
        for param_name, p in model.named_parameters():
            if param_name.endswith("bias") or "norm" in param_name:
                p.copy_((1.0 if "norm" in param_name and name != "gemma" else 0.0) + 0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("name", ["qwen2", "phi3", "llama_biases", "mistral_window", "llama_tied", "gemma"])
def test_architectures_match_transformers(name):
    """Logits at every step of a greedy generation within 1e-4 of transformers' (one token a step, its
    cache kept) and the same tokens as its generate; the window of 4 positions is crossed."""
    model = architecture(name)
    ids = torch.randint(0, 301, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=7, do_sample=False, pad_token_id=0)
    m = from_hf(model, max_seq_len=16, workers=2)
    try:
        cache = None
        with torch.no_grad():
            for pos in range(expected.shape[1] - 1):
                out = model(expected[:, pos:pos + 1], cache=cache, use_cache=True, position_ids=torch.tensor([[pos]]))
                cache = out.cache
                assert_close(m.decode(expected[:, pos], pos), out.logits[:, -1].float(), 1e-4, f"{name} pos {pos}")
        assert torch.equal(m.generate(ids, max_new_tokens=7), expected)
    finally:
        m.close()


@pytest.mark.parametrize("name", ["qwen2", "phi3", "llama_biases", "llama_tied", "gemma"])
def test_the_weight_schema_is_what_the_graph_declares_and_the_ranks_bind(name):
    """Every graph input a weight makes (``schema``) has the shape of what ``shard_weights`` takes for it,
    on every rank of 3, whether the model stores q/k/v and gate/up apart or fused (Phi-3)."""
    from megakernel.models.decoder import Shard
    from megakernel.models.hf import config_of
    from megakernel.models.schema import shard_weights

    model = architecture(name)
    c = config_of(model, ServingConfig(max_seq_len=16, max_batch=2, prefill_chunk=4))
    for rank in range(3):
        g = decode_step(c, mk.Graph(world_size=3, rank=rank))
        weights = shard_weights(model.state_dict(), c, Shard.of(c, rank, 3), model.model.rotary_emb.inv_freq,
                                tied=bool(model.config.tie_word_embeddings))
        runtime = {"history", "pos", "prompt_len", "block_table", "prefill_pos", "prefill_tokens", "sampling", "seed"}
        assert set(weights) == set(g.inputs) - runtime, f"{name}, rank {rank}"
        for input_name, tensor in weights.items():
            assert tuple(tensor.shape) == tuple(g.inputs[input_name].shape), f"{name}, rank {rank}: {input_name}"


@pytest.mark.parametrize("name", ["qwen2", "phi3", "llama_biases", "mistral_window", "llama_tied", "gemma"])
def test_architectures_over_three_ranks(name):
    """Each architecture sharded over 3 virtual ranks (4 query heads and 2 KV heads padded to 3 groups,
    intermediate 200 and vocabulary 301 padded): transformers' tokens, and its logits at the first step."""
    model = architecture(name)
    ids = torch.randint(0, 301, (1, 4), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        first = model(ids[:, :1]).logits[:, 0].float()
    results = mk.launch(functools.partial(_padded_rank, model, ids), world_size=3, virtual=True, timeout=600)
    for rank, (tokens, logits) in enumerate(results):
        assert torch.equal(tokens, expected), f"{name}: rank {rank} of 3"
        assert_close(logits, first, 1e-4, f"{name}: rank {rank} of 3")


def _padded_rank(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = from_hf(model, max_seq_len=16, workers=1)
    try:
        return m.generate(ids, max_new_tokens=6), m.decode(ids[:, 0], 0)
    finally:
        m.close()


@pytest.mark.parametrize("world,heads,kv_heads", [(3, 4, 2), (4, 6, 2)])
def test_any_tensor_parallel_degree_pads_what_does_not_divide(world, heads, kv_heads):
    """Vocabulary 301 and intermediate 200 over 3 or 4 ranks, 2 KV heads over 3 ranks (a zero KV head
    pads the third) and 6 query heads over 4 ranks (each KV head's 3 query heads split 2 + 1 and a
    zero one): the same tokens and logits as transformers."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**SHAPES, "vocab_size": 301}, num_attention_heads=heads,
                                         num_key_value_heads=kv_heads)).eval()
    model.generation_config.eos_token_id = None
    ids = torch.randint(0, 301, (1, 4), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        first = model(ids[:, :1]).logits[:, 0].float()
    results = mk.launch(functools.partial(_padded_rank, model, ids), world_size=world, virtual=True, timeout=600)
    for rank, (tokens, logits) in enumerate(results):
        assert torch.equal(tokens, expected), f"rank {rank} of {world}"
        assert logits.shape == (1, 301)
        assert_close(logits, first, 1e-4, f"rank {rank} of {world}")


def tensor_parallel_generation(family: str, batch: int, model=None, new_tokens: int = 12):
    """One rank's tokens and logits; ``model``: the one model virtual ranks share (threads must not make
    their own: torch's seeded generator is the process's)."""
    model = model or hf_model(family, kv_heads=1 if family == "llama" else 2)
    m = from_hf(model, max_seq_len=24, max_batch=batch, workers=1)
    try:
        tokens = m.generate(prompt(batch), max_new_tokens=new_tokens)
        return tokens, m.decode(tokens[:, 3], 3)
    finally:
        m.close()


# (llama at 4 ranks: test_generation_on_the_device_matches_transformers, on virtual ranks). Process ranks
# take seconds each to start: 2 ranks as processes, 4 as threads (virtual ranks)
@pytest.mark.parametrize("family,world,batch", [("llama", 2, 1), ("qwen3", 2, 2), ("qwen3", 4, 1)])
def test_tensor_parallel_generation_matches_transformers(family, world, batch):
    model = hf_model(family, kv_heads=1 if family == "llama" else 2)
    ids = prompt(batch)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        # position 3 recomputed with the generated tokens as context: the cache keeps every step
        reference = model(expected[:, :4]).logits[:, 3].float()
    virtual = world > 2
    results = mk.launch(functools.partial(tensor_parallel_generation, family, batch, model if virtual else None),
                        world_size=world, timeout=600, virtual=virtual)
    for rank, (tokens, logits) in enumerate(results):
        assert torch.equal(tokens, expected), f"rank {rank} of {world}"
        assert_close(logits, reference, 1e-4, f"rank {rank} of {world}")
        assert torch.equal(logits, results[0][1])


# The small decode step compiles for sm_90 and gfx942 in test_aot; these shapes compile for one of them each
# (the specs they check are the same for both).
@pytest.mark.parametrize("config,parallelism,targets", [
    (DecoderConfig(hidden=96, heads=4, kv_heads=2, head_dim=48, intermediate=200, layers=1, vocab=128, eps=1e-6,
                   qk_norm=True, serving=ServingConfig(max_seq_len=80, max_batch=2, prefill_chunk=0),
                   dtype=torch.bfloat16),
     1, ("sm_90", "gfx942")),
    # GPU-shaped at batch 1: the one-row GEMV tiles and attention with 16-byte vectors (aligned, whole blocks)
    (DecoderConfig(hidden=1024, heads=8, kv_heads=2, head_dim=128, intermediate=2048, layers=1, vocab=512,
                   eps=1e-6, qk_norm=False, serving=ServingConfig(max_seq_len=256, prefill_chunk=0),
                   dtype=torch.bfloat16),
     64, ("sm_90",)),
    # Gemma-shaped: head_dim 256, 1 + w norms, GELU-tanh gates, a sliding window, q/k/v biases
    (DecoderConfig(hidden=512, heads=2, kv_heads=1, head_dim=256, intermediate=512, layers=1, vocab=256, eps=1e-6,
                   qk_norm=False, serving=ServingConfig(max_seq_len=64, prefill_chunk=0), dtype=torch.bfloat16,
                   activation="gelu_tanh",
                   norm_unit_offset=True, embed_scaled=True, qkv_bias=True, windows=(32,)), 1, ("gfx942",)),
    # drafts: 3 verification rows per batch row through chunk attention, sampled into "verified", accepted
    (DecoderConfig(hidden=96, heads=4, kv_heads=2, head_dim=48, intermediate=200, layers=1, vocab=128, eps=1e-6,
                   qk_norm=True, serving=ServingConfig(max_seq_len=80, max_batch=2, prefill_chunk=0, draft_tokens=2),
                   dtype=torch.bfloat16), 1, ("sm_90",)),
])
def test_decode_graph_compiles_ahead_of_time(config, parallelism, targets):
    g = decode_step(config, mk.Graph(world_size=1, rank=0, parallelism=parallelism))
    if config.batch == 1:
        specs = [dict(s.constexprs) for s in g.specs]
        assert any(s.get("BLOCK_M") == 1 and s.get("EVEN_K") and s.get("ALIGNED") and s.get("USE_DOT") is False
                   for s in specs)
        assert any(s.get("BLOCK_S") and s.get("ALIGNED") for s in specs)
    for target in targets:
        assert compile_kernel(g.specs, target, row_words=16).size > 10_000


def test_bad_shapes_are_rejected():
    model = hf_model("llama", heads=4, kv_heads=1)
    m = from_hf(model, max_seq_len=8, workers=1)
    try:
        with pytest.raises(mk.GraphError, match="outside"):
            m.decode(torch.tensor([1]), 8)
        with pytest.raises(mk.GraphError, match="batch 1"):
            m.decode(torch.tensor([1, 2]), 0)
        vocab = SHAPES["vocab_size"]
        for bad in (vocab, 10**6, -1):  # checked before the run: logits for a made-up token are no answer
            with pytest.raises(mk.GraphError, match=rf"token id {bad} is outside the vocabulary \[0, {vocab}\)"):
                m.decode(torch.tensor([bad]), 0)
    finally:
        m.close()
    from transformers import GPT2Config, GPT2LMHeadModel
    with pytest.raises(mk.GraphError, match="from_hf supports LlamaForCausalLM, .*MixtralForCausalLM, got GPT2LMHeadModel"):
        from_hf(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)), max_seq_len=8)
    partial = hf_model("llama")
    partial.model.rotary_emb.rope_type = "proportional"
    with pytest.raises(mk.GraphError, match="rope type 'proportional' is not supported; supported: default, linear"):
        from_hf(partial, max_seq_len=8)


GENERATION_CASES = [(7, None), (7, 1), (7, 3), (1, None), (1, 3), (1, 1)]  # (prompt length, tokens per launch)
NEW_TOKENS = 3


def device_generation(model):
    """Every case of GENERATION_CASES on one model: tokens, launches per case and host meetings after each."""
    m = from_hf(model, max_seq_len=10, workers=1)
    try:
        results, barriers = [], []
        for length, per_launch in GENERATION_CASES:
            launches = m.kernel.launches
            tokens = m.generate(prompt(1, length), max_new_tokens=NEW_TOKENS, tokens_per_launch=per_launch)
            results.append((tokens, m.kernel.launches - launches))
            barriers.append(m.kernel.host_barriers)
        return results, barriers, m.config.prefill_chunk
    finally:
        m.close()


@pytest.mark.parametrize("family,world", [("llama", 1), ("qwen3", 2), ("llama", 4)])
def test_generation_on_the_device_matches_transformers(family, world):
    """The whole prompt and the new tokens sampled on the device, the prompt's first T - 1 tokens prefilled in
    the first step (the backend's prefill rows): ceil(new / tokens_per_launch) launches, or without prefill
    rows ceil((T + new - 1) / tokens_per_launch); transformers' tokens, the same history on every rank, no
    host meeting after the first run."""
    model = hf_model(family, kv_heads=1 if family == "llama" else 2, layers=1)  # one model: the ranks are threads
    job = functools.partial(device_generation, model)
    results = mk.launch(job, world_size=world, virtual=True, timeout=600) if world > 1 else [job()]
    for (length, per_launch), *per_rank in zip(GENERATION_CASES, *(r[0] for r in results)):
        with torch.no_grad():
            expected = model.generate(prompt(1, length), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        prefill_chunk = results[0][2]
        steps = NEW_TOKENS if prefill_chunk and length > 1 else length + NEW_TOKENS - 1
        for rank, (tokens, launches) in enumerate(per_rank):
            what = f"{family} over {world} ranks, prompt {length}, {per_launch} tokens per launch, rank {rank}"
            assert torch.equal(tokens, expected), what
            assert launches == -(-steps // (per_launch or steps)), what
    assert results[0][2] == 64  # the torch backend's default: the prefilled path is the one tested
    for rank, (_, barriers, _) in enumerate(results):
        assert len(set(barriers)) == 1, f"rank {rank} met the others on the host after its first run: {barriers}"


def test_generation_stops_after_the_end_of_sequence_token():
    model = hf_model("llama", layers=1)
    ids = prompt(1, 3)
    with torch.no_grad():
        free = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    eos = int(free[0, 5])  # the third new token
    model.generation_config.eos_token_id = eos
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    for prefill_chunk, expected_launches in ((None, 2), (0, 3)):
        m = from_hf(model, max_seq_len=12, prefill_chunk=prefill_chunk, workers=1)
        try:
            launches = m.kernel.launches
            tokens = m.generate(ids, max_new_tokens=8, tokens_per_launch=2, eos_token_id=eos)
            assert torch.equal(tokens, expected) and tokens[0, -1] == eos
            # steps 0-1, 2-3, then 4-5 (step 4 samples the eos at 5, stop); prefilled, the first step is 2
            assert m.kernel.launches - launches == expected_launches, prefill_chunk
        finally:
            m.close()


def test_mistral_windows_every_layer_whatever_layer_types_says():
    """Mistral's transformers code ignores layer_types and windows every layer: a full-attention layer
    type is not honoured, the same greedy tokens as transformers past the window of 4 positions."""
    torch.manual_seed(0)
    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, sliding_window=4, layer_types=["full_attention"])
    model = MistralForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    ids = prompt(1, length=6)
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
    m = from_hf(model, max_seq_len=16, workers=2)
    try:
        assert m.config.windows == (4,)
        assert torch.equal(m.generate(ids, max_new_tokens=10), expected)
    finally:
        m.close()
