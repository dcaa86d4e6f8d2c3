"""What ordering a step's requests that share KV pages costs (issue 56): ``DecodeModel.run_scheduled``
runs a request that reads a position another request of the step writes after it, in a launch of its own
(``serving.pages.waves``), rather than making every step's graph wait for it.

    python bench/scheduled.py [--repeats 5]

SmolLM2-135M (its GGUF file, as stored) on the torch backend, pages of 16 positions: a step of two
requests, A (one page of prompt tokens) and B (10 more tokens), where B's block table starts on A's page
(a prefix cache handing out A's page in the step that computes it: two waves), against the same step
with B on pages of its own (no sharing: one wave), and a step of A alone. Wall time of each step, best of
``--repeats``, taken in turns so that the machine's load hits each alike.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import smollm2_path  # noqa: E402  (the tests' checkpoint)

from megakernel.serving import from_pretrained  # noqa: E402
from megakernel.serving.compiled import Scheduled  # noqa: E402

PAGE = 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model = from_pretrained(smollm2_path(), max_seq_len=64, max_batch=2, page_size=PAGE, kv_pages=16,
                            prefill_chunk=32, backend="torch")
    a, b = torch.randint(100, 20000, (PAGE,)), torch.randint(100, 20000, (10,))
    steps = {"A alone": [Scheduled(a, 0, torch.tensor([0]))],
             "A and B, B on A's page (2 waves)": [Scheduled(a, 0, torch.tensor([0])),
                                                  Scheduled(b, PAGE, torch.tensor([0, 1]))],
             "A and B, pages of their own (1 wave)": [Scheduled(a, 0, torch.tensor([2])),
                                                      Scheduled(b, PAGE, torch.tensor([3, 4]))]}
    best = {name: float("inf") for name in steps}
    try:
        for _ in range(args.repeats):
            for name, requests in steps.items():
                start = time.perf_counter()
                model.run_scheduled(requests)
                best[name] = min(best[name], time.perf_counter() - start)
    finally:
        model.close()
    base = best["A and B, pages of their own (1 wave)"]
    print(f"# bench/scheduled.py: torch {torch.__version__}, best of {args.repeats}")
    print("| step | ms | vs one wave |\n| --- | ---: | ---: |")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {seconds / base:.2f}x |")


if __name__ == "__main__":
    main()
