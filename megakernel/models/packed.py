"""A quantized weight as a checkpoint keeps it (``Packed``): its packed rows and scales, cut and joined as
ranks and fused projections need, without dequantizing anything, then bound to the heap as they are.

It narrows, pads and concatenates like the tensors ``schema.shard_weights`` takes slices of, in the
weight's element coordinates: rows freely, columns at whole blocks of its format's packed bytes (FP8's
anywhere: a rank's columns that start inside a 128-column scale block keep that block's scales and
how far into it they start, ``scale_offset``). Its payload may be
lazy (a GGUF file's memory map, a safetensors slice): only what a rank takes is read.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..errors import GraphError
from ..tasks.formats import FP8_SCALE_BLOCK, Format


def materialized(part: Any) -> torch.Tensor:
    """A lazy payload's tensor (``load()``: what it spans is read now), or the tensor itself."""
    return part.load() if hasattr(part, "load") else torch.as_tensor(part)


@dataclass(frozen=True)
class Packed:
    """Weight ``name`` [rows, cols] in ``format``: ``data`` its packed rows [rows, format.row_bytes(cols)]
    (uint8), ``scales`` its FP8 scales ([rows] or [rows, ceil((scale_offset + cols) / 128)], float32);
    ``scale_offset``: fp8_block's columns of its first scale block before its own first column."""

    name: str
    data: Any
    format: Format
    cols: int
    scales: Any = None
    scale_offset: int = 0

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    def narrow(self, dim: int, start: int, length: int) -> "Packed":
        if dim == 0:
            scales = self.scales.narrow(0, start, length) if self.scales is not None else None
            return replace(self, data=self.data.narrow(0, start, length), scales=scales)
        f = self.format
        if start % f.block or (length % f.block and start + length != self.cols):
            raise GraphError(f"{self.name}: a rank's columns {start}..{start + length} cut a {f.name} block of "
                             f"{f.block} columns; splits across ranks must fall on whole blocks")
        scales, offset = self.scales, self.scale_offset
        if f.scales == "block":  # the scale blocks the columns touch, and where in the first they start
            first = (offset + start) // FP8_SCALE_BLOCK
            scales = scales.narrow(1, first, -(-(offset + start + length) // FP8_SCALE_BLOCK) - first)
            offset = (offset + start) % FP8_SCALE_BLOCK
        return replace(self, data=self.data.narrow(1, f.row_bytes(start), f.row_bytes(length)), cols=length,
                       scales=scales, scale_offset=offset)

    def with_scale_blocks(self, blocks: int) -> "Packed":
        """This weight with its block scales padded to ``blocks`` columns (zeros: past its last column)."""
        scales = materialized(self.scales).float()
        return replace(self, scales=torch.cat([scales, scales.new_zeros(scales.shape[0], blocks - scales.shape[1])], 1))

    def new_zeros(self, shape) -> "Packed":
        """Zero weights of ``shape`` (rows, cols) in this format: zero bytes are zero in every format."""
        rows, cols = shape
        if cols % self.format.block:
            raise GraphError(f"{self.name}: padding of {cols} columns is not whole {self.format.name} blocks")
        scales_shape = self.format.scales_shape(rows, cols)
        return Packed(self.name, torch.zeros(rows, self.format.row_bytes(cols), dtype=torch.uint8), self.format, cols,
                      torch.zeros(scales_shape) if scales_shape else None)

    def contiguous(self) -> "Packed":
        """This weight read: its payload as tensors."""
        data = materialized(self.data)
        data = data.view(torch.uint8).contiguous()  # FP8 checkpoints' float8 elements as their bytes
        scales = materialized(self.scales).float().contiguous() if self.scales is not None else None
        return replace(self, data=data, scales=scales)

    def detach(self) -> "Packed":
        return self


def concat(parts: list, dim: int = 0):
    """``torch.cat`` of tensors, or of the ``Packed`` parts of one weight (one format; along columns with
    block scales, each part after the first starts a scale block or is zeros: a rank's padding)."""
    if not isinstance(parts[0], Packed):
        return torch.cat(parts, dim)
    first = parts[0]
    formats = {p.format.name for p in parts}
    if len(formats) > 1:
        raise GraphError(f"{first.name}: its parts are kept in {', '.join(sorted(formats))}; one format per weight")
    parts = [p.contiguous() for p in parts]
    scales = None
    if first.format.scales == "block" and dim == 1:
        scales = _joined_scales(parts)
    elif first.format.scales == "block":
        if any(p.scale_offset != first.scale_offset for p in parts):
            raise GraphError(f"{first.name}: rows joined from parts whose columns start at different places in "
                             f"their scale blocks")
        scales = torch.cat([p.scales for p in parts])
    elif first.format.scales == "channel":
        # along columns, a row keeps one scale: the parts after the first may only be its zero padding
        if dim == 1 and any(p.data.any() for p in parts[1:]):
            raise GraphError(f"{first.name}: columns joined from parts with scales of their own per row")
        scales = torch.cat([p.scales for p in parts]) if dim == 0 else first.scales
    cols = first.cols if dim == 0 else sum(p.cols for p in parts)
    return Packed(first.name, torch.cat([p.data for p in parts], dim), first.format, cols, scales, first.scale_offset)


def _joined_scales(parts: list[Packed]) -> torch.Tensor:
    """The block scales of ``parts`` side by side (read): a part that starts a block brings its scales; one
    that starts inside the block before must be zeros (any scale gives its zero bytes zero), and blocks
    only zeros reach get scale 0."""
    def padded(scales: torch.Tensor, blocks: int) -> torch.Tensor:
        return torch.cat([scales, scales.new_zeros(scales.shape[0], blocks - scales.shape[1])], 1)

    first = parts[0]
    joined, end = first.scales, first.scale_offset + first.cols  # end: columns from the first block's start
    for p in parts[1:]:
        if end % FP8_SCALE_BLOCK == 0 and p.scale_offset == 0:
            joined = torch.cat([padded(joined, end // FP8_SCALE_BLOCK), p.scales], 1)
        elif p.data.any():
            raise GraphError(f"{first.name}: columns joined inside a scale block of {FP8_SCALE_BLOCK}")
        end += p.cols
    return padded(joined, -(-end // FP8_SCALE_BLOCK))
