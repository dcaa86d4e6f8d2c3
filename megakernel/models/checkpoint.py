"""Checkpoint directories as ``save_pretrained`` writes them (``config.json`` and ``model.safetensors``,
or shards listed in ``model.safetensors.index.json``), read lazily: a tensor is a ``LazyTensor`` whose
``narrow`` only narrows ranges, and bytes are read from the file (safetensors' slices, memory-mapped)
only for the ranges a rank takes, when it takes them.

A checkpoint directory may come from anyone: its config's sizes are checked against caps and against the
bytes its files hold before a module is made, its files must be regular files named inside it, and a
malformed file or field is a ``GraphError`` naming the file and the tensor or field."""
from __future__ import annotations

import json
import stat
from dataclasses import replace
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError, safe_open

from ..errors import GraphError
from ..tasks.formats import FP8_BLOCK, FP8_CHANNEL, FP8_SCALE_BLOCK, Format
from .gguf import build_gguf
from .architectures import architecture_of
from .hf import CONFIG_ERRORS, CONFIG_SIZES, ModelBuild, auto_classes, build, config_of_file, in_dtype
from .packed import Packed
from .schema import stored_formats
from .serving_config import ServingConfig

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
          "F8_E4M3": torch.float8_e4m3fn}
SMALLEST_WEIGHT_BYTES = 2  # bf16/f16: the fewest bytes a weight of a checkpoint takes (1 in an FP8 one)
# FP8 checkpoints by quantization_config.quant_method: the suffix of a weight's scales (``*.weight`` ->
# ``*.{suffix}``) and its format. transformers' "fp8": 128 x 128 block scales; "fbgemm_fp8": one per output row.
FP8_SCHEMES = {"fp8": ("weight_scale_inv", FP8_BLOCK), "fbgemm_fp8": ("weight_scale", FP8_CHANNEL)}


def read_config(path: Path) -> dict:
    """``config.json`` as JSON, its sizes checked (``CONFIG_SIZES``) and its weights' least possible bytes
    checked against the bytes the checkpoint's files hold, before anything is built from it."""
    file = path / "config.json"
    try:
        config = json.loads(_regular(file, "the config").read_text())
    except (ValueError, UnicodeDecodeError, RecursionError) as error:  # RecursionError: nested past Python's stack
        raise GraphError(f"{file}: not JSON: {error}") from None
    if not isinstance(config, dict):
        raise GraphError(f"{file}: not a JSON object")
    architectures = config.get("architectures")
    if not (isinstance(architectures, list) and architectures and all(isinstance(a, str) for a in architectures)):
        raise GraphError(f"{file}: field architectures must be a list of class names, got {architectures!r}")
    # the class before the sizes: another family's config names them otherwise
    architecture_of(architectures[0], f"{path}: from_pretrained")
    for field, (required, cap) in CONFIG_SIZES.items():
        value = config.get(field)
        if value is None and not required:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= cap:
            raise GraphError(f"{file}: field {field} must be a positive integer of at most {cap:,}, got {value!r}")
    hidden, heads, layers = config["hidden_size"], config["num_attention_heads"], config["num_hidden_layers"]
    head_dim = config.get("head_dim") or hidden // heads
    if head_dim == 0:
        raise GraphError(f"{file}: field hidden_size {hidden} is smaller than num_attention_heads {heads}")
    experts = config.get("num_experts") or config.get("num_local_experts") or 1
    mlp = config.get("moe_intermediate_size") if experts > 1 else None
    mlp = (mlp or config.get("intermediate_size") or 0) * experts
    # the fewest weights the model can have: its embedding, and per layer the query and output
    # projections and the MLP's three matrices (keys, values, norms and biases only add to it)
    weights = config["vocab_size"] * hidden + layers * (2 * hidden * heads * head_dim + 3 * hidden * mlp)
    held = sum(file.stat().st_size for file in shard_files(path).values())
    smallest = SMALLEST_WEIGHT_BYTES if fp8_scheme(config, file) is None else 1
    if weights * smallest > held:
        raise GraphError(f"{file}: its sizes make at least {weights:,} weights ({weights * smallest:,} "
                         f"bytes at {smallest} bytes each); the checkpoint's safetensors files hold {held:,} bytes")
    return config


def fp8_scheme(config: dict, file: Path) -> tuple[str, Format] | None:
    """The scales' suffix and format of an FP8 checkpoint (``FP8_SCHEMES``); None: not quantized."""
    quantization = config.get("quantization_config")
    if quantization is None:
        return None
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    if method not in FP8_SCHEMES:
        raise GraphError(f"{file}: quantization_config.quant_method {method!r} is not supported; supported: "
                         f"{', '.join(FP8_SCHEMES)}")
    block = quantization.get("weight_block_size")
    if method == "fp8" and list(block or ()) != [FP8_SCALE_BLOCK] * 2:
        raise GraphError(f"{file}: quantization_config.weight_block_size {block!r} is not supported; supported: "
                         f"[{FP8_SCALE_BLOCK}, {FP8_SCALE_BLOCK}]")
    return FP8_SCHEMES[method]


class FP8Weights:
    """A checkpoint's tensors, its float8_e4m3fn weights as ``Packed`` ones with their scales (block scales
    repeated per row, ``tasks.formats``); the modules it left unconverted as stored."""

    def __init__(self, checkpoint: "Checkpoint", suffix: str, format: Format):
        self.checkpoint, self.suffix, self.format_kept = checkpoint, suffix, format

    def format(self, key: str) -> Format | None:
        tensor = self.checkpoint.get(key)
        return self.format_kept if tensor is not None and tensor.dtype == torch.float8_e4m3fn else None

    def get(self, key: str):
        tensor = self.checkpoint.get(key)
        if tensor is None or tensor.dtype != torch.float8_e4m3fn:
            return tensor
        scale_key = key.removesuffix("weight") + self.suffix
        if len(tensor.shape) != 2:  # experts stacked as transformers holds them, not as it saves them
            raise GraphError(f"{self.checkpoint.path}: FP8 tensor {key} has shape {tuple(tensor.shape)}; FP8 weights "
                             f"are matrices (an expert's each), with their scales")
        scales = self.checkpoint.get(scale_key)
        rows, cols = tensor.shape
        block = self.format_kept is FP8_BLOCK
        expected = ((-(-rows // FP8_SCALE_BLOCK), -(-cols // FP8_SCALE_BLOCK)),) if block else ((rows, 1), (rows,))
        if scales is None or tuple(scales.shape) not in expected:
            raise GraphError(f"{self.checkpoint.path}: FP8 tensor {key} ({rows} x {cols}) needs scales {scale_key} of "
                             f"shape {expected[0]}, got {tuple(scales.shape) if scales is not None else 'none'}")
        if not scales.dtype.is_floating_point or scales.dtype.itemsize == 1:
            raise GraphError(f"{self.checkpoint.path}: FP8 scales {scale_key} are {scales.dtype}; supported: float32, "
                             f"bfloat16, float16")
        scales = scales.load().float()
        finite = scales.isfinite()
        if not finite.all():  # every weight they scale would be NaN or infinite
            raise GraphError(f"{self.checkpoint.path}: FP8 scales {scale_key} hold {scales[~finite][0].item()} at "
                             f"{tuple(int(i) for i in (~finite).nonzero()[0])}: a corrupt checkpoint")
        scales = scales.repeat_interleave(FP8_SCALE_BLOCK, 0)[:rows] if block else scales.reshape(rows)
        return Packed(key, tensor, self.format_kept, cols, scales)

    def __getitem__(self, key: str):
        tensor = self.get(key)
        return tensor if tensor is not None else self.checkpoint[key]


def _regular(file: Path, what: str) -> Path:
    """``file`` if, links followed, it is a regular file: a device (/dev/zero) or a pipe has no size to
    bound a read by."""
    try:
        mode = file.stat().st_mode
    except OSError as error:
        raise GraphError(f"{file}: {what} cannot be read: {error.strerror}") from None
    if not stat.S_ISREG(mode):
        raise GraphError(f"{file}: {what} is not a regular file")
    return file


def shard_files(path: Path) -> dict[str, Path]:
    """The checkpoint's safetensors files by the name the index (or save_pretrained's one-file layout)
    gives them; each name is a relative path inside ``path`` and each file a regular file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(_regular(index, "the index").read_text()).get("weight_map")
        except (ValueError, UnicodeDecodeError, AttributeError, RecursionError) as error:
            raise GraphError(f"{index}: not a JSON object: {error}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise GraphError(f"{index}: weight_map must map tensor names to file names, got {type(weight_map).__name__}")
        names = weight_map
    elif (path / "model.safetensors").exists():
        names = {"(the one file)": "model.safetensors"}
    else:
        raise GraphError(f"{path}: no model.safetensors or model.safetensors.index.json (save_pretrained's layout)")
    files: dict[str, Path] = {}
    for tensor, name in names.items():
        # the name, not its link's target, must stay inside: a hub cache's files are links to its blobs
        parts = PurePosixPath(name).parts
        if not parts or PurePosixPath(name).is_absolute() or ".." in parts:
            raise GraphError(f"{index}: entry {tensor}: {name!r} is not a file inside the checkpoint folder")
        if name not in files:
            if not (path / name).exists():
                raise GraphError(f"{path}: the checkpoint's shard {name} is missing")
            files[name] = _regular(path / name, f"the checkpoint's shard (entry {tensor})")
    return files


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
        self.files: dict[str, object] = {}   # file name -> its safetensors handle
        self.located: dict[str, str] = {}    # tensor name -> its file
        for file, full in sorted(shard_files(path).items()):
            self.files[file] = handle = self._parsed(file, "its header", lambda: safe_open(str(full), framework="pt"))
            for name in handle.keys():
                self.located[name] = file
        for name, file in self.located.items():
            shape = tuple(self._parsed(file, f"tensor {name}", lambda: self.files[file].get_slice(name).get_shape()))
            if name in shapes and shape != tuple(shapes[name]):
                raise GraphError(f"{path / file}: tensor {name} has shape {shape}; the model's config makes it "
                                 f"{tuple(shapes[name])}")

    def get(self, name: str) -> LazyTensor | None:
        file = self.located.get(name)
        if file is None:
            return None
        part = self._parsed(file, f"tensor {name}", lambda: self.files[file].get_slice(name))
        dtype = DTYPES.get(part.get_dtype())
        if dtype is None:
            raise GraphError(f"{self.path / file}: tensor {name} has dtype {part.get_dtype()}, not one of {', '.join(DTYPES)}")
        return LazyTensor(self, name, dtype, tuple((0, n) for n in part.get_shape()))

    def __getitem__(self, name: str) -> LazyTensor:
        tensor = self.get(name)
        if tensor is None:
            raise GraphError(f"{self.path}: the checkpoint has no tensor {name}")
        return tensor

    def _parsed(self, file: str, what: str, parse):
        """``parse()``, a malformed file's error (safetensors checks a header against the file's size) named."""
        try:
            return parse()
        except (SafetensorError, OSError, ValueError) as error:
            raise GraphError(f"{self.path / file}: {what} is not readable safetensors: {error}") from None

    def read(self, name: str, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
        file = self.located[name]
        tensor = self._parsed(file, f"tensor {name}", lambda: self.files[file].get_slice(name)[
            tuple(slice(start, stop) for start, stop in ranges)])
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


def build_pretrained(path, serving: ServingConfig, dequantize: bool = False, dtype: torch.dtype | None = None
                     ) -> ModelBuild:
    """Read this rank's share of a checkpoint directory (``config.json`` + ``*.safetensors``, one file or
    shards, as ``save_pretrained`` writes it; an FP8 one's weights stay FP8, ``FP8Weights``), or of a GGUF
    file (``models.gguf``: its weights stay quantized), for a decode step built for ``serving`` (nothing is
    downloaded). Only this rank's slices are read (``Checkpoint``): no whole model in host memory.
    The model's modules are made on the meta device (no memory) for what ``config_of`` reads off them;
    the RoPE frequencies from its rotary module's class, made for real. ``dequantize``: a GGUF file's
    weights as float32 (``models.gguf``). ``dtype``: the weights and activations in that float dtype
    (``hf.in_dtype``; None: as the checkpoint stores them, float32 for a GGUF file's).
    """
    return in_dtype(_build_pretrained(Path(path), serving, dequantize), dtype)


def _build_pretrained(path: Path, serving: ServingConfig, dequantize: bool) -> ModelBuild:
    AutoConfig, AutoModelForCausalLM = auto_classes()
    if path.suffix == ".gguf" and path.is_file():
        return build_gguf(path, serving, dequantize)
    if not (path / "config.json").is_file():
        raise GraphError(f"{path}: no config.json: not a checkpoint directory as save_pretrained writes one")
    fp8 = fp8_scheme(read_config(path), path / "config.json")  # its sizes checked before any module is made
    if dequantize:
        raise GraphError(f"{path}: dequantize applies to GGUF files; a checkpoint directory's weights load as stored")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except CONFIG_ERRORS as error:
        raise GraphError(f"{path / 'config.json'}: transformers cannot read it: {type(error).__name__}: {error}") from None
    checkpoint = Checkpoint(path, {key: tuple(t.shape) for key, t in skeleton.state_dict().items()})
    skeleton.to(checkpoint["model.embed_tokens.weight"].dtype)  # the dtype the weights are stored in
    decoder = config_of_file(path / "config.json", skeleton, serving)
    tied = bool(config.tie_word_embeddings)
    tensors = checkpoint
    if fp8 is not None:
        tensors = FP8Weights(checkpoint, *fp8)
        decoder = replace(decoder, formats=stored_formats(tensors.format, decoder, tied, path))
    rotary = type(skeleton.model.rotary_emb)(config)  # on the host: the frequencies for real
    return replace(build(decoder, tensors, rotary, tied), bytes_read=checkpoint.bytes_read)
