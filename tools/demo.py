"""The main job on the cpu backend: a Llama MLP block as one persistent kernel, run step after step."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from .. import Megakernel
from .examples import mlp_block


def _reference(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    d = {k: v.double() for k, v in inputs.items()}
    h = torch.nn.functional.rms_norm(d["x"], d["norm"].shape, d["norm"], 1e-6)
    act = torch.nn.functional.silu(h @ d["gate"].T) * (h @ d["up"].T)
    return d["x"] + act @ d["down"].T


def main(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    graph = mlp_block()
    t0 = time.perf_counter()
    with Megakernel(graph, workers=args.workers) as kernel:
        print(f"built: {len(graph.tasks)} tasks, {kernel.tables.events} events on {args.workers} workers "
              f"in {time.perf_counter() - t0:.2f} s; kernel source {kernel.kernel_path}")
        generator = torch.Generator().manual_seed(0)
        worst = 0.0
        for step in range(args.steps):
            inputs = {name: torch.randn(t.shape, generator=generator) * (0.1 if t.ndim == 2 and name != "x" else 1)
                      for name, t in graph.inputs.items()}
            t0 = time.perf_counter()
            y = kernel.run(inputs)["y"]
            elapsed = time.perf_counter() - t0
            error = ((y.double() - _reference(inputs)).abs().max() / _reference(inputs).abs().max()).item()
            worst = max(worst, error)
            print(f"step {step}: {elapsed * 1e3:.1f} ms, {len(graph.tasks)} tasks, max relative error {error:.2e}")
        kernel.save_image(out / "kernel.npz")
        print(f"kernel image: {out / 'kernel.npz'} (megakernel disasm {out / 'kernel.npz'} --execute)")
    if worst > 1e-4:
        print("FAILED: the kernel disagrees with torch in float64")
        return 1
    return 0
