"""Example graphs shared by the command line, the benchmarks and the tests."""
from __future__ import annotations

import torch

from .. import Graph


def every_task_type() -> Graph:
    """A small graph whose kernel has every task type and tile variant of the library in it."""
    g = Graph(world_size=1, rank=0)
    x = g.input("x", (20, 96), torch.float32)
    xb = g.input("xb", (2, 96), torch.bfloat16)
    w = g.input("w", (40, 96), torch.bfloat16)
    wf = g.input("wf", (40, 96), torch.float32)
    norm = g.input("norm", (96,), torch.float32)
    h = g.rms_norm(xb, norm, 1e-6)
    y = g.touch(g.linear(h, w, split_k=2))     # GEMV tiles, split-K partials, the reduction tile; an empty task
    g.output("y", g.silu_mul(g.add(y, y), g.mul(y, y)))
    g.output("z", g.all_reduce(g.linear(x, wf)))  # tl.dot tiles; put tiles (to itself, in a world of one)
    # decode: embedding, per-head norm, RoPE, KV cache append, split-KV attention and its combine tile
    tokens, pos = g.input("tokens", (2,), torch.int64), g.input("pos", (1,), torch.int64)
    inv_freq = g.input("inv_freq", (24,), torch.float32)
    q = g.embedding(tokens, g.input("embed", (50, 96), torch.bfloat16))
    q = g.rope(g.rms_norm(q, g.input("q_norm", (48,), torch.bfloat16), 1e-6, head_dim=48), inv_freq, pos, 48)
    cache = g.new_tensor((2 * 80, 48), torch.bfloat16, name="kv_cache")
    k_cache = g.kv_append(cache, q[:, :48], pos, batch=2)
    g.output("attention", g.decode_attention(q, k_cache, k_cache, pos, batch=2, head_dim=48))
    return g


def mlp_block(hidden: int = 128, intermediate: int = 320, batch: int = 1, dtype=torch.float32) -> Graph:
    """RMSNorm -> gate/up projections -> SiLU-mul -> down projection -> residual (a Llama MLP block)."""
    g = Graph(world_size=1, rank=0)
    x = g.input("x", (batch, hidden), dtype)
    norm = g.input("norm", (hidden,), dtype)
    gate = g.input("gate", (intermediate, hidden), dtype)
    up = g.input("up", (intermediate, hidden), dtype)
    down = g.input("down", (hidden, intermediate), dtype)
    h = g.rms_norm(x, norm, 1e-6)
    act = g.silu_mul(g.linear(h, gate), g.linear(h, up))
    g.output("y", g.add(x, g.linear(act, down)))
    return g
