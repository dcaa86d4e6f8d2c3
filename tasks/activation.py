"""Gated activations (tiles of the binary type): ``silu_mul(a, b) = silu(a) * b``, the gate of a SwiGLU
MLP, and ``gelu_tanh_mul(a, b) = gelu_tanh(a) * b``, Gemma's GeGLU."""
from __future__ import annotations

from .elementwise import binary


def silu_mul(g, a, b):
    """Elementwise ``silu(a) * b``, computed in float32."""
    return binary(g, "silu_mul", a, b)


def gelu_tanh_mul(g, a, b):
    """Elementwise ``gelu(a) * b`` (tanh approximation, ``gelu_pytorch_tanh``), computed in float32."""
    return binary(g, "gelu_tanh_mul", a, b)


TASK_TYPES = ()
OPS = {"silu_mul": silu_mul, "gelu_tanh_mul": gelu_tanh_mul}
