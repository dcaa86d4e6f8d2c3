"""GGUF files (llama.cpp's one-file checkpoints) as decode models, their weights kept as they are stored.

A GGUF file may come from anyone: its header (``Header``: the metadata's keys and values, the tensors'
names, shapes, types and places) is read here first, every count and length checked against the bytes
left in the file and against caps, and the sizes the model is made of checked (``check_metadata``), before
``transformers`` reads the metadata (``AutoConfig.from_pretrained(gguf_file=)``, then ``hf.config_of``).
Each tensor is found by its llama.cpp name (``schema.Stored.gguf``) as a lazy view of the file's memory map,
so that a rank reads only the rows and blocks it takes. A quantized tensor (``FORMATS``) is a ``Packed``
weight the tiles dequantize, its blocks' float16 scales checked finite as they are read; a float one (F32,
F16, BF16: norms, or every matrix) is read in the model's dtype. llama.cpp keeps a Llama's q and k
projection rows in its own rotary order within each head; they are put back in transformers' order as they
are read, by moving whole rows (no byte of a row changes), as transformers' GGUF loading does to the float
values.
"""
from __future__ import annotations

import functools
import math
import mmap
import re
import struct
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import GraphError, is_count, is_int, is_number
from ..tasks.formats import Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, Format, dequantize
from .decoder_config import DecoderConfig
from .hf import CONFIG_ERRORS, CONFIG_SIZES, ModelBuild, auto_classes, build, config_of_file
from .packed import Packed
from .schema import DENSE_MLP, K_PROJ, LAYER, MODEL, Q_PROJ, Stored, stored_formats
from .serving_config import ServingConfig

FORMATS = {"Q8_0": Q8_0, "Q4_0": Q4_0, "Q4_1": Q4_1, "Q4_K": Q4_K, "Q6_K": Q6_K}
# the float types as numpy views of the map: BF16 as its 16-bit words, viewed as bfloat16 once read
FLOATS = {"F32": np.float32, "F16": np.float16, "BF16": np.int16}
# the float16 fields of each block format's blocks (byte offsets): d, and Q4_1's m, Q4_K's dmin
BLOCK_SCALES = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q4_k": (0, 2), "q6_k": (208,)}
ROTARY_ORDER = ("llama",)  # architectures whose q and k rows llama.cpp stores in its rotary order

# The header's value types: a scalar's struct format by type number; 8 a string, 9 an array
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9
VERSIONS = (2, 3)  # gguf's reader reads these
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NESTING = 4  # arrays of arrays: none in llama.cpp's files; gguf's reader recurses per level
# Caps on the header's counts, far past any released file (~40 keys, ~300 tensors; the largest vocabularies,
# Gemma 3's 262,144 tokens with their scores and types, hold ~790,000 array items), and below what exhausts
# memory: gguf's reader (and so transformers') makes objects of ~3 KB per array item and per field.
MAX_FIELDS = MAX_TENSORS = 1 << 16
MAX_ARRAY_ITEMS = 1 << 20  # all arrays of the file together
# The metadata a decoder's sizes come from ({architecture}.KEY), checked before transformers makes a config
# of it: key -> (required, the config field it becomes, whose cap is CONFIG_SIZES')
SIZE_FIELDS = {"block_count": (True, "num_hidden_layers"), "embedding_length": (True, "hidden_size"),
               "attention.head_count": (True, "num_attention_heads"),
               "feed_forward_length": (False, "intermediate_size"),
               "attention.head_count_kv": (False, "num_key_value_heads"), "rope.dimension_count": (False, "head_dim"),
               "attention.key_length": (False, "head_dim"), "vocab_size": (False, "vocab_size"),
               "expert_count": (False, "num_experts"), "expert_used_count": (False, "num_experts"),
               "expert_feed_forward_length": (False, "moe_intermediate_size"),
               "context_length": (False, "max_position_embeddings")}
BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.")  # a layer's tensor: blk.{i}.*


@dataclass(frozen=True)
class Array:
    """A metadata array as ``Header`` keeps it: its items' value type and how many (transformers reads them)."""

    type: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as ``Header`` describes it."""

    name: str
    shape: tuple[int, ...]  # outermost dimension first (GGUF lists them innermost first)
    kind: str               # its GGML type's name: F16, Q8_0, ...
    start: int              # where its bytes begin in the file
    size: int               # how many


class Header:
    """A GGUF file's header, every count and length checked against the bytes after it (and the caps above)
    before it is used: ``fields``, the metadata (scalars and strings as values, arrays as ``Array``), and
    ``tensors``, each lying inside the file; ``map``, the file's memory map. ``kinds``: each GGML type
    number's name, block elements and block bytes."""

    def __init__(self, path: Path, kinds: dict[int, tuple[str, int, int]]):
        self.path, self.pos, self.items = path, 0, 0
        with open(path, "rb") as file:
            try:
                self.map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # nothing to map
                raise GraphError(f"{path}: not a GGUF file: it is empty") from None
        if self._take(4, "its magic") != b"GGUF":
            raise GraphError(f"{path}: not a GGUF file (no GGUF magic)")
        version = self._scalar("<I", "its version")
        if version & 0xFFFF == 0:  # the version's bytes swapped, as gguf's reader tells the byte order
            raise GraphError(f"{path}: a big-endian GGUF file; only little-endian ones are read")
        if version not in VERSIONS:
            raise GraphError(f"{path}: GGUF version {version}; supported: {', '.join(map(str, VERSIONS))}")
        tensors, fields = self._scalar("<Q", "tensor_count"), self._scalar("<Q", "kv_count")
        # the least bytes of a tensor's description (name length, dimension count, type, offset) and a field's
        for what, count, cap, least in (("tensor_count", tensors, MAX_TENSORS, 24), ("kv_count", fields, MAX_FIELDS, 13)):
            if count > cap or count * least > self._left():
                raise GraphError(f"{path}: {what} is {count:,}: at most {cap:,}, and {least} bytes each at least "
                                 f"({self._left():,} bytes follow)")
        self.fields: dict[str, Any] = {}
        for _ in range(fields):
            key = self._string("a metadata key")
            if key in self.fields:
                raise GraphError(f"{path}: field {key} appears twice")
            self.fields[key] = self._value(self._scalar("<I", f"field {key}'s type"), key, 0)
        described = [self._tensor_info(kinds) for _ in range(tensors)]
        alignment = self.fields.get("general.alignment", 32)
        if not (is_count(alignment) and alignment & (alignment - 1) == 0):
            raise GraphError(f"{path}: field general.alignment is {alignment!r}, not a power of two")
        data = -(-self.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, kind, offset, size in described:
            if name in self.tensors:
                raise GraphError(f"{path}: tensor {name} appears twice")
            if data + offset + size > len(self.map):
                raise GraphError(f"{path}: tensor {name} ({kind}, {shape}) lies past the end of the file "
                                 f"({len(self.map):,} bytes): a truncated or malformed file")
            self.tensors[name] = TensorInfo(name, shape, kind, data + offset, size)

    def array(self, info: TensorInfo, dtype, shape: tuple[int, ...]) -> np.ndarray:
        """``info``'s bytes in the map, not read: ``dtype`` elements in ``shape``."""
        return np.frombuffer(self.map, dtype, info.size // np.dtype(dtype).itemsize, info.start).reshape(shape)

    def _left(self) -> int:
        return len(self.map) - self.pos

    def _skip(self, n: int, what: str) -> int:
        """Where the next ``n`` bytes (``what``) begin; past them, if the file holds them."""
        if n > self._left():
            raise GraphError(f"{self.path}: {what} ({n:,} bytes) runs past the end of the file at byte {self.pos:,}: "
                             f"a truncated or malformed file")
        self.pos += n
        return self.pos - n

    def _take(self, n: int, what: str) -> bytes:
        start = self._skip(n, what)
        return self.map[start:start + n]

    def _scalar(self, fmt: str, what: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt), what))[0]

    def _string(self, what: str) -> str:
        data = self._take(self._scalar("<Q", f"{what}'s length"), what)
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise GraphError(f"{self.path}: {what} at byte {self.pos - len(data):,} is not UTF-8") from None

    def _skip_strings(self, count: int, key: str) -> None:
        """Past an array's ``count`` strings (transformers reads them): the file's longest loop, kept tight."""
        data, pos, end = self.map, self.pos, len(self.map)
        for _ in range(count):
            pos += 8 + (struct.unpack_from("<Q", data, pos)[0] if pos + 8 <= end else end)  # else: past the end
            if pos > end:
                raise GraphError(f"{self.path}: field {key}'s strings run past the end of the file: a truncated or "
                                 f"malformed file")
        self.pos = pos

    def _value(self, kind: int, key: str, depth: int) -> Any:
        if kind in SCALARS:
            return self._scalar(SCALARS[kind], f"field {key}")
        if kind == STRING:
            return self._string(f"field {key}")
        if kind != ARRAY:
            raise GraphError(f"{self.path}: field {key} has value type {kind}, not a GGUF type")
        if depth == MAX_NESTING:
            raise GraphError(f"{self.path}: field {key} nests arrays more than {MAX_NESTING} deep")
        item, count = self._scalar("<I", f"field {key}'s item type"), self._scalar("<Q", f"field {key}'s length")
        least = struct.calcsize(SCALARS[item]) if item in SCALARS else {STRING: 8, ARRAY: 12}.get(item)
        if least is None:
            raise GraphError(f"{self.path}: field {key} is an array of value type {item}, not a GGUF type")
        self.items += count
        if self.items > MAX_ARRAY_ITEMS or count * least > self._left():
            raise GraphError(f"{self.path}: field {key} is an array of {count:,} items: the file's arrays may hold "
                             f"{MAX_ARRAY_ITEMS:,} items in all, of {least} bytes each at least "
                             f"({self._left():,} bytes follow)")
        if item in SCALARS:
            self._skip(count * least, f"field {key}")
        elif item == STRING:
            self._skip_strings(count, key)
        else:
            for _ in range(count):
                self._value(item, key, depth + 1)
        return Array(item, count)

    def _tensor_info(self, kinds: dict[int, tuple[str, int, int]]) -> tuple:
        name = self._string("a tensor's name")
        dims = self._scalar("<I", f"tensor {name}'s dimension count")
        if not 1 <= dims <= MAX_DIMS:
            raise GraphError(f"{self.path}: tensor {name} has {dims:,} dimensions; a GGML tensor has 1 to {MAX_DIMS}")
        shape = tuple(self._scalar("<Q", f"tensor {name}'s dimensions") for _ in range(dims))[::-1]
        code = self._scalar("<I", f"tensor {name}'s type")
        if code not in kinds:
            raise GraphError(f"{self.path}: tensor {name} has type {code}, not a GGML type")
        kind, block, block_bytes = kinds[code]
        offset = self._scalar("<Q", f"tensor {name}'s offset")
        if shape[-1] % block:
            raise GraphError(f"{self.path}: tensor {name}'s rows of {shape[-1]} elements are not whole {kind} blocks "
                             f"of {block}")
        return name, shape, kind, offset, math.prod(shape) // block * block_bytes


def check_metadata(header: Header) -> None:
    """The sizes a model of the file is made of (``SIZE_FIELDS``) positive integers within their caps, its
    layers the file's blocks, its RoPE base a finite positive number: before transformers makes a config
    (and a model) of them."""
    path, fields = header.path, header.fields
    architecture = fields.get("general.architecture")
    if not isinstance(architecture, str):
        raise GraphError(f"{path}: field general.architecture must be a string, got {architecture!r}")
    for suffix, (required, field) in SIZE_FIELDS.items():
        key, cap = f"{architecture}.{suffix}", CONFIG_SIZES[field][1]
        value = fields.get(key)
        if value is None and not required:
            continue
        if not (is_int(value) and 0 < value <= cap):
            raise GraphError(f"{path}: field {key} ({field}) must be a positive integer of at most {cap:,}, got "
                             f"{value!r}")
    blocks = 1 + max((int(m.group(1)) for m in map(BLOCK_TENSOR.match, header.tensors) if m), default=-1)
    layers = fields[f"{architecture}.block_count"]
    if layers > blocks:
        raise GraphError(f"{path}: field {architecture}.block_count is {layers:,}; the file's tensors are of {blocks} "
                         f"blocks")
    base = fields.get(f"{architecture}.rope.freq_base", 1.0)
    if not (is_number(base) and math.isfinite(base) and base > 0):
        raise GraphError(f"{path}: field {architecture}.rope.freq_base (rope_theta) must be a finite positive number, "
                         f"got {base!r}")


class MappedArray:
    """A rectangle of a GGUF tensor's memory map, narrowed without reading; ``load`` reads it (counted in
    the file's ``bytes_read``) as a tensor of ``dtype`` (None: as stored). ``format``: it is packed rows of
    that block format, whose scales ``load`` checks finite; ``head_rows``: its rows are in llama.cpp's
    rotary order within heads of that many rows, which ``load`` puts back in transformers' order."""

    def __init__(self, file: "GGUFFile", name: str, array: np.ndarray, dtype: torch.dtype | None = None,
                 format: Format | None = None, head_rows: int = 0):
        self.file, self.name, self.array, self.dtype, self.format, self.head_rows = \
            file, name, array, dtype, format, head_rows

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.array.shape)

    def narrow(self, dim: int, start: int, length: int) -> "MappedArray":
        if dim == 0 and self.head_rows and (start % self.head_rows or length % self.head_rows):
            raise GraphError(f"{self.name}: rows {start}..{start + length} cut a head of {self.head_rows} rows")
        index = [slice(None)] * self.array.ndim
        index[dim] = slice(start, start + length)
        return MappedArray(self.file, self.name, self.array[tuple(index)], self.dtype, self.format, self.head_rows)

    def new_zeros(self, shape) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype)

    def load(self) -> torch.Tensor:
        array = np.array(self.array)  # a copy: the map is read-only
        if self.format is not None:
            self._check_scales(array)
        if self.head_rows:
            half = self.head_rows // 2
            within = np.arange(self.head_rows).reshape(half, 2).T.reshape(-1)  # llama.cpp's row 2a + b -> b * half + a
            array = array[(np.arange(0, len(array), self.head_rows)[:, None] + within).reshape(-1)]
        tensor = torch.from_numpy(array)
        if tensor.dtype == torch.int16:  # BF16's words (``FLOATS``; integer tensors are refused)
            tensor = tensor.view(torch.bfloat16)
        self.file.bytes_read += tensor.numel() * tensor.element_size()
        return tensor.to(self.dtype) if self.dtype is not None else tensor

    def _check_scales(self, rows: np.ndarray) -> None:
        """The float16 fields of the blocks read (their columns start at a block: ``Packed.narrow``) finite:
        a NaN or infinite scale makes every weight of its block so."""
        if rows.size == 0:  # a rank whose share of the rows is empty (heads padded at this TP degree)
            return
        blocks = rows.reshape(len(rows), -1, self.format.block_bytes)
        for at in BLOCK_SCALES[self.format.name]:
            scales = np.ascontiguousarray(blocks[..., at:at + 2]).view(np.float16)
            finite = np.isfinite(scales)
            if not finite.all():
                raise GraphError(f"{self.file.path}: tensor {self.name} holds a {self.format.name} block whose "
                                 f"float16 scale is {scales[~finite][0]}: a corrupt file")

    def __getattr__(self, name: str):
        return getattr(self.load(), name)


class GGUFFile:
    """The tensors of a GGUF file by their ``transformers`` state-dict names (``get`` and ``[]``, as
    ``schema.shard_weights`` reads them): ``Packed`` weights or ``MappedArray`` float tensors."""

    def __init__(self, header: Header, c: DecoderConfig, dequantize: bool = False):
        self.path, self.header, self.bytes_read, self.dequantize = header.path, header, 0, dequantize
        self.architecture = header.fields["general.architecture"]
        self.config = c
        self.names = {}  # transformers key -> (Stored, GGUF name)
        for stored in _stored():
            for i in range(c.layers) if "{i}" in stored.key else (0,):
                self.names[stored.key.format(i=i)] = (stored, stored.gguf.format(i=i))

    def format(self, key: str):
        """The format the file keeps ``key`` in (None: a float tensor or absent)."""
        name = self.names.get(key, (None, None))[1]
        tensor = self.header.tensors.get(name)
        return None if tensor is None or self.dequantize else self._format(tensor)

    def _format(self, tensor: TensorInfo):
        if tensor.kind not in FORMATS and tensor.kind not in FLOATS:
            raise GraphError(f"{self.path}: tensor {tensor.name} is {tensor.kind}; supported: "
                             f"{', '.join([*FORMATS, *FLOATS])}")
        return FORMATS.get(tensor.kind)

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def get(self, key: str) -> Any:
        stored, name = self.names.get(key, (None, None))
        tensor = self.header.tensors.get(name)
        if tensor is None:
            return None
        format = self._format(tensor)
        expected = stored.whole_shape(self.config)
        if tensor.shape != expected:
            raise GraphError(f"{self.path}: tensor {name} has shape {tensor.shape}; the model's config makes it "
                             f"{expected}")
        head_rows = self.config.head_dim if stored in (Q_PROJ, K_PROJ) and self.architecture in ROTARY_ORDER else 0
        if format is None:
            return MappedArray(self, name, self.header.array(tensor, FLOATS[tensor.kind], expected), self.config.dtype,
                               head_rows=head_rows)
        rows, cols = (1, *expected)[-2:]
        data = self.header.array(tensor, np.uint8, (rows, format.row_bytes(cols)))
        packed = Packed(name, MappedArray(self, name, data, format=format, head_rows=head_rows), format, cols)
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
    """The file's ``Header`` (checked: ``check_metadata``) and its transformers config. Reading a file's
    metadata takes seconds (a tokenizer's vocabulary is in it): a process reads each version of a file once
    (``_parse``), and the virtual ranks of a job, threads, share it."""
    stat = path.stat()
    with _PARSING:
        return _parse(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _parse(path: Path, size: int, mtime_ns: int):
    try:
        import gguf
    except ImportError:
        raise GraphError(f"{path}: reading GGUF files needs the gguf package: pip install 'megakernel[gguf]'") from None
    kinds = {int(kind): (kind.name, *gguf.GGML_QUANT_SIZES[kind]) for kind in gguf.GGMLQuantizationType}
    header = Header(path, kinds)
    check_metadata(header)
    try:
        config = auto_classes()[0].from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except CONFIG_ERRORS as error:
        raise GraphError(f"{path}: transformers cannot read its metadata: {type(error).__name__}: {error}") from None
    return header, config


def build_gguf(path: Path, serving: ServingConfig, dequantize: bool = False) -> ModelBuild:
    """``build_pretrained`` of a ``.gguf`` file: see the module docstring. ``dequantize``: every weight as
    float32 elements instead (what transformers' GGUF loading makes; for the torch backend, whose
    quantized tiles unpack their weights at every step)."""
    header, config = parsed(path)
    try:
        with torch.device("meta"):
            skeleton = auto_classes()[1].from_config(config)
    except CONFIG_ERRORS as error:
        raise GraphError(f"{path}: transformers cannot make a model of its metadata: {type(error).__name__}: "
                         f"{error}") from None
    c = config_of_file(path, skeleton.float(), serving)
    file = GGUFFile(header, c, dequantize)
    tied = "lm_head.weight" not in file
    c = replace(c, formats=stored_formats(file.format, c, tied, path))
    rotary = type(skeleton.model.rotary_emb)(config)
    return replace(build(c, file, rotary, tied), bytes_read=file.bytes_read)
