"""Checkpoint directories as ``save_pretrained`` writes them (``config.json`` and ``model.safetensors``,
or shards listed in ``model.safetensors.index.json``), read lazily: a tensor is a ``LazyTensor`` whose
``narrow`` only narrows ranges, and bytes are read from the file (safetensors' slices, memory-mapped)
only for the ranges a rank takes, when it takes them."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import GraphError
from .engine import DecodeModel
from .hf import SUPPORTED, config_of, decode_model

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}


class LazyTensor:
    """A tensor of a checkpoint, narrowed without reading; any other use (``contiguous``, ``detach``,
    ``reshape``, ...) reads the ranges it spans and acts on the tensor read."""

    def __init__(self, checkpoint: "Checkpoint", name: str, dtype: torch.dtype, ranges: tuple[tuple[int, int], ...]):
        self.checkpoint, self.name, self.dtype, self.ranges = checkpoint, name, dtype, ranges

    @property
    def shape(self) -> torch.Size:
        return torch.Size(stop - start for start, stop in self.ranges)

    def narrow(self, dim: int, start: int, length: int) -> "LazyTensor":
        ranges = list(self.ranges)
        first, stop = ranges[dim]
        if not (0 <= start and first + start + length <= stop):
            raise IndexError(f"narrow({dim}, {start}, {length}) of {self.name} {tuple(self.shape)}")
        ranges[dim] = (first + start, first + start + length)
        return LazyTensor(self.checkpoint, self.name, self.dtype, tuple(ranges))

    def new_zeros(self, shape) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype)

    def load(self) -> torch.Tensor:
        return self.checkpoint.read(self.name, self.ranges)

    def __getattr__(self, name: str):
        return getattr(self.load(), name)


class Checkpoint:
    """The tensors of a checkpoint directory by name; ``bytes_read`` counts what was read so far."""

    def __init__(self, path: Path, shapes: dict[str, tuple[int, ...]]):
        """``shapes``: every tensor the model has, by name, and its shape (the checkpoint must agree)."""
        self.path, self.bytes_read = path, 0
        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = json.loads(index.read_text())["weight_map"]
        elif (path / "model.safetensors").is_file():
            files = None
        else:
            raise GraphError(f"{path}: no model.safetensors or model.safetensors.index.json (save_pretrained's layout)")
        self.files: dict[str, object] = {}   # file name -> its safetensors handle
        self.located: dict[str, str] = {}    # tensor name -> its file
        for file in sorted(set(files.values()) if files else {"model.safetensors"}):
            if not (path / file).is_file():
                raise GraphError(f"{path}: the checkpoint's shard {file} is missing")
            self.files[file] = handle = safe_open(str(path / file), framework="pt")
            for name in handle.keys():
                self.located[name] = file
        for name, file in self.located.items():
            shape = tuple(self.files[file].get_slice(name).get_shape())
            if name in shapes and shape != tuple(shapes[name]):
                raise GraphError(f"{path / file}: tensor {name} has shape {shape}; the model's config makes it "
                                 f"{tuple(shapes[name])}")

    def get(self, name: str) -> LazyTensor | None:
        file = self.located.get(name)
        if file is None:
            return None
        part = self.files[file].get_slice(name)
        dtype = DTYPES.get(part.get_dtype())
        if dtype is None:
            raise GraphError(f"{self.path / file}: tensor {name} has dtype {part.get_dtype()}, not one of {', '.join(DTYPES)}")
        return LazyTensor(self, name, dtype, tuple((0, n) for n in part.get_shape()))

    def __getitem__(self, name: str) -> LazyTensor:
        tensor = self.get(name)
        if tensor is None:
            raise GraphError(f"{self.path}: the checkpoint has no tensor {name}")
        return tensor

    def read(self, name: str, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
        tensor = self.files[self.located[name]].get_slice(name)[tuple(slice(start, stop) for start, stop in ranges)]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def from_pretrained(path, *, max_seq_len: int, max_batch: int = 1, page_size: int = 16, kv_pages: int | None = None,
                    prefill_chunk: int = 0, parallelism: int | str = "auto", **kernel_options) -> DecodeModel:
    """Load a checkpoint directory (``config.json`` + ``*.safetensors``, one file or shards, as
    ``save_pretrained`` writes it; nothing is downloaded) straight into this rank's heap and compile
    its decode step. Only this rank's slices are read (``Checkpoint``): no whole model in host memory.
    The model's modules are made on the meta device (no memory) for what ``from_hf`` reads off them;
    the RoPE frequencies from its rotary module's class, made for real. The other arguments are ``from_hf's``.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise GraphError(f"{path}: no config.json: not a checkpoint directory as save_pretrained writes one")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    name = (getattr(config, "architectures", None) or ["?"])[0]
    if name not in SUPPORTED:
        raise GraphError(f"{path}: from_pretrained supports {', '.join(SUPPORTED)}, got {name}")
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    checkpoint = Checkpoint(path, {key: tuple(t.shape) for key, t in skeleton.state_dict().items()})
    skeleton.to(checkpoint["model.embed_tokens.weight"].dtype)  # the dtype the weights are stored in
    decoder = config_of(skeleton, max_seq_len, max_batch, page_size, kv_pages, prefill_chunk)
    rotary = type(skeleton.model.rotary_emb)(config)  # on the host: the frequencies for real
    model = decode_model(decoder, checkpoint, rotary, bool(config.tie_word_embeddings), parallelism, **kernel_options)
    model.bytes_read = checkpoint.bytes_read
    return model
