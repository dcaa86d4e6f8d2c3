"""GGUF files written for tests: a small random Llama as llama.cpp's converter writes it (its q and k rows in
llama.cpp's rotary order, norms in F32), its matrices in one tensor type, and its metadata overridable."""
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import gguf

# rows of whole 256-element blocks, for every block type
LLAMA = dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_hidden_layers=2, vocab_size=80, max_position_embeddings=64, tie_word_embeddings=False)
# llama.cpp's names of a Llama's tensors, by transformers' (``{i}``: the layer)
NAMES = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
         "model.norm.weight": "output_norm.weight",
         **{f"model.layers.{{i}}.{hf}.weight": f"blk.{{i}}.{cpp}.weight" for hf, cpp in (
             ("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
             ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
             ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
             ("mlp.down_proj", "ffn_down"))}}
U32, I32, F32, BOOL, STRING, ARRAY, U64 = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32,
                                          gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.BOOL,
                                          gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY,
                                          gguf.GGUFValueType.UINT64)


def llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # norms that are not all ones: a wrong norm shows
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "q_proj" in name or "k_proj" in name:  # attention far from uniform: a wrong rotary order shows
                p.mul_(10)
    model.generation_config.eos_token_id = None
    return model


def metadata(config: dict = LLAMA) -> dict:
    """A Llama's metadata as llama.cpp writes it: key -> (value, GGUF value type)."""
    return {"general.architecture": ("llama", STRING), "llama.block_count": (config["num_hidden_layers"], U32),
            "llama.context_length": (config["max_position_embeddings"], U32),
            "llama.embedding_length": (config["hidden_size"], U32),
            "llama.feed_forward_length": (config["intermediate_size"], U32),
            "llama.attention.head_count": (config["num_attention_heads"], U32),
            "llama.attention.head_count_kv": (config["num_key_value_heads"], U32),
            "llama.rope.dimension_count": (config["head_dim"], U32), "llama.vocab_size": (config["vocab_size"], U32),
            "llama.rope.freq_base": (10000.0, F32), "llama.attention.layer_norm_rms_epsilon": (1e-6, F32)}


def rotary_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's ``permute``: each head's rows in its rotary order."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write(path, model: LlamaForCausalLM, kind: str = "F16", meta: dict | None = None, kinds: dict | None = None,
          raw: dict | None = None) -> None:
    """``model`` as a GGUF file: its matrices in ``kind`` (F32, F16, or a type gguf quantizes to; ``kinds``:
    GGUF name -> the type of that tensor), norms in F32; ``meta``: the metadata (``metadata()``'s); ``raw``:
    GGUF name -> the packed bytes [rows, row bytes] written for that tensor instead, in its type."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.kv_data[0].pop("general.architecture")  # written by ``meta``, which may change or drop it
    for key, (value, vtype) in (metadata() if meta is None else meta).items():
        writer.add_key_value(key, value, vtype, sub_type=gguf.GGUFValueType.get_type(value[0]) if vtype == ARRAY
                             else None)
    cfg = model.config
    for key, tensor in model.state_dict().items():
        layer = key.split(".")[2] if key.startswith("model.layers.") else None
        name = NAMES[key.replace(f".{layer}.", ".{i}.", 1) if layer else key].format(i=layer)
        w = tensor.float().numpy()
        if name.endswith("attn_q.weight"):
            w = rotary_order(w, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            w = rotary_order(w, cfg.num_key_value_heads)
        qtype = gguf.GGMLQuantizationType["F32" if w.ndim == 1 else (kinds or {}).get(name, kind)]
        if name in (raw or {}):
            writer.add_tensor(name, raw[name], raw_dtype=qtype)
        elif qtype.name in ("F32", "F16"):
            writer.add_tensor(name, w.astype(np.float32 if qtype.name == "F32" else np.float16))
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def transformers_model(path) -> LlamaForCausalLM:
    """The file as transformers loads it (float32): the reference."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model
