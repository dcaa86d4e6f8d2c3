"""Hostile files that need no kernel run: checkpoint directories and GGUF files (``from_pretrained``) and
serialized task tables (``deserialize``), each refused as a ``GraphError`` naming the file, tensor, field, task
or word, within seconds."""
import json
import os
import shutil
import struct
import time

import gguf
import numpy as np
import pytest
import torch
from gguf_files import ARRAY, BOOL, F32, I32, STRING, U32, U64, llama, metadata, write
from transformers import Qwen2Config, Qwen2ForCausalLM

import megakernel as mk
from megakernel.errors import GraphError
from megakernel.image import load
from megakernel.serving import from_pretrained
from megakernel.reference import execute
from megakernel.scheduler import ARG0, FormatError, deserialize, disassemble, serialize

SHAPES = dict(hidden_size=32, head_dim=16, intermediate_size=64, num_hidden_layers=1, vocab_size=64,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)


@pytest.fixture
def checkpoint(tmp_path):
    Qwen2ForCausalLM(Qwen2Config(**SHAPES)).save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    return tmp_path / "ckpt"


def _refused(path, match: str, seconds: float = 2) -> None:
    start = time.monotonic()
    with pytest.raises(GraphError, match=match):
        from_pretrained(path, max_seq_len=16, workers=1)
    assert time.monotonic() - start < seconds


def _edit_json(file, change) -> None:
    data = json.loads(file.read_text())
    change(data)
    file.write_text(json.dumps(data))


# -- 7. index entries outside the folder -----------------------------------------------------------------
def test_index_entries_outside_the_checkpoint_are_refused(checkpoint, tmp_path):
    index = checkpoint / "model.safetensors.index.json"
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(checkpoint / json.loads(index.read_text())["weight_map"]["model.norm.weight"], outside)
    for entry in (str(outside), "../elsewhere.safetensors"):
        _edit_json(index, lambda d: d["weight_map"].update({"model.norm.weight": entry}))
        _refused(checkpoint, rf"entry model.norm.weight: '{entry}' is not a file inside the checkpoint folder")


# -- 8. malformed files and fields ------------------------------------------------------------------------
def test_malformed_safetensors_files_name_the_file(checkpoint):
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    whole = shard.read_bytes()
    shard.write_bytes(whole[:len(whole) // 2])  # truncated
    _refused(checkpoint, rf"{shard}: its header is not readable safetensors")
    shard.write_bytes((20).to_bytes(8, "little") + b"this is not json...." + whole[28:])
    _refused(checkpoint, rf"{shard}: its header is not readable safetensors")


def test_malformed_index_and_config_name_the_field(checkpoint):
    index, config = checkpoint / "model.safetensors.index.json", checkpoint / "config.json"
    original_index, original_config = index.read_text(), config.read_text()
    index.write_text(json.dumps({"weight_map": ["model.safetensors"]}))
    _refused(checkpoint, "weight_map must map tensor names to file names, got list")
    index.write_text(original_index)
    config.write_text("{not json")
    _refused(checkpoint, rf"{config}: not JSON")
    for field, value in (("num_attention_heads", 0), ("hidden_size", "big"), ("vocab_size", None),
                         ("num_hidden_layers", 2.5), ("num_hidden_layers", "2"), ("architectures", 7)):
        config.write_text(original_config)
        _edit_json(config, lambda d: d.update({field: value}))
        _refused(checkpoint, rf"{config}: field {field} must be")


# -- issue 37, 7 and 6: what transformers refuses, or would make of a config ----------------------------------
@pytest.mark.parametrize("case,change,match", [
    ("unknown rope type", lambda d: d["rope_parameters"].update(rope_type="nonsense"),
     r"transformers cannot read it: KeyError: 'nonsense'"),
    ("unknown layer type", lambda d: d.update(layer_types=["nonsense"]),
     "transformers cannot read it: StrictDataclassClassValidationError"),
    ("a string for a bool", lambda d: d.update(tie_word_embeddings="yes"),
     "transformers cannot read it: StrictDataclassFieldValidationError"),
    *[(f"rope_theta {theta}", lambda d, theta=theta: d["rope_parameters"].update(rope_theta=theta),
       rf"Qwen2ForCausalLM: rope_theta={theta} is not supported; supported: a finite positive number")
      for theta in (float("nan"), float("inf"), 0, -1.0)],
    *[(f"rms_norm_eps {eps}", lambda d, eps=eps: d.update(rms_norm_eps=eps),
       rf"Qwen2ForCausalLM: rms_norm_eps={eps} is not supported; supported: a finite positive number")
      for eps in (float("nan"), 0.0, -1e-06)],
    ("sliding_window 0", lambda d: d.update(sliding_window=0, use_sliding_window=True),
     r"Qwen2ForCausalLM: sliding_window=0 is not supported; supported: a positive int, or null"),
    ("max_position_embeddings 0", lambda d: d.update(max_position_embeddings=0),
     r"field max_position_embeddings must be a positive integer"),
])
def test_configs_transformers_refuses_or_rope_bases_that_are_not_finite_are_named(checkpoint, case, change, match):
    config = checkpoint / "config.json"
    _edit_json(config, change)
    _refused(checkpoint, rf"{config}: {match}")


def test_json_nested_past_the_stack_is_not_json(checkpoint):
    config, index = checkpoint / "config.json", checkpoint / "model.safetensors.index.json"
    for file in (config, index):
        original = file.read_text()
        file.write_text("[" * 100_000 + "]" * 100_000)
        _refused(checkpoint, rf"{file}: not (JSON|a JSON object): maximum recursion depth")
        file.write_text(original)


# -- issue 37, 7: hostile GGUF files: every count checked against the bytes left and caps, before parsing ------
def _string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def _field(key: str, value_type: int, payload: bytes) -> bytes:
    return _string(key.encode()) + struct.pack("<I", value_type) + payload


def _gguf_bytes(fields: list[bytes], tensors: list[bytes] = (), counts: tuple | None = None,
                version: bytes = struct.pack("<I", 3)) -> bytes:
    """A GGUF file's bytes: its header, ``fields`` (``_field``) and tensor descriptions, as the format lays them."""
    counts = counts or (len(tensors), len(fields))
    return b"GGUF" + version + struct.pack("<QQ", *counts) + b"".join(fields) + b"".join(tensors)


ARCH = _field("general.architecture", STRING, _string(b"llama"))
UINT8, FLOAT32 = 0, 6


HOSTILE_HEADERS = {case: (data, match) for case, data, match in [
    ("empty", b"", "not a GGUF file: it is empty"),
    ("not GGUF", b"PK\x03\x04" + bytes(60), "not a GGUF file"),
    ("big-endian", _gguf_bytes([ARCH], version=struct.pack(">I", 3)), "a big-endian GGUF file"),
    ("version 1", _gguf_bytes([ARCH], version=struct.pack("<I", 1)), "GGUF version 1; supported: 2, 3"),
    ("kv_count 2**40", _gguf_bytes([ARCH], counts=(0, 1 << 40)), "kv_count is 1,099,511,627,776: at most 65,536"),
    ("tensor_count 2**40", _gguf_bytes([ARCH], counts=(1 << 40, 1)), "tensor_count is 1,099,511,627,776"),
    ("a key of 2**63 bytes", _gguf_bytes([struct.pack("<Q", 1 << 63) + bytes(64)]),
     "a metadata key .9,223,372,036,854,775,808 bytes. runs past the end of the file"),
    ("an array of 1e12 bytes", _gguf_bytes([ARCH, _field("tokenizer.ggml.scores", ARRAY, struct.pack("<IQ", UINT8, 10**12))]),
     r"field tokenizer\.ggml\.scores is an array of 1,000,000,000,000 items"),
    ("2,000,000 strings", _gguf_bytes([ARCH, _field("tokenizer.ggml.tokens", ARRAY, struct.pack("<IQ", STRING, 2_000_000)
                                                    + _string(b"a") * 2_000_000)]),
     r"field tokenizer\.ggml\.tokens is an array of 2,000,000 items: the file's arrays may hold 1,048,576 items"),
    ("arrays 100,000 deep", _gguf_bytes([ARCH, _field("x", ARRAY, struct.pack("<IQ", ARRAY, 1) * 100_000
                                                      + struct.pack("<IQ", UINT8, 0))]),
     "field x nests arrays more than 4 deep"),
    ("an unknown value type", _gguf_bytes([ARCH, _field("x", 99, b"")]), "field x has value type 99, not a GGUF type"),
    ("a key twice", _gguf_bytes([ARCH, ARCH]), "field general.architecture appears twice"),
    ("2**31 dimensions", _gguf_bytes([ARCH], [_string(b"token_embd.weight") + struct.pack("<I", 1 << 31)]),
     "tensor token_embd.weight has 2,147,483,648 dimensions; a GGML tensor has 1 to 4"),
    ("an unknown tensor type", _gguf_bytes([ARCH], [_string(b"output_norm.weight") + struct.pack("<IQIQ", 1, 32, 99, 0)]),
     "tensor output_norm.weight has type 99, not a GGML type"),
    ("a tensor past the end", _gguf_bytes([ARCH], [_string(b"output_norm.weight") + struct.pack("<IQIQ", 1, 1 << 40, 0, 0)]),
     r"tensor output_norm.weight \(F32, \(1099511627776,\)\) lies past the end of the file"),
]}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", HOSTILE_HEADERS)
def test_hostile_gguf_headers_are_refused_at_once(tmp_path, case):
    data, match = HOSTILE_HEADERS[case]
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    _refused(path, rf"{path}: {match}")


def _with(**changes) -> dict:
    """SmolLM2-like metadata of the test Llama, fields changed: key (without ``llama.``) -> (value, type);
    None drops it."""
    meta = metadata()
    for key, value in changes.items():
        key = key.replace("__", ".") if key.startswith("general") else "llama." + key.replace("__", ".")
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    return meta


def _changed(meta: dict) -> str:
    """A test id: the fields ``meta`` changes."""
    base = metadata()
    return ", ".join(f"{key}={meta[key][0]!r}" if key in meta else f"no {key}"
                     for key in sorted(base.keys() | meta.keys()) if meta.get(key) != base.get(key))


NAN = float("nan")


@pytest.fixture(scope="module")
def tiny_llama():
    return llama()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("meta,match", [
    *[(_with(block_count=value), rf"field llama\.block_count \(num_hidden_layers\) must be a positive integer of at "
                                 rf"most 1,024, got {value[0]!r}")
      for value in ((10**6, U32), (1 << 32, U64), (1 << 40, U64), (0, U32), (-1, I32), (2.5, F32), ("2", STRING),
                    (True, BOOL))],
    (_with(block_count=(3, U32)), r"field llama\.block_count is 3; the file's tensors are of 2 blocks"),
    (_with(block_count=None), r"field llama\.block_count \(num_hidden_layers\) must be a positive integer"),
    (_with(attention__head_count=(0, U32)), r"field llama\.attention\.head_count \(num_attention_heads\) must be"),
    (_with(attention__head_count_kv=(0, U32)), r"field llama\.attention\.head_count_kv \(num_key_value_heads\) must"),
    (_with(rope__dimension_count=(0, U32)), r"field llama\.rope\.dimension_count \(head_dim\) must be a positive"),
    (_with(rope__dimension_count=(1 << 31, U32)), r"field llama\.rope\.dimension_count \(head_dim\) .* at most 4,096"),
    (_with(embedding_length=(1 << 30, U32)), r"field llama\.embedding_length \(hidden_size\) .* at most 131,072"),
    (_with(vocab_size=([80], ARRAY)), r"field llama\.vocab_size \(vocab_size\) must be a positive integer"),
    (_with(attention__head_count=(3, U32), rope__dimension_count=None),  # 256 hidden over 3 heads
     "transformers cannot read its metadata: StrictDataclassClassValidationError"),
    *[(_with(rope__freq_base=(value, F32)), rf"field llama\.rope\.freq_base \(rope_theta\) must be a finite positive "
                                            rf"number, got {value!r}")
      for value in (NAN, float("inf"), 0.0, -1.0)],
    (_with(general__architecture=None), "field general.architecture must be a string, got None"),
    (_with(context_length=(0, U32)), r"field llama\.context_length \(max_position_embeddings\) must be a positive"),
    (_with(context_length=(1 << 40, U64)), r"field llama\.context_length \(max_position_embeddings\) .* 16,777,216"),
    (_with(attention__layer_norm_rms_epsilon=(NAN, F32)), r"LlamaForCausalLM: rms_norm_eps=nan is not supported"),
], ids=lambda v: _changed(v) if isinstance(v, dict) else "refused")
def test_gguf_metadata_is_checked_before_transformers_makes_a_model(tmp_path, tiny_llama, meta, match):
    path = tmp_path / "model.gguf"
    write(path, tiny_llama, "F16", meta)
    _refused(path, rf"{path}: {match}")


# -- issue 37, 6: non-finite block scales --------------------------------------------------------------------
@pytest.mark.parametrize("scale", [NAN, float("inf"), -float("inf")])
def test_a_non_finite_gguf_block_scale_is_refused_as_it_is_read(tmp_path, tiny_llama, scale):
    """One Q8_0 block's float16 scale of ffn_down made NaN or infinite: every weight of it would be, and the
    logits with them; the rank reading its rows refuses the file, naming the tensor."""
    name = "blk.1.ffn_down.weight"
    rows = gguf.quants.quantize(tiny_llama.state_dict()["model.layers.1.mlp.down_proj.weight"].numpy(),
                                gguf.GGMLQuantizationType.Q8_0)
    rows[5, 34 * 3:34 * 3 + 2] = np.array([scale], dtype=np.float16).view(np.uint8)  # row 5's fourth block
    path = tmp_path / "model.gguf"
    write(path, tiny_llama, "Q8_0", raw={name: rows})
    _refused(path, rf"{path}: tensor {name} holds a q8_0 block whose float16 scale is {scale}: a corrupt file", 30)


# -- 3. sizes past the files, files that are not files ---------------------------------------------------------
def test_config_sizes_are_checked_before_a_module_is_made(checkpoint):
    config = checkpoint / "config.json"
    original = config.read_text()
    for field, value, match in (("num_hidden_layers", 10**6, "must be a positive integer of at most 1,024"),
                                ("num_hidden_layers", 1000, "the checkpoint's safetensors files hold"),
                                ("vocab_size", 10**6, "the checkpoint's safetensors files hold")):
        config.write_text(original)
        _edit_json(config, lambda d: d.update({field: value}))
        start = time.monotonic()
        _refused(checkpoint, match)
        assert time.monotonic() - start < 5  # refused before transformers builds the model


def test_a_checkpoint_file_that_is_not_a_regular_file_is_refused(checkpoint):
    shard = sorted(checkpoint.glob("*.safetensors"))[0]
    shard.unlink()
    os.symlink("/dev/zero", shard)
    _refused(checkpoint, rf"{shard}: the checkpoint's shard \(entry [^)]+\) is not a regular file")


# -- 11. mutated task tables -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def image(tmp_path_factory):
    g = mk.Graph()
    x = g.input("x", (1, 8), torch.float32)
    h = g.rms_norm(x, g.input("w", (8,), torch.float32), 1e-6)
    g.output("y", g.linear(h, g.input("m", (16, 8), torch.float32)))
    path = tmp_path_factory.mktemp("image") / "image.npz"
    with mk.Megakernel(g, workers=1) as kernel:
        kernel.save_image(path)
    return load(path)


def test_a_negative_heap_offset_names_the_task_and_word(image):
    tables = deserialize(serialize(image.tables))
    tables.rows[1, ARG0 + tables.specs[tables.rows[1, 0]].arg_names.index("x")] = -64
    with pytest.raises(FormatError, match=r"task 1 \(linear\): word x is -64"):
        deserialize(serialize(tables))


def test_mutated_tables_are_format_errors_or_tables_that_run_or_fail_as_graph_errors(image, tmp_path):
    """A table may come from anyone: any word changed is refused by ``deserialize``, or makes a table whose
    listing and reference run end, at worst, in a GraphError (the heap's bounds are not the table's)."""
    blob = serialize(image.tables)
    words = np.frombuffer(blob[:len(blob) // 8 * 8], dtype="<i8")
    rng = np.random.default_rng(25)
    outcomes = {"refused": 0, "read": 0}
    for _ in range(400):
        mutated = words.copy()
        at = int(rng.integers(len(mutated)))
        mutated[at] = rng.choice([-1, -(1 << 40), 1 << 40, 1 << 62, int(rng.integers(-100, 100)), mutated[at] + 1,
                                  mutated[at] - 1, mutated[at] ^ (1 << int(rng.integers(63)))])
        table = tmp_path / "mutated.table"  # as a file from anyone is read (the task library checked too)
        table.write_bytes(mutated.tobytes() + blob[len(words) * 8:])
        try:
            tables = load(table).tables
        except FormatError:
            outcomes["refused"] += 1
            continue
        outcomes["read"] += 1
        disassemble(tables)
        try:
            execute(tables, image.heap.clone())
        except GraphError:
            pass
    assert outcomes["refused"] > 200 and outcomes["read"] > 0, outcomes
