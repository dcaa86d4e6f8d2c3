"""Cross-rank communication inside one launch on the cpu backend: signal latency and all_reduce time.

Latency: a chain of put tiles in which every step forwards the value the peer put in the step
before, so step i cannot start before the peer's step i-1 has stored and signalled. Both ranks run
the chain; the time per step is one hop (store, release signal, acquire wait, next tile), and a
round trip is two hops. The per-step time is the slope between a short and a long chain, so launch
and host costs cancel.

All-reduce: one launch per measurement, the median of several, for each size and algorithm.

On the cpu backend every tile runs in the Triton interpreter and every worker is a process: the
absolute numbers describe the interpreter, not a GPU.

Across nodes (``--nodes``): the same chain with each rank on a node of its own (``launch(...,
ranks_per_node=1)``: the put and its signal go through the transport, gloo point-to-point and a progress
agent per rank) beside one node, in one run; and SmolLM2-135M (its GGUF file) decoding at TP 4 over 2
nodes x 2 ranks on the torch backend beside one node of 4: the bytes and messages each rank sends over
the network per decode step (from the transport's channels, fixed when the kernel is built) and tokens/s.

    python bench/comm.py [--world 2] [--workers 1] [--nodes]
"""
from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

import megakernel as mk
from megakernel.serving import from_pretrained

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import SMOLLM2_PROMPT, smollm2_path  # noqa: E402  (the tests' checkpoint)

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


def _latency_job(workers: int) -> dict:
    return latency(workers)


def _smollm2_job(tokens: int, prefill_chunk: int | None) -> dict:
    model = from_pretrained(smollm2_path(), max_seq_len=64, backend="torch", workers=1, prefill_chunk=prefill_chunk)
    try:
        model.generate(SMOLLM2_PROMPT, 2)  # compiles and warms the workers
        start = time.perf_counter()
        out = model.generate(SMOLLM2_PROMPT, tokens)
        seconds = time.perf_counter() - start
        transport = model.kernel.transport
        return {"tokens": out[0].tolist(), "tokens_per_s": tokens / seconds,
                "bytes": transport.step_bytes() if transport else 0, "messages": transport.step_messages() if transport else 0}
    finally:
        model.close()


def nodes(workers: int, tokens: int = 16) -> None:
    """The cross-node rows: a hop through memory and through the transport; SmolLM2 at TP 4 on 1 and 2 nodes."""
    hops = {name: mk.launch(functools.partial(_latency_job, workers), world_size=2, ranks_per_node=per_node,
                            timeout=1800)[0] for name, per_node in (("memory (one node)", None), ("gloo (two nodes)", 1))}
    print("| put chain, 2 ranks | one hop (us) | round trip (us) |")
    print("| --- | ---: | ---: |")
    for name, lat in hops.items():
        print(f"| {name} | {lat['hop_us']:.0f} | {lat['round_trip_us']:.0f} |")
    print()
    cases = [(per_node, chunk) for chunk in (None, 0) for per_node in (None, 2)]
    runs = {case: mk.launch(functools.partial(_smollm2_job, tokens, case[1]), world_size=4, ranks_per_node=case[0],
                            backend="torch", timeout=1800) for case in cases}
    same = all(r["tokens"] == runs[cases[0]][0]["tokens"] for rs in runs.values() for r in rs)
    print(f"SmolLM2-135M (GGUF as stored), TP 4, torch backend, 1 worker a rank, {tokens} greedy tokens; "
          f"same tokens: {same}")
    print("| ranks | prefill rows | network bytes / step / rank | messages / step / rank | tokens/s |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (per_node, chunk), results in runs.items():
        print(f"| {'2 nodes x 2' if per_node else '1 node x 4'} | {'default' if chunk is None else chunk} | "
              f"{max(r['bytes'] for r in results):,} | {max(r['messages'] for r in results)} | "
              f"{results[0]['tokens_per_s']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--nodes", action="store_true", help="the cross-node rows instead")
    args = parser.parse_args()
    if args.nodes:
        return nodes(args.workers)
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
