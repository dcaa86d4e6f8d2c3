"""Kernel images: a kernel's tables and heap saved to one file, readable without the graph.

An image is a file from anyone: every part is checked before it is used, and the heap (the large
part) is read only when asked for. ``save_image`` stores its arrays uncompressed; an archive member
may be compressed, but may not expand past MAX_EXPANSION times the bytes the file stores for it
(checked before a byte is decompressed, and no member is read past its declared size), so a small
file cannot make a reader allocate gigabytes."""
from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .scheduler import FormatError, QueueTables, Spec, deserialize
from .tasks import DTYPES, TASK_TYPES
from .heap import HeapView, RankHeap

MAX_EXPANSION = 32  # decompressed / stored bytes of one member: generous for data, far below a zip bomb's


@dataclass
class Image:
    tables: QueueTables
    heap: RankHeap | None                             # None for a bare table file
    outputs: dict[str, tuple[int, str, int, int, int]]  # name -> (offset, dtype, rows, cols, row_stride)

    def output(self, name: str) -> torch.Tensor:
        offset, dtype, rows, cols, stride = self.outputs[name]
        return HeapView(self.heap).tensor(offset, dtype, rows, cols, stride)


def load(path: str | Path, heap: bool = True) -> Image:
    """Read a ``Megakernel.save_image`` file (.npz; the heap too unless ``heap=False``) or a bare
    serialized table."""
    path = Path(path)
    if path.suffix != ".npz":
        return Image(_tables(path.read_bytes()), None, {})
    with zipfile.ZipFile(path) as archive:
        tables = _tables(_member(archive, "tables", np.uint8).tobytes())
        outputs = json.loads(_member(archive, "outputs", np.uint8).tobytes().decode())
        memory = None
        if heap:  # the data area, then the comm area (``layout``)
            memory = RankHeap(torch.from_numpy(_member(archive, "heap", np.uint8)),
                              torch.from_numpy(_member(archive, "comm", np.uint8)))
    if not isinstance(outputs, dict) or not all(isinstance(v, list) and len(v) == 5 for v in outputs.values()):
        raise FormatError(f"{path}: the outputs record is not a kernel image's")
    return Image(tables, memory, {k: tuple(v) for k, v in outputs.items()})


def _tables(blob: bytes) -> QueueTables:
    tables = deserialize(blob)
    _check_task_types(tables.specs)
    return tables


def _check_task_types(specs: list[Spec]) -> None:
    """Every opcode names a task type of this library with its own argument words and constants: the
    metadata is the only description of a row, and a table may come from anyone. (Here, not in
    ``deserialize``: the scheduler knows no task library.)"""
    dtype_names = set(DTYPES.values())
    for opcode, spec in enumerate(specs):
        task_type = TASK_TYPES.get(spec.task_type)
        if task_type is None:
            raise FormatError(f"task table opcode {opcode}: no task type {spec.task_type!r} in this library")
        if spec.arg_names != task_type.arg_names:
            raise FormatError(f"task table opcode {opcode} ({spec.task_type}): argument words {list(spec.arg_names)}, "
                              f"the task type's are {list(task_type.arg_names)}")
        if tuple(name for name, _ in spec.constexprs) != task_type.constexpr_names:
            raise FormatError(f"task table opcode {opcode} ({spec.task_type}): constants "
                              f"{[name for name, _ in spec.constexprs]}, the task type's are "
                              f"{list(task_type.constexpr_names)}")
        for name, value in spec.constexprs:
            # a dtype is a name; any other constant is one JSON scalar (its meaning is the tile's to check)
            if name.endswith("DTYPE") and value not in dtype_names or not isinstance(value, (bool, int, float, str)):
                raise FormatError(f"task table opcode {opcode} ({spec.task_type}): constant {name}={value!r} "
                                  f"is not {'a dtype name' if name.endswith('DTYPE') else 'a number, flag or name'}")


def _member(archive: zipfile.ZipFile, name: str, dtype) -> np.ndarray:
    """The 1-D array ``name`` of an .npz archive, its header checked against the bytes stored for it
    before any of them is read (a header may claim gigabytes that a small compressed file lacks)."""
    try:
        info = archive.getinfo(f"{name}.npy")
    except KeyError:
        raise FormatError(f"not a kernel image: no {name!r} array") from None
    if info.file_size > MAX_EXPANSION * max(info.compress_size, 1 << 16):
        raise FormatError(f"not a kernel image: its {name!r} array expands from {info.compress_size:,} stored bytes "
                          f"to {info.file_size:,} (at most {MAX_EXPANSION}x is read)")
    with archive.open(info) as file:
        readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
        reader = readers.get(np.lib.format.read_magic(file))
        if reader is None:
            raise FormatError(f"not a kernel image: its {name!r} array has an unknown .npy version")
        shape, _, stored = reader(file)
        if stored != np.dtype(dtype) or len(shape) != 1 or shape[0] != info.file_size - file.tell():
            raise FormatError(f"not a kernel image: its {name!r} array claims {stored} {shape}, and the file holds "
                              f"{info.file_size - file.tell()} bytes for it")
        return np.frombuffer(file.read(shape[0]), dtype=dtype).copy()
