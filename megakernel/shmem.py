"""Puts and signals to ranks of other nodes on NVIDIA GPUs: NVSHMEM's device calls for Triton, and where
NVSHMEM's device library is.

A kernel built for the ``nvshmem`` transport (``codegen.TRANSPORTS``) reaches a peer of its node as any
kernel does, by stores through its mapped heap, and a peer of another node, whose ``bases`` entry is 0 (not
mapped), through NVSHMEM: a put tile's rows go as ``nvshmemx_putmem_block`` calls from this rank's block to
the same comm-area offset on the peer (the comm area lies in NVSHMEM's symmetric heap, at the same offset
on every rank: ``symmetric_area``), and a signal is ``nvshmem_fence`` (the puts before it land first) then a put of no bytes
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
then have its device state set by ``nvshmemx_cumodule_init`` before it runs (``init_module``).

The host side is torch's: NVSHMEM is started by torch's symmetric memory (``set_backend("NVSHMEM")``, then
``empty`` and ``rendezvous`` over a process group, which bootstraps NVSHMEM from the group's store), and
torch exports ``_nvshmemx_cumodule_init``. Where a piece is missing (no CUDA GPU, a torch built without
NVSHMEM) ``host_missing`` says which, and the calls raise with it. ``loopback`` is the transport's
smallest whole use, on one processing element (the GPU check's one GPU): rows put and a counter
signalled to itself through NVSHMEM.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language import core

from .device import heap_ptr
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


@triton.jit(do_not_specialize=["base", "src", "dst", "counter", "seen", "rows", "cols", "pe", "polls"])
def loopback(base: tl.int64, src: tl.int64, dst: tl.int64, counter: tl.int64, seen: tl.int64, rows: tl.int64,
             cols: tl.int64, pe: tl.int64, polls: tl.int64):
    """One program: the ``rows`` x ``cols`` int32 block at byte ``src`` of the symmetric area at ``base`` put
    at byte ``dst`` of PE ``pe``'s area (``put_rows``), then 1 added to the int64 counter at byte ``counter``
    there (``signal``: fenced after the puts). With ``pe`` this one, the program then polls its counter
    (``polls`` reads at most, never a hang) and writes the value it last read at byte ``seen``: 1 once the
    signal arrived, and the rows have arrived before it."""
    put_rows(base, dst, src, pe, rows, cols, cols, cols, tl.int32)
    signal(base, counter, rows * 0 + 1, pe)
    word = heap_ptr(base, counter, tl.int64)
    value = tl.load(word, volatile=True)
    tries = 0
    while (value < 1) & (tries < polls):
        value = tl.load(word, volatile=True)
        tries += 1
    tl.store(heap_ptr(base, seen, tl.int64), value)


def host_missing() -> str | None:
    """Why NVSHMEM's host side cannot run in this process (no CUDA GPU, a torch without symmetric memory or
    built without NVSHMEM), or None."""
    if not torch.cuda.is_available() or torch.version.hip:
        return "no CUDA GPU in this process"
    try:
        from torch._C._distributed_c10d import _nvshmemx_cumodule_init  # noqa: F401
        from torch.distributed import _symmetric_memory as symmetric
    except ImportError as error:
        return f"torch {torch.__version__} has no NVSHMEM symmetric memory ({error})"
    if not all(hasattr(symmetric, name) for name in ("set_backend", "get_backend", "empty", "rendezvous")):
        return f"torch {torch.__version__}'s symmetric memory lacks set_backend, get_backend, empty or rendezvous"
    if not symmetric.is_nvshmem_available():
        return f"torch {torch.__version__} was built without NVSHMEM, or its host library does not load"
    return None


def _host() -> None:
    missing = host_missing()
    if missing:
        raise BackendError(f"NVSHMEM's host side: {missing}")


def symmetric_area(nbytes: int, device: torch.device, group_name: str) -> torch.Tensor:
    """``nbytes`` of NVSHMEM's symmetric heap on ``device``, the same offset on every rank of the process
    group ``group_name`` (a collective: every rank calls it with the same size); NVSHMEM starts on the
    first call. Torch allocates it (``_symmetric_memory``, NVSHMEM backend) and frees it with the tensor."""
    _host()
    from torch.distributed import _symmetric_memory as symmetric
    if symmetric.get_backend(device) != "NVSHMEM":
        symmetric.set_backend("NVSHMEM")  # before the process's first symmetric allocation
    area = symmetric.empty(nbytes, dtype=torch.uint8, device=device)
    symmetric.rendezvous(area, group_name)
    return area


def init_module(compiled) -> None:
    """Give a loaded Triton kernel that links NVSHMEM's device library (``compiled``, a CompiledKernel)
    NVSHMEM's device state (``nvshmemx_cumodule_init`` on its module): without it the first call faults.
    After NVSHMEM has started (``symmetric_area``), before the first launch."""
    _host()
    from torch._C._distributed_c10d import _nvshmemx_cumodule_init
    compiled._init_handles()
    _nvshmemx_cumodule_init(compiled.module)
