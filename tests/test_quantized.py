"""Quantized weights: every format's dequantization against gguf's own (and torch's float8 conversion), in
torch and in the tiles, and quantized linears against float64."""
import os

import numpy as np
import pytest
import torch
from helpers import SMOLLM2_NEW_TOKENS, SMOLLM2_PROMPT, run_checked, smollm2_path

import megakernel as mk
from megakernel.backends.torch_loop import WorkerHeap
from megakernel.heap import HeapView, RankHeap
from megakernel.tasks.common import ONEDNN, linear_rows
from megakernel.tasks.formats import FORMATS, FP8_BLOCK, FP8_SCALE_BLOCK, Q4_K, Q8_0, dequantize, quantized_input

gguf = pytest.importorskip("gguf")

GGUF_FORMATS = [f for f in FORMATS.values() if f.scales is None]
FP8_FORMATS = [f for f in FORMATS.values() if f.scales is not None]
# float16 scales at the edges of the type: the largest, the smallest normal and subnormal, negative, zero
EXTREME_F16 = np.array([65504.0, -65504.0, 6.104e-05, 5.96e-08, -5.96e-08, 0.0, 1.0, -0.0078125], dtype=np.float16)
F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q6_k": (208,)}


def random_blocks(format, rows: int, cols: int, seed: int) -> np.ndarray:
    """Packed rows of random bytes, every float16 field a random finite value, one in four an extreme one."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, cols // format.block, format.block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[format.name]:
        values = rng.standard_normal(blocks.shape[:2]).astype(np.float16) * np.float16(4)
        extreme = rng.random(blocks.shape[:2]) < 0.25
        values[extreme] = rng.choice(EXTREME_F16, int(extreme.sum()))
        blocks[..., at:at + 2] = values.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def gguf_reference(format, packed: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(packed, gguf.GGMLQuantizationType[format.name.upper()]).copy())


def fp8_weight(format, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every byte value (NaNs and subnormals included) in random places, scales of every magnitude; and the
    weight as the checkpoint defines it, ``w.float() * scale``."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (rows, cols), generator=gen, dtype=torch.uint8)
    data.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)
    shape = format.scales_shape(rows, cols)
    scales = torch.randn(shape, generator=gen) * 10.0 ** torch.randint(-30, 30, shape, generator=gen).float()
    values = data.view(torch.float8_e4m3fn).float()
    if format.scales == "channel":
        expected = values * scales[:, None]
    else:
        expected = values * scales.repeat_interleave(FP8_SCALE_BLOCK, 1)[:, :cols]
    return data, scales, expected


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN where the other is NaN."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("format", GGUF_FORMATS, ids=lambda f: f.name)
def test_dequantize_is_gguf(format):
    packed = random_blocks(format, 7, 2 * 256, seed=1)
    assert same(dequantize(format, torch.from_numpy(packed), 512), gguf_reference(format, packed))


@pytest.mark.parametrize("format", FP8_FORMATS, ids=lambda f: f.name)
def test_dequantize_fp8_is_scaled_float8(format):
    data, scales, expected = fp8_weight(format, 200, 300, seed=2)
    assert same(dequantize(format, data, 300, scales), expected)
    # a part of the weight, as a tile reads it: rows 130.., columns 128..
    assert same(dequantize(format, data[130:, 128:], 172, scales, 130, 128), expected[130:, 128:])


@pytest.mark.interpreter
@pytest.mark.parametrize("format", list(FORMATS.values()), ids=lambda f: f.name)
def test_tiles_dequantize_every_element_as_the_format_defines(format):
    """The embedding lookup of every row of a quantized table (float32 out, nothing rounded) is the table
    as gguf (or torch's float8 conversion times the scale) dequantizes it, bit for bit: the tiles' helper
    is the format's definition under the interpreter too."""
    rows, cols = (6, 512) if format.scales is None else (130, 136)
    if format.scales is None:
        packed = random_blocks(format, rows, cols, seed=3)
        data, scales, expected = torch.from_numpy(packed), None, gguf_reference(format, packed)
    else:
        data, scales, _ = fp8_weight(format, rows, cols, seed=4)
        data[(data & 0x7F) == 0x7F] -= 1  # no NaN weights: a NaN output would read as an element never written
        expected = dequantize(format, data, cols, scales)
    g = mk.Graph(world_size=1, rank=0)
    table = quantized_input(g, "table", (rows, cols), format, torch.float32)
    g.output("rows", g.embedding(g.input("tokens", (rows,), torch.int64), table))
    inputs = {"table": data, "tokens": torch.randperm(rows)}
    if scales is not None:
        inputs["table.scales"] = scales
    out = run_checked(g, inputs)
    assert same(out["rows"], expected[inputs["tokens"]])


@pytest.mark.interpreter
@pytest.mark.parametrize("format,k,scale_offset", [(Q8_0, 544, 0), (Q4_K, 512, 0), (FP8_BLOCK, 512, 0),
                                                   (FP8_BLOCK, 544, 0), (FP8_BLOCK, 512, 64), (FP8_BLOCK, 544, 80)],
                         ids=["q8_0", "q4_k-vectors", "fp8-vectors", "fp8-gathered", "fp8-vectors-inside-a-block",
                              "fp8-gathered-inside-a-block"])
@pytest.mark.parametrize("rows_of_x,split_k", [(1, None), (3, 2), (20, None)])
def test_quantized_linear_matches_float64(format, k, scale_offset, rows_of_x, split_k):
    """A GEMV of a weight, its split-K form and its ``tl.dot`` form (16 rows of x and 4), against float64
    over the dequantized weight, every output element written: Q8_0 with a K that is not whole BLOCK_K
    steps, and the formats with a 16-byte vector path (FP8, Q4_K) with it (aligned) and without; FP8
    block scales also for columns that start inside a scale block (a rank's of a bigger weight)."""
    n = 70
    inputs = {}
    if format.scales is None:
        packed = torch.from_numpy(random_blocks(format, n, k, seed=5))
        weight = dequantize(format, packed, k).double()
    else:  # the columns scale_offset.. of a weight of scale_offset + k
        packed, inputs["w.scales"], _ = fp8_weight(format, n, scale_offset + k, seed=5)
        packed[(packed & 0x7F) == 0x7F] -= 1  # no NaN weights
        inputs["w.scales"] = inputs["w.scales"].clamp(-1e3, 1e3)
        weight = dequantize(format, packed, scale_offset + k, inputs["w.scales"])[:, scale_offset:].double()
        packed = packed[:, scale_offset:].contiguous()
    g = mk.Graph(world_size=1, rank=0)
    x = g.input("x", (rows_of_x, k), torch.float32)
    w = quantized_input(g, "w", (n, k), format, torch.float32, scale_offset)
    g.output("y", g.linear(x, w, split_k=split_k))
    xs = torch.randn(rows_of_x, k, dtype=torch.float64)
    out = run_checked(g, {"x": xs.float(), "w": packed, **inputs})
    expected = xs @ weight.T
    assert torch.allclose(out["y"].double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("rows_of_x,split_k", [(3, 2), (20, None)])
def test_a_quantized_linears_rows_that_hold_no_sequence_are_zero(rows_of_x, split_k):
    """``pos``: a row at -1 is zero whatever x holds there (NaN here), the others x @ W.T (Q8_0, GEMV split
    in K and ``tl.dot`` tiles)."""
    n, k = 40, 544
    packed = torch.from_numpy(random_blocks(Q8_0, n, k, seed=7))
    g = mk.Graph(world_size=1, rank=0)
    x, pos = g.input("x", (rows_of_x, k), torch.float32), g.input("pos", (rows_of_x,), torch.int64)
    g.output("y", g.linear(x, quantized_input(g, "w", (n, k), Q8_0, torch.float32), split_k=split_k, pos=pos))
    xs = torch.randn(rows_of_x, k, dtype=torch.float64)
    positions = torch.where(torch.arange(rows_of_x) % 3 == 1, -1, torch.arange(rows_of_x))
    dead = positions < 0
    xs[dead] = float("nan")
    out = run_checked(g, {"x": xs.float(), "w": packed, "pos": positions})["y"].double()
    expected = xs @ dequantize(Q8_0, packed, k).double().T
    expected[dead] = 0
    assert torch.equal(out[dead], expected[dead])
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_quantized_weights_refuse_partial_blocks_and_bad_splits():
    g = mk.Graph(world_size=1, rank=0)
    with pytest.raises(mk.GraphError, match="not whole q8_0 blocks"):
        quantized_input(g, "w", (4, 48), Q8_0, torch.float32)
    for format, offset in ((Q8_0, 32), (FP8_BLOCK, 128), (FP8_BLOCK, -1)):
        with pytest.raises(mk.GraphError, match="only fp8_block weights have one"):
            quantized_input(g, f"w.{format.name}.{offset}", (4, 64), format, torch.float32, offset)
    w = quantized_input(g, "w2", (4, 512), Q8_0, torch.float32)
    with pytest.raises(mk.GraphError, match="split_k of a quantized weight"):
        g.linear(g.input("x", (1, 512), torch.float32), w, split_k=3)
    with pytest.raises(mk.GraphError, match="expected w of shape"):
        g.linear(g.input("x2", (1, 256), torch.float32), w)


# -- a real GGUF file, decoded with its weights as stored ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_smollm2_gguf_decodes_as_transformers(smollm2, world):
    """SmolLM2-135M's GGUF file (Q4_1 layers, a Q8_0 embedding tied to the LM head) loaded as it is stored:
    every rank holds packed bytes only (about the file's size at one rank; the tied LM head reads the
    embedding's rows) and its logits and greedy tokens are those of transformers' GGUF loading (dequantized
    to float32)."""
    from megakernel.serving import from_pretrained
    path = smollm2_path()
    with torch.no_grad():
        expected = smollm2.generate(SMOLLM2_PROMPT, max_new_tokens=SMOLLM2_NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected_logits = smollm2(expected[:, :-1]).logits[0, -1]  # those the last token was chosen from

    def run():
        model = from_pretrained(path, max_seq_len=32, backend="torch", workers=2)
        try:
            tokens = model.generate(SMOLLM2_PROMPT, SMOLLM2_NEW_TOKENS)
            return model.logits[0].clone(), tokens, model.weight_bytes, model.bytes_read
        finally:
            model.close()
    results = mk.launch(run, world_size=world, virtual=True, backend="torch", timeout=600)
    file_bytes = os.path.getsize(path)
    for rank, (logits, tokens, weight_bytes, bytes_read) in enumerate(results):
        error = (logits - expected_logits).abs().max().item()
        assert error <= 1e-4 * expected_logits.abs().max().item(), f"rank {rank}: logits off by {error}"
        assert torch.equal(tokens, expected), f"rank {rank}: {tokens.tolist()} vs transformers {expected.tolist()}"
        # packed bytes only: at one rank the file's weights (its tokenizer and metadata aside), at two the
        # replicated embedding and half of the rest (the attention's padded heads included)
        assert bytes_read <= weight_bytes <= file_bytes, (rank, weight_bytes, file_bytes)
        assert weight_bytes >= 0.95 * file_bytes if world == 1 else weight_bytes <= 0.7 * file_bytes


# -- FP8 checkpoints made here: block scales (transformers' "fp8") and row scales (FBGEMM's) -----------------
FP8_SCHEMES = {"fp8": "weight_scale_inv", "fbgemm_fp8": "weight_scale"}
FP8_IDS = torch.tensor([[11, 7, 250, 3]])


def fp8_quantized(w: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` as float8_e4m3fn, its scales as the checkpoint stores them, and what they dequantize to."""
    rows, cols = w.shape
    if method == "fp8":
        blocks = torch.nn.functional.pad(w, (0, -cols % 128, 0, -rows % 128)).unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
        scales = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448
        per_element = scales.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    else:
        scales = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448
        per_element = scales
    q = (w / per_element).to(torch.float8_e4m3fn)
    return q, scales, q.float() * per_element


def fp8_llama(path, method: str, block_gains: bool = False, **sizes):
    """A 1-layer Llama whose dimensions are not multiples of 128 (hidden 160, vocabulary 300; ``sizes``:
    other LlamaConfig sizes), its projections saved in FP8 in ``path`` with ``method``'s scales; returns
    the model with the dequantized weights (the reference). ``block_gains``: each 128-column block of a
    projection scaled by 1/8, 1 or 8 in turn first, so that its block scales differ a lot."""
    import json

    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(**{**dict(hidden_size=160, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=64), **sizes},
                         num_hidden_layers=1, vocab_size=300, max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    tensors = {}
    with torch.no_grad():
        for key, w in model.state_dict().items():
            if key.endswith("proj.weight"):
                if block_gains:
                    w.mul_((8.0 ** (torch.arange(w.shape[1]) // 128 % 3 - 1)).repeat(w.shape[0], 1))
                q, scales, dequantized = fp8_quantized(w, method)
                tensors[key], tensors[key.removesuffix("weight") + FP8_SCHEMES[method]] = q, scales
                w.copy_(dequantized)
            else:
                tensors[key] = w.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    quantization = {"quant_method": method, **({"weight_block_size": [128, 128]} if method == "fp8" else {})}
    (path / "config.json").write_text(json.dumps({**config.to_dict(), "architectures": ["LlamaForCausalLM"],
                                                  "quantization_config": quantization}))
    return model


def _fp8_tokens(path, workers: int = 2):
    """Greedy tokens, the bytes of weights held, and the logits of the last step."""
    from megakernel.serving import from_pretrained
    model = from_pretrained(path, max_seq_len=16, workers=workers)
    try:
        return model.generate(FP8_IDS, 3), model.weight_bytes, model.logits[0].clone()
    finally:
        model.close()


@pytest.mark.slow  # models end to end
@pytest.mark.parametrize("method,world", [pytest.param("fp8", 1, marks=pytest.mark.interpreter), ("fbgemm_fp8", 1),
                                          ("fp8", 2), ("fbgemm_fp8", 2)])
def test_fp8_checkpoint_decodes_as_its_dequantized_model(tmp_path, torch_backend, method, world):
    """Block scales at one rank under the interpreter, both schemes at one and two on the torch backend: the
    projections stay FP8 on the heap (a byte per weight and the scales) and the greedy tokens are the
    dequantized model's."""
    reference = fp8_llama(tmp_path, method)
    with torch.no_grad():
        expected = reference.generate(FP8_IDS, max_new_tokens=3, do_sample=False, pad_token_id=0)
    results = mk.launch(lambda: _fp8_tokens(tmp_path), world_size=world, virtual=True, timeout=600)
    float_bytes = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    projections = sum(t.numel() for k, t in reference.state_dict().items() if k.endswith("proj.weight"))
    for rank, (tokens, weight_bytes, _) in enumerate(results):
        assert torch.equal(tokens, expected), f"rank {rank}: {tokens.tolist()} vs {expected.tolist()}"
        if world == 1:  # the projections at a byte per weight (and their scales), the rest as stored
            assert weight_bytes < float_bytes - 2.5 * projections, (weight_bytes, float_bytes)


@pytest.mark.slow  # models end to end
@pytest.mark.parametrize("world", [2, 3])
def test_fp8_block_scales_split_anywhere_among_ranks(tmp_path, torch_backend, world):
    """Row-parallel FP8 weights whose ranks' columns start inside 128-column scale blocks (o_proj's 288
    columns at heads of 48: rank columns from 96 and 192; down_proj's 200: from 67, 100 and 134) and end
    in zero padding: each rank keeps the scales of the blocks it touches, and the greedy tokens are the
    dequantized model's, its logits too (each block's weights scaled by 1/8, 1 or 8 first: a rank that used
    another block's scale would be off by 8x)."""
    reference = fp8_llama(tmp_path, "fp8", block_gains=True, hidden_size=192, num_attention_heads=6,
                          num_key_value_heads=3, head_dim=48, intermediate_size=200)
    with torch.no_grad():
        expected = reference.generate(FP8_IDS, max_new_tokens=3, do_sample=False, pad_token_id=0)
        expected_logits = reference(expected[:, :-1]).logits[0, -1]
    for rank, (tokens, _, logits) in enumerate(mk.launch(lambda: _fp8_tokens(tmp_path, workers=1), world_size=world,
                                                         virtual=True, timeout=600)):
        assert torch.equal(tokens, expected), f"rank {rank}: {tokens.tolist()} vs {expected.tolist()}"
        error = (logits[:expected_logits.numel()] - expected_logits).abs().max().item()
        assert error <= 1e-4 * expected_logits.abs().max().item(), f"rank {rank}: logits off by {error}"


def test_a_packed_fp8_weight_cut_inside_scale_blocks_keeps_the_scales_it_touches():
    """Narrowing, zero-padding and joining a Packed fp8_block weight at columns inside scale blocks
    dequantizes to the same columns of the whole weight; joining real columns inside a block is refused."""
    from megakernel.models.packed import Packed, concat
    data, scales, expected = fp8_weight(FP8_BLOCK, 5, 400, seed=6)
    whole = Packed("w", data, FP8_BLOCK, 400, scales)

    def values(p: Packed) -> torch.Tensor:
        p = p.contiguous()
        return dequantize(p.format, p.data, p.cols, p.scales, scale_offset=p.scale_offset)
    for start, length in ((80, 100), (100, 156), (256, 144), (0, 130), (390, 10)):
        part = whole.narrow(1, start, length)
        assert part.scale_offset == start % FP8_SCALE_BLOCK and same(values(part), expected[:, start:start + length])
        cut = length // 3
        inner = part.narrow(1, cut, length - cut)  # narrowed again: offsets add up
        assert same(values(inner), expected[:, start + cut:start + length])
        padded = concat([part, part.new_zeros((5, 300))], 1)  # a rank's padding after its real columns
        assert padded.cols == length + 300 and same(values(padded)[:, :length], expected[:, start:start + length])
        assert not values(padded)[:, length:].any()
    # whole blocks side by side, then real columns that would start inside the block before
    assert same(values(concat([whole.narrow(1, 40, 216), whole.narrow(1, 256, 144)], 1)), expected[:, 40:])
    with pytest.raises(mk.GraphError, match="columns joined inside a scale block"):
        concat([whole.narrow(1, 0, 100), whole.narrow(1, 100, 50)], 1)


# -- GGUF files written here: every block format end to end, and files that are wrong ------------------------
GGUF_HIDDEN, GGUF_INTERMEDIATE, GGUF_VOCAB, GGUF_IDS = 256, 512, 300, torch.tensor([[11, 7, 250, 3]])
GGUF_NEW_TOKENS = 3
# per tensor kind, the block type of each layer: every format in the first layer (fused q/k/v and gate/up,
# row-parallel o and down), others in the second; v apart from q and k, as Q4_K_M files keep it
EVERY_FORMAT = {"token_embd": "Q8_0", "output": "Q6_K", "attn_qkv": ("Q4_K", "Q8_0"), "attn_v": "Q6_K",
                "attn_output": ("Q6_K", "Q4_0"), "ffn_gate_up": ("Q4_0", "Q6_K"), "ffn_down": ("Q4_1", "Q4_K")}
# row-parallel weights (attn_output, ffn_down) in 32-element blocks: a rank's 128 columns are whole blocks
SPLITTABLE = {**EVERY_FORMAT, "attn_output": ("Q8_0", "Q4_0"), "ffn_down": ("Q4_1", "Q8_0")}
# a small scale per format: random blocks dequantize to weights of about 0.01 to 0.03
BLOCK_SCALES = {"Q4_K": (2e-5, 1e-5), "Q6_K": (4e-6,)}


def gguf_blocks(kind: str, rows: int, cols: int, rng) -> np.ndarray:
    """Packed rows of block type ``kind``: the 32-element types quantized from random weights by gguf, the
    K types random bytes with small float16 scales."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in BLOCK_SCALES:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        fields = (0, 2) if kind == "Q4_K" else (208,)
        for at, scale in zip(fields, BLOCK_SCALES[kind]):
            values = (scale * (0.5 + rng.random(data.shape[:2]))).astype(np.float16)
            data[..., at:at + 2] = values.view(np.uint8).reshape(*data.shape[:2], 2)
        return data.reshape(rows, -1)
    return gguf.quants.quantize((0.02 * rng.standard_normal((rows, cols))).astype(np.float32), qtype)


def write_gguf(path, kinds: dict, layers: int = 2, seed: int = 0, drop: str | None = None) -> None:
    """A Llama GGUF file (hidden 256, 4 heads of 64, 2 KV heads) with its tensors in ``kinds``' block types."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, layers), (writer.add_context_length, 64),
                       (writer.add_embedding_length, GGUF_HIDDEN), (writer.add_feed_forward_length, GGUF_INTERMEDIATE),
                       (writer.add_head_count, 4), (writer.add_head_count_kv, 2), (writer.add_vocab_size, GGUF_VOCAB),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_rope_freq_base, 10000.0)):
        add(value)

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        if name == drop:
            return
        if kind == "F32":
            writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(name, (0.02 * rng.standard_normal((rows, cols))).astype(np.float16))
        else:
            writer.add_tensor(name, gguf_blocks(kind, rows, cols, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
    add("token_embd.weight", kinds["token_embd"], GGUF_VOCAB, GGUF_HIDDEN)
    add("output.weight", kinds["output"], GGUF_VOCAB, GGUF_HIDDEN)
    add("output_norm.weight", "F32", 1, GGUF_HIDDEN)
    for i in range(layers):
        qkv, o, gate_up, down = (kinds[k][i] if isinstance(kinds[k], tuple) else kinds[k]
                                 for k in ("attn_qkv", "attn_output", "ffn_gate_up", "ffn_down"))
        for name, kind, rows, cols in (("attn_norm", "F32", 1, GGUF_HIDDEN), ("ffn_norm", "F32", 1, GGUF_HIDDEN),
                                       ("attn_q", qkv, 256, GGUF_HIDDEN), ("attn_k", qkv, 128, GGUF_HIDDEN),
                                       ("attn_v", kinds.get("attn_v", qkv), 128, GGUF_HIDDEN),
                                       ("attn_output", o, GGUF_HIDDEN, 256),
                                       ("ffn_gate", gate_up, GGUF_INTERMEDIATE, GGUF_HIDDEN),
                                       ("ffn_up", gate_up, GGUF_INTERMEDIATE, GGUF_HIDDEN),
                                       ("ffn_down", down, GGUF_HIDDEN, GGUF_INTERMEDIATE)):
            add(f"blk.{i}.{name}.weight", kind, rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def transformers_gguf_model(path):
    """The file as transformers loads it: dequantized by gguf, q and k rows put back in its order."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def _gguf_decode(path):
    """Greedy tokens, and the logits of the last step (those of the last token's choice)."""
    from megakernel.serving import from_pretrained
    model = from_pretrained(path, max_seq_len=16, workers=2)
    try:
        tokens = model.generate(GGUF_IDS, GGUF_NEW_TOKENS)
        return model.logits[0].clone(), tokens
    finally:
        model.close()


@pytest.mark.slow  # models end to end
@pytest.mark.parametrize("world", [1, 2])
def test_a_gguf_file_of_every_block_format_decodes_as_transformers_loads_it(tmp_path, torch_backend, world):
    """Q8_0, Q4_0, Q4_1, Q4_K and Q6_K weights, fused (q/k/v, gate/up; v in another format than q and k,
    as in Q4_K_M files: each part its own input, projected into its columns) and row-parallel, an untied
    LM head:
    the logits and greedy tokens of transformers' GGUF loading, at one rank (one layer: every format) and
    at two (two layers), on the torch backend (the tiles of every format are the interpreter's bit for bit:
    ``test_tiles_dequantize_every_element_as_the_format_defines``)."""
    path = tmp_path / "model.gguf"
    write_gguf(path, EVERY_FORMAT if world == 1 else SPLITTABLE, layers=1 if world == 1 else 2)
    reference = transformers_gguf_model(path)
    with torch.no_grad():
        expected = reference.generate(GGUF_IDS, max_new_tokens=GGUF_NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected_logits = reference(expected[:, :-1]).logits[0, -1]
    for rank, (logits, tokens) in enumerate(mk.launch(lambda: _gguf_decode(path), world_size=world, virtual=True,
                                                      timeout=600)):
        error = (logits - expected_logits).abs().max().item()
        assert error <= 1e-4 * expected_logits.abs().max().item(), f"rank {rank}: logits off by {error}"
        assert torch.equal(tokens, expected), f"rank {rank}: {tokens.tolist()} vs {expected.tolist()}"


def _load(path):
    from megakernel.serving import from_pretrained
    from_pretrained(path, max_seq_len=16, workers=1).close()


@pytest.mark.parametrize("case,match", [
    ("split inside a block", "cut a q6_k block of 256 columns"),
    ("fused floats and blocks", r"parts of layers\.0\.qkv .* are kept in q4_k, q4_k, floats; a fused weight in "
                                r"several formats must have every part quantized"),
    ("unknown block type", r"tensor blk\.0\.ffn_gate\.weight is Q5_1; supported: Q8_0"),
    ("missing tensor", r"no tensor blk\.1\.ffn_down\.weight"),
    ("truncated", r"tensor blk\.1\.ffn_down\.weight \(Q4_K, \(256, 512\)\) lies past the end of the file .*: a truncated"),
])
def test_bad_gguf_files_are_errors_naming_the_tensor(tmp_path, torch_backend, case, match):
    path = tmp_path / "model.gguf"
    kinds = dict(EVERY_FORMAT)
    if case == "fused floats and blocks":
        kinds["attn_v"] = "F16"
    elif case == "unknown block type":
        kinds["ffn_gate_up"] = ("Q5_1", "Q6_K")
    write_gguf(path, kinds, drop="blk.1.ffn_down.weight" if case == "missing tensor" else None)
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:-1000])
    world = 2 if case == "split inside a block" else 1
    with pytest.raises(Exception, match=match):
        mk.launch(lambda: _load(path), world_size=world, virtual=True, timeout=300)


@pytest.mark.parametrize("case,match", [
    ("scales of the wrong shape", r"FP8 tensor model\.layers\.0\.mlp\.down_proj\.weight \(160 x 256\) needs scales "
                                  r"model\.layers\.0\.mlp\.down_proj\.weight_scale_inv of shape \(2, 2\), got \(2, 1\)"),
    ("missing scales", r"needs scales model\.layers\.0\.mlp\.down_proj\.weight_scale_inv .* got none"),
    ("NaN scales", r"FP8 scales model\.layers\.0\.mlp\.down_proj\.weight_scale_inv hold nan at \(1, 0\): a corrupt"),
    ("infinite scales", r"FP8 scales model\.layers\.0\.mlp\.down_proj\.weight_scale_inv hold -inf at \(1, 0\)"),
    ("integer scales", r"FP8 scales model\.layers\.0\.mlp\.down_proj\.weight_scale_inv are torch\.int64; supported"),
    ("another method", r"quant_method 'awq' is not supported; supported: fp8, fbgemm_fp8"),
    ("another block size", r"weight_block_size \[64, 64\] is not supported"),
])
def test_bad_fp8_checkpoints_are_errors_naming_the_tensor(tmp_path, torch_backend, case, match):
    import json

    from safetensors.torch import load_file, save_file
    fp8_llama(tmp_path, "fp8")
    key = "model.layers.0.mlp.down_proj.weight_scale_inv"
    if "scales" in case:
        tensors = load_file(str(tmp_path / "model.safetensors"))
        if case == "missing scales":
            del tensors[key]
        elif case == "integer scales":
            tensors[key] = tensors[key].to(torch.int64)
        elif case in ("NaN scales", "infinite scales"):
            tensors[key][1, 0] = float("nan") if case == "NaN scales" else -float("inf")
        else:
            tensors[key] = tensors[key][:, :1].contiguous()
        save_file(tensors, str(tmp_path / "model.safetensors"))
    else:
        config = json.loads((tmp_path / "config.json").read_text())
        config["quantization_config"] = ({"quant_method": "awq"} if case == "another method" else
                                         {"quant_method": "fp8", "weight_block_size": [64, 64]})
        (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(mk.GraphError, match=match):
        _load(tmp_path)


def test_fp8_experts_stacked_in_one_tensor_are_refused_by_name(tmp_path, torch_backend):
    """A Qwen3-MoE saved with its experts as transformers holds them in memory (one [experts, rows, cols]
    tensor), that tensor in FP8: refused by name (FP8 scales are per matrix), not a raw unpacking error."""
    import json

    from safetensors.torch import save_file
    from test_moe import moe_model
    model = moe_model("qwen3_moe", 2)
    key = "model.layers.0.mlp.experts.gate_up_proj"
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**model.config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"],
                                                      "quantization_config": {"quant_method": "fbgemm_fp8"}}))
    with pytest.raises(mk.GraphError, match=rf"FP8 tensor {key} has shape \(8, 88, 64\); FP8 weights are matrices"):
        _load(tmp_path)


@pytest.mark.slow  # models end to end
@pytest.mark.parametrize("world", [1, 2])
def test_fp8_moe_checkpoint_streams_fp8_experts(tmp_path, torch_backend, world):
    """A Qwen3-MoE (a sparse and a dense layer) whose projections, every expert's included, are saved in
    FP8 with a scale per row: the expert tiles stream the chosen experts' FP8 rows and the greedy tokens are
    the dequantized model's, at one and two ranks."""
    import json

    from safetensors.torch import load_file, save_file
    from test_moe import moe_model
    from transformers import AutoModelForCausalLM
    moe_model("qwen3_moe", 2).save_pretrained(tmp_path / "float")
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    fp8, dequantized = {}, {}
    for key, w in load_file(str(tmp_path / "float" / "model.safetensors")).items():
        fp8[key] = dequantized[key] = w
        if key.endswith("proj.weight"):
            fp8[key], fp8[key.removesuffix("weight") + "weight_scale"], dequantized[key] = fp8_quantized(w, "fbgemm_fp8")
    for name, tensors, extra in (("fp8", fp8, {"quantization_config": {"quant_method": "fbgemm_fp8"}}),
                                 ("dequantized", dequantized, {})):
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **extra}))
    assert any(".experts.7.down_proj.weight_scale" in key for key in fp8)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "dequantized").eval()
    reference.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = reference.generate(FP8_IDS[:, :4] % 100, max_new_tokens=3, do_sample=False, pad_token_id=0)

    def tokens():
        from megakernel.serving import from_pretrained
        model = from_pretrained(tmp_path / "fp8", max_seq_len=16, workers=2)
        try:
            return model.generate(FP8_IDS[:, :4] % 100, 3)
        finally:
            model.close()
    for rank, result in enumerate(mk.launch(tokens, world_size=world, virtual=True, timeout=600)):
        assert torch.equal(result, expected), f"rank {rank}: {result.tolist()} vs {expected.tolist()}"


@pytest.mark.parametrize("format", [Q4_K, FP8_BLOCK], ids=["q4_k", "fp8_block"])
def test_the_torch_backend_unpacks_weights_once_and_again_when_their_bytes_change(format):
    """A torch worker keeps a tile's unpacked weights between launches (``WorkerHeap.derived``): launches
    that bind other weight bytes, or only other FP8 scales, compute with those, as float64 does."""
    n, k = 40, 512
    g = mk.Graph(world_size=1, rank=0, parallelism=2, few_tiles=True)
    x = g.input("x", (3, k), torch.float32)
    g.output("y", g.linear(x, quantized_input(g, "w", (n, k), format, torch.float32)))
    xs = torch.randn(3, k, dtype=torch.float64)

    def weights(seed):
        if format.scales is None:
            packed = torch.from_numpy(random_blocks(format, n, k, seed))
            return {"w": packed}, dequantize(format, packed, k).double()
        packed, scales, _ = fp8_weight(format, n, k, seed)
        packed[(packed & 0x7F) == 0x7F] -= 1  # no NaN weights
        scales = scales.clamp(-1e3, 1e3)
        return {"w": packed, "w.scales": scales}, dequantize(format, packed, k, scales).double()

    first, w1 = weights(1)
    second, w2 = weights(2)
    cases = [(first, w1), (first, w1), (second, w2)]
    if format.scales is not None:  # the same bytes, other scales
        rescaled = {"w": second["w"], "w.scales": second["w.scales"] * 2}
        cases.append((rescaled, dequantize(format, rescaled["w"], k, rescaled["w.scales"]).double()))
    with mk.Megakernel(g, backend="torch", workers=2) as kernel:
        for bound, weight in cases:  # poisoned, and the reference executor's unpacking of the same heap
            out = run_checked(g, {"x": xs.float(), **bound}, kernel=kernel, exact=True)
            expected = xs @ weight.T
            assert torch.allclose(out["y"].double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_a_worker_keeps_what_it_derives_within_its_budget_and_while_the_bytes_hold():
    whole = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    made = []

    def make():
        made.append(1)
        return heap.tensor(0, torch.uint8, 4, 64, 64).float() * 2

    heap = WorkerHeap(whole, derived_bytes=4 * 64 * 5)
    source = heap.tensor(0, torch.uint8, 4, 64, 64)
    for _ in range(3):
        assert torch.equal(heap.derived(("a",), (source,), make), source.float() * 2)
    assert len(made) == 1
    whole[5] ^= 1  # a byte of the source changes: made again
    assert torch.equal(heap.derived(("a",), (source,), make), source.float() * 2) and len(made) == 2
    other = heap.tensor(1024, torch.uint8, 4, 64, 64)  # no room left for a second: made at every call
    heap.derived(("b",), (other,), make), heap.derived(("b",), (other,), make)
    assert len(made) == 4
    oracle = HeapView(RankHeap(whole, whole[:0]))  # the reference executor's: made at every call
    oracle.derived(("a",), (source,), make), oracle.derived(("a",), (source,), make)
    assert len(made) == 6


@pytest.mark.parametrize("room,calls", [(1 << 20, 1), (1000, 2)], ids=["room", "no_room"])
def test_a_worker_lays_out_a_weight_once_where_it_has_room_to_keep_it(room, calls, monkeypatch):
    """``linear_rows`` on a worker's heap: with room, the weight is made and laid out for oneDNN once for two
    calls; without room (less than the weight's bytes), multiplied as it is at each call, not laid out anew."""
    laid_out = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda *a: laid_out.append(1) or reorder(*a))
    whole = torch.zeros(1 << 16, dtype=torch.uint8)
    heap = WorkerHeap(whole, derived_bytes=room)
    heap.stable = ((0, 8192, 0),)  # the weight: an input only bind writes
    w, x, y = (heap.tensor(0, torch.float32, 64, 32, 32), heap.tensor(8192, torch.float32, 3, 32, 32),
               heap.tensor(16384, torch.float32, 3, 64, 64))
    w.copy_(torch.randn(64, 32)), x.copy_(torch.randn(3, 32))
    made = []
    for _ in range(2):
        y.fill_(float("nan"))
        linear_rows(heap, ("w",), x, y, (w,), lambda: made.append(1) or w, torch.float32)
        assert torch.allclose(y.double(), x.double() @ w.double().T, atol=1e-5)
    assert len(made) == (calls if ONEDNN else 2) and len(laid_out) == (2 - calls if ONEDNN else 0)


def test_a_worker_trusts_the_hosts_count_of_writes_for_sources_inside_inputs_only_bind_writes():
    whole = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    made = []

    def make():
        made.append(1)
        return heap.tensor(0, torch.uint8, 4, 64, 64).float()

    heap = WorkerHeap(whole, derived_bytes=1 << 20)
    heap.stable = ((0, 256, 0), (1024, 2048, 5))  # (first byte, end byte, writes so far) of two inputs
    inside, straddling = heap.tensor(0, torch.uint8, 4, 64, 64), heap.tensor(192, torch.uint8, 2, 64, 64)
    heap.derived(("in",), (inside,), make), heap.derived(("in",), (inside,), make)
    assert len(made) == 1
    whole[5] ^= 1  # not written by bind: not looked at
    heap.derived(("in",), (inside,), make)
    assert len(made) == 1
    heap.stable = ((0, 256, 1), (1024, 2048, 5))  # bound again: made again
    heap.derived(("in",), (inside,), make), heap.derived(("in",), (inside,), make)
    assert len(made) == 2
    heap.derived(("across",), (straddling,), make)  # past the input's end: its bytes compared
    whole[200] ^= 1
    heap.derived(("across",), (straddling,), make)
    assert len(made) == 4
    heap.stable = ()  # handed out since: compared
    heap.derived(("in",), (inside,), make), heap.derived(("in",), (inside,), make)
    assert len(made) == 5
