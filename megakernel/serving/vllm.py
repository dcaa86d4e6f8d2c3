"""``MegakernelForCausalLM``: a vLLM model whose forward is the megakernel's decode step.

vLLM schedules (which requests run, how many of each one's tokens, which KV blocks hold them), samples
and serves; the megakernel computes every layer and the LM head. Chosen per model with
``LLM(model=..., hf_overrides={"architectures": ["MegakernelForCausalLM"]})`` (the server's
``--hf-overrides``); the entry point ``vllm.general_plugins`` in pyproject registers the class in every
vLLM process (``register``), and it does nothing unless vLLM loads it.

A vLLM step is a flat batch: request i's tokens are ``input_ids[query_start_loc[i]:query_start_loc[i+1]]``
at consecutive positions, its KV cache in the blocks of ``block_table[i]`` (the attention metadata vLLM
builds for the attention layers this class declares). ``DecodeModel.run_scheduled`` runs it: each
request's last token in a batch row (its logits), the tokens before it in the prefill rows, the KV cache
in the megakernel's heap at vLLM's block ids, so that vLLM's block manager, preemption and prefix cache
stay right. With tensor parallelism vLLM's ranks are the megakernel's (the process group vLLM made).
The declared ``Attention`` layers are never called: they make vLLM size its pool and build the metadata
(their own KV tensors, which vLLM allocates, stay unused).

forward returns per-token logits (``compute_logits`` passes them through): the rows vLLM samples, each
request's last token, hold them; the others are NaN, and ``compute_logits`` refuses them by name (prompt
logprobs need logits the step does not make).
"""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Iterable

import torch
from torch import nn
from vllm import ModelRegistry
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention

from ..backends import gpu_flavour
from ..backends.cpu import usable_cores
from ..errors import GraphError
from ..models.architectures import ARCHITECTURES
from ..models.checkpoint import build_pretrained
from ..models.hf import ModelBuild
from ..models.serving_config import PREFILL_CHUNK, ServingConfig
from .engine import DecodeModel, Scheduled

ARCHITECTURE = "MegakernelForCausalLM"
# batch rows of the megakernel's step: vLLM may schedule more requests (max_num_seqs, 256 by default), which
# then run in launches of this many; a step's tiles grow with its rows
MAX_BATCH = 16
BACKEND_FIELD = "megakernel_backend"  # hf_overrides={..., BACKEND_FIELD: "torch"}: the backend (default: the GPU, else torch)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in each of its processes (once or more)."""
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:{ARCHITECTURE}")


class MegakernelForCausalLM(nn.Module):
    """A causal LM of any class ``from_pretrained`` takes, its checkpoint directory read by the megakernel
    (``models.build_pretrained``), its step compiled once vLLM has sized the KV cache (the first forward
    with attention metadata)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        self.vllm_config = vllm_config
        model, cache, scheduler = vllm_config.model_config, vllm_config.cache_config, vllm_config.scheduler_config
        self.path = Path(model.model)
        self.architecture = checkpoint_architecture(self.path)
        _refuse_unsupported(vllm_config, self.architecture)
        text, ranks = model.hf_text_config, vllm_config.parallel_config.tensor_parallel_size
        heads, layers = text.num_attention_heads, text.num_hidden_layers
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        self.vocab = model.get_vocab_size()
        self.backend = getattr(model.hf_config, BACKEND_FIELD, None) or gpu_flavour() or "torch"
        self.serving = ServingConfig(max_seq_len=model.max_model_len, max_batch=min(scheduler.max_num_seqs, MAX_BATCH),
                                     page_size=cache.block_size,
                                     prefill_chunk=min(PREFILL_CHUNK, -(-scheduler.max_num_batched_tokens // 16) * 16))
        # declared for vLLM's KV sizing and metadata (a rank's heads, as vLLM's own models declare), never called
        self.attention = nn.ModuleList(
            Attention(heads // ranks, head_dim, head_dim ** -0.5, max(1, kv_heads // ranks), cache_config=cache,
                      prefix=f"{prefix}.model.layers.{i}.self_attn.attn".lstrip("."))
            for i in range(layers))
        self.build: ModelBuild | None = None  # read by load_weights, compiled at the first forward
        self.engine: DecodeModel | None = None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Read this rank's share of the checkpoint into host memory (the megakernel's own reader: packed
        and FP8 weights stay as stored); vLLM's iterator of tensors is left unread. The module has no
        parameters of vLLM's: none to report."""
        self.build = build_pretrained(self.path, self.serving)
        return set()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise GraphError(f"{ARCHITECTURE} embeds the tokens inside its step: inputs_embeds are not supported")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Per-token logits [tokens, vocab] of this step: each request's last token's (NaN elsewhere)."""
        if inputs_embeds is not None or intermediate_tensors is not None:
            raise GraphError(f"{ARCHITECTURE}: inputs_embeds and pipeline stages are not supported")
        metadata = get_forward_context().attn_metadata
        logits = torch.full((input_ids.shape[0], self.vocab), math.nan)
        if metadata is None:  # a dummy run before the KV cache exists (profiling, warm-up): nothing to keep
            return logits.zero_()
        if not isinstance(metadata, dict):
            raise GraphError(f"{ARCHITECTURE}: micro-batches (dual batch overlap) are not supported")
        m = metadata[self.attention[0].layer_name]
        starts, seq_lens = m.query_start_loc.tolist(), m.seq_lens.tolist()
        page = self.serving.page_size
        requests = [Scheduled(input_ids[a:b].long(), int(positions[a]), m.block_table[i, :-(-seq_lens[i] // page)].long())
                    for i, (a, b) in enumerate(zip(starts, starts[1:]))]
        last = torch.tensor(starts[1:]) - 1
        engine = self._engine()
        for first in range(0, len(requests), engine.config.batch):
            rows = last[first:first + engine.config.batch]
            logits[rows] = engine.run_scheduled(requests[first:first + engine.config.batch])
        return logits

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """forward's logits of the rows vLLM samples (refused where the step made none)."""
        if bool(hidden_states[:, :1].isnan().any()):
            raise GraphError(f"{ARCHITECTURE} makes logits at each request's last scheduled token only: prompt "
                             "logprobs are not supported")
        return hidden_states

    def _engine(self) -> DecodeModel:
        """The step, compiled at the first real forward: the KV pool holds vLLM's blocks (known only after
        vLLM sized its cache)."""
        if self.engine is None:
            if self.build is None:
                raise GraphError(f"{ARCHITECTURE}: forward before load_weights")
            blocks = self.vllm_config.cache_config.num_gpu_blocks
            build = replace(self.build, config=replace(self.build.config, kv_pages=blocks))
            # on torch, a worker per core vLLM gives this process (it pins its workers: often one core)
            workers = {"workers": usable_cores()} if self.backend == "torch" else {}
            self.build, self.engine = None, DecodeModel(build, backend=self.backend, **workers)
        return self.engine


def checkpoint_architecture(path: Path) -> str:
    """The class named in the checkpoint's own config.json (vLLM's config shows the override)."""
    config = path / "config.json"
    if not config.is_file():
        raise GraphError(f"{ARCHITECTURE}: {path} is not a checkpoint directory with a config.json (vLLM's model "
                         "path; GGUF files are not loaded through vLLM)")
    names = json.loads(config.read_text()).get("architectures") or []
    supported = [name for name in names if name in ARCHITECTURES]
    if not supported:
        raise GraphError(f"{ARCHITECTURE}: {config} names {names}; the megakernel builds {sorted(ARCHITECTURES)}")
    return supported[0]


def _refuse_unsupported(vllm_config: VllmConfig, architecture: str) -> None:
    """Every option this class does not build is refused by name, at load: nothing falls back to vLLM's
    own model."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    refused = [
        # vLLM's tensor-parallel ranks are the megakernel's: its default process group must be theirs alone
        (world != parallel.tensor_parallel_size, f"a process group of {world} ranks for tensor_parallel_size="
                                                 f"{parallel.tensor_parallel_size} (data parallelism)"),
        (parallel.pipeline_parallel_size != 1, f"pipeline_parallel_size={parallel.pipeline_parallel_size} (1)"),
        (vllm_config.speculative_config is not None, "speculative decoding (speculative_config)"),
        (vllm_config.lora_config is not None, "LoRA adapters (enable_lora)"),
        (model.quantization is not None, f"quantization={model.quantization!r} (a quantized checkpoint through vLLM "
                                         "is not built yet)"),
        (cache.cache_dtype not in ("auto", None), f"kv_cache_dtype={cache.cache_dtype!r} (the model's: 'auto')"),
        (model.runner_type != "generate", f"runner={model.runner_type!r} (generate)"),
    ]
    config = json.loads((Path(model.model) / "config.json").read_text())
    stored = config.get("dtype") or config.get("torch_dtype")
    if stored is not None and str(model.dtype).removeprefix("torch.") != stored:
        refused.append((True, f"dtype={str(model.dtype).removeprefix('torch.')} (the megakernel runs the weights "
                              f"as stored: the checkpoint's {stored})"))
    for bad, what in refused:
        if bad:
            raise GraphError(f"{ARCHITECTURE} ({architecture}): {what} is not supported")
