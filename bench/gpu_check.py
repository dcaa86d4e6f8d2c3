"""The GPU check: one script, one GPU, under 9 minutes; prints a table last.

1. every task type, run by the megakernel on the GPU, against the reference executor (the task
   types' torch references replaying the same tables on a host copy of the heap);
2. decode steps of a small random Llama against ``transformers`` on the same GPU;
3. a Llama-3-8B-shaped decoder layer (bfloat16, batch 1) as one megakernel launch, checked against
   an eager PyTorch layer computed in float32, and timed against the eager layer and against
   CUDA-graph replay of it, with its fraction of the memory-bandwidth floor (copy bandwidth measured
   here, in the same run), and its own launch captured in a graph (``Megakernel.capture``) and replayed;
4. per-task dispatch overhead (many empty tasks);
5. cross-rank signal latency and small all-reduces between two virtual ranks (two persistent
   kernels resident at once on one GPU);
6. a Qwen3-30B-A3B-shaped layer (hidden 2048, 128 experts, top-8, expert intermediate 768, bf16) as
   one launch, against the reference executor, with its fraction of the bandwidth floor of the bytes
   it must read (attention, router, the 8 chosen experts, the KV cache);
7. a stack of two Llama-3-8B-shaped layers as a decode loop (the stream fed back, the position
   advanced on the device): tokens per second for STEPS steps in one launch against one step per
   launch, the two bitwise equal;
8. serving: whole decode steps of two Llama-3-8B-shaped layers (paged KV cache), tokens per second at
   batch 1, 8 and 32 with the rows at positions of their own, and a 512-token prefill chunk in one launch;
9. the Llama-3-8B-shaped layer with its projections in Q4_K (``quantized``), dequantized in the tiles,
   against eager float32 over the dequantized weights, with its fraction of the bandwidth floor of the
   bytes it reads;
10. sampling: the ``sample`` tile over 8 rows of the layer's vocabulary, greedy and with temperature,
   top-k, top-p and min-p, its tokens against the host twin, and the launch time of each;
11. speculation: a random Llama (on a GPU 4 layers of hidden 2048, bf16) fed a prompt that repeats a
   piece, with ``draft_tokens`` 4 and without: the same tokens, device steps and time per token of each.
12. nodes: a hierarchical all-reduce over 2 nodes x 2 ranks through the cpu transport (the host's gloo, on
   the machine's own torch and triton), the nvshmem transport's kernel compiled for the GPU with the
   NVSHMEM device library installed there, and NVSHMEM run on the one GPU: torch's symmetric memory,
   the module's NVSHMEM state, the transport's put and signal calls to this processing element itself
   (``shmem.loopback``); a missing piece (torch without NVSHMEM, a bitcode this Triton cannot read) is
   a "not run" row with the reason.
13. expert parallelism: the Qwen3-30B-A3B-shaped sparse MLP over 8 tokens on two virtual ranks, each
   holding half the experts whole (``moe_mlp(..., expert_parallel=True)``: routed puts and their
   rank-order sum), against float64 on the host, both ranks the same bits, and its launch time.

A section named ``NAME:spin`` runs NAME with the old wait/signal protocol (``MEGAKERNEL_PROTOCOL=spin``:
every thread spinning on scalar atomics, system-scope signals) instead of the default ``poll``, so one
table compares them; ``layer:spin`` is left out of the default list (a second compile of the 8B-shaped
kernel), ask for it with ``--only``. Where Triton has no ``tl.atomic_poll`` (3.6) spin is the default
and the ``:spin`` sections are left out: they would repeat the others.

    python bench/gpu_check.py                       # on a machine with an NVIDIA or AMD GPU
    python bench/gpu_check.py --only layer,virtual  # some sections
    python bench/gpu_check.py --smoke               # small shapes on the cpu backend (the interpreter)
    python bench/gpu_check.py --smoke --backend torch  # the same on the torch backend (the tests run this)

Each section runs in a process of its own under a time limit (a GPU fault poisons its process; a
hang must not use up the machine's time), all within BUDGET seconds; ``--smoke`` runs the sections of
each protocol in one process.

The first GPU run (the device machine: one H200, torch 2.11 and triton 3.6, the Triton that
``tests/test_triton36.py`` checks this script and the compiles under; 15 minutes of device time in all,
the machine's start of a minute or two included) is one call, ``python bench/gpu_check.py`` with a
timeout of 540 s. The sections run one after the other, each in its own process under its limit and
all within BUDGET (480 s); a section that fails, faults or hangs is a FAILED row and the next one
starts, and one the budget left no time for is a row too. The output's first line names the date, GPU,
driver, torch, triton and protocol; the table comes last, whatever happened. It runs from the root of
the copied tree with nothing installed (the image has no registry): the script puts the tree on
``sys.path``, and ``megakernel`` finds its ``tasks/``, ``scheduler/`` and ``tools/`` in the checkout
(``megakernel/checkout.py``); ``tests/test_triton36.py`` runs this command with ``--smoke`` so, in an
environment made like the image. That leaves about four
minutes for one rerun, at once while the machine is still warm, of the sections that failed, fixed
(``--only NAME,...``, a timeout of 200 s). The table goes into bench/RESULTS.md as printed.

Times are device times of the launch (CUDA events) unless a row says wall.
"""
from __future__ import annotations

import os

os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # before CUDA starts: each stream its own hardware queue

import argparse
import functools
import math
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace

from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tree's megakernel, installed or not
import megakernel as mk  # noqa: E402
from megakernel import aot, device, shmem
from megakernel.errors import BackendError
from megakernel.models import schema
from megakernel.models.decoder import Shard, decoder_layer
from megakernel.models.decoder_config import DecoderConfig
from megakernel.models.serving_config import ServingConfig
from megakernel.reference import execute
from megakernel.scheduler import deserialize, serialize
from megakernel.tasks.formats import Q4_0, Q4_K, dequantize
from megakernel.tasks.expert_parallel import Held
from megakernel.heap import HeapView
from megakernel.tools.examples import EVERY_TASK_PARTS, across_nodes, every_task_type, example_inputs

LLAMA3_8B = DecoderConfig(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, layers=1,
                          vocab=128256, eps=1e-5, qk_norm=False,
                          serving=ServingConfig(max_seq_len=4096, prefill_chunk=0),
                          dtype=torch.bfloat16)
QWEN3_30B_A3B = DecoderConfig(hidden=2048, heads=32, kv_heads=4, head_dim=128, intermediate=6144, layers=1,
                              vocab=151936, eps=1e-6, qk_norm=False,
                              serving=ServingConfig(max_seq_len=4096, prefill_chunk=0), dtype=torch.bfloat16,
                              moe=(True,), experts=128, top_k=8, moe_intermediate=768, norm_topk=True,
                              router_weight_dtype=torch.bfloat16)
SMOKE_MOE = DecoderConfig(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, layers=1, vocab=256,
                          eps=1e-6, qk_norm=False, serving=ServingConfig(max_seq_len=64, prefill_chunk=0),
                          dtype=torch.bfloat16, moe=(True,), experts=8, top_k=2, moe_intermediate=48, norm_topk=True,
                          router_weight_dtype=torch.bfloat16)
SMOKE_LAYER = DecoderConfig(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, layers=1, vocab=256,
                            eps=1e-5, qk_norm=False, serving=ServingConfig(max_seq_len=64, prefill_chunk=0),
                            dtype=torch.bfloat16)


@dataclass(frozen=True)
class Setup:
    """What a run checks with: the GPU, or (``--smoke``) small shapes on a host backend (cpu or torch)."""

    backend: str
    device: str
    layer: DecoderConfig
    moe: DecoderConfig       # a mixture-of-experts layer
    pos: int                 # the layer's decode position: the KV cache holds that many earlier rows
    repeats: int
    per_worker: int          # dispatch: empty tasks per worker (and 4x that)
    sizes: tuple[int, ...]   # all-reduce bytes
    timeout: float           # seconds any wait may take: a hang shows fast

    @property
    def engine(self) -> str:
        """What runs the tiles, for the rows' labels."""
        return {"cpu": "cpu interpreter", "torch": "cpu torch"}.get(self.backend, "device")


GPU = Setup("auto", "cuda", LLAMA3_8B, QWEN3_30B_A3B, 1023, 20, 16, (4096, 65536), timeout=10.0)
SMOKE = Setup("cpu", "cpu", SMOKE_LAYER, SMOKE_MOE, 9, 2, 2, (256,), timeout=60.0)


@dataclass
class Row:
    check: str
    value: str
    target: str = ""
    ok: bool | None = None   # None: a measurement without a target
    timing: bool = False     # a target on time: it holds on a GPU only


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e|; infinite when an element was never written (the poison is NaN)."""
    if torch.isnan(actual).any():
        return math.inf
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp_min(1e-12)).item()


def median_launch(kernel: mk.Megakernel, repeats: int) -> tuple[float, float]:
    """(device seconds of the launch, wall seconds of ``run``), medians over ``repeats`` runs after one."""
    kernel.run()
    device, wall = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        kernel.run()
        wall.append(time.perf_counter() - start)
        device.append(kernel.launch_seconds)
    return statistics.median(device), statistics.median(wall)


def sized_kernel(build, s: "Setup") -> tuple[tuple, mk.Megakernel]:
    """``build(parallelism)`` (a tuple whose first item is the graph) and its kernel, its tiles sized for
    every worker this device holds: the first kernel, built for one, says how many that is."""
    built = build(1)
    kernel = mk.Megakernel(built[0], backend=s.backend, timeout=s.timeout)
    if kernel.workers > 1:
        kernel.close()
        built = build(kernel.workers)
        kernel = mk.Megakernel(built[0], backend=s.backend, timeout=s.timeout)
    return built, kernel


def timed(fn, repeats: int, device: str) -> float:
    """Median seconds of ``fn()`` after two warm-up calls (CUDA events on a GPU, wall clock on the host)."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        if device == "cpu":
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        else:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
    return statistics.median(times)


# -- 1. every task type ---------------------------------------------------------------------------------
def check_task_types(s: Setup) -> list[Row]:
    """Every task type, in ``EVERY_TASK_PARTS`` kernels (a third of one kernel's compile time), against the
    reference executor of the same tables."""
    worst, types, tasks = {}, set(), 0
    for part in range(EVERY_TASK_PARTS):
        g = every_task_type(part, EVERY_TASK_PARTS)
        with mk.Megakernel(g, backend=s.backend, timeout=s.timeout) as kernel:
            kernel.bind(example_inputs(g))
            kernel.poison()
            heap = kernel.heap.cpu().clone()
            out = kernel.run()
            execute(deserialize(serialize(kernel.tables)), heap)
            view = HeapView(heap)
            for name, t in g.outputs.items():
                ref = view.tensor(t.addr(0, 0), t.dtype, t.rows, t.cols, t.row_stride).reshape(t.shape)
                worst[name] = relative_error(out[name].cpu(), ref)
        types |= {s.task_type for s in g.specs}
        tasks += len(g.tasks)
    name, error = max(worst.items(), key=lambda item: item[1])
    return [Row(f"{len(types)} task types, {tasks} tasks in {EVERY_TASK_PARTS} kernels vs reference",
                f"max rel. error {error:.1e} ({name})", "<= 1e-2 (bf16)", error <= 1e-2)]


# -- 2. decode steps against transformers ----------------------------------------------------------------
def check_decode(s: Setup) -> list[Row]:
    from megakernel.serving import from_hf
    from megakernel.tools.demo import random_llama

    hf = random_llama(seed=3).to(s.device)
    steps = 8
    ids = torch.randint(0, hf.config.vocab_size, (1, steps), generator=torch.Generator().manual_seed(4))
    model = from_hf(hf, max_seq_len=steps, backend=s.backend, timeout=s.timeout)
    try:
        worst = 0.0
        with torch.no_grad():
            for pos in range(steps):
                ours = model.decode(ids[:, pos], pos)
                theirs = hf(ids[:, :pos + 1].to(s.device)).logits[:, -1]
                worst = max(worst, relative_error(ours.float().cpu(), theirs.float().cpu()))
    finally:
        model.close()
    return [Row(f"decode, random Llama ({hf.config.num_hidden_layers} layers), {steps} steps vs transformers",
                f"max rel. error {worst:.1e}", "<= 1e-3 (fp32)", worst <= 1e-3)]


# -- 6. a mixture-of-experts layer -----------------------------------------------------------------------
def moe_floor_bytes(c: DecoderConfig, pos: int) -> int:
    """What the MoE layer must read at least: attention weights, the router, the k chosen experts, the cache."""
    s = Shard.of(c, 0, 1)
    weights = sum(math.prod(w.shape(c, s)) * c.top_k // c.experts if w.per_expert else math.prod(w.shape(c, s))
                  for w in schema.layer_weights(c, 0))
    return (weights + 2 * (pos + 1) * c.kv_heads * c.head_dim) * c.dtype.itemsize


def check_moe(s: Setup) -> list[Row]:
    c, pos = s.moe, s.pos
    gen = torch.Generator().manual_seed(11)
    (g,), kernel = sized_kernel(lambda parallelism: (layer_graph(c, parallelism),), s)
    inputs = {name: random_weight(t.shape, t.dtype, gen) for name, t in g.inputs.items() if t.dtype.is_floating_point}
    inputs["pos"] = torch.tensor([pos])
    inputs["inv_freq"] = 1.0 / 10000.0 ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
    try:
        kernel.bind(inputs)
        heap = kernel.heap.cpu().clone()
        y = kernel.run()["y"].cpu()
        mk_device, mk_wall = median_launch(kernel, s.repeats)
        tables, tasks, workers = deserialize(serialize(kernel.tables)), len(g.tasks), kernel.workers
    finally:
        kernel.close()
    execute(tables, heap)
    t = g.outputs["y"]
    error = relative_error(y, HeapView(heap).tensor(t.addr(0, 0), t.dtype, t.rows, t.cols, t.row_stride))
    rows = [Row(f"MoE layer {c.experts} experts top-{c.top_k} x {c.moe_intermediate} bf16 ({tasks} tasks, {workers} "
                f"workers) vs reference", f"max rel. error {error:.1e}", "<= 1e-2 (bf16)", error <= 1e-2)]
    if s.device == "cpu":
        return rows + [Row(f"MoE layer: megakernel ({s.engine}, wall)", f"{mk_wall * 1e3:.1f} ms")]
    floor = moe_floor_bytes(c, pos) / copy_bandwidth(s.device, 2048)
    return rows + [Row(f"MoE layer floor ({moe_floor_bytes(c, pos) / 2**20:.0f} MiB at copy bandwidth)",
                       f"{floor * 1e6:.1f} us"),
                   Row("MoE layer: megakernel launch", f"{mk_device * 1e6:.1f} us"),
                   Row("MoE layer: fraction of the bandwidth floor", f"{floor / mk_device:.0%}", ">= 75%",
                       floor / mk_device >= 0.75, timing=True)]


# -- 7. many steps per launch -----------------------------------------------------------------------------
STEPS = 8


def step_loop(c: DecoderConfig, parallelism: int, layers: int) -> tuple[mk.Graph, mk.graph.Tensor]:
    """``layers`` decoder layers whose output is the next step's input, the position advanced at the end."""
    g = mk.Graph(world_size=1, rank=0, parallelism=parallelism)
    x = g.new_tensor((c.batch, c.hidden), c.dtype, name="stream")
    pos = g.input("pos", (1,), torch.int64)
    inv_freq = g.input("inv_freq", (c.head_dim // 2,), torch.float32)
    y = x
    for i in range(layers):
        with g.scope(f"layer{i}"):
            y = decoder_layer(g, c, Shard.of(c, 0, 1), y, pos, inv_freq, i)
    g.output("y", g.put(g.rms_norm(y, g.input("norm", (c.hidden,), c.dtype), c.eps), to_rank=0, into=x))
    g.advance(pos)
    return g, x


def check_steps(s: Setup) -> list[Row]:
    c, device = s.layer, s.device
    layers, steps = (2, STEPS) if device != "cpu" else (1, 2)  # the smoke run: just enough to check
    gen = torch.Generator().manual_seed(7)
    weights = {name.replace("layers.0.", f"layers.{i}."): w for i in range(layers)
               for name, w in layer_weights(c, gen).items()}
    weights["norm"] = torch.ones(c.hidden, dtype=c.dtype)
    x0 = torch.randn(1, c.hidden, generator=gen).to(c.dtype)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
    (g, x), kernel = sized_kernel(lambda parallelism: step_loop(c, parallelism, layers), s)
    try:
        kernel.bind({**weights, "inv_freq": inv_freq})

        def loop(launches: int, steps: int) -> tuple[torch.Tensor, float]:
            kernel.tensor(x).copy_(x0)
            kernel.bind({"pos": torch.tensor([0])})
            start = time.perf_counter()
            for _ in range(launches):
                y = kernel.run(steps=steps)["y"]
            return y.cpu(), time.perf_counter() - start

        if device != "cpu":
            loop(1, steps), loop(steps, 1)  # warm
        together, one_launch = loop(1, steps)
        apart, per_step = loop(steps, 1)
        tasks = len(g.tasks)
    finally:
        kernel.close()
    same = torch.equal(together, apart)
    where = f"{s.engine}, " if device == "cpu" else ""
    return [Row(f"steps: {layers} layers, {steps} steps in one launch vs one per launch ({tasks} tasks a step)",
                "bitwise equal" if same else "DIFFER", "equal", same),
            Row(f"steps: {steps} steps in one launch ({where}wall)", f"{steps / one_launch:.1f} tokens/s"),
            Row(f"steps: one step per launch ({where}wall)", f"{steps / per_step:.1f} tokens/s"),
            Row("steps: many steps per launch vs one", f"{per_step / one_launch:.2f}x", "> 1x", per_step > one_launch,
                timing=True)]


# -- 8. serving: decode at batch 1/8/32, sequences at positions of their own; a prefill chunk ---------------
def serving_kernel(c: DecoderConfig, s: Setup) -> tuple[mk.Graph, mk.Megakernel]:
    """A whole decode step (``decode_step``) of ``c`` with random weights, every batch row's pages its own."""
    from megakernel.models.decoder import decode_step

    (g,), kernel = sized_kernel(lambda parallelism: (decode_step(c, mk.Graph(world_size=1, rank=0,
                                                                             parallelism=parallelism)),), s)
    gen = torch.Generator().manual_seed(11)
    values = {}
    for name, t in g.inputs.items():
        if t.dtype.is_floating_point:
            scale = 1.0 if "norm" in name or name == "inv_freq" else 1 / math.sqrt(t.shape[-1])
            values[name] = (torch.randn(t.shape, generator=gen) * scale).to(t.dtype)
    values["inv_freq"] = 1.0 / 500000.0 ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
    values["history"] = torch.randint(0, c.vocab, (c.batch, c.max_seq_len), generator=gen)
    table = torch.full((c.rows, c.max_pages), c.pool_pages)  # prefill rows: the first sequence's pages
    table[:c.batch] = torch.arange(c.batch * c.max_pages).reshape(c.batch, c.max_pages)
    table[c.batch:] = table[0]
    values.update(prompt_len=torch.ones(c.batch, dtype=torch.int64), block_table=table,
                  sampling=torch.zeros(c.batch, 4), seed=torch.zeros(c.batch, dtype=torch.int64))  # greedy
    if c.prefill_chunk:
        values.update(prefill_tokens=torch.randint(0, c.vocab, (c.prefill_chunk,), generator=gen),
                      prefill_pos=torch.full((c.prefill_chunk,), -1))
    kernel.bind(values)
    return g, kernel


def check_serving(s: Setup) -> list[Row]:
    smoke = s.device == "cpu"
    layers, steps = (1, 2) if smoke else (2, STEPS)
    base = replace(s.layer, layers=layers, vocab=1024,
                   serving=replace(s.layer.serving, max_seq_len=32 if smoke else 2048))
    rows = []
    for batch in (1, 2) if smoke else (1, 8, 32):
        c = replace(base, serving=replace(base.serving, max_batch=batch))
        g, kernel = serving_kernel(c, s)
        try:
            start = torch.linspace(c.max_seq_len // 8, c.max_seq_len - 2 * steps, batch).long()  # spread out
            times = []
            for _ in range(s.repeats + 1):
                kernel.bind({"pos": start})
                kernel.run(steps=steps)
                times.append(kernel.launch_seconds)
            seconds = statistics.median(times[1:])
        finally:
            kernel.close()
        where = s.engine
        rows.append(Row(f"serving: {layers} layers, batch {batch} at positions {int(start[0])}-{int(start[-1])}, "
                        f"{steps} steps a launch ({where})", f"{batch * steps / seconds:,.1f} tokens/s"))
    chunk = 4 if smoke else 512
    c = replace(base, serving=replace(base.serving, max_batch=1, prefill_chunk=chunk,
                                      max_seq_len=32 if smoke else 1024))
    g, kernel = serving_kernel(c, s)
    try:
        times = []
        for _ in range(s.repeats + 1):
            kernel.bind({"pos": torch.tensor([chunk]), "prefill_pos": torch.arange(chunk)})
            kernel.run()
            times.append(kernel.launch_seconds)
        seconds = statistics.median(times[1:])
        tasks = len(g.tasks)
    finally:
        kernel.close()
    return rows + [Row(f"serving: prefill of a {chunk}-token chunk and its next token, {layers} layers ({tasks} tasks)",
                       f"{(chunk + 1) / seconds:,.1f} tokens/s")]


# -- 3. the Llama-3-8B-shaped layer ----------------------------------------------------------------------
def layer_graph(c: DecoderConfig, parallelism: int) -> mk.Graph:
    g = mk.Graph(world_size=1, rank=0, parallelism=parallelism)
    x = g.input("x", (c.batch, c.hidden), c.dtype)
    pos = g.input("pos", (1,), torch.int64)
    inv_freq = g.input("inv_freq", (c.head_dim // 2,), torch.float32)
    g.output("y", decoder_layer(g, c, Shard.of(c, 0, 1), x, pos, inv_freq, 0))
    return g


def random_weight(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A norm's weight (1-D) near 1, a projection's [out, in] scaled by 1 / sqrt(in): activations stay O(1)."""
    if len(shape) == 1:
        return (1 + 0.1 * torch.randn(shape, generator=gen)).to(dtype)
    return (torch.randn(shape, generator=gen) / math.sqrt(shape[1])).to(dtype)


def layer_weights(c: DecoderConfig, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random weights for layer 0 of ``c`` on one rank (the schema's), named as ``layer_graph``'s inputs."""
    s = Shard.of(c, 0, 1)
    return {f"layers.0.{w.name}": random_weight(w.shape(c, s), c.dtype, gen) for w in schema.layer_weights(c, 0)}


def eager_layer(c: DecoderConfig, w: dict[str, torch.Tensor], x: torch.Tensor, pos: int, inv_freq: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    """The same layer in plain PyTorch over a static KV cache [max_seq, kv_heads * head_dim]."""
    def rms(t, weight):
        t32 = t.float()
        return (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + c.eps)).to(t.dtype) * weight

    def rope(t, heads):  # [batch, heads * head_dim], rotate-half
        t = t.view(-1, heads, c.head_dim)
        angle = pos * inv_freq
        cos, sin = torch.cat([angle.cos(), angle.cos()]).to(t.dtype), torch.cat([angle.sin(), angle.sin()]).to(t.dtype)
        half = c.head_dim // 2
        rotated = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * cos + rotated * sin

    q_cols, kv_cols = c.heads * c.head_dim, c.kv_heads * c.head_dim
    qkv = rms(x, w["layers.0.input_norm"]) @ w["layers.0.qkv"].T
    q, k, v = qkv[:, :q_cols], qkv[:, q_cols:q_cols + kv_cols], qkv[:, q_cols + kv_cols:]
    q, k = rope(q, c.heads), rope(k, c.kv_heads)
    k_cache[pos] = k.reshape(-1)
    v_cache[pos] = v.reshape(-1)
    keys = k_cache[:pos + 1].view(pos + 1, c.kv_heads, c.head_dim).transpose(0, 1)      # [kv, seq, hd]
    values = v_cache[:pos + 1].view(pos + 1, c.kv_heads, c.head_dim).transpose(0, 1)
    attn = F.scaled_dot_product_attention(q.view(c.heads, 1, c.head_dim), keys, values, enable_gqa=True)
    x = x + attn.reshape(1, q_cols) @ w["layers.0.o"].T
    gate, up = (rms(x, w["layers.0.post_norm"]) @ w["layers.0.gate_up"].T).chunk(2, dim=-1)
    return x + (F.silu(gate.float()).to(x.dtype) * up) @ w["layers.0.down"].T


def layer_bytes(c: DecoderConfig, pos: int) -> int:
    """What the layer must move at least: its weights once, the KV cache it attends to, the stream."""
    s = Shard.of(c, 0, 1)
    weights = sum(math.prod(w.shape(c, s)) for w in schema.layer_weights(c, 0))
    return (weights + 2 * (pos + 1) * c.kv_heads * c.head_dim + 2 * c.hidden) * c.dtype.itemsize


def copy_bandwidth(device: str, mib: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), 10, device)


@dataclass
class LayerRun:
    """One decode step of layer 0 of ``c`` run by the megakernel, and its float32 eager reference."""

    y: torch.Tensor
    error: float             # of y against the eager layer in float32
    device_s: float          # median device time of a launch
    wall_s: float            # median wall time of a run
    replay_s: float          # a replay of the launch captured in a graph
    replayed: bool           # the replay's output is bitwise run()'s
    workers: int
    tasks: int
    x: torch.Tensor
    inv_freq: torch.Tensor
    history: list[torch.Tensor]  # the K and V cache rows before the position


def run_layer(c: DecoderConfig, s: Setup, weights: dict[str, torch.Tensor], w32: dict[str, torch.Tensor],
              gen: torch.Generator) -> LayerRun:
    """Layer 0 of ``c`` with ``weights`` bound (as the heap holds them; ``w32``: their float32 values) at
    position ``s.pos`` over a random KV cache, as one launch: run, timed, captured and replayed."""
    pos, device, repeats = s.pos, s.device, s.repeats
    x = (torch.randn(1, c.hidden, generator=gen)).to(c.dtype)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
    history = [(torch.randn(pos, c.kv_heads * c.head_dim, generator=gen) * 0.5).to(c.dtype) for _ in range(2)]
    (g,), kernel = sized_kernel(lambda parallelism: (layer_graph(c, parallelism),), s)
    try:
        kernel.bind({**weights, "x": x, "pos": torch.tensor([pos]), "inv_freq": inv_freq})
        kernel.poison()  # the cache rows past the position stay poisoned: no tile may read them
        caches = {b.name: b for b in g.buffers if b.name.endswith("_cache")}
        for b, rows in zip((caches["layers.0.k_cache"], caches["layers.0.v_cache"]), history):
            kernel.view.tensor(b.offset, b.dtype, b.rows, b.cols, b.cols)[:pos].copy_(rows)
        y = kernel.run()["y"].cpu()
        mk_device, mk_wall = median_launch(kernel, repeats)  # the same step again: same work, same result
        captured = kernel.capture()  # the launch as a graph: no host work per step
        mk_replay = timed(captured.replay, repeats, device)
        kernel.check()
        replayed = torch.equal(kernel.tensor(g.outputs["y"]).cpu(), y)
        workers, tasks = kernel.workers, len(g.tasks)
    finally:
        kernel.close()
    kv_cols = c.kv_heads * c.head_dim
    caches32 = [torch.cat([h.float(), torch.zeros(c.max_seq_len - pos, kv_cols)]) for h in history]
    error = relative_error(y, eager_layer(c, w32, x.float(), pos, inv_freq, *caches32))
    return LayerRun(y, error, mk_device, mk_wall, mk_replay, replayed, workers, tasks, x, inv_freq, history)


def check_layer(s: Setup) -> list[Row]:
    c, pos, device, repeats = s.layer, s.pos, s.device, s.repeats
    gen = torch.Generator().manual_seed(5)
    weights = layer_weights(c, gen)
    run = run_layer(c, s, weights, {k: v.float() for k, v in weights.items()}, gen)
    error, mk_device, mk_wall, mk_replay, replayed = run.error, run.device_s, run.wall_s, run.replay_s, run.replayed
    workers, tasks, x, inv_freq, history = run.workers, run.tasks, run.x, run.inv_freq, run.history
    kv_cols = c.kv_heads * c.head_dim

    on = {k: v.to(device) for k, v in weights.items()}
    caches = [torch.cat([h, torch.zeros(c.max_seq_len - pos, kv_cols, dtype=c.dtype)]).to(device) for h in history]
    xd, freq = x.to(device), inv_freq.to(device)
    step = functools.partial(eager_layer, c, on, xd, pos, freq, *caches)
    eager = timed(step, repeats, device)
    rows = [Row(f"layer {c.hidden}x{c.intermediate} bf16 ({tasks} tasks, {workers} workers) vs fp32 eager",
                f"max rel. error {error:.1e}", "<= 3e-2", error <= 3e-2),
            Row("layer: captured launch replayed (Megakernel.capture)", f"{mk_replay * 1e6:.1f} us per replay, "
                f"{'bitwise equal to run()' if replayed else 'DIFFERS from run()'}", "equal", replayed)]
    if device == "cpu":
        rows.append(Row(f"layer: megakernel / eager ({s.engine}, wall)", f"{mk_wall * 1e3:.1f} / {eager * 1e3:.1f} ms"))
        return rows
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(), step()  # warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        step()
    replay = timed(graph.replay, repeats, device)
    bandwidth = copy_bandwidth(device, 2048)
    floor = layer_bytes(c, pos) / bandwidth
    fraction = floor / mk_device
    return rows + [
        Row("copy bandwidth (read + write)", f"{bandwidth / 1e12:.2f} TB/s"),
        Row(f"layer floor ({layer_bytes(c, pos) / 2**20:.0f} MiB at copy bandwidth)", f"{floor * 1e6:.1f} us"),
        Row("layer: megakernel launch", f"{mk_device * 1e6:.1f} us ({mk_wall * 1e6:.0f} us wall per run)"),
        Row("layer: run() wall vs replay of the captured launch", f"{mk_wall * 1e6:.0f} / {mk_replay * 1e6:.1f} us"),
        Row("layer: eager PyTorch", f"{eager * 1e6:.1f} us"),
        Row("layer: CUDA-graph replay of eager", f"{replay * 1e6:.1f} us"),
        Row("layer: fraction of the bandwidth floor", f"{fraction:.0%}", ">= 75%", fraction >= 0.75, timing=True),
        Row("layer: megakernel vs CUDA-graph replay", f"{replay / mk_device:.2f}x faster", "> 1x", mk_device < replay,
            timing=True),
    ]


# -- 9. the same layer with quantized projections ----------------------------------------------------------
PROJECTIONS = ("qkv", "o", "gate_up", "down")
# float16 fields of a block and their sizes times sqrt(cols): random blocks then make weights of about
# 1 / sqrt(cols), as random_weight's (Q4_K: its minimums about balance its scales' mean)
PACKED_SCALES = {"q4_0": ((0, 1 / 4.6),), "q4_k": ((0, 1 / 180), (2, 7.5 / 180))}


def random_packed(format, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random packed rows of a GGUF block ``format`` (uint8 [rows, format.row_bytes(cols)])."""
    blocks = torch.randint(0, 256, (rows, cols // format.block, format.block_bytes), generator=gen, dtype=torch.uint8)
    for at, size in PACKED_SCALES[format.name]:
        scale = size / math.sqrt(cols) * (0.5 + torch.rand(blocks.shape[:2], generator=gen))
        blocks[..., at:at + 2] = scale.half().unsqueeze(-1).view(torch.uint8)
    return blocks.reshape(rows, -1)


def check_quantized(s: Setup) -> list[Row]:
    """The layer of ``check_layer`` with its projections in Q4_K (the smoke's 128-wide layer: Q4_0, whole
    32-column blocks), against eager float32 over the dequantized weights; the bandwidth floor counts the
    bytes it reads (packed weights, norms, the KV cache, the stream)."""
    shapes = s.layer
    format = Q4_K if shapes.hidden % Q4_K.block == 0 and shapes.intermediate % Q4_K.block == 0 else Q4_0
    c = replace(shapes, formats=tuple((f"layers.0.{name}", format.name) for name in PROJECTIONS))
    gen = torch.Generator().manual_seed(9)
    weights = layer_weights(shapes, gen)
    w32 = {k: v.float() for k, v in weights.items()}
    for name in (f"layers.0.{p}" for p in PROJECTIONS):
        rows, cols = weights[name].shape
        weights[name] = random_packed(format, rows, cols, gen)
        w32[name] = dequantize(format, weights[name], cols)
    run = run_layer(c, s, weights, w32, gen)
    read = sum(w.numel() * w.element_size() for w in weights.values()) + \
        (2 * (s.pos + 1) * c.kv_heads * c.head_dim + 2 * c.hidden) * c.dtype.itemsize
    rows = [Row(f"quantized layer ({format.name} projections, {run.tasks} tasks) vs fp32 eager of the dequantized "
                f"weights", f"max rel. error {run.error:.1e}", "<= 3e-2", run.error <= 3e-2),
            Row("quantized layer: captured launch replayed", f"{run.replay_s * 1e6:.1f} us per replay, "
                f"{'bitwise equal to run()' if run.replayed else 'DIFFERS from run()'}", "equal", run.replayed)]
    if s.device == "cpu":
        return rows + [Row(f"quantized layer: megakernel ({s.engine}, wall)", f"{run.wall_s * 1e3:.1f} ms")]
    floor = read / copy_bandwidth(s.device, 2048)
    return rows + [
        Row(f"quantized layer floor ({read / 2**20:.0f} MiB read at copy bandwidth)", f"{floor * 1e6:.1f} us"),
        Row("quantized layer: megakernel launch", f"{run.device_s * 1e6:.1f} us"),
        Row("quantized layer: fraction of the bandwidth floor", f"{floor / run.device_s:.0%}", ">= 75%",
            floor / run.device_s >= 0.75, timing=True)]


# -- 10. sampling on the device -----------------------------------------------------------------------------
SAMPLED = (0.8, 50, 0.9, 0.05)  # temperature, top_k, top_p, min_p: every filter on, both bisections run


def check_sampling(s: Setup) -> list[Row]:
    """``sample`` over a batch of 8 rows of the layer's vocabulary (bfloat16 logits, as the decode step
    gathers them), greedy and with every filter on: the tokens against the host twin (``drawn``) and
    the launch time of each, one task per row."""
    from megakernel.tasks.sampling import PARAMS, drawn

    batch, vocab, positions = 8, s.layer.vocab, 64
    g = mk.Graph(world_size=1, rank=0)
    logits = g.input("logits", (batch, vocab), torch.bfloat16)
    history = g.input("history", (batch, positions), torch.int64)
    pos, prompt_len = g.input("pos", (batch,), torch.int64), g.input("prompt_len", (batch,), torch.int64)
    params, seed = g.input("params", (batch, len(PARAMS)), torch.float32), g.input("seed", (batch,), torch.int64)
    logprobs = g.new_tensor((batch, positions), torch.float32, name="logprobs")
    g.output("history", g.sample(logits, history, pos, prompt_len, params, seed, logprobs))
    gen = torch.Generator().manual_seed(5)
    values = {"logits": (torch.randn(batch, vocab, generator=gen) * 4).to(torch.bfloat16),
              "history": torch.zeros(batch, positions, dtype=torch.int64), "pos": torch.arange(batch) + 3,
              "prompt_len": torch.ones(batch, dtype=torch.int64), "seed": torch.arange(batch) * 7919}
    rows, seconds = [], {}
    with mk.Megakernel(g, backend=s.backend, timeout=s.timeout) as kernel:
        for name, row in (("greedy", (0.0, 0, 1.0, 0.0)), ("sampled", SAMPLED)):
            kernel.bind({**values, "params": torch.tensor([row] * batch)})
            seconds[name], _ = median_launch(kernel, s.repeats)
            tokens = kernel.run()["history"][torch.arange(batch), values["pos"] + 1].cpu()
            z = values["logits"].float()
            expected = (z.argmax(dim=1) if name == "greedy" else
                        torch.stack([drawn(z[b], torch.tensor(row), int(values["seed"][b]), [int(values["pos"][b]) + 1])[0]
                                     for b in range(batch)]))
            agree = int((tokens == expected).sum())
            rows.append(Row(f"sampling: {name} tokens of {batch} rows (vocabulary {vocab:,}) vs the host twin",
                            f"{agree}/{batch} equal", f"{batch}/{batch}", agree == batch))
    rows.append(Row(f"sampling: launch time, greedy vs T/top-k/top-p/min-p {SAMPLED} ({batch} rows)",
                    f"{seconds['greedy'] * 1e6:.0f} us vs {seconds['sampled'] * 1e6:.0f} us"))
    return rows


SPECULATION_LLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                         num_key_value_heads=4, vocab_size=32000, max_position_embeddings=512)


def check_speculation(s: Setup) -> list[Row]:
    """Speculative decoding (``draft_tokens``): a random Llama on a prompt that repeats a piece, 64 new
    tokens with 4 drafted tokens a step and without: the same tokens, the device steps of each (a step
    reads every weight once) and the time per token, after a warm-up generation."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from megakernel.serving import from_hf
    from megakernel.tools.demo import random_llama

    if s.device == "cuda":
        torch.manual_seed(3)
        hf = LlamaForCausalLM(LlamaConfig(**SPECULATION_LLAMA)).eval().to(torch.bfloat16).to(s.device)
    else:
        hf = random_llama(seed=3)
    # the interpreter takes ~1 s a step of this model (2-3 with drafts): its smoke run a shorter piece, twice,
    # and 6 tokens (11 steps without drafts)
    interpreted = s.device == "cpu" and s.backend == "cpu"
    prompt = torch.tensor([[11, 12, 13] * 2]) if interpreted else torch.tensor([[11, 12, 13, 14, 15, 16] * 4])
    new = 64 if s.device == "cuda" else 6 if interpreted else 16
    runs = {}
    for draft_tokens in (0, 4):
        model = from_hf(hf, max_seq_len=prompt.shape[1] + new, draft_tokens=draft_tokens, backend=s.backend,
                        timeout=s.timeout)
        try:
            if s.device == "cuda":
                model.generate(prompt, new)  # compiles
            steps = model.steps_run
            start = time.perf_counter()
            tokens = model.generate(prompt, new)  # on the host when it returns
            runs[draft_tokens] = tokens, model.steps_run - steps, (time.perf_counter() - start) / new
        finally:
            model.close()
    (plain, plain_steps, plain_time), (drafted, steps, seconds) = runs[0], runs[4]
    return [Row(f"speculation: {new} tokens with 4 drafts a step vs none ({prompt.shape[1]}-token prompt)",
                "identical" if torch.equal(plain, drafted) else "DIFFERENT", "identical", torch.equal(plain, drafted)),
            Row("speculation: device steps (prompt + new tokens), drafts vs none", f"{steps} vs {plain_steps}"),
            Row("speculation: time per generated token, drafts vs none",
                f"{seconds * 1e3:.2f} ms vs {plain_time * 1e3:.2f} ms")]


# -- 4. dispatch overhead --------------------------------------------------------------------------------
def _touch_graph(workers: int, per_worker: int) -> mk.Graph:
    g = mk.Graph(world_size=1, rank=0)
    t = g.input("t", (workers, per_worker), torch.float32)
    for r in range(workers):     # independent tasks: each its own element
        for col in range(per_worker):
            g.touch(t[r:r + 1, col:col + 1])
    g.output("t", t)
    return g


def check_dispatch(s: Setup) -> list[Row]:
    """Seconds one worker spends per empty task: the slope between queues of ``per_worker`` and
    ``4 * per_worker`` tasks, so the launch itself does not count."""
    per_worker = s.per_worker
    with mk.Megakernel(_touch_graph(1, 1), backend=s.backend, timeout=s.timeout) as kernel:
        workers = kernel.workers
    seconds = {}
    for n in (per_worker, 4 * per_worker):
        with mk.Megakernel(_touch_graph(workers, n), backend=s.backend, policy="round_robin",
                           timeout=s.timeout) as kernel:
            kernel.bind({"t": torch.zeros(workers, n)})
            seconds[n], _ = median_launch(kernel, s.repeats)
    per_task = (seconds[4 * per_worker] - seconds[per_worker]) / (3 * per_worker)
    return [Row(f"dispatch: empty tasks, {workers} workers x {per_worker} and x {4 * per_worker}",
                f"{per_task * 1e6:.2f} us per task per worker ({workers / per_task:,.0f} tasks/s in all)",
                "<= 1 us", per_task <= 1e-6, timing=True)]


# -- 5. two virtual ranks --------------------------------------------------------------------------------
SHORT, LONG = 4, 36


def _chain(steps: int) -> mk.Graph:
    g = mk.Graph()
    x = g.input("x", (1, 8), torch.float32)
    for i in range(steps):
        x = g.put(x, to_rank=1 - g.rank, into=g.new_tensor((1, 8), torch.float32, name=f"hop{i}", comm=True))
    g.output("y", x)
    return g


def _virtual_job(s: Setup) -> dict:
    out = {}
    for steps in (SHORT, LONG):
        with mk.Megakernel(_chain(steps), backend=s.backend, timeout=s.timeout) as kernel:
            kernel.bind({"x": torch.randn(1, 8)})
            out[steps], _ = median_launch(kernel, s.repeats)
            y = kernel.run()["y"]
            out[f"ok{steps}"] = bool(torch.isfinite(y).all())
    for size in s.sizes:
        g = mk.Graph()
        g.output("y", g.all_reduce(g.input("x", (1, size // 4), torch.float32)))
        with mk.Megakernel(g, backend=s.backend, timeout=s.timeout) as kernel:
            x = torch.randn(1, size // 4, generator=torch.Generator().manual_seed(g.rank))
            kernel.bind({"x": x})
            out[size], _ = median_launch(kernel, s.repeats)
            expected = sum(torch.randn(1, size // 4, generator=torch.Generator().manual_seed(r)).double()
                           for r in range(2))
            out[f"error{size}"] = relative_error(kernel.run()["y"].cpu(), expected)
    return out


def check_virtual_ranks(s: Setup) -> list[Row]:
    ranks = mk.launch(functools.partial(_virtual_job, s), world_size=2, virtual=True, backend=s.backend, timeout=600)
    hop = max((r[LONG] - r[SHORT]) / (LONG - SHORT) for r in ranks)
    unit, scale = ("us", 1e6)
    written = all(r[f"ok{s}"] for r in ranks for s in (SHORT, LONG))
    rows = [Row("virtual ranks: put chains written", "yes" if written else "NO", "", written),
            Row("virtual ranks: signal round trip (2 puts + waits)", f"{2 * hop * scale:.2f} {unit}", "<= 5 us",
                2 * hop <= 5e-6, timing=True)]
    for size in s.sizes:
        error = max(r[f"error{size}"] for r in ranks)
        rows.append(Row(f"virtual ranks: all_reduce {size:,} B", f"{max(r[size] for r in ranks) * scale:.1f} {unit}, "
                        f"rel. error {error:.0e}", "<= 1e-6", error <= 1e-6))
    return rows


# -- 12. ranks on two nodes -------------------------------------------------------------------------------
def _nodes_job() -> tuple[torch.Tensor, dict[int, str]]:
    g = mk.Graph()
    g.output("y", g.all_reduce(g.input("x", (4, 1024), torch.float32)))
    with mk.Megakernel(g, backend="torch", workers=1, timeout=60) as kernel:
        return kernel.run({"x": torch.full((4, 1024), float(g.rank + 1))})["y"], kernel.links


def check_nodes(s: Setup) -> list[Row]:
    """Ranks on two nodes on this machine's stack: a hierarchical all-reduce at 2 nodes x 2 ranks through the
    cpu transport (gloo and a progress agent per rank; the torch backend on the host, whatever the device),
    the nvshmem transport's kernel compiled for this GPU with the NVSHMEM device library installed here, and
    NVSHMEM's puts and signal run on this GPU to itself (``nvshmem_loopback``)."""
    results = mk.launch(_nodes_job, world_size=4, ranks_per_node=2, backend="torch", timeout=300)
    right = all(torch.equal(y, torch.full((4, 1024), 10.0)) and list(links.values()).count("gloo") == 2
                for y, links in results)
    rows = [Row("nodes: all_reduce over 2 nodes x 2 ranks (cpu transport)", "yes" if right else "NO", "", right)]
    arch = torch.cuda.get_device_capability() if torch.cuda.is_available() and not torch.version.hip else (9, 0)
    target = f"sm_{arch[0]}{arch[1]}"
    if target not in aot.TARGETS:
        return rows + [Row("nodes: nvshmem transport kernel", f"no AOT target {target}", "", None)]
    try:
        library = shmem.device_library(arch[0] * 10 + arch[1])
        compiled = aot.compile_kernel(across_nodes().specs, target, row_words=16, transport="nvshmem")
    except BackendError as error:
        return rows + [Row("nodes: nvshmem transport kernel", f"not compiled: {str(error)[:120]}", "", None)]
    return rows + [Row(f"nodes: nvshmem transport kernel, {target} ({library.name})",
                       f"{compiled.registers} registers, {compiled.spilled} bytes spilled", "0 spilled",
                       compiled.spilled == 0), nvshmem_loopback(arch[0] * 10 + arch[1])]


def nvshmem_loopback(arch: int) -> Row:
    """NVSHMEM's host side and the transport's device calls on the one GPU (one processing element): a
    world of one rank (gloo, for the store NVSHMEM bootstraps from), a symmetric area from torch, the
    ``shmem.loopback`` kernel linked with the device library and given NVSHMEM's state, 4 rows of 256
    int32 put to this PE and a signal after them; right when the rows and the signal both arrived."""
    import torch.distributed as dist
    check = "nodes: nvshmem puts and a signal to this GPU itself (one PE)"
    missing = shmem.host_missing()
    if missing:
        return Row(check, f"not run: {missing}", "", None)
    rows, cols, polls = 4, 256, 1 << 24
    src, dst, counter, seen = 0, rows * cols * 4, 2 * rows * cols * 4, 2 * rows * cols * 4 + 8
    try:
        library = shmem.device_library(arch)
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        area = shmem.symmetric_area(seen + 8, torch.device("cuda", torch.cuda.current_device()),
                                    dist.group.WORLD.group_name)
        sent = torch.randint(-2**31, 2**31 - 1, (rows * cols,), dtype=torch.int32, device=area.device)
        area[src:dst].view(torch.int32).copy_(sent)
        area[dst:counter].fill_(0xA5)  # poisoned
        area[counter:].view(torch.int64).copy_(torch.tensor([0, -7]))
        words = (area.data_ptr(), src, dst, counter, seen, rows, cols, 0, polls)
        kernel = shmem.loopback.warmup(*words, grid=(1,), num_warps=4,
                                       extern_libs={"libnvshmem_device": str(library)})
        shmem.init_module(kernel)
        torch.cuda.synchronize()
        start = time.perf_counter()
        kernel[(1, 1, 1)](*words, stream=torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    except (BackendError, ValueError, RuntimeError) as error:  # a bitcode 3.6 cannot read, a host call refused
        return Row(check, f"not run: {type(error).__name__}: {str(error)[:160]}", "", None)
    arrived = torch.equal(area[dst:counter].view(torch.int32), sent)
    signalled = int(area[seen:].view(torch.int64).item())
    return Row(check, f"rows {'arrived' if arrived else 'WRONG'}, counter read {signalled}, {wall * 1e6:.0f} us wall",
               "rows arrived, counter 1", arrived and signalled == 1)


# -- 13. expert parallelism over two virtual ranks ---------------------------------------------------------
EP_TOKENS = 8


def expert_parallel_inputs(c: DecoderConfig) -> dict[str, torch.Tensor]:
    """The sparse MLP's input rows and weights, whole (every expert), made once before the ranks start."""
    gen = torch.Generator().manual_seed(13)
    return {"x": random_weight((EP_TOKENS, c.hidden), c.dtype, gen) * 4,
            "router": random_weight((c.experts, c.hidden), c.dtype, gen),
            "gate_up": random_weight((c.experts * 2 * c.moe_intermediate, c.hidden), c.dtype, gen),
            "down": random_weight((c.experts * c.hidden, c.moe_intermediate), c.dtype, gen)}


def expert_parallel_float64(c: DecoderConfig, w: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sparse MLP in float64 on the host: softmax, top-k renormalised, each chosen expert's SwiGLU."""
    x, inter = w["x"].double(), c.moe_intermediate
    top, chosen = torch.sort(torch.softmax(x @ w["router"].double().T, -1), dim=-1, descending=True, stable=True)
    top = top[:, :c.top_k] / top[:, :c.top_k].sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for s_, e in enumerate(chosen[b, :c.top_k].tolist()):
            gate, up = (w["gate_up"][e * 2 * inter:(e + 1) * 2 * inter].double() @ x[b]).split(inter)
            y[b] += top[b, s_] * (w["down"][e * c.hidden:(e + 1) * c.hidden].double() @ (F.silu(gate) * up))
    return y


def _expert_parallel_job(s: Setup, w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
    c = s.moe
    g = mk.Graph()
    held = Held.balanced(c.experts, g.rank, g.world_size)
    mine = {"gate_up": 2 * c.moe_intermediate, "down": c.hidden}  # rows per expert
    weights = {name: torch.cat([w[name][held.first * rows:(held.first + held.count) * rows],
                                w[name].new_zeros((held.stacked - held.count) * rows, w[name].shape[1])])
               for name, rows in mine.items()}
    inputs = {name: g.input(name, t.shape, t.dtype) for name, t in {**w, **weights}.items()}
    g.output("y", g.moe_mlp(inputs["x"], inputs["router"], inputs["gate_up"], inputs["down"], c.top_k, True,
                            torch.float32, expert_parallel=True))
    with mk.Megakernel(g, backend=s.backend, timeout=s.timeout) as kernel:
        kernel.bind({**w, **weights})
        y = kernel.run()["y"].cpu()
        return y, median_launch(kernel, s.repeats)[0]


def check_expert_parallel(s: Setup) -> list[Row]:
    c = s.moe
    w = expert_parallel_inputs(c)
    ranks = mk.launch(functools.partial(_expert_parallel_job, s, w), world_size=2, virtual=True, backend=s.backend,
                      timeout=600)
    same = torch.equal(ranks[0][0], ranks[1][0])
    error = relative_error(ranks[0][0], expert_parallel_float64(c, w))
    unit, scale = ("ms", 1e3) if s.device == "cpu" else ("us", 1e6)
    return [Row(f"expert parallel over 2 ranks: {c.experts} experts top-{c.top_k}, {EP_TOKENS} tokens, bf16, vs "
                f"float64", f"max rel. error {error:.1e}", "<= 2e-2 (bf16)", error <= 2e-2),
            Row("expert parallel: both ranks the same bits", "yes" if same else "NO", "", same),
            Row("expert parallel: sparse MLP launch (slower rank)", f"{max(r[1] for r in ranks) * scale:.1f} {unit}")]


SECTIONS = {"types": check_task_types, "decode": check_decode, "layer": check_layer, "dispatch": check_dispatch,
            "virtual": check_virtual_ranks, "moe": check_moe, "steps": check_steps, "serving": check_serving,
            "quantized": check_quantized, "sampling": check_sampling, "speculation": check_speculation,
            "nodes": check_nodes, "expert_parallel": check_expert_parallel}
SPIN = ":spin"  # a section with the old protocol
DEFAULT = ["types", "decode", "layer", "quantized", "moe", "steps", "dispatch", "dispatch" + SPIN, "virtual",
           "virtual" + SPIN, "serving", "sampling", "speculation", "nodes", "expert_parallel"]
if device.protocol() == "spin":  # the default already: the :spin sections would repeat the others
    DEFAULT = [name for name in DEFAULT if not name.endswith(SPIN)]
# Seconds each section may take in its own process (a CUDA fault poisons the process that hit it, a
# hang must not eat the GPU's time): all of them within BUDGET.
LIMITS = {"types": 90, "decode": 90, "layer": 240, "quantized": 150, "moe": 150, "steps": 150, "dispatch": 60,
          "virtual": 90, "serving": 150, "sampling": 60, "speculation": 150, "nodes": 120, "expert_parallel": 90}
BUDGET = 480


def run_child(names: list[str], smoke: str | None, limit: float) -> list[Row]:
    """Run sections ``names`` (all with the default protocol, or all ``:spin``) in a process of their own
    (``smoke``: small, on that host backend); their rows, or one FAILED row."""
    bases, spin = [name.removesuffix(SPIN) for name in names], names[0].endswith(SPIN)
    command = [sys.executable, __file__, "--child", "--only", ",".join(bases),
               *(["--smoke", "--backend", smoke] if smoke else [])]
    env = dict(os.environ, **({"MEGAKERNEL_PROTOCOL": "spin"} if spin else {}))
    what = ",".join(names)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired as expired:
        tail = expired.stderr or ""  # bytes here even with text=True
        sys.stderr.write((tail.decode(errors="replace") if isinstance(tail, bytes) else tail)[-4000:])
        return [Row(what, f"FAILED: timed out after {limit:.0f} s", "", False)]
    sys.stderr.write(done.stderr[-8000:])
    lines = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
    if not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return [Row(what, f"FAILED (exit {done.returncode}): {last}", "", False)]
    rows = [Row(**row) for row in json.loads(lines[-1][5:])]
    for row in rows if spin else []:
        row.check += " [spin protocol]"
    return rows


def driver() -> str:
    """The driver for the output's first line: NVIDIA's version from nvidia-smi, or ROCm's HIP version."""
    if torch.version.hip:
        return f", HIP {torch.version.hip}"
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return f", driver {done.stdout.split()[0]}" if done.returncode == 0 and done.stdout.strip() else ""


def run_here(name: str, setup: Setup) -> list[Row]:
    try:
        return SECTIONS[name](setup)
    except Exception as error:  # reported as a row: the table shows every section's fate
        traceback.print_exc()
        last = str(error).strip().splitlines()[-1][:160] if str(error).strip() else ""
        return [Row(name, f"FAILED: {type(error).__name__}: {last}", "", False)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="small shapes on a host backend")
    parser.add_argument("--backend", choices=["cpu", "torch"], default="cpu",
                        help="with --smoke: the Triton interpreter (cpu) or each tile as torch code (torch)")
    parser.add_argument("--only", help=f"comma-separated sections to run (default: {','.join(DEFAULT)}); any "
                                       f"of {', '.join(SECTIONS)}, each also as NAME{SPIN}")
    parser.add_argument("--child", action="store_true", help="run the sections in this process, print their rows")
    args = parser.parse_args(argv)
    chosen = args.only.split(",") if args.only else DEFAULT
    unknown = {name.removesuffix(SPIN) for name in chosen} - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    setup = replace(SMOKE, backend=args.backend) if args.smoke else GPU
    if args.child:
        rows = [row for name in chosen for row in run_here(name, setup)]
        print("ROWS " + json.dumps([asdict(row) for row in rows]))
        return 0
    if not args.smoke and not torch.cuda.is_available():
        print("no GPU visible to torch: run with --smoke for the cpu backend", file=sys.stderr)
        return 2
    import triton
    gpu = torch.cuda.get_device_name() if setup.device == "cuda" else platform.processor() or "cpu"
    print(f"# gpu_check {time.strftime('%Y-%m-%d')}: {gpu}{driver() if setup.device == 'cuda' else ''}; torch "
          f"{torch.__version__}, triton {triton.__version__}, python {platform.python_version()}, protocol "
          f"{device.protocol()}", flush=True)
    rows: list[Row] = []
    deadline = time.monotonic() + BUDGET * (3 if args.smoke else 1)
    # on a GPU a process per section (a fault poisons only its own); the smoke run shares one per protocol
    groups = [[name] for name in chosen] if not args.smoke else [
        group for group in ([n for n in chosen if not n.endswith(SPIN)], [n for n in chosen if n.endswith(SPIN)])
        if group]
    for group in groups:
        start = time.perf_counter()
        left = deadline - time.monotonic()
        if left < 10:
            rows.append(Row(",".join(group), "FAILED: not run, the time budget is spent", "", False))
            continue
        limit = min(sum(LIMITS[name.removesuffix(SPIN)] for name in group) * (3 if args.smoke else 1), left)
        rows += run_child(group, args.backend if args.smoke else None, limit)
        print(f"# {','.join(group)}: {time.perf_counter() - start:.1f} s", flush=True)
    if args.smoke:  # the CPU is no GPU: time targets do not apply
        for row in rows:
            if row.timing:
                row.target, row.ok = f"{row.target} (GPU)", None
    print()
    print("| check | result | target | ok |")
    print("| --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row.check} | {row.value} | {row.target} | {'' if row.ok is None else 'yes' if row.ok else 'NO'} |")
    return 0 if all(row.ok is not False for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
