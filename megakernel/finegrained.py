"""Fine-grained device memory on ROCm: where the hip backend keeps a heap's comm area (``layout``).

An AMD GPU keeps coarse-grained memory (what ``hipMalloc`` and torch's allocator give) coherent only
at kernel boundaries: a running kernel may read a stale line of what a peer GPU stored, and AMD
documents that system-scope atomics to coarse-grained memory are downgraded to device scope, so a
counter a peer raises may never be seen. Fine-grained memory (``hipExtMallocWithFlags(...,
hipDeviceMallocFinegrained)``) stays coherent while kernels run; iris keeps its symmetric heap there.
The binding is hip-python (``pip install 'megakernel[rocm]'``, a release matching the ROCm that
torch was built for: it loads ``libamdhip64.so`` by name and must find the same runtime torch uses);
peers open the allocation through HIP's IPC handles. The tensors returned own their memory: it is
freed (or its mapping closed) with the last view of it. Not yet run on an AMD GPU.
"""
from __future__ import annotations

import ctypes

import torch

from .errors import BackendError


def _hip():
    try:
        from hip import hip
    except ImportError:
        raise BackendError("the hip backend keeps what peers write in fine-grained memory, allocated through "
                           "hip-python: pip install 'megakernel[rocm]'") from None
    return hip


def _check(hip, what: str, result):
    error, *values = result if isinstance(result, tuple) else (result,)
    if error != hip.hipError_t.hipSuccess:
        raise BackendError(f"{what} failed: {error}")
    return values[0] if len(values) == 1 else values


class _Memory:
    """``nbytes`` of device memory at ``address``, as torch takes it (``__cuda_array_interface__``; the
    tensor keeps this object alive), given back by ``release`` when the last view goes."""

    def __init__(self, address: int, nbytes: int, release):
        self.address, self.nbytes, self._release = address, nbytes, release
        self.__cuda_array_interface__ = dict(shape=(nbytes,), typestr="|u1", data=(address, False), version=3)

    def __del__(self):
        self._release(self.address)


def _tensor(memory: _Memory) -> torch.Tensor:
    """A view of ``memory`` (no ``device=``: torch would copy memory it finds on another device)."""
    tensor = torch.as_tensor(memory)
    if not tensor.is_cuda or tensor.data_ptr() != memory.address:  # torch < 2.5 copies to the host
        raise BackendError(f"torch {torch.__version__} copied device memory instead of viewing it: the hip "
                           f"backend needs torch 2.5 or later")
    return tensor


def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    """``nbytes`` of zeroed fine-grained memory on ``device``, as a flat uint8 tensor."""
    hip = _hip()
    _check(hip, "hipSetDevice", hip.hipSetDevice(device.index))
    address = int(_check(hip, "hipExtMallocWithFlags", hip.hipExtMallocWithFlags(nbytes,
                                                                               hip.hipDeviceMallocFinegrained)))
    tensor = _tensor(_Memory(address, nbytes, lambda a: hip.hipFree(a)))
    tensor.zero_()
    return tensor


def export(tensor: torch.Tensor) -> bytes:
    """The IPC handle of an ``allocate``d tensor, for ``open_handle`` in another process."""
    hip = _hip()
    handle = _check(hip, "hipIpcGetMemHandle", hip.hipIpcGetMemHandle(tensor.data_ptr()))
    return ctypes.string_at(int(handle), hip.HIP_IPC_HANDLE_SIZE)  # int(): the struct's address


def open_handle(raw: bytes, nbytes: int, device: torch.device) -> torch.Tensor:
    """Another process's ``allocate``d memory (its ``export``ed handle) mapped here, as a flat uint8 tensor."""
    hip = _hip()
    handle = hip.hipIpcMemHandle_t()
    ctypes.memmove(int(handle), raw, hip.HIP_IPC_HANDLE_SIZE)
    _check(hip, "hipSetDevice", hip.hipSetDevice(device.index))
    address = int(_check(hip, "hipIpcOpenMemHandle", hip.hipIpcOpenMemHandle(handle,
                                                                           hip.hipIpcMemLazyEnablePeerAccess)))
    return _tensor(_Memory(address, nbytes, lambda a: hip.hipIpcCloseMemHandle(a)))
