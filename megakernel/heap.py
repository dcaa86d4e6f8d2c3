"""The cpu backend's heap: a POSIX shared-memory segment, mode 0600, with an unguessable name.

The creator unlinks the name as soon as every process that needs the segment has mapped it, so a
crash afterwards cannot leak it: the memory lives exactly as long as its mappings.
"""
from __future__ import annotations

import mmap
import os
import secrets

import torch

SHM_DIR = "/dev/shm"


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
        return cls(f"megakernel-{secrets.token_hex(16)}", max(size, 1), create=True)

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
