"""``ServingConfig``: the sizes a model's decode step is built for (its context, batch rows, KV cache pages,
prefill rows, reported log-probabilities and drafts) and how its ranks split the experts, each default
declared here once and every value checked here once, before anything is built (the graph's tiles grow
with the batch rows and the prefill chunk, its buffers with the rest).

The loaders (``hf.build_hf``, ``checkpoint.build_pretrained``, ``gguf.build_gguf``) take one, and the
``DecoderConfig`` they make holds it (its prefill chunk resolved); ``megakernel serve``'s flags are its
fields, with the defaults of ``SERVER``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..errors import GraphError, is_count, is_int
from ..tasks.chunk_attention import BLOCK_ROWS

MAX_BATCH, MAX_PREFILL_CHUNK = 4096, 65536  # rows of a decode step: each has tiles in every layer
MAX_DRAFT_TOKENS = BLOCK_ROWS - 1  # a sequence's verification rows are one block of chunk attention
MAX_LOGPROBS = 20  # the most likely tokens a step can report per row (OpenAI's top_logprobs allows 20)
# Prefill rows by default where they help (torch, GPUs): a chat prompt (30-40 tokens) in one step, not one
# step per token; the cpu backend's interpreter runs the tiles as proofs, where they would cost every step.
PREFILL_CHUNK = 64


@dataclass(frozen=True)
class ServingConfig:
    """What a decode step is built to serve. Each field's ``help`` is its ``megakernel serve`` flag's."""

    max_seq_len: int = field(metadata={"help": "the context: prompt + new tokens"})
    max_batch: int = field(default=1, metadata={"help": "sequences decoded together (batch rows)"})
    page_size: int = field(default=16, metadata={"help": "KV cache positions per page"})
    kv_pages: int | None = field(default=None, metadata={"help": "KV cache pages (default: every row at "
                                                                 "max_seq_len)"})
    prefill_chunk: int | None = field(default=None, metadata={
        "help": "prompt tokens a launch prefills besides the batch rows (0: a prompt goes through its batch row a "
                f"token per step; default: the backend's, {PREFILL_CHUNK} on torch and GPUs, 0 on cpu)"})
    max_logprobs: int = field(default=0, metadata={"help": "the most likely tokens whose log-probabilities each "
                                                           f"step reports (at most {MAX_LOGPROBS})"})
    draft_tokens: int = field(default=0, metadata={"help": "tokens drafted per sequence and step from its own "
                                                           "history, verified in the step (tasks.speculation; 0: "
                                                           f"none; at most {MAX_DRAFT_TOKENS})"})
    expert_parallel: bool = field(default=False, metadata={
        "help": "a mixture of experts' experts each whole on one rank, balanced (attention and dense layers stay "
                "tensor-parallel), instead of every rank a share of every expert"})

    def __post_init__(self):
        for name in POSITIVE:
            value = getattr(self, name)
            if name == "kv_pages":
                if value is not None and not is_count(value):
                    raise GraphError(f"kv_pages must be a positive int or None (every row at max_seq_len), got "
                                     f"{value!r}")
            elif not is_count(value):
                raise GraphError(f"{name} must be a positive int, got {value!r}")
        if not (self.prefill_chunk is None or is_int(self.prefill_chunk) and self.prefill_chunk >= 0):
            raise GraphError(f"prefill_chunk must be a non-negative int or None (the backend's), got "
                             f"{self.prefill_chunk!r}")
        self.check_logprobs(MAX_LOGPROBS)
        if not (is_int(self.draft_tokens) and 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS):
            raise GraphError(f"draft_tokens must be an int in [0, {MAX_DRAFT_TOKENS}] (0: no drafts), got "
                             f"{self.draft_tokens!r}")
        if self.batch_rows > MAX_BATCH:
            raise GraphError(f"max_batch={self.batch_rows:,} is more than a decode step holds; at most {MAX_BATCH:,}"
                             " batch rows x (draft_tokens + 1)")
        if not isinstance(self.expert_parallel, bool):
            raise GraphError(f"expert_parallel must be True or False, got {self.expert_parallel!r}")
        if (self.prefill_chunk or 0) > MAX_PREFILL_CHUNK:
            raise GraphError(f"prefill_chunk={self.prefill_chunk:,} is more than a decode step holds; at most "
                             f"{MAX_PREFILL_CHUNK:,}")

    def check_logprobs(self, most: int) -> None:
        """``max_logprobs`` is at most ``most`` (a model's vocabulary bounds it too: ``DecoderConfig``)."""
        if not (is_int(self.max_logprobs) and 0 <= self.max_logprobs <= most):
            raise GraphError(f"max_logprobs must be an int in [0, {most}], got {self.max_logprobs!r}")

    @property
    def rows_per_sequence(self) -> int:
        """Rows a sequence takes in a step: its batch row, or with drafts its ``draft_tokens + 1``
        verification rows."""
        return self.draft_tokens + 1

    @property
    def batch_rows(self) -> int:
        """Rows a step runs for its batch."""
        return self.max_batch * self.rows_per_sequence

    def for_backend(self, prefill_rows: bool) -> ServingConfig:
        """This config with the default ``prefill_chunk`` of a backend where it has none: PREFILL_CHUNK
        where prefill rows help (``BackendKind.prefill_rows``), else 0."""
        if self.prefill_chunk is not None:
            return self
        return replace(self, prefill_chunk=PREFILL_CHUNK if prefill_rows else 0)

    @classmethod
    def taken_from(cls, serving: ServingConfig | None, options: dict[str, Any]) -> tuple[ServingConfig, dict[str, Any]]:
        """A loader's ``ServingConfig``: ``serving`` with the fields among ``options`` (keyword arguments
        of the loader) in place of its own, or those fields alone where it is None; and the options left
        (the kernel's)."""
        names = {f.name for f in fields(cls)}
        given = {name: value for name, value in options.items() if name in names}
        rest = {name: value for name, value in options.items() if name not in names}
        return (cls(**given) if serving is None else replace(serving, **given)), rest


POSITIVE = ("max_seq_len", "max_batch", "page_size", "kv_pages")  # fields that are positive ints (kv_pages: or None)

# ``megakernel serve``'s defaults, where they differ from the library's on purpose: a server batches the
# requests of many clients (8 batch rows, not 1), offers a context for chat-length conversations (the
# library asks for one), and lets a request ask for the log-probabilities of the 5 most likely tokens
# (OpenAI's completions ``logprobs`` allows 5). Its prefill rows are the library's: the backend's.
SERVER = ServingConfig(max_seq_len=2048, max_batch=8, max_logprobs=5)
