"""A sequence of continuous batching (``DecodeModel.add``), the fault that ends some of a step's, and the
prefill rows' plan for a launch (``plan_prefill``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import GraphError
from ..tasks.chunk_attention import BLOCK_ROWS
from .sampling_params import GREEDY, SamplingParams


class SequenceFault(GraphError):
    """A step whose launch met data it cannot use in some sequences (``runtime.FaultError``: logits that
    are not finite, an index out of range): those sequences ended, their slots and pages free, and
    ``sequences`` maps each one's id to what it met; the others' tokens of the step are theirs as usual
    (an index fault, whose clamped data may be anywhere, ends every sequence of the step)."""

    def __init__(self, message: str, sequences: dict[int, str]):
        super().__init__(message, sequences)
        self.message, self.sequences = message, sequences

    def __str__(self) -> str:
        return self.message


@dataclass
class Sequence:
    """A sequence of continuous batching (``DecodeModel.add``): its batch row, prompt and new tokens, and
    the log-probability of each (with the ``max_logprobs`` most likely tokens' ids and log-probabilities)."""

    id: int
    slot: int
    prompt: torch.Tensor
    max_new: int
    stop: frozenset[int]                           # token ids that end it (included in its tokens)
    sampling: SamplingParams = GREEDY              # its seed set: the one drawn for it where it brought none
    pos: int = 0                                   # the position its row is at (the device's, mirrored)
    prefilled: int = 0                             # prompt positions whose KV the prefill rows wrote
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    done: bool = False

    @property
    def prefilling(self) -> bool:
        """Its prompt still has positions before the last for prefill rows (its batch row waits)."""
        return self.prefilled < self.prompt.numel() - 1

    @property
    def last_position(self) -> int:
        """The position of its last step (which samples its last token)."""
        return self.prompt.numel() + self.max_new - 2


@dataclass
class Chunk:
    """The prefill rows of a launch: (sequence, first position, positions, first row) parts, and the
    sequences whose prompt they finish."""

    parts: list[tuple[Sequence, int, int, int]] = field(default_factory=list)
    finishing: set[int] = field(default_factory=set)


def plan_prefill(active: list[Sequence], prefill_chunk: int) -> Chunk:
    """The prompt positions the prefill rows take in the next launch: each prefilling sequence in turn
    (oldest first), from a row at a multiple of ``BLOCK_ROWS`` (a block of rows holds one sequence's),
    up to ``prefill_chunk`` rows in all."""
    chunk, row = Chunk(), 0
    for s in sorted((s for s in active if s.prefilling), key=lambda s: s.id):
        count = min(prefill_chunk - row, s.prompt.numel() - 1 - s.prefilled)
        if count <= 0:
            break
        chunk.parts.append((s, s.prefilled, count, row))
        row += -(-count // BLOCK_ROWS) * BLOCK_ROWS
        if s.prefilled + count == s.prompt.numel() - 1:
            chunk.finishing.add(s.id)
    return chunk
