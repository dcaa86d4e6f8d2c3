"""``from_hf`` and ``from_pretrained``: this rank's share of a model, built for a ``ServingConfig``
(``megakernel.models``), compiled into a ``DecodeModel``.

Each takes the serving config whole (``serving``) or its fields as keyword arguments (which, beside a
``serving``, replace its own); the other keyword arguments are the kernel's (``KernelOptions``:
``Megakernel``'s ``backend``, ``workers``, ``trace``, ...), its backend resolved once."""
from __future__ import annotations

from typing import Any

import torch

from ..kernel_options import KernelOptions
from ..models.checkpoint import build_pretrained
from ..models.hf import build_hf, in_dtype
from ..models.serving_config import ServingConfig
from .engine import DecodeModel


def from_hf(model, serving: ServingConfig | None = None, *, dtype: torch.dtype | None = None,
            parallelism: int | str = "auto", **options: Any) -> DecodeModel:
    """Shard ``model`` (a transformers causal LM already in memory; nothing is downloaded) for this rank and
    compile its decode step. The serving fields: ``max_seq_len`` (required), ``max_batch``; the KV cache, a
    pool of ``kv_pages`` pages of ``page_size`` positions (None: enough for every batch row at
    ``max_seq_len``); ``prefill_chunk``: prompt tokens a launch prefills besides the batch rows (0: a prompt
    goes through its batch row a token per step; None: the backend's, ``ServingConfig.for_backend``); ``max_logprobs``: the most likely tokens whose
    log-probabilities each step reports (``Sequence.top``); ``draft_tokens`` K: each step drafts up to K
    tokens per sequence from its own history and verifies them (``tasks.speculation``: the same tokens, in
    fewer steps where the text repeats itself; 0: none). ``parallelism``: the number of workers the step's
    tiles are sized for; "auto" (see ``DecodeModel``). ``dtype``: the weights and activations in that float
    dtype (``torch.bfloat16``, ``torch.float16``, ``torch.float32``; None: the model's), cast as transformers
    casts them."""
    serving, kernel = _for_backend(serving, options)
    return DecodeModel(in_dtype(build_hf(model, serving), dtype), kernel, parallelism)


def from_pretrained(path, serving: ServingConfig | None = None, *, dequantize: bool = False,
                    dtype: torch.dtype | None = None, parallelism: int | str = "auto", **options: Any) -> DecodeModel:
    """Load a checkpoint directory (as ``save_pretrained`` writes it) or a GGUF file straight into this rank's
    heap (only its slices are read; nothing is downloaded) and compile its decode step
    (``models.build_pretrained``). ``dequantize``: a GGUF file's weights as float32 (``models.gguf``). The
    other arguments are ``from_hf``'s (``dtype`` None: as the checkpoint stores them, float32 for GGUF's)."""
    serving, kernel = _for_backend(serving, options)
    return DecodeModel(build_pretrained(path, serving, dequantize, dtype), kernel, parallelism)


def _for_backend(serving: ServingConfig | None, options: dict[str, Any]) -> tuple[ServingConfig, KernelOptions]:
    """The loader's ``ServingConfig`` (``ServingConfig.taken_from``) with the defaults of the backend asked
    for, and the kernel's options (``KernelOptions.of`` the rest: an option that is neither is refused)."""
    serving, rest = ServingConfig.taken_from(serving, options)
    kernel = KernelOptions.of(rest)
    return serving.for_backend(kernel.kind.prefill_rows), kernel
