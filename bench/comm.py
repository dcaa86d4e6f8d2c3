"""Cross-rank communication inside one launch on the cpu backend: signal latency and all_reduce time.

Latency: a chain of put tiles in which every step forwards the value the peer put in the step
before, so step i cannot start before the peer's step i-1 has stored and signalled. Both ranks run
the chain; the time per step is one hop (store, release signal, acquire wait, next tile), and a
round trip is two hops. The per-step time is the slope between a short and a long chain, so launch
and host costs cancel.

All-reduce: one launch per measurement, the median of several, for each size and algorithm.

On the cpu backend every tile runs in the Triton interpreter and every worker is a process: the
absolute numbers describe the interpreter, not a GPU.

    python bench/comm.py [--world 2] [--workers 1]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch

import megakernel as mk

SHORT, LONG = 4, 36
SIZES = (256, 4096, 65536, 262144)  # bytes of float32


def _chain(steps: int) -> mk.Graph:
    g = mk.Graph()
    peer = (g.rank + 1) % g.world_size
    x = g.input("x", (1, 8), torch.float32)
    for i in range(steps):
        x = g.put(x, to_rank=peer, into=g.new_tensor((1, 8), torch.float32, name=f"hop{i}", comm=True))
    g.output("y", g.add(x, x))
    return g


def _timed_runs(kernel: mk.Megakernel, inputs: dict, repeats: int) -> float:
    kernel.run(inputs)  # first run: imports and caches in the workers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        kernel.run(inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def latency(workers: int, repeats: int = 5) -> dict:
    times = {}
    for steps in (SHORT, LONG):
        with mk.Megakernel(_chain(steps), workers=workers) as kernel:
            times[steps] = _timed_runs(kernel, {"x": torch.randn(1, 8)}, repeats)
    hop = (times[LONG] - times[SHORT]) / (LONG - SHORT)
    return {"hop_us": hop * 1e6, "round_trip_us": 2 * hop * 1e6, "short_s": times[SHORT], "long_s": times[LONG]}


def all_reduce(workers: int, repeats: int = 3) -> list[dict]:
    rows = []
    for size in SIZES:
        cols = size // 4
        for algorithm in ("one_shot", "two_shot"):
            g = mk.Graph()
            x = g.input("x", (1, cols), torch.float32)
            g.output("y", g.all_reduce(x, algorithm=algorithm))
            with mk.Megakernel(g, workers=workers) as kernel:
                seconds = _timed_runs(kernel, {"x": torch.randn(1, cols)}, repeats)
            rows.append({"bytes": size, "algorithm": algorithm, "tasks": len(g.tasks), "ms": seconds * 1e3})
    return rows


def _job(workers: int) -> dict:
    return {"latency": latency(workers), "all_reduce": all_reduce(workers)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    result = mk.launch(functools.partial(_job, args.workers), world_size=args.world, timeout=1800)[0]
    lat = result["latency"]
    print(f"# cpu backend (Triton interpreter), world {args.world}, {args.workers} worker(s) per rank; rank 0's view")
    print(f"put chain: {SHORT} hops {lat['short_s'] * 1e3:.1f} ms, {LONG} hops {lat['long_s'] * 1e3:.1f} ms per launch")
    print(f"one hop (store + signal + wait + next tile): {lat['hop_us']:.0f} us; round trip {lat['round_trip_us']:.0f} us")
    print()
    print("| bytes | algorithm | tasks per rank | time per launch (ms) |")
    print("| ---: | --- | ---: | ---: |")
    for row in result["all_reduce"]:
        print(f"| {row['bytes']:,} | {row['algorithm']} | {row['tasks']} | {row['ms']:.1f} |")


if __name__ == "__main__":
    main()
