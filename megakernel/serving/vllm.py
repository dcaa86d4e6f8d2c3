"""``MegakernelForCausalLM``: a vLLM model whose forward is the megakernel's decode step.

vLLM schedules (which requests run, how many of each one's tokens, which KV blocks hold them), samples
and serves; the megakernel computes every layer and the LM head. Chosen per model with
``LLM(model=..., hf_overrides={"architectures": ["MegakernelForCausalLM"]})`` (the server's
``--hf-overrides``); the entry point ``vllm.general_plugins`` in pyproject registers the class in every
vLLM process (``register``), and it does nothing unless vLLM loads it.

A vLLM step is a flat batch: request i's tokens are ``input_ids[query_start_loc[i]:query_start_loc[i+1]]``
at consecutive positions, its KV cache in the blocks of ``block_table[i]`` (the attention metadata vLLM
builds for the attention layers this class declares). ``CompiledModel.run_scheduled`` runs it: each
request's last token in a batch row (its logits), the tokens before it in the prefill rows, the KV cache
in the megakernel's heap at vLLM's block ids, so that vLLM's block manager, preemption and prefix cache
stay right. With tensor parallelism vLLM's ranks are the megakernel's (the process group vLLM made).
The declared ``Attention`` layers are never called: they make vLLM size its pool and build the metadata
(their own KV tensors, which vLLM allocates, stay unused).

forward keeps the logits of each request's last token and returns each token's row number;
``compute_logits`` turns the rows vLLM samples back into logits. Prompt logprobs, which would need the
logits of every prompt token, are refused per request where vLLM checks a request (``register``).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn
from vllm import ModelRegistry
from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.sampling_params import SamplingParams

from ..backends import gpu_flavour
from ..backends.cpu import usable_cores
from ..errors import GraphError
from ..kernel_options import KernelOptions
from ..models.architectures import ARCHITECTURES
from ..models.checkpoint import build_pretrained
from ..models.hf import DTYPES, ModelBuild
from ..models.serving_config import PREFILL_CHUNK, ServingConfig
from ..tasks.chunk_attention import BLOCK_ROWS
from .compiled import CompiledModel, Scheduled

ARCHITECTURE = "MegakernelForCausalLM"
# batch rows of the megakernel's step: vLLM may schedule more requests (max_num_seqs, 256 by default), which
# run_scheduled then runs in launches of this many; a step's tiles grow with its rows
MAX_BATCH = 16
BACKEND_FIELD = "megakernel_backend"  # hf_overrides={..., BACKEND_FIELD: "torch"}: the backend (default: the GPU, else torch)
WORKERS_FIELD = "megakernel_workers"  # hf_overrides={..., WORKERS_FIELD: 3}: a rank's workers (default: torch_workers)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: vLLM calls it in each of its processes (once or more),
    its front end's included, where requests are checked."""
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:{ARCHITECTURE}")
    if not getattr(SamplingParams.verify, "refuses_prompt_logprobs", False):
        SamplingParams.verify = _refusing_prompt_logprobs(SamplingParams.verify)


def _refusing_prompt_logprobs(verify: Callable) -> Callable:
    """vLLM's check of a request's sampling parameters, which also refuses prompt logprobs when the model is
    this class (the step makes logits at each request's last scheduled token only): the request gets vLLM's
    own validation error (the server's 400), where the engine would otherwise die at ``compute_logits``."""
    @functools.wraps(verify)
    def checked(params: SamplingParams, model_config, *args, **kwargs):
        if ARCHITECTURE in (getattr(model_config.hf_config, "architectures", None) or ()) and (
                params.prompt_logprobs is not None or getattr(params, "prompt_logprob_token_ids", None) is not None):
            raise VLLMValidationError(f"{ARCHITECTURE} makes logits at each request's last scheduled token only: "
                                      "prompt_logprobs is not supported", parameter="prompt_logprobs",
                                      value=params.prompt_logprobs)
        return verify(params, model_config, *args, **kwargs)
    checked.refuses_prompt_logprobs = True
    return checked


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
        self.backend = getattr(model.hf_config, BACKEND_FIELD, None) or gpu_flavour() or "torch"
        batch = min(scheduler.max_num_seqs, MAX_BATCH)
        # prefill rows: on the torch backend a block for each batch row's request, so that a step in which every
        # request starts with a short prompt prefills in one launch (8 prompts of 6-10 tokens, one core: 355 ms in
        # two launches of 64 rows, 309 in one of 128; rows of no sequence cost its linears nothing)
        chunk = max(PREFILL_CHUNK, batch * BLOCK_ROWS) if self.backend == "torch" else PREFILL_CHUNK
        self.serving = ServingConfig(max_seq_len=model.max_model_len, max_batch=batch, page_size=cache.block_size,
                                     prefill_chunk=min(chunk, -(-scheduler.max_num_batched_tokens // BLOCK_ROWS)
                                                       * BLOCK_ROWS))
        # declared for vLLM's KV sizing and metadata (a rank's heads, as vLLM's own models declare), never called
        self.attention = nn.ModuleList(
            Attention(heads // ranks, head_dim, head_dim ** -0.5, max(1, kv_heads // ranks), cache_config=cache,
                      prefix=f"{prefix}.model.layers.{i}.self_attn.attn".lstrip("."))
            for i in range(layers))
        self.build: ModelBuild | None = None  # read by load_weights, compiled at the first forward
        self.engine: CompiledModel | None = None
        self.logits: torch.Tensor | None = None  # the last forward's, of its requests' last tokens
        self.logits_row = torch.zeros(0, dtype=torch.int64)  # per token of it: its row of logits, or -1

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Read this rank's share of the checkpoint into host memory (the megakernel's own reader: packed
        and FP8 weights stay as stored); vLLM's iterator of tensors is left unread. The module has no
        parameters of vLLM's: none to report."""
        build = build_pretrained(self.path, self.serving, dtype=self.vllm_config.model_config.dtype)
        if build.rope_at is not None:  # a step's rows would need frequencies of their own
            raise GraphError(f"{ARCHITECTURE} ({self.architecture}): rope types whose frequencies follow the "
                             "position (dynamic, longrope) are not supported")
        self.build = build
        return set()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise GraphError(f"{ARCHITECTURE} embeds the tokens inside its step: inputs_embeds are not supported")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """Run this step; returns each token's row number [tokens, 1], which vLLM hands to ``compute_logits``
        for the rows it samples (the logits themselves, of each request's last token, are kept here: a
        [tokens, vocab] tensor would cost gigabytes for a long prefill)."""
        if inputs_embeds is not None or intermediate_tensors is not None:
            raise GraphError(f"{ARCHITECTURE}: inputs_embeds and pipeline stages are not supported")
        rows = torch.arange(input_ids.shape[0], dtype=torch.float32, device=input_ids.device).unsqueeze(1)
        metadata = get_forward_context().attn_metadata
        self.logits, self.logits_row = None, torch.full((input_ids.shape[0],), -1, device=input_ids.device)
        if metadata is None:  # a dummy run before the KV cache exists (profiling): nothing to keep
            return rows
        if not isinstance(metadata, dict):
            raise GraphError(f"{ARCHITECTURE}: micro-batches (dual batch overlap) are not supported")
        m = metadata[self.attention[0].layer_name]
        engine = self._engine()
        starts, seq_lens = m.query_start_loc.tolist(), m.seq_lens.tolist()
        # (an empty request of a padded batch starts past the last token: clamped, and skipped below)
        firsts = positions[m.query_start_loc[:-1].clamp(max=positions.numel() - 1)].tolist()
        page = self.serving.page_size
        scheduled = {}  # by request index: those with tokens in this step (a padded batch has empty ones)
        for i, (a, b) in enumerate(zip(starts, starts[1:])):
            if b > a:
                if firsts[i] + b - a != seq_lens[i]:
                    raise GraphError(f"{ARCHITECTURE}: request {i} has {b - a} tokens from position {firsts[i]} "
                                     f"but a sequence length of {seq_lens[i]}")
                scheduled[i] = Scheduled(tokens=input_ids[a:b].long().cpu(), start=firsts[i],
                                         pages=m.block_table[i, :-(-seq_lens[i] // page)].long().cpu())
        if scheduled:  # (run_scheduled orders the requests that share KV blocks, and runs them in rows of its batch)
            self.logits = engine.run_scheduled(list(scheduled.values())).to(input_ids.device)
        last = torch.tensor([starts[i + 1] - 1 for i in scheduled], dtype=torch.int64)
        self.logits_row[last.to(input_ids.device)] = torch.arange(len(scheduled), device=input_ids.device)
        return rows

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The logits of the rows vLLM samples (``hidden_states``: forward's row numbers of them); refused
        for a row the step made none for."""
        rows = self.logits_row[hidden_states[:, 0].long()]
        if self.logits is None or bool((rows < 0).any()):
            raise GraphError(f"{ARCHITECTURE} makes logits at each request's last scheduled token only: prompt "
                             "logprobs are not supported")
        return self.logits[rows]

    def _engine(self) -> CompiledModel:
        """The step, compiled at the first real forward: the KV pool holds vLLM's blocks (known only after
        vLLM sized its cache)."""
        if self.engine is None:
            if self.build is None:
                raise GraphError(f"{ARCHITECTURE}: forward before load_weights")
            blocks = self.vllm_config.cache_config.num_gpu_blocks
            if not blocks:
                raise GraphError(f"{ARCHITECTURE}: a forward with attention metadata before vLLM sized its KV cache")
            config = self.build.config
            build = replace(self.build, config=replace(config, serving=replace(config.serving, kv_pages=blocks)))
            workers = getattr(self.vllm_config.model_config.hf_config, WORKERS_FIELD, None)
            if workers is None and self.backend == "torch":
                workers = torch_workers(self.vllm_config.parallel_config.tensor_parallel_size)
            self.build, self.engine = None, CompiledModel(build, KernelOptions(backend=self.backend, workers=workers))
        return self.engine


def torch_workers(ranks: int) -> int:
    """Workers for a rank on the torch backend: a core each of those vLLM pins the process to (often one),
    or, where it pins nothing (``VLLM_CPU_OMP_THREADS_BIND=nobind``), the machine's cores shared by the ranks."""
    cores = usable_cores()
    return cores if cores < (os.cpu_count() or 1) else max(1, cores // ranks)


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
        (parallel.pipeline_parallel_size != 1, f"pipeline_parallel_size={parallel.pipeline_parallel_size} (1)"),
        (parallel.decode_context_parallel_size != 1,
         f"decode_context_parallel_size={parallel.decode_context_parallel_size} (1)"),
        # vLLM's tensor-parallel ranks are the megakernel's: its default process group must be theirs alone
        (world != parallel.tensor_parallel_size, f"a process group of {world} ranks for tensor_parallel_size="
                                                 f"{parallel.tensor_parallel_size} (data parallelism)"),
        # a captured graph would freeze the step's host work (the plan of each launch) and its first compile
        (not model.enforce_eager, "CUDA graphs and torch.compile (pass enforce_eager=True: the step is one "
                                  "launch already)"),
        (bool(getattr(model, "enable_prompt_embeds", False)), "prompt embeddings (enable_prompt_embeds)"),
        (vllm_config.speculative_config is not None, "speculative decoding (speculative_config)"),
        (vllm_config.lora_config is not None, "LoRA adapters (enable_lora)"),
        (model.quantization is not None, f"quantization={model.quantization!r} (a quantized checkpoint through vLLM "
                                         "is not built yet)"),
        (cache.cache_dtype not in ("auto", None), f"kv_cache_dtype={cache.cache_dtype!r} (the model's: 'auto')"),
        (model.runner_type != "generate", f"runner={model.runner_type!r} (generate)"),
    ]
    refused.append((model.dtype not in DTYPES, f"dtype={model.dtype} (one of {', '.join(map(str, DTYPES))})"))
    for bad, what in refused:
        if bad:
            raise GraphError(f"{ARCHITECTURE} ({architecture}): {what} is not supported")
