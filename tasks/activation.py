"""Activations: ``silu_mul(a, b) = silu(a) * b``, the gate of a SwiGLU MLP (a tile of the binary type)."""
from __future__ import annotations

from .elementwise import binary


def silu_mul(g, a, b):
    """Elementwise ``silu(a) * b``, computed in float32."""
    return binary(g, "silu_mul", a, b)


TASK_TYPES = ()
OPS = {"silu_mul": silu_mul}
