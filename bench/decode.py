"""Decode-step cost: tasks, weight bytes and time per step on the cpu backend, and the GPU bandwidth floor.

    python bench/decode.py

Part 1 runs a small random Llama (the demo's) for a few decode steps on one rank and prints tasks per
step, bytes of weights each step reads, and the time per step (the Triton interpreter: a CPU number,
not a GPU one). Part 2 generates with the whole decode loop on the device, one token per launch
against every token in one launch, and prints the launches and the host's time per generated token
(the generation's wall time less the launches' own: what the host adds), and their ratio; then a
prompt to its first token with and without a prefill chunk (launches per prompt token). Part 3
counts, for mixture-of-experts models, the bytes of weights one step reads (attention, routers, the
k chosen experts' slices: what the expert tiles stream) against the dense equivalent (every
expert), for a Qwen3-30B-A3B shape and the tests' small Qwen3-MoE, from the graph's tasks; the expert
bytes of a layer-step at batch 1, 8 and 64 with the rows grouped by expert against a pass per row; and the bytes of
weights one step of a Llama-3.1-8B reads in each weight format (bf16, FP8, Q8_0, Q4_K), from the graph's
tasks too. Part 4 prints, for a Llama-3-8B-shaped decoder layer (hidden 4096, 32 heads, 8 KV
heads, head dim 128, intermediate 14336, bfloat16, batch 1), the bytes one decode step of the layer
must move, which sets its memory-bandwidth floor: a GPU run reports its fraction of that floor.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from megakernel.models import DecoderConfig, ServingConfig
from megakernel.serving import from_hf
from megakernel.tools.demo import random_llama

LLAMA3_8B = DecoderConfig(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, layers=1,
                          vocab=128256, eps=1e-5, qk_norm=False,
                          serving=ServingConfig(max_seq_len=4096, prefill_chunk=0),
                          dtype=torch.bfloat16)


def weight_bytes(c: DecoderConfig, lm_head: bool = True) -> int:
    """Bytes of weights one decode step reads: every projection once, plus the LM head and norms."""
    size = torch.empty((), dtype=c.dtype).element_size()
    qkv = (c.heads + 2 * c.kv_heads) * c.head_dim * c.hidden
    per_layer = qkv + c.heads * c.head_dim * c.hidden + 3 * c.intermediate * c.hidden + 2 * c.hidden
    return size * (c.layers * per_layer + (c.vocab * c.hidden if lm_head else 0) + c.hidden)


def layer_floor_bytes(c: DecoderConfig, context: int) -> int:
    """One layer, one token: its weights, the KV cache it reads at ``context`` positions, and the
    activations it must read and write (negligible next to the weights at batch 1)."""
    size = torch.empty((), dtype=c.dtype).element_size()
    cache = 2 * context * c.kv_heads * c.head_dim * size
    return weight_bytes(replace(c, layers=1), lm_head=False) - c.hidden * size + cache


def cpu_steps(steps: int = 6) -> None:
    model = from_hf(random_llama(), max_seq_len=32, workers=2)
    try:
        times = []
        for pos in range(steps):
            start = time.perf_counter()
            model.decode(torch.tensor([pos + 3]), pos)
            times.append(time.perf_counter() - start)
        c = model.config
        print(f"cpu backend, the demo's random Llama ({c.layers} layers, hidden {c.hidden}, {c.dtype}), 2 workers:")
        print(f"  tasks per step: {len(model.graph.tasks)}; one launch per step")
        print(f"  weight bytes read per step: {weight_bytes(c):,}")
        print(f"  time per step: median {statistics.median(times[1:]) * 1e3:.0f} ms over {steps - 1} steps "
              f"(first step {times[0] * 1e3:.0f} ms)")
    finally:
        model.close()


def host_per_token(prompt: int = 4, new_tokens: int = 12) -> None:
    model = from_hf(random_llama(), max_seq_len=32, workers=2)
    kernel = model.kernel
    run, launched = kernel.run, []

    def timed_run(*args, **kwargs):  # the launch alone, as the backend measured it
        out = run(*args, **kwargs)
        launched.append(kernel.launch_seconds)
        return out

    kernel.run = timed_run
    try:
        ids = torch.arange(3, 3 + prompt).reshape(1, -1)
        model.generate(ids, 2, tokens_per_launch=1)  # warm: the kernel's first launch meets the ranks
        print(f"generation on the device: prompt {prompt}, {new_tokens} new tokens, cpu backend, 2 workers:")
        host = {}
        for per_launch in (1, None):
            launched.clear()
            start = time.perf_counter()
            tokens = model.generate(ids, new_tokens, tokens_per_launch=per_launch)
            wall = time.perf_counter() - start
            host[per_launch] = (wall - sum(launched)) / new_tokens
            print(f"  tokens per launch {per_launch or 'all'}: {len(launched)} launches, host {host[per_launch] * 1e3:.2f} "
                  f"ms per generated token (wall {wall:.2f} s, launches {sum(launched):.2f} s), "
                  f"{kernel.host_barriers} host meetings in all")
            assert tokens.shape[1] == prompt + new_tokens
        print(f"  host time per token, one token per launch / all in one launch: {host[1] / host[None]:.1f}x")
    finally:
        model.close()


QWEN3_30B_A3B = DecoderConfig(hidden=2048, heads=32, kv_heads=4, head_dim=128, intermediate=6144, layers=48,
                              vocab=151936, eps=1e-6, qk_norm=True,
                              serving=ServingConfig(max_seq_len=4096, prefill_chunk=0),
                              dtype=torch.bfloat16,
                              moe=(True,) * 48, experts=128, top_k=8, moe_intermediate=768, norm_topk=True,
                              router_weight_dtype=torch.bfloat16)


def moe_layer(c: DecoderConfig, tokens: int) -> list[tuple[int, int]]:
    """One sparse layer of ``c`` over ``tokens`` rows, built as a graph: its ``grouped_expert`` tasks, each
    as (group j, weight elements it streams when its group has an expert)."""
    from megakernel.graph import Graph
    from megakernel.models.decoder import Shard, decoder_layer
    from megakernel.tasks.moe import GROUPED_EXPERT

    one = replace(c, layers=1, moe=(True,), serving=replace(c.serving, max_batch=tokens))
    g = Graph(world_size=1, rank=0)
    decoder_layer(g, one, Shard.of(one, 0, 1), g.input("x", (tokens, c.hidden), c.dtype),
                  g.input("pos", (tokens,), torch.int64), g.input("inv_freq", (c.head_dim // 2,), torch.float32), 0)
    gated = {i: bool(dict(spec.constexprs)["ACT"]) for i, spec in enumerate(g.specs)
             if spec.task_type == GROUPED_EXPERT.name}
    j, n, k = (GROUPED_EXPERT.arg_names.index(name) for name in ("j", "n", "k"))
    return [(args[j], args[n] * args[k] * (2 if gated[op] else 1))
            for op, args in zip(g.tasks.opcode, g.tasks.args) if op in gated]


def moe_bytes(c: DecoderConfig) -> tuple[int, int]:
    """(bytes of weights a decode step reads at batch 1, the dense equivalent's), from one layer's graph:
    the grouped expert tiles' own bytes (k groups, each streaming one chosen expert: a token's k experts
    are distinct, so at batch 1 every group has one) against every expert's."""
    size = c.dtype.itemsize
    streamed = sum(elements for _, elements in moe_layer(c, 1)) * size
    every_expert = c.experts * 3 * c.moe_intermediate * c.hidden * size
    one = replace(c, layers=1, moe=(True,))
    others = weight_bytes(replace(one, intermediate=0), lm_head=False) - c.hidden * size
    others += c.experts * c.hidden * size  # the router
    return c.layers * (others + streamed) + c.vocab * c.hidden * size, \
        c.layers * (others + every_expert) + c.vocab * c.hidden * size


def moe_grouping(c: DecoderConfig, batches=(1, 8, 64), samples: int = 48) -> None:
    """Expert weight bytes one sparse layer-step reads at each batch, the rows grouped by expert (a pass
    per distinct expert chosen) against a pass per (token, slot) row, for routers that pick uniformly at
    random (``samples`` layer-steps, seeded): the bytes per expert from the layer's grouped tasks, the
    number of distinct experts from the sampled choices."""
    size, generator = c.dtype.itemsize, torch.Generator().manual_seed(0)
    print(f"  rows grouped by expert, one sparse layer-step, uniform random routing ({samples} samples):")
    for batch in batches:
        tasks = moe_layer(c, batch)
        groups = 1 + max(j for j, _ in tasks)
        per_expert = sum(elements for _, elements in tasks) * size / groups
        distinct = statistics.mean(
            len(torch.unique(torch.stack([torch.randperm(c.experts, generator=generator)[:c.top_k]
                                          for _ in range(batch)]))) for _ in range(samples))
        grouped, ungrouped = distinct * per_expert, batch * c.top_k * per_expert
        print(f"    batch {batch:>2}: {len(tasks):>4} grouped tiles ({groups} groups), {distinct:5.1f} distinct "
              f"experts of {batch * c.top_k} rows: {grouped / 2**20:6.1f} MiB grouped, {ungrouped / 2**20:6.1f} MiB "
              f"a pass per row ({ungrouped / grouped:.2f}x)")


def expert_parallel_traffic(c: DecoderConfig, worlds=(2, 4, 8), batches=(1, 8, 64), samples: int = 48) -> None:
    """Under expert parallelism, per rank and sparse layer-step: the expert weight bytes it reads (a pass
    per expert of its own chosen) and the bytes it sends (``tasks.expert_parallel.combine``: a token's row to each
    other rank where the token chose one of its experts), against tensor parallelism's (every expert's
    share of columns read per distinct expert chosen; the all-reduce of the whole [batch, hidden] part),
    for routers that pick uniformly at random (``samples`` layer-steps, seeded)."""
    from megakernel.tasks.comm import ONE_SHOT_MAX_BYTES
    from megakernel.tasks.expert_parallel import Held

    size, generator = c.dtype.itemsize, torch.Generator().manual_seed(1)
    per_expert = 3 * c.moe_intermediate * c.hidden * size
    print(f"  expert parallelism, per rank and sparse layer-step, uniform random routing ({samples} samples):")
    for world in worlds:
        held = [Held.balanced(c.experts, r, world) for r in range(world)]
        for batch in batches:
            read = busiest = sent = 0.0
            for _ in range(samples):
                chosen = torch.stack([torch.randperm(c.experts, generator=generator)[:c.top_k] for _ in range(batch)])
                reads = []
                for h in held:
                    mine = (chosen >= h.first) & (chosen < h.first + h.count)
                    reads.append(len(torch.unique(chosen[mine])) * per_expert)
                    sent += int(mine.any(dim=1).sum()) * c.hidden * size * (world - 1)
                read, busiest = read + sum(reads), busiest + max(reads)
            read, busiest, sent = read / (samples * world), busiest / samples, sent / (samples * world)
            whole = batch * c.hidden * size
            all_reduce = (world - 1) * whole if whole <= ONE_SHOT_MAX_BYTES else 2 * (world - 1) * whole / world
            # tensor parallelism reads 1/world of every distinct expert chosen: the ranks' mean under EP
            print(f"    EP {world}, batch {batch:>2}: expert bytes read {read / 2**20:6.1f} MiB a rank on average "
                  f"(= TP's), {busiest / 2**20:6.1f} MiB on the busiest rank; sent {sent / 2**10:7.1f} KiB a rank "
                  f"(TP's all-reduce {all_reduce / 2**10:7.1f} KiB)")


def moe_fraction() -> None:
    small = DecoderConfig(hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=96, layers=2, vocab=100,
                          eps=1e-6, qk_norm=True, serving=ServingConfig(max_seq_len=16, prefill_chunk=0),
                          moe=(True, True), experts=8, top_k=2,
                          moe_intermediate=44, norm_topk=True)
    print("mixture of experts, weights one decode step reads (batch 1), from the graph's expert tiles:")
    for name, c in (("Qwen3-30B-A3B shape (48 layers, 128 experts, top-8, bf16)", QWEN3_30B_A3B),
                    ("the tests' Qwen3-MoE (2 layers, 8 experts, top-2, float32)", small)):
        active, dense = moe_bytes(c)
        print(f"  {name}: {active / 2**20:,.1f} MiB of {dense / 2**20:,.1f} MiB dense-equivalent "
              f"({active / dense:.1%} active)")
    moe_grouping(QWEN3_30B_A3B)
    expert_parallel_traffic(QWEN3_30B_A3B)


LLAMA31_8B = replace(LLAMA3_8B, layers=32)
# weight formats for the 8B shapes: each as a checkpoint of that kind keeps its weights (FP8 checkpoints leave
# the embedding and the LM head in bfloat16; GGUF quantizes them too)
PROJECTIONS = ("qkv", "o", "gate_up", "down")
FORMAT_CASES = {"bf16": ((), False), "fp8 (128x128 block scales)": ("fp8_block", False),
                "fp8 (a scale per row)": ("fp8_channel", False), "q8_0": ("q8_0", True), "q4_k": ("q4_k", True)}


def step_weight_bytes(c: DecoderConfig, format: str | tuple, embeddings: bool) -> tuple[int, int]:
    """(bytes of weights one decode step reads, tasks per step) for ``c`` with its projections (and, with
    ``embeddings``, its embedding and LM head) kept in ``format``, counted from the graph's tasks: the
    weight (and scale) regions every linear tile reads, and the embedding's one row per batch row (its
    tiles declare the whole table, which they may read any row of). One layer's graph, times the layers."""
    from megakernel.graph import Graph
    from megakernel.models.decoder import decode_step

    layers = [f"layers.0.{name}" for name in PROJECTIONS] + (["embed", "lm_head"] if embeddings else [])
    one = replace(c, layers=1, formats=tuple((n, format) for n in layers if format))
    g = decode_step(one, Graph(world_size=1, rank=0))
    inputs = {t.buffer.index: name for name, t in g.inputs.items()}
    weights = {index for index, name in inputs.items() if name.split(".scales")[0].removeprefix("layers.0.")
               in (*PROJECTIONS, "lm_head", "norm", "input_norm", "post_norm")}
    layer_bytes = head_bytes = 0
    for t in range(len(g.tasks)):
        scope = g.op_names[g.tasks.op[t]]
        read = sum((r1 - r0) * (c1 - c0) * g.buffers[b].dtype.itemsize for b, r0, r1, c0, c1 in g.tasks.reads[t]
                   if b in weights)
        if scope.startswith("layer0/"):
            layer_bytes += read
        else:
            head_bytes += read
    embed = g.inputs["embed"]
    row = embed.cols * embed.dtype.itemsize  # a packed row or a row of elements
    return (c.layers * layer_bytes + head_bytes + c.batch * row,
            c.layers * sum(g.op_names[op].startswith("layer0/") for op in g.tasks.op)
            + sum(not g.op_names[op].startswith("layer0/") for op in g.tasks.op))


def format_bytes() -> None:
    print("Llama-3.1-8B shapes (32 layers, batch 1): weight bytes one decode step reads, by format, from the graph:")
    bf16 = None
    for name, (format, embeddings) in FORMAT_CASES.items():
        read, tasks = step_weight_bytes(LLAMA31_8B, format, embeddings)
        bf16 = bf16 or read
        print(f"  {name:<27} {read / 2**30:6.2f} GiB ({read / bf16:.3f} of bf16); at 4.8 TB/s (H200) "
              f"{read / 4.8e12 * 1e3:5.2f} ms per token; {tasks:,} tasks per step")


def prefill_launches(prompt: int = 24, chunk: int = 32) -> None:
    """A prompt to its first token: through the batch row a token per step (one launch each, or all in
    one launch of ``prompt`` steps) against one prefill chunk (the prompt's positions but the last in
    prefill rows, the last in the batch row: one launch of one step)."""
    llama, ids = random_llama(), torch.arange(3, 3 + prompt)
    print(f"prompt of {prompt} tokens to its first new token, cpu backend, 2 workers:")
    results = {}
    for name, prefill_chunk, steps in (("a token per step, a launch each", 0, 1),
                                       ("a token per step, one launch", 0, prompt),
                                       (f"prefill chunk of {chunk}", chunk, 1)):
        model = from_hf(llama, max_seq_len=32, prefill_chunk=prefill_chunk, workers=2)
        try:
            model.generate(ids[:2].reshape(1, -1), 1)  # warm: the kernel's first launch meets the ranks
            launches, made = model.kernel.launches, {}
            start = time.perf_counter()
            sequence = model.add(ids, 1)
            while not made:
                made = model.step(steps)
            wall = time.perf_counter() - start
            count = model.kernel.launches - launches
            results[name] = (count, wall)
            print(f"  {name}: {count} launches ({count / prompt:.3f} per prompt token), "
                  f"{'1' if prefill_chunk else prompt} device steps, wall {wall:.2f} s; first token {made[sequence]}")
        finally:
            model.close()
    per_step, _ = results["a token per step, a launch each"]
    together = results["a token per step, one launch"][1]
    prefill, prefill_wall = results[f"prefill chunk of {chunk}"]
    print(f"  launches per prompt token, a launch per step / prefill: {per_step / prefill:.0f}x; "
          f"wall (cpu interpreter), {prompt} steps in one launch / prefill: {together / prefill_wall:.1f}x")


def main() -> None:
    cpu_steps()
    print()
    host_per_token()
    print()
    prefill_launches()
    print()
    moe_fraction()
    print()
    format_bytes()
    print()
    print("Llama-3-8B-shaped layer (bfloat16, batch 1): bytes one decode step must move")
    for context in (1, 1024, 4096):
        floor = layer_floor_bytes(LLAMA3_8B, context)
        print(f"  context {context:>5}: {floor / 2**20:8.1f} MiB; at 4.8 TB/s (H200) the floor is "
              f"{floor / 4.8e12 * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
