"""``SamplingParams``: how a sequence's tokens are drawn on the device (``tasks.sampling`` draws them), checked
where they are made."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import GraphError, is_int, is_number
from ..tasks.sampling import PARAMS

SEED_BITS = 63  # a seed is an int64 on the device's heap
# the least positive float parameter: float32's smallest normal number (GPUs flush the subnormal ones to 0,
# where a temperature would divide by zero and a min-p would keep everything)
SMALLEST_NORMAL = float(torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class SamplingParams:
    """How a sequence's tokens are drawn on the device (``tasks.sampling``): ``temperature`` 0 is greedy
    (the argmax); above it, softmax(logits / temperature) over the tokens that ``top_k`` (0: all), ``top_p``
    (1: all) and ``min_p`` (0: all) keep. ``seed``: the key of the sequence's random stream, which with
    the position alone decides its draws (None: one drawn for it, the same on every rank). A positive
    float parameter is at least ``SMALLEST_NORMAL`` (1.18e-38): at the least temperature the draw is the
    argmax (among equal logits, one of them at random)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        def zero_or_normal(x) -> bool:
            return x == 0 or x >= SMALLEST_NORMAL

        checks = (("temperature", is_number(self.temperature) and 0 <= self.temperature < math.inf
                   and zero_or_normal(self.temperature), f"0 or a finite number >= {SMALLEST_NORMAL:.8g}"),
                  ("top_k", is_int(self.top_k) and 0 <= self.top_k < 1 << 24, "an int in [0, 2^24) (0: off)"),
                  ("top_p", is_number(self.top_p) and SMALLEST_NORMAL <= self.top_p <= 1,
                   f"a number in [{SMALLEST_NORMAL:.8g}, 1]"),
                  ("min_p", is_number(self.min_p) and 0 <= self.min_p <= 1 and zero_or_normal(self.min_p),
                   f"0 or a number in [{SMALLEST_NORMAL:.8g}, 1]"),
                  ("seed", self.seed is None or is_int(self.seed), "an int or None"))
        for name, good, what in checks:
            if not good:
                raise GraphError(f"sampling: {name} must be {what}, got {getattr(self, name)!r}")

    @property
    def row(self) -> list[float]:
        """The sampling tile's float32 params (``tasks.sampling.PARAMS``)."""
        return [float(getattr(self, name)) for name in PARAMS]


GREEDY = SamplingParams()
