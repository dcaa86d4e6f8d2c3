"""GGUF files (llama.cpp's one-file checkpoints) as decode models, their weights kept as they are stored.

The config is the file's metadata as ``transformers`` reads it (``AutoConfig.from_pretrained(gguf_file=)``,
then ``hf.config_of``); each tensor is found by its llama.cpp name (``schema.Stored.gguf``) as a lazy view
of the file's memory map, so that a rank reads only the rows and blocks it takes. A quantized tensor
(``FORMATS``) is a ``Packed`` weight the tiles dequantize; a float one (norms; F16 or BF16 matrices) is
read in the model's dtype. llama.cpp keeps a Llama's q and k projection rows in its own rotary order
within each head; they are put back in transformers' order by moving whole packed rows (no byte of a
row changes), as transformers' GGUF loading does to the float values.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import GraphError
from ..tasks.quantized import Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, dequantize
from .decoder import DecoderConfig
from .packed import Packed
from .schema import DENSE_MLP, K_PROJ, LAYER, MODEL, Q_PROJ, Stored, stored_formats

FORMATS = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1, "Q4_K": Q4_K, "Q6_K": Q6_K}
FLOATS = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
ROTARY_ORDER = ("llama",)  # architectures whose q and k rows llama.cpp stores in its rotary order


class MappedArray:
    """A rectangle of a GGUF tensor's memory map, narrowed without reading; ``load`` reads it (counted in
    the file's ``bytes_read``) as a tensor of ``dtype`` (None: as stored)."""

    def __init__(self, file: "GGUFFile", array: np.ndarray, dtype: torch.dtype | None = None):
        self.file, self.array, self.dtype = file, array, dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.array.shape)

    def narrow(self, dim: int, start: int, length: int) -> "MappedArray":
        index = [slice(None)] * self.array.ndim
        index[dim] = slice(start, start + length)
        return MappedArray(self.file, self.array[tuple(index)], self.dtype)

    def new_zeros(self, shape) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype)

    def load(self) -> torch.Tensor:
        tensor = torch.from_numpy(np.array(self.array))  # a copy: the map is read-only
        if tensor.dtype == torch.int16:  # gguf maps BF16 as int16 words
            tensor = tensor.view(torch.bfloat16)
        self.file.bytes_read += tensor.numel() * tensor.element_size()
        return tensor.to(self.dtype) if self.dtype is not None else tensor

    def __getattr__(self, name: str):
        return getattr(self.load(), name)


class GGUFFile:
    """The tensors of a GGUF file by their ``transformers`` state-dict names (``get`` and ``[]``, as
    ``schema.shard_weights`` reads them): ``Packed`` weights or ``MappedArray`` float tensors."""

    def __init__(self, path: Path, reader, c: DecoderConfig, dequantize: bool = False):
        self.path, self.bytes_read, self.dequantize = path, 0, dequantize
        self.architecture = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8") \
            if "general.architecture" in reader.fields else "?"
        self.tensors = {t.name: t for t in reader.tensors}
        self.config = c
        self.names = {}  # transformers key -> (Stored, GGUF name)
        for stored in _stored():
            for i in range(c.layers) if "{i}" in stored.key else (0,):
                self.names[stored.key.format(i=i)] = (stored, stored.gguf.format(i=i))

    def format(self, key: str):
        """The format the file keeps ``key`` in (None: a float tensor or absent)."""
        name = self.names.get(key, (None, None))[1]
        tensor = self.tensors.get(name)
        return None if tensor is None or self.dequantize else self._format(tensor)

    def _format(self, tensor):
        kind = tensor.tensor_type.name
        if kind not in FORMATS and kind not in FLOATS:
            raise GraphError(f"{self.path}: tensor {tensor.name} is {kind}; supported: "
                             f"{', '.join([*FORMATS, *FLOATS])}")
        return FORMATS.get(kind)

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def get(self, key: str) -> Any:
        stored, name = self.names.get(key, (None, None))
        tensor = self.tensors.get(name)
        if tensor is None:
            return None
        format = self._format(tensor)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        expected = stored.whole_shape(self.config)
        if shape != expected:
            raise GraphError(f"{self.path}: tensor {name} has shape {shape}; the model's config makes it {expected}")
        rows, cols = (1, *shape)[-2:]
        if format is None:
            return MappedArray(self, tensor.data.reshape(expected), self.config.dtype)
        if cols % format.block or tensor.data.shape != (rows, format.row_bytes(cols)):
            raise GraphError(f"{self.path}: tensor {name} holds {tensor.data.shape} bytes, not {rows} rows of "
                             f"{cols // format.block} {format.name} blocks: a truncated or malformed file")
        head_rows = self.config.head_dim if stored in (Q_PROJ, K_PROJ) and self.architecture in ROTARY_ORDER else 0
        packed = Packed(name, MappedArray(self, tensor.data), format, cols, head_rows=head_rows)
        if self.dequantize:  # the whole tensor, read and unpacked now
            return dequantize(format, packed.contiguous().data, cols).reshape(expected).to(self.config.dtype)
        return packed

    def __getitem__(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GraphError(f"{self.path}: the file has no tensor {self.names.get(key, (None, key))[1]} ({key})")
        return value


def _stored() -> list[Stored]:
    return [part for weight in (*MODEL, *LAYER, *DENSE_MLP) for part in weight.parts if part.gguf]


_PARSING = threading.Lock()


def parsed(path: Path):
    """The file's ``gguf.GGUFReader`` (its metadata parsed, its tensors memory-mapped) and its transformers
    config. Parsing a file's metadata takes seconds (a tokenizer's vocabulary is in it): a process parses
    each version of a file once (``_parse``), and the virtual ranks of a job, threads, share it."""
    stat = path.stat()
    with _PARSING:
        return _parse(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parse(path: Path, size: int, mtime_ns: int):
    try:
        import gguf
    except ImportError:
        raise GraphError(f"{path}: reading GGUF files needs the gguf package: pip install 'megakernel[gguf]'") from None
    from .hf import auto_classes

    try:
        reader = gguf.GGUFReader(path)  # first: a file that is not GGUF is named as such
    except (ValueError, OSError, IndexError, KeyError, TypeError) as error:
        raise GraphError(f"{path}: not a readable GGUF file (truncated or malformed): {type(error).__name__}: "
                         f"{error}") from None
    try:
        config = auto_classes()[0].from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except (ValueError, KeyError, TypeError, OSError, IndexError) as error:
        raise GraphError(f"{path}: transformers cannot read its metadata: {type(error).__name__}: {error}") from None
    return reader, config


def from_gguf(path: Path, *, max_seq_len: int, max_batch: int = 1, page_size: int = 16, kv_pages: int | None = None,
              prefill_chunk: int = 0, max_logprobs: int = 0, draft_tokens: int = 0, dequantize: bool = False,
              parallelism: int | str = "auto",
              **kernel_options):
    """``from_pretrained`` of a ``.gguf`` file: see the module docstring. ``dequantize``: every weight as
    float32 elements instead (what transformers' GGUF loading makes; for the torch backend, whose
    quantized tiles unpack their weights at every step)."""
    from .hf import auto_classes, config_of, decode_model

    reader, config = parsed(path)
    with torch.device("meta"):
        skeleton = auto_classes()[1].from_config(config)
    c = config_of(skeleton.float(), max_seq_len, max_batch, page_size, kv_pages, prefill_chunk, max_logprobs,
                  draft_tokens)
    file = GGUFFile(path, reader, c, dequantize)
    tied = "lm_head.weight" not in file
    c = replace(c, formats=stored_formats(file.format, c, tied, path))
    rotary = type(skeleton.model.rotary_emb)(config)
    model = decode_model(c, file, rotary, tied, parallelism, **kernel_options)
    model.bytes_read = file.bytes_read
    return model
