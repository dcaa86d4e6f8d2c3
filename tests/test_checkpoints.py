"""``from_pretrained``: checkpoint directories as ``save_pretrained`` writes them, read slice by slice."""
import functools
import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

import megakernel as mk
from megakernel.serving import from_hf, from_pretrained

# checkpoint loading end to end, one and several ranks: on the torch backend (the tiles are proven
# under the interpreter: test_ops, test_task_types), but for the tests marked interpreter
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("torch_backend")]

SHAPES = dict(hidden_size=96, head_dim=48, intermediate_size=200, num_hidden_layers=2, vocab_size=301,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@functools.cache
def model():
    """A Qwen2 (q/k/v biases, made random) with untied embeddings: every kind of tensor a checkpoint has."""
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(Qwen2Config(**SHAPES, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    m.generation_config.eos_token_id = None
    return m


def total_bytes() -> int:
    return sum(t.numel() * t.element_size() for t in model().state_dict().values())


IDS = torch.tensor([[11, 7, 250, 3]])


@pytest.mark.parametrize("shards", ["one file", "several"])
def test_a_saved_checkpoint_decodes_as_the_model_in_memory(tmp_path, shards):
    model().save_pretrained(tmp_path, max_shard_size="50KB" if shards == "several" else "1GB")
    assert (len(list(tmp_path.glob("*.safetensors"))) > 1) == (shards == "several")
    with torch.no_grad():
        expected = model().generate(IDS, max_new_tokens=5, do_sample=False, pad_token_id=0)
    loaded = from_pretrained(tmp_path, max_seq_len=16, workers=2)
    try:
        assert torch.equal(loaded.generate(IDS, max_new_tokens=5), expected)
        assert loaded.bytes_read == total_bytes()  # one rank: every tensor, once
    finally:
        loaded.close()


def _rank_reads(path) -> tuple[torch.Tensor, int]:
    loaded = from_pretrained(path, max_seq_len=16, workers=1)
    try:
        return loaded.generate(IDS, max_new_tokens=5), loaded.bytes_read
    finally:
        loaded.close()


def test_each_rank_reads_only_its_slices(tmp_path):
    model().save_pretrained(tmp_path, max_shard_size="50KB")
    with torch.no_grad():
        expected = model().generate(IDS, max_new_tokens=5, do_sample=False, pad_token_id=0)
    results = mk.launch(functools.partial(_rank_reads, tmp_path), world_size=2, virtual=True, timeout=600)
    replicated = sum(t.numel() * t.element_size() for name, t in model().state_dict().items()
                     if "norm" in name or "embed_tokens" in name)
    for rank, (tokens, read) in enumerate(results):
        assert torch.equal(tokens, expected), f"rank {rank}"
        # half of every split tensor, the embedding and norms whole: well under the whole model
        assert read < 0.6 * total_bytes(), f"rank {rank} read {read} of {total_bytes()} bytes"
        assert read > replicated


def test_malformed_checkpoints_are_named(tmp_path):
    model().save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    missing = sorted((tmp_path / "sharded").glob("*.safetensors"))[3]
    missing.unlink()
    with pytest.raises(mk.GraphError, match=f"the checkpoint's shard {missing.name} is missing"):
        from_pretrained(tmp_path / "sharded", max_seq_len=8)
    model().save_pretrained(tmp_path / "wrong")
    config = json.loads((tmp_path / "wrong" / "config.json").read_text())
    config["intermediate_size"] = 256
    (tmp_path / "wrong" / "config.json").write_text(json.dumps(config))
    with pytest.raises(mk.GraphError, match=r"tensor model\.layers\.0\.mlp\.down_proj\.weight has shape \(96, 200\); "
                                            r"the model's config makes it \(96, 256\)"):
        from_pretrained(tmp_path / "wrong", max_seq_len=8)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(mk.GraphError, match="from_pretrained supports LlamaForCausalLM, .*, got GPT2LMHeadModel"):
        from_pretrained(tmp_path / "gpt2", max_seq_len=8)
    with pytest.raises(mk.GraphError, match="no config.json"):
        from_pretrained(tmp_path, max_seq_len=8)
    from safetensors.torch import save_file
    (tmp_path / "holed").mkdir()
    (tmp_path / "holed" / "config.json").write_text((tmp_path / "sharded" / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in model().state_dict().items() if k != "model.layers.1.mlp.down_proj.weight"},
              str(tmp_path / "holed" / "model.safetensors"))
    with pytest.raises(mk.GraphError, match="the checkpoint has no tensor model.layers.1.mlp.down_proj.weight"):
        from_pretrained(tmp_path / "holed", max_seq_len=8)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((tmp_path / "wrong" / "config.json").read_text())
    with pytest.raises(mk.GraphError, match="no model.safetensors or model.safetensors.index.json"):
        from_pretrained(tmp_path / "empty", max_seq_len=8)


def test_from_hf_and_from_pretrained_bind_the_same_weights(tmp_path):
    model().save_pretrained(tmp_path)
    loaded, direct = from_pretrained(tmp_path, max_seq_len=8, workers=1), from_hf(model(), max_seq_len=8, workers=1)
    try:
        for name, t in direct.graph.inputs.items():
            if name not in ("tokens", "pos"):
                assert torch.equal(loaded.kernel.tensor(t), direct.kernel.tensor(t)), name
    finally:
        loaded.close()
        direct.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_float32_checkpoint_runs_in_16_bits_as_transformers_casts_it(smollm2, dtype):
    """``from_pretrained(..., dtype=...)`` of SmolLM2's GGUF file (float32 when dequantized): the weights cast
    as transformers casts them, the activations in that dtype, every sum in float32. Against float64 over the
    same cast weights, the logits at the prompt's last token are as far as transformers' own in that dtype
    (30 layers of 16-bit activations: bfloat16 1.9e-2 of the largest logit here, transformers 2.2e-2;
    float16 3.2e-3, transformers 1.5e-3: rounded at other places), and 16 greedy tokens are transformers'."""
    import copy
    from helpers import SMOLLM2_PROMPT, smollm2_path
    cast = copy.deepcopy(smollm2).to(dtype)
    with torch.no_grad():
        expected = copy.deepcopy(cast).double()(SMOLLM2_PROMPT).logits[0, -1]
        theirs = cast(SMOLLM2_PROMPT).logits[0, -1].double()
        tokens = cast.generate(SMOLLM2_PROMPT, max_new_tokens=16, do_sample=False)[0, SMOLLM2_PROMPT.shape[1]:]
    model = from_pretrained(smollm2_path(), max_seq_len=64, dequantize=True, dtype=dtype)
    try:
        floats = [model.kernel.tensor(t) for t in model.graph.inputs.values() if t.dtype.is_floating_point]
        assert model.config.dtype == dtype and {w.dtype for w in floats} == {dtype, torch.float32}
        first = model.generate(SMOLLM2_PROMPT, max_new_tokens=1)
        error = lambda logits: ((logits.double() - expected).abs().max() / expected.abs().max()).item()  # noqa: E731
        assert error(model.logits[0]) <= 2.5 * error(theirs), (error(model.logits[0]), error(theirs))
        ids = model.generate(SMOLLM2_PROMPT, max_new_tokens=16)[0, SMOLLM2_PROMPT.shape[1]:]
        assert first[0, -1] == ids[0] and ids.tolist() == tokens.tolist()
    finally:
        model.close()
