"""Quantized weight formats, the host side: what a format is, a weight kept in one (``Quantized``), its graph
inputs, and its dequantization in torch (the references' and the tests'). The tiles that read them on the
device are ``tasks.quantized``.

A quantized weight [rows, cols] is its packed bytes, uint8 [rows, row bytes] as the file stores them,
and for FP8 its float32 scales (``Quantized``). Every format cuts a row into blocks along K (the
columns) of ``block`` elements in ``block_bytes`` bytes each:

- GGUF (llama.cpp's blocks, read from the file as they are): Q8_0 (32 int8 and a float16 scale),
  Q4_0 (32 nibbles, a scale; the value is scale * (q - 8)), Q4_1 (32 nibbles, a scale and a minimum),
  Q4_K (256-element super-blocks of eight 32-element sub-blocks with 6-bit scales and minimums), Q6_K
  (256 elements of 6 bits in sixteen 16-element sub-blocks with int8 scales).
- FP8 e4m3 (float8_e4m3fn bytes) times a float32 scale per output row (``fp8_channel``, scales [rows]) or
  per row and 128 columns (``fp8_block``, scales [rows, ceil(cols / 128)]: an FP8 checkpoint's 128 x 128
  block scales, ``weight_scale_inv``, repeated for each row of their block on the host, so that ranks
  and fused projections cut and join rows anywhere; 4 bytes per 128 weights more than the checkpoint).
  A rank's columns may start inside a scale block: its weight's ``scale_offset`` columns of the first
  block belong to the rank before (an element's block is (column + scale_offset) // 128).

A split across ranks or across K cuts at whole blocks of the packed bytes (FP8 anywhere: its bytes are
independent elements): a tile's K-range starts on a block. ``dequantize`` rebuilds each element as its
format defines it, in float32: the value gguf's (and so transformers') own dequantization gives.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .common import ceil_div

FP8_SCALE_BLOCK = 128  # the columns of a row one fp8_block scale covers


@dataclass(frozen=True)
class Format:
    """A storage format: ``code`` (the tiles' FORMAT constant), ``block`` elements of a row in
    ``block_bytes`` bytes, and the scales it keeps beside its bytes (None, "channel" or "block")."""

    name: str
    code: int
    block: int
    block_bytes: int
    scales: str | None = None

    def row_bytes(self, cols: int) -> int:
        """Bytes of a packed row of ``cols`` elements (a whole number of blocks)."""
        return cols // self.block * self.block_bytes

    def scales_shape(self, rows: int, cols: int, scale_offset: int = 0) -> tuple[int, ...] | None:
        if self.scales == "channel":
            return (rows,)
        if self.scales == "block":
            return (rows, ceil_div(scale_offset + cols, FP8_SCALE_BLOCK))
        return None


Q8_0 = Format("q8_0", 1, 32, 34)
Q4_0 = Format("q4_0", 2, 32, 18)
Q4_1 = Format("q4_1", 3, 32, 20)
Q4_K = Format("q4_k", 4, 256, 144)
Q6_K = Format("q6_k", 5, 256, 210)
FP8_CHANNEL = Format("fp8_channel", 6, 1, 1, "channel")
FP8_BLOCK = Format("fp8_block", 7, 1, 1, "block")
FORMATS = {f.name: f for f in (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, FP8_CHANNEL, FP8_BLOCK)}
FORMATS_BY_CODE = {f.code: f for f in FORMATS.values()}  # by the tiles' FORMAT constant


@dataclass(frozen=True)
class Quantized:
    """A weight [rows, cols] in ``format``: ``data`` its packed rows (a uint8 graph tensor [rows, row
    bytes]), ``scales`` its float32 scales (FP8), ``dtype`` the dtype its values are used in;
    ``scale_offset`` (fp8_block): the columns of its first scale block before its own first column (a
    rank's, as its addresses: left out of the description ranks compare)."""

    data: object          # graph Tensor
    format: Format
    cols: int
    dtype: torch.dtype
    scales: object = None  # graph Tensor
    scale_offset: int = field(default=0, repr=False)

    @property
    def rows(self) -> int:
        return self.data.rows

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)


def rows_of(weight, start: int, length: int):
    """Rows ``start .. start + length`` of a weight: a view of a graph tensor, or of a ``Quantized`` one's
    packed rows and their scales."""
    if not isinstance(weight, Quantized):
        return weight[start:start + length]
    scales = weight.scales
    if scales is not None:
        scales = scales[start:start + length]  # [rows] or [rows, column blocks]: a scale row per weight row
    return Quantized(weight.data[start:start + length], weight.format, weight.cols, weight.dtype, scales,
                     weight.scale_offset)


def quantized_input(g, name: str, shape: tuple[int, int], format: Format, dtype: torch.dtype,
                    scale_offset: int = 0, scale_blocks: int | None = None) -> Quantized:
    """The graph inputs of a weight ``shape`` kept in ``format``: its bytes, named ``name``, and its scales,
    named ``name + ".scales"`` (FP8); its values are used in ``dtype``. fp8_block, a rank's columns that
    start inside a scale block: ``scale_offset``, the columns of the first block before its own;
    ``scale_blocks``, the scale columns it holds (the same on every rank; None: those it needs)."""
    rows, cols = shape
    g.require(cols % format.block == 0, f"{name}: {cols} columns are not whole {format.name} blocks of {format.block}")
    g.require(scale_offset == 0 or (format.scales == "block" and 0 < scale_offset < FP8_SCALE_BLOCK),
              f"{name}: a scale offset of {scale_offset!r} columns; only fp8_block weights have one, below "
              f"{FP8_SCALE_BLOCK}")
    data = g.input(name, (rows, format.row_bytes(cols)), torch.uint8)
    scales_shape = format.scales_shape(rows, cols, scale_offset)
    if scale_blocks is not None and format.scales == "block":
        g.require(scale_blocks >= scales_shape[1], f"{name}: {scale_blocks} scale blocks, {scales_shape[1]} needed")
        scales_shape = (rows, scale_blocks)
    scales = g.input(name + ".scales", scales_shape, torch.float32) if scales_shape else None
    return Quantized(data, format, cols, dtype, scales, scale_offset)


# -- dequantization in torch: one function per format, on packed rows uint8 [n, bytes] ----------------------

def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of every block, as float32 [..., 1]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 values: the low nibbles (elements 0-15), then the high ones (16-31)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _q8_0(b):
    return _f16(b, 0) * b[..., 2:].view(torch.int8).float()


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[..., 2:]).float() - 8)


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[..., 4:]).float() + _f16(b, 2)


def _q4_k(b):
    d, dmin, s, qs = _f16(b, 0), _f16(b, 2), b[..., 4:16].long(), b[..., 16:].long()
    low, mid, high = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scale = torch.cat([low & 63, (high & 15) | ((low >> 2) & 48)], dim=-1)      # [..., 8] sub-blocks
    minimum = torch.cat([mid & 63, (high >> 4) | ((mid >> 2) & 48)], dim=-1)
    q = torch.stack([qs.unflatten(-1, (4, 32)) & 15, qs.unflatten(-1, (4, 32)) >> 4], dim=-2)  # [..., 4, 2, 32]
    q = q.flatten(-3, -2).float()                                               # [..., 8, 32]
    return ((d * scale.float()).unsqueeze(-1) * q - (dmin * minimum.float()).unsqueeze(-1)).flatten(-2)


def _q6_k(b):
    ql, qh, scale, d = b[..., :128].long(), b[..., 128:192].long(), b[..., 192:208].view(torch.int8), _f16(b, 208)
    low = torch.stack([ql.unflatten(-1, (2, 64)) & 15, ql.unflatten(-1, (2, 64)) >> 4], dim=-2).flatten(-2)
    high = torch.stack([(qh.unflatten(-1, (2, 32)) >> shift) & 3 for shift in (0, 2, 4, 6)], dim=-2).flatten(-2)
    q = ((low | (high << 4)) - 32).flatten(-2).float().unflatten(-1, (16, 16))   # [..., 16 sub-blocks, 16]
    return ((d * scale.float()).unsqueeze(-1) * q).flatten(-2)


GGUF_DEQUANTIZE = {Q8_0: _q8_0, Q4_0: _q4_0, Q4_1: _q4_1, Q4_K: _q4_k, Q6_K: _q6_k}


def dequantize(format: Format, data: torch.Tensor, cols: int, scales: torch.Tensor | None = None,
               row0: int = 0, col0: int = 0, scale_offset: int = 0) -> torch.Tensor:
    """float32 [n, cols]: packed rows ``data`` (uint8 [n, format.row_bytes(cols)]), which are rows
    ``row0 ..`` and columns ``col0 ..`` of the weight ``scales`` (FP8: the whole weight's, or rows
    from row0 on; fp8_block: their first block starts ``scale_offset`` columns before the weight) belong to."""
    if format.scales is None:
        blocks = data.reshape(data.shape[0], cols // format.block, format.block_bytes)
        return GGUF_DEQUANTIZE[format](blocks).reshape(data.shape[0], cols)
    values = data.view(torch.float8_e4m3fn).float()
    rows = torch.arange(row0, row0 + data.shape[0])
    if format.scales == "channel":
        return values * scales[rows].float().unsqueeze(1)
    columns = torch.arange(scale_offset + col0, scale_offset + col0 + cols)
    return values * scales[rows][:, columns // FP8_SCALE_BLOCK].float()
