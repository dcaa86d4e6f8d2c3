"""What tracing costs: one graph run with ``trace=False`` and ``trace=True``, median time per run and the ratio.

    python bench/trace_overhead.py [--layers 4] [--workers 2] [--runs 7]

The graph is a stack of decoder-like MLP blocks (RMSNorm, gate and up projections, SiLU-mul, down
projection, residual add; fp32, one token). Both kernels are built first; then their runs alternate
(off, on, off, on, ...) so that drift in the machine's load hits both alike, after one warm-up run
each. A traced run includes everything ``run`` does for the trace: three clock reads and stores per
task in the kernel, and turning the stamps into ``kernel.trace`` on the host. On the cpu backend
(the Triton interpreter) this is a CPU number, not a GPU one.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import megakernel as mk

HIDDEN, INTERMEDIATE = 128, 320


def mlp_stack(layers: int) -> mk.Graph:
    """``layers`` Llama MLP blocks, each feeding the next through its residual."""
    g = mk.Graph(world_size=1, rank=0)
    x = g.input("x", (1, HIDDEN), torch.float32)
    for i in range(layers):
        norm = g.input(f"norm{i}", (HIDDEN,), torch.float32)
        gate = g.input(f"gate{i}", (INTERMEDIATE, HIDDEN), torch.float32)
        up = g.input(f"up{i}", (INTERMEDIATE, HIDDEN), torch.float32)
        down = g.input(f"down{i}", (HIDDEN, INTERMEDIATE), torch.float32)
        h = g.rms_norm(x, norm, 1e-6)
        x = g.add(x, g.linear(g.silu_mul(g.linear(h, gate), g.linear(h, up)), down))
    g.output("y", x)
    return g


def timed_runs(kernels: dict[bool, mk.Megakernel], runs: int) -> dict[bool, list[float]]:
    """Seconds per run of each kernel, runs alternating between them, after one warm-up run each."""
    times: dict[bool, list[float]] = {flag: [] for flag in kernels}
    for kernel in kernels.values():
        kernel.run()
    for _ in range(runs):
        for flag, kernel in kernels.items():
            start = time.perf_counter()
            kernel.run()
            times[flag].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    g = mlp_stack(args.layers)
    generator = torch.Generator().manual_seed(0)
    inputs = {name: torch.randn(t.shape, generator=generator) * 0.1 for name, t in g.inputs.items()}
    kernels = {flag: mk.Megakernel(g, workers=args.workers, trace=flag) for flag in (False, True)}
    try:
        for kernel in kernels.values():
            kernel.bind(inputs)
        times = timed_runs(kernels, args.runs)
        assert len(kernels[True].trace.spans) == len(g.tasks)
    finally:
        for kernel in kernels.values():
            kernel.close()
    off, on = (statistics.median(times[flag]) for flag in (False, True))
    print(f"{args.layers} MLP blocks (hidden {HIDDEN}, intermediate {INTERMEDIATE}), {len(g.tasks)} tasks, "
          f"{args.workers} workers, cpu backend; median of {args.runs} runs each\n")
    print("| trace | median ms/run | min ms | max ms |")
    print("| --- | ---: | ---: | ---: |")
    for flag, median in ((False, off), (True, on)):
        print(f"| {'on' if flag else 'off'} | {median * 1e3:.1f} | {min(times[flag]) * 1e3:.1f} | "
              f"{max(times[flag]) * 1e3:.1f} |")
    print(f"\non/off: {on / off:.3f}x ({(on - off) / len(g.tasks) * 1e6:+.1f} us per task)")


if __name__ == "__main__":
    main()
