"""Heaps on the host side: a rank's two areas, typed views of them, and the cpu backend's shared-memory
segment.

The cpu backend's heap is a POSIX shared-memory segment, mode 0600, with an unguessable name that
carries its creator's pid (and the launch's id, under ``launch``). The creator unlinks the name as
soon as every process that needs the segment has mapped it, so a crash afterwards cannot leak it:
the memory lives exactly as long as its mappings, and a view of it keeps its mapping alive. A
process killed before that point leaves the name behind; the next segment made by the same user
sweeps the names whose creator is gone.
"""
from __future__ import annotations

import mmap
import os
import secrets
import shutil
from dataclasses import dataclass, field
from typing import Callable

import torch

from .errors import GraphError
from .layout import COMM

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "megakernel-"
LAUNCH_ENV = "MEGAKERNEL_LAUNCH_ID"  # set by ``launch``: segments carry it so the launcher can sweep them


@dataclass(frozen=True)
class RankHeap:
    """A rank's heap as this process maps it: its data area and its comm area (``layout``), flat uint8
    tensors (on cpu and CUDA two slices of one allocation, the comm area right after the data)."""

    data: torch.Tensor
    comm: torch.Tensor

    @classmethod
    def split(cls, whole: torch.Tensor, data_size: int) -> "RankHeap":
        """The heap laid out as one allocation: the data area, then the comm area."""
        return cls(whole[:data_size], whole[data_size:])

    def bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        """The ``nbytes`` at heap ``offset`` (of either area), a view."""
        area, at = (self.comm, offset - COMM) if offset >= COMM else (self.data, offset)
        return area[at:at + nbytes]

    def clone(self) -> "RankHeap":
        return RankHeap(self.data.clone(), self.comm.clone())

    def cpu(self) -> "RankHeap":
        return RankHeap(self.data.cpu(), self.comm.cpu())


@dataclass
class Heaps:
    """This rank's heap and its node's peers', as this process can read and write them, and ``delta``: this
    rank's comm area address minus its data area's, as its programs see them (``layout.device_words``);
    what a backend's ``allocate`` returns. ``shadows``: for each peer on another node, the stand-in for its
    comm area in this rank's heap, which this rank's tiles write as they would the peer's and the
    transport carries over (``transport``)."""

    local: RankHeap
    peers: dict[int, RankHeap]
    delta: int
    shadows: dict[int, torch.Tensor] = field(default_factory=dict)


def kernel_bases(heaps: list[RankHeap], rank: int) -> tuple[list[int], int]:
    """What rank ``rank``'s kernel addresses every rank's heap with, its heaps ``heaps`` as mapped in this
    process: (``bases``, ``delta``). ``delta`` is this rank's comm area address minus its data area's
    (``layout.device_words`` adds it to comm offsets); ``bases[r]`` is rank r's comm area less ``delta``,
    so that ``bases[r]`` plus a rewritten comm offset is rank r's comm area plus the offset (a put, a
    signal), and ``bases[rank]`` is this rank's data area (its own data and comm offsets alike)."""
    local = heaps[rank]
    delta = local.comm.data_ptr() - local.data.data_ptr()
    return [heap.comm.data_ptr() - delta for heap in heaps], delta


@dataclass
class HostWrites:
    """How often the host wrote each of a kernel's inputs that only ``bind`` writes, so that a worker may keep
    what it derives from their bytes (``WorkerHeap.derived``) without reading them again to see whether they
    changed. Not counted, so compared by their bytes: an input some task writes (it changes on the device),
    and one whose view was handed out (``Megakernel.tensor``: the host may write it at any time after)."""

    areas: dict[int, tuple[int, int]]  # the inputs counted: buffer index -> (heap offset, bytes)
    counts: dict[int, int] = field(default_factory=dict)
    _stable: tuple[tuple[int, int, int], ...] | None = None

    def written(self, buffer: int) -> None:
        if buffer in self.areas:
            self.counts[buffer] = self.counts.get(buffer, 0) + 1
            self._stable = None

    def handed_out(self, buffer: int) -> None:
        if self.areas.pop(buffer, None) is not None:
            self._stable = None

    def stable(self) -> tuple[tuple[int, int, int], ...]:
        """(first byte, end byte, writes so far) of each input counted, by first byte: what a launch tells
        the torch backend's workers."""
        if self._stable is None:
            self._stable = tuple(sorted((offset, offset + size, self.counts.get(buffer, 0))
                                        for buffer, (offset, size) in self.areas.items()))
        return self._stable


class HeapView:
    """Typed torch views of a rank's heap (``RankHeap``, host or device) by heap offset, for the runtime,
    images and the reference tiles."""

    def __init__(self, heap: RankHeap):
        self.heap = heap
        self._typed: dict[tuple[bool, torch.dtype], torch.Tensor] = {}

    def tensor(self, offset: int, dtype: torch.dtype | str, rows: int, cols: int, row_stride: int) -> torch.Tensor:
        """The ``rows x cols`` view at byte ``offset`` with ``row_stride`` elements between rows;
        ``dtype`` a torch dtype or its name ("bfloat16")."""
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        comm = offset >= COMM
        typed = self._typed.get((comm, dtype))
        if typed is None:
            typed = self._typed[comm, dtype] = (self.heap.comm if comm else self.heap.data).view(dtype)
        offset -= COMM if comm else 0
        # the offsets and sizes come from a table, which may come from anyone (an image, a file): a view
        # past its area would read or write other memory, as_strided checks only part of it
        area = "comm area" if comm else "heap"
        if offset % dtype.itemsize or min(offset, rows, cols, row_stride) < 0 or max(rows, cols, row_stride) >= 1 << 62:
            raise GraphError(f"a {rows} x {cols} {dtype} view at {area} offset {offset} (row stride {row_stride}) "
                             f"is misaligned, negative or too large")
        end = offset + ((rows - 1) * row_stride + cols) * dtype.itemsize if rows and cols else offset
        if end > typed.numel() * dtype.itemsize:
            raise GraphError(f"a {rows} x {cols} {dtype} view at {area} offset {offset} (row stride {row_stride}) "
                             f"ends at byte {end:,}, past the {area}'s {typed.numel() * dtype.itemsize:,}")
        # as_strided counts from the storage's start: an area that is a slice of a larger allocation
        # (the comm area, virtual ranks' heaps) begins at its own storage offset
        return torch.as_strided(typed, (rows, cols), (row_stride, 1), typed.storage_offset() + offset // dtype.itemsize)

    def derived(self, key: tuple, sources: tuple[torch.Tensor, ...], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """What ``make()`` derives from the heap views ``sources`` (a reference tile's weights unpacked from
        their packed bytes, a weight laid out for the CPU's matrix library), ``key`` naming it: made at every
        call here, as an oracle should; a torch backend worker keeps it while the sources hold the same
        bytes (``WorkerHeap``). The result is read, never written."""
        return make()

    def keeps(self, key: tuple, sources: tuple[torch.Tensor, ...], nbytes: int) -> bool:
        """Whether ``derived(key, sources, ...)`` of ``nbytes`` is kept (or would be), so that deriving it pays
        off: here always, so that the oracle computes as a worker that keeps it does."""
        return True

    def word(self, offset: int) -> int:
        """The int64 at heap ``offset`` (a position, a token id, a page number), for a reference tile."""
        return int(self.tensor(offset, torch.int64, 1, 1, 1))

    def words(self, offset: int, count: int, step: int) -> list[int]:
        """The ``count`` int64 words from heap ``offset``, ``step`` bytes apart (0: the same word each time)."""
        if step == 0:
            return [self.word(offset)] * count
        if step % 8:
            raise GraphError(f"words {step} bytes apart at heap offset {offset} are not whole int64 words apart")
        return self.tensor(offset, torch.int64, count, 1, step // 8)[:, 0].tolist()

    def checked_index(self, value: int, bound: int, where: str) -> int:
        """A data-dependent index of a reference tile (a token id, a position, a page), read at ``where``:
        the kernel clamps one out of [0, bound) and reports it after the run (``device.checked_index``);
        the reference executor, an oracle, refuses it here. (The torch backend's heaps clamp and report.)"""
        if not 0 <= value < bound:
            raise GraphError(f"index {value} read at {where} is outside [0, {bound})")
        return value

    def not_finite(self, row: int, position: int, where: str) -> None:
        """A reference tile met logits that are not finite (``tasks.sampling``): the kernel reports them
        after the run; the reference executor refuses them here. (The torch backend's heaps report.)"""
        raise GraphError(f"{where} (batch row {row}, sampling position {position}) are not finite")


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
        sweep_orphans(SHM_DIR, SEGMENT_PREFIX)
        launch = os.environ.get(LAUNCH_ENV, "none")
        return cls(f"{SEGMENT_PREFIX}{os.getpid()}-{launch}-{secrets.token_hex(16)}", max(size, 1), create=True)

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Drop this mapping: it is unmapped when the last tensor viewing it goes, not before (a view
        handed out earlier stays valid)."""
        self.tensor = self._map = None


def remove_segments(launch_id: str) -> None:
    """Unlink every segment a launch's ranks created and did not unlink (a rank died in between)."""
    for name in os.listdir(SHM_DIR):
        fields = name.split("-")
        if name.startswith(SEGMENT_PREFIX) and len(fields) == 4 and fields[2] == launch_id:
            _remove(os.path.join(SHM_DIR, name))


def sweep_orphans(folder: str, prefix: str) -> None:
    """Remove this user's entries ``<prefix><pid>-...`` of ``folder`` whose creating process is gone."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return
    for name in names:
        pid = name[len(prefix):].split("-")[0]
        if not (name.startswith(prefix) and pid.isdigit()) or _alive(int(pid)):
            continue
        path = os.path.join(folder, name)
        try:
            if os.lstat(path).st_uid == os.getuid():
                _remove(path)
        except FileNotFoundError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass
