"""Heaps on the host side: typed views of any heap, and the cpu backend's shared-memory segment.

The cpu backend's heap is a POSIX shared-memory segment, mode 0600, with an unguessable name. The
creator unlinks the name as soon as every process that needs the segment has mapped it, so a crash
afterwards cannot leak it: the memory lives exactly as long as its mappings.
"""
from __future__ import annotations

import mmap
import os
import secrets

import torch

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "megakernel-"
LAUNCH_ENV = "MEGAKERNEL_LAUNCH_ID"  # set by ``launch``: segments carry it so the launcher can sweep them


class HeapView:
    """Typed torch views of a heap (a flat uint8 tensor, host or device), for the runtime, images and
    the reference tiles."""

    def __init__(self, heap: torch.Tensor):
        self.heap = heap
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def tensor(self, offset: int, dtype: torch.dtype | str, rows: int, cols: int, row_stride: int) -> torch.Tensor:
        """The ``rows x cols`` view at byte ``offset`` with ``row_stride`` elements between rows;
        ``dtype`` a torch dtype or its name ("bfloat16")."""
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed[dtype] = self.heap.view(dtype)
        assert offset % dtype.itemsize == 0, f"misaligned {dtype} at heap offset {offset}"
        # as_strided counts from the storage's start: a heap that is a slice of a larger one (virtual
        # ranks) begins at its own storage offset
        return torch.as_strided(typed, (rows, cols), (row_stride, 1), typed.storage_offset() + offset // dtype.itemsize)


class SharedHeap:
    """A mapping of one shared-memory segment; ``tensor`` is a flat uint8 view of it."""

    def __init__(self, name: str, size: int, create: bool = False):
        self.name, self.size = name, size
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.address = self.tensor.data_ptr()

    @classmethod
    def create(cls, size: int) -> "SharedHeap":
        launch = os.environ.get(LAUNCH_ENV)
        prefix = f"{SEGMENT_PREFIX}{launch}-" if launch else SEGMENT_PREFIX
        return cls(f"{prefix}{secrets.token_hex(16)}", max(size, 1), create=True)

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self.tensor = None
        if self._map is not None:
            self._map.close()
            self._map = None


def remove_segments(launch_id: str) -> None:
    """Unlink every segment a launch's ranks created and did not unlink (a rank died in between)."""
    prefix = f"{SEGMENT_PREFIX}{launch_id}-"
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except FileNotFoundError:
                pass
