"""Puts and signals to ranks of other nodes on NVIDIA GPUs: NVSHMEM's device calls for Triton, and where
NVSHMEM's device library is.

A kernel built for the ``nvshmem`` transport (``codegen.TRANSPORTS``) reaches a peer of its node as any
kernel does, by stores through its mapped heap, and a peer of another node, whose ``bases`` entry is 0 (not
mapped), through NVSHMEM: a put tile's rows go as ``nvshmemx_putmem_block`` calls from this rank's block to
the same comm-area offset on the peer (the comm area lies in NVSHMEM's symmetric heap, at the same offset
on every rank), and a signal is ``nvshmem_fence`` (the puts before it land first) then a put of no bytes
with an ADD on the peer's event counter (``nvshmemx_putmem_signal_block``). Both are block-scoped calls,
made by every thread of the program, as NVSHMEM asks; a wait on a counter a peer of another node raises is
the usual poll of this rank's own memory.

The calls are declared here as torch declares them (``torch.distributed._symmetric_memory._nvshmem_triton``:
``extern_elementwise`` of the C symbols, linked through ``extern_libs``), because torch defines its own only
where it sees a GPU Triton can run on (``has_triton``), so not ahead of time on a CPU, and its docstrings give
the signal operations the wrong numbers.

The library's device code is LLVM bitcode, linked into the kernel by Triton (``extern_libs``): the
``nvidia-nvshmem-cu12`` wheel ships one file per architecture, ``lib/libnvshmem_device_sm_90.bc``
(torch's own finder wants the single ``libnvshmem_device.bc`` of older releases). A loaded module must
then have its device state set by ``nvshmemx_cumodule_init`` before it runs.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import triton
import triton.language as tl
from triton.language import core

from .errors import BackendError

SIGNAL_ADD = tl.constexpr(10)  # NVSHMEM_SIGNAL_ADD (nvshmem_common_transport.h; torch's docstring says 5)
LIBRARY_ENV = "MEGAKERNEL_NVSHMEM_LIB"  # a bitcode file to link instead of the installed wheel's
I64, U64, I32 = core.dtype("int64"), core.dtype("uint64"), core.dtype("int32")


@core.extern
def putmem_block(dest, source, nbytes, pe, _semantic=None):
    """``nvshmemx_putmem_block(void *dest, const void *source, size_t nbytes, int pe)``: returns when ``source``
    may be reused; ordered before later puts and signals to ``pe`` by a fence. (void; declared int32.)"""
    return core.extern_elementwise("", "", [dest, source, nbytes, pe], {(I64, I64, I64, I32): ("nvshmemx_putmem_block", I32)},
                                   is_pure=False, _semantic=_semantic)


@core.extern
def putmem_signal_block(dest, source, nbytes, signal_at, value, op, pe, _semantic=None):
    """``nvshmemx_putmem_signal_block(dest, source, nbytes, uint64_t *sig_addr, uint64_t signal, int sig_op,
    int pe)``: the bytes, then the signal word updated (``op``: SIGNAL_ADD) once they are delivered."""
    return core.extern_elementwise("", "", [dest, source, nbytes, signal_at, value, op, pe],
                                   {(I64, I64, I64, I64, U64, I32, I32): ("nvshmemx_putmem_signal_block", I32)},
                                   is_pure=False, _semantic=_semantic)


@core.extern
def fence(_semantic=None):
    """``nvshmem_fence()``: this thread's puts to each peer before it are delivered before those after it."""
    return core.extern_elementwise("", "", [], {(): ("nvshmem_fence", I32)}, is_pure=False, _semantic=_semantic)


@triton.jit(noinline=True)
def put_rows(base, dst, src, peer, rows, cols, dst_stride, src_stride, DTYPE: tl.constexpr):
    """The block of ``rows`` x ``cols`` at heap offset ``src`` here put at offset ``dst`` of rank ``peer``'s
    heap: a row at a time (each row is contiguous; the block's rows are not)."""
    size = DTYPE.primitive_bitwidth // 8
    for r in range(0, rows):
        putmem_block(base + dst + r * dst_stride * size, base + src + r * src_stride * size, cols * size,
                     peer.to(tl.int32))


@triton.jit(noinline=True)
def signal(base, counter, increment, peer):
    """Add ``increment`` to the event counter at heap offset ``counter`` on rank ``peer``, after every put
    this program made to it."""
    fence()
    at = base + counter
    putmem_signal_block(at, at, increment * 0, at, increment.to(tl.uint64), SIGNAL_ADD, peer.to(tl.int32))


def device_library(arch: int) -> Path:
    """NVSHMEM's device bitcode for ``sm_<arch>``: ``$MEGAKERNEL_NVSHMEM_LIB``, else the installed
    ``nvidia-nvshmem-cu12`` wheel's file for the architecture (or its single file of releases before 3.7)."""
    chosen = os.environ.get(LIBRARY_ENV)
    if chosen:
        if not Path(chosen).is_file():
            raise BackendError(f"{LIBRARY_ENV}={chosen}: no such file")
        return Path(chosen)
    spec = importlib.util.find_spec("nvidia.nvshmem")
    folders = [Path(p) / "lib" for p in (spec.submodule_search_locations or [])] if spec else []
    for folder in folders:
        for name in (f"libnvshmem_device_sm_{arch}.bc", "libnvshmem_device.bc"):
            if (folder / name).is_file():
                return folder / name
    raise BackendError(f"NVSHMEM's device library for sm_{arch} is not installed: pip install nvidia-nvshmem-cu12 "
                       f"(its lib/libnvshmem_device_sm_{arch}.bc), or set {LIBRARY_ENV} to a bitcode file")
