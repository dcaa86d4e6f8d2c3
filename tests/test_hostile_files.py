"""Hostile files that need no kernel run: checkpoint directories (``from_pretrained``) and serialized task
tables (``deserialize``), each refused as a ``GraphError`` naming the file, tensor, field, task or word."""
import json
import os
import shutil
import time

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import megakernel as mk
from megakernel.errors import GraphError
from megakernel.image import load
from megakernel.models import from_pretrained
from megakernel.reference import execute
from megakernel.scheduler import ARG0, FormatError, deserialize, disassemble, serialize

SHAPES = dict(hidden_size=32, head_dim=16, intermediate_size=64, num_hidden_layers=1, vocab_size=64,
              num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)


@pytest.fixture
def checkpoint(tmp_path):
    Qwen2ForCausalLM(Qwen2Config(**SHAPES)).save_pretrained(tmp_path / "ckpt", max_shard_size="20KB")
    return tmp_path / "ckpt"


def _refused(path, match: str) -> None:
    with pytest.raises(GraphError, match=match):
        from_pretrained(path, max_seq_len=16, workers=1)


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
                         ("num_hidden_layers", 2.5), ("architectures", 7)):
        config.write_text(original_config)
        _edit_json(config, lambda d: d.update({field: value}))
        _refused(checkpoint, rf"{config}: field {field} must be")


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
