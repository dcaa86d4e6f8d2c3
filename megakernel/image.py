"""Kernel images: a kernel's tables and heap saved to one file, readable without the graph."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .scheduler import QueueTables, deserialize
from .heap import HeapView


@dataclass
class Image:
    tables: QueueTables
    heap: torch.Tensor | None                         # flat uint8; None for a bare table file
    outputs: dict[str, tuple[int, str, int, int, int]]  # name -> (offset, dtype, rows, cols, row_stride)

    def output(self, name: str) -> torch.Tensor:
        offset, dtype, rows, cols, stride = self.outputs[name]
        return HeapView(self.heap).tensor(offset, dtype, rows, cols, stride)


def load(path: str | Path) -> Image:
    """Read a ``Megakernel.save_image`` file (.npz) or a bare serialized table."""
    path = Path(path)
    if path.suffix == ".npz":
        with np.load(path) as data:
            tables = deserialize(data["tables"].tobytes())
            heap = torch.from_numpy(data["heap"].copy())
            outputs = json.loads(data["outputs"].tobytes().decode())
        return Image(tables, heap, {k: tuple(v) for k, v in outputs.items()})
    return Image(deserialize(path.read_bytes()), None, {})
