"""Decode-step cost: tasks, weight bytes and time per step on the cpu backend, and the GPU bandwidth floor.

    python bench/decode.py

Part 1 runs a small random Llama (the demo's) for a few decode steps on one rank and prints tasks per
step, bytes of weights each step reads, and the time per step (the Triton interpreter: a CPU number,
not a GPU one). Part 2 prints, for a Llama-3-8B-shaped decoder layer (hidden 4096, 32 heads, 8 KV
heads, head dim 128, intermediate 14336, bfloat16, batch 1), the bytes one decode step of the layer
must move, which sets its memory-bandwidth floor: a GPU run reports its fraction of that floor.
"""
from __future__ import annotations

import statistics
import time

import torch

from megakernel.models import DecoderConfig, from_hf
from megakernel.tools.demo import random_llama

LLAMA3_8B = DecoderConfig(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, layers=1,
                          vocab=128256, eps=1e-5, qk_norm=False, max_seq_len=4096, dtype=torch.bfloat16)


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
    return weight_bytes(DecoderConfig(**{**c.__dict__, "layers": 1}), lm_head=False) - c.hidden * size + cache


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


def main() -> None:
    cpu_steps()
    print()
    print("Llama-3-8B-shaped layer (bfloat16, batch 1): bytes one decode step must move")
    for context in (1, 1024, 4096):
        floor = layer_floor_bytes(LLAMA3_8B, context)
        print(f"  context {context:>5}: {floor / 2**20:8.1f} MiB; at 4.8 TB/s (H200) the floor is "
              f"{floor / 4.8e12 * 1e6:6.1f} us")


if __name__ == "__main__":
    main()
