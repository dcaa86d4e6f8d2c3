"""Atomic operations on int64 words of memory shared between processes, from Python.

Python has no atomics, and torch none on CPU tensors; Triton's interpreter has them: its runtime's
``atomic_rmw`` is a C++ atomic on a raw address, which holds across processes on shared memory (the
cpu backend's kernels rely on it). The torch backend's workers wait and signal through it: a wait
polls a word with plain loads (aligned 8-byte loads are single-copy atomic on x86-64 and aarch64),
then reads it once with ``load_acquire`` before the tile reads what its producers wrote; a signal is
an ``add`` that releases the tile's stores.
"""
from __future__ import annotations

import functools

import numpy as np
from triton._C.libtriton import interpreter as _runtime

_ADD, _MAX, _XCHG = _runtime.RMW_OP.ADD, _runtime.RMW_OP.MAX, _runtime.RMW_OP.XCHG
_ACQUIRE, _RELEASE, _ACQ_REL = (_runtime.MEM_SEMANTIC.ACQUIRE, _runtime.MEM_SEMANTIC.RELEASE,
                                _runtime.MEM_SEMANTIC.ACQUIRE_RELEASE)
_ZERO = np.zeros(1, dtype=np.int64)


def _rmw(op, addresses: np.ndarray, values: np.ndarray, semantic) -> np.ndarray:
    return _runtime.atomic_rmw(op, addresses, values, _all(addresses.size), semantic)


@functools.cache
def _all(size: int) -> np.ndarray:
    """The mask of ``size`` operations, every one on (made once per size: a wait and a signal are a few us)."""
    return np.ones(size, dtype=bool)


def addresses(*words: int) -> np.ndarray:
    """The byte addresses ``words`` as the operations below take them."""
    return np.array(words, dtype=np.uint64)


def add(at: np.ndarray, increments: np.ndarray) -> None:
    """``*at[i] += increments[i]`` for each i, each add a release: the stores before it are visible to
    whoever acquires the word after it."""
    _rmw(_ADD, at, increments, _RELEASE)


def load_acquire(at: np.ndarray) -> int:
    """The word at ``at[0]``, read with acquire semantics: later reads see what was released before it."""
    return int(_rmw(_ADD, at, _ZERO, _ACQUIRE)[0])


def exchange(at: np.ndarray, value: int) -> int:
    """Store ``value`` at ``at[0]`` (acquire and release); the word's previous value."""
    return int(_rmw(_XCHG, at, np.array([value], dtype=np.int64), _ACQ_REL)[0])


def maximum(at: np.ndarray, value: int) -> int:
    """``*at[0] = max(*at[0], value)`` (signed, released); the word's previous value."""
    return int(_rmw(_MAX, at, np.array([value], dtype=np.int64), _RELEASE)[0])
