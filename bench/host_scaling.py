"""Host-path scaling: graph build, schedule and serialize for ~1k to ~1M tile tasks.

The graph is a stack of Llama-like decode MLP blocks on a bf16 residual stream (one token):

    x -> rms_norm -> linear gate / linear up -> silu_mul -> linear down (split-K 2) -> add x

Each layer has its own weights and ~400 tile tasks (GEMV tiles, split-K partials and their reduction
tiles, norm and elementwise tiles); the number of layers is scaled to reach each task count.
"schedule" is ``megakernel.scheduler.schedule``: dependency inference, placement, event encoding,
tables and the pre-launch checks. "gc s" is the part of the total that CPython's cyclic garbage
collector ran (during the build, where each full collection walks the growing graph; ``schedule``
pauses it), measured through ``gc.callbacks``.

    python bench/host_scaling.py                    # ~1k, 10k, 100k and 1M tasks
    python bench/host_scaling.py --max-tasks 10000  # a quick run
"""
from __future__ import annotations

import argparse
import gc
import platform
import resource
import time

import torch

import megakernel as mk
from megakernel import graph as graph_module
from megakernel.scheduler import POLICIES, schedule, serialize

# These graphs are built and scheduled, never run: their weights (128 GB at 1M tasks) need no heap, so the
# check that refuses a graph larger than this machine's largest heap is lifted here.
graph_module.largest_heap = lambda: 1 << 62

HIDDEN, INTERMEDIATE = 2048, 4096
SIZES = (1_000, 10_000, 100_000, 1_000_000)


def mlp_stack(layers: int, dtype: torch.dtype = torch.bfloat16) -> mk.Graph:
    """``layers`` decode MLP blocks, each feeding the next through the residual stream."""
    g = mk.Graph(world_size=1, rank=0)
    x = g.input("x", (1, HIDDEN), dtype)
    for i in range(layers):
        norm = g.input(f"norm{i}", (HIDDEN,), dtype)
        gate = g.input(f"gate{i}", (INTERMEDIATE, HIDDEN), dtype)
        up = g.input(f"up{i}", (INTERMEDIATE, HIDDEN), dtype)
        down = g.input(f"down{i}", (HIDDEN, INTERMEDIATE), dtype)
        h = g.rms_norm(x, norm, 1e-6)
        act = g.silu_mul(g.linear(h, gate), g.linear(h, up))
        x = g.add(x, g.linear(act, down, split_k=2))
    g.output("y", x)
    return g


class CollectorClock:
    """Seconds spent in CPython's cyclic garbage collector since ``reset``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start

    def reset(self) -> None:
        self.seconds = 0.0


def peak_rss_gib() -> float:
    """The process's peak resident memory so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def measure(layers: int, workers: int, policies: list[str], clock: CollectorClock) -> list[dict]:
    """Build the graph once, then schedule and serialize it under each policy."""
    clock.reset()
    start = time.perf_counter()
    g = mlp_stack(layers)
    build = time.perf_counter() - start
    build_gc = clock.seconds
    shapes = g.buffer_shapes()
    rows = []
    for policy in policies:
        clock.reset()
        start = time.perf_counter()
        tables = schedule(g.tasks, shapes, specs=g.specs, op_names=g.op_names, workers=workers, policy=policy,
                          describe=g.describe_task)
        scheduled = time.perf_counter() - start
        start = time.perf_counter()
        serialize(tables)
        serialized = time.perf_counter() - start
        total = build + scheduled + serialized
        rows.append(dict(tasks=len(g.tasks), policy=policy, build=build, gc=build_gc + clock.seconds,
                         schedule=scheduled, serialize=serialized, total=total,
                         us_per_task=total / len(g.tasks) * 1e6, rss=peak_rss_gib()))
        del tables
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tasks", type=int, default=SIZES[-1], help="largest task count to run")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--policy", action="append", choices=POLICIES,
                        help="placement policy to time; repeat for several (default: critical_path, round_robin)")
    args = parser.parse_args()
    policies = args.policy or ["critical_path", "round_robin"]

    per_layer = len(mlp_stack(1).tasks)
    clock = CollectorClock()
    print(f"# {platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}; "
          f"{per_layer} tasks per layer, {args.workers} workers")
    header = (f"{'tasks':>9} | {'policy':<13} | {'build s':>8} | {'schedule s':>10} | {'serialize s':>11} | "
              f"{'total s':>8} | {'µs/task':>8} | {'gc s':>6} | {'peak RSS GiB':>12}")
    print(header)
    print("-" * len(header))
    for target in [s for s in SIZES if s <= args.max_tasks] or [args.max_tasks]:
        for r in measure(max(1, round(target / per_layer)), args.workers, policies, clock):
            print(f"{r['tasks']:>9} | {r['policy']:<13} | {r['build']:>8.3f} | {r['schedule']:>10.3f} | "
                  f"{r['serialize']:>11.3f} | {r['total']:>8.3f} | {r['us_per_task']:>8.2f} | {r['gc']:>6.3f} | "
                  f"{r['rss']:>12.2f}", flush=True)
        gc.collect()  # free the last graph (its tensors and the graph refer to each other) before the next


if __name__ == "__main__":
    main()
