"""The main job: a small random Llama, greedy generation tensor-parallel over 2 ranks on the cpu backend (the
Triton tiles under the interpreter; ``--backend torch``: the tiles as torch code), the prompt and every new
token in one megakernel launch per rank (the tokens sampled on the device), checked against
``transformers``' own ``generate``; the trace of the last step is written for Perfetto."""
from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from .. import launch
from ..serving import from_hf

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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompt = torch.randint(0, CONFIG["vocab_size"], (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = random_llama().generate(prompt, max_new_tokens=args.tokens, do_sample=False, pad_token_id=0)
    print(f"random Llama: {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, "
          f"{CONFIG['num_attention_heads']} heads / {CONFIG['num_key_value_heads']} KV heads; "
          f"tensor parallel over {args.ranks} ranks x {args.workers} workers ({args.backend} backend)")
    start = time.perf_counter()
    results = launch(functools.partial(_rank_job, prompt, args.tokens, args.workers, str(out)),
                     world_size=args.ranks, backend=args.backend, timeout=1800)
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
