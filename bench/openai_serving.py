"""The servers under vLLM's own serving benchmark client (``vllm.benchmarks.serve``, a client nobody here
wrote): vLLM's OpenAI server with its own model, the same server with ``MegakernelForCausalLM``, and
``megakernel serve --backend torch``, on the same float32 SmolLM2 checkpoint, one server at a time.

    .venv-vllm/bin/python bench/openai_serving.py [--prompts 16] [--input-len 64] [--output-len 48]
                                                  [--megakernel-python .venv/bin/python] [--checkpoint DIR]
                                                  [--only 0 1 2] [--repeats 2]

Each server gets ``--max-batch``-sized batches (vLLM's ``max_num_seqs``, megakernel's ``--max-batch``: 8)
and serves the client's random dataset (``--input-len`` prompt tokens, ``--output-len`` tokens each with
``ignore_eos``, ``/v1/completions``), at 1 and at 8 concurrent requests, ``--repeats`` times each in turns,
the best kept (runs of one server at 8 vary by ~10% with the order in which the first requests reach it).
Reported: output tokens/s, mean time to first token and mean time per output token after the first, as the
client measures them, of the best run; the others' tokens/s beside it.
``megakernel serve`` runs in the project's environment (``--megakernel-python``: it needs fastapi and
uvicorn, not vLLM), vLLM's servers in this one (enforce_eager, as ``bench/vllm.py``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

NAME = "smollm2"  # the served model's name, in every server
OVERRIDE = json.dumps({"architectures": ["MegakernelForCausalLM"]})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def servers(args) -> dict[str, list[str]]:
    """Each server's command, without its port."""
    vllm = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.checkpoint,
            "--served-model-name", NAME, "--dtype", "float32", "--max-model-len", "512",
            "--max-num-seqs", str(args.max_batch), "--enforce-eager"]
    return {"vLLM's own model": vllm,
            "vLLM + MegakernelForCausalLM": [*vllm, "--hf-overrides", OVERRIDE],
            "megakernel serve --backend torch": [args.megakernel_python, "-m", "megakernel.tools.cli", "serve",
                                                 args.checkpoint, "--backend", "torch", "--name", NAME,
                                                 "--max-batch", str(args.max_batch), "--max-seq-len", "512"]}


def started(command: list[str], port: int, log) -> subprocess.Popen:
    """The server, once ``GET /health`` says 200 (megakernel's: the model compiled)."""
    server = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"{command[:4]} exited with {server.returncode}; its log: {log.name}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return server
        except OSError:
            time.sleep(1)
    stop(server)
    raise SystemExit(f"{command[:4]} did not answer within 600 s; its log: {log.name}")


def stop(server: subprocess.Popen) -> None:
    with_children = os.getpgid(server.pid)
    os.killpg(with_children, signal.SIGTERM)
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(with_children, signal.SIGKILL)
        server.wait()


def measure(args, port: int, concurrency: int) -> dict:
    """vLLM's client against the server on ``port``: its result (output_throughput, mean_ttft_ms, ...)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    client = parser.parse_args([
        "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
        "--model", args.checkpoint, "--served-model-name", NAME, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len), "--ignore-eos",
        "--num-prompts", str(args.prompts), "--max-concurrency", str(concurrency), "--seed", "0",
        "--disable-tqdm"])
    return main(client)


def main_() -> None:
    # run as a script, this folder is first on sys.path, where bench/vllm.py would hide vLLM's package
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--megakernel-python", default=os.path.join(".venv", "bin", "python"))
    parser.add_argument("--checkpoint", help="a checkpoint folder (default: SmolLM2's GGUF file, converted)")
    parser.add_argument("--only", type=int, nargs="*", help="the servers to run, by their number above (0, 1, 2)")
    parser.add_argument("--repeats", type=int, default=2, help="runs at each concurrency, in turns; the best is kept")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        if args.checkpoint is None:
            spec = importlib.util.spec_from_file_location("vllm_bench", os.path.join(os.path.dirname(__file__),
                                                                                    "vllm.py"))
            vllm_bench = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(vllm_bench)
            args.checkpoint = vllm_bench.smollm2_folder(scratch)
        for number, (name, command) in enumerate(servers(args).items()):
            if args.only is not None and number not in args.only:
                continue
            port = free_port()
            with open(os.path.join(tempfile.gettempdir(), f"openai_serving.{port}.log"), "w") as log:
                server = started(command, port, log)
                try:
                    measure(args, port, 1)  # warm-up: compiles, first launches
                    runs = {c: [] for c in (1, 8)}
                    for _ in range(args.repeats):
                        for c in runs:
                            runs[c].append(measure(args, port, c))
                    rows.append((name, runs))
                finally:
                    stop(server)
    print(f"\nSmolLM2-135M float32, vLLM's serving benchmark client: {args.prompts} random prompts of "
          f"{args.input_len} tokens, {args.output_len} tokens each (ignore_eos), /v1/completions")
    print("| server | concurrency | output tokens/s, best | mean TTFT, ms | mean TPOT, ms | every run's tokens/s |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, runs in rows:
        for concurrency, results in runs.items():
            r = max(results, key=lambda result: result["output_throughput"])
            every = ", ".join(f"{result['output_throughput']:.1f}" for result in results)
            print(f"| {name} | {concurrency} | {r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} | "
                  f"{r['mean_tpot_ms']:.0f} | {every} |")


if __name__ == "__main__":
    main_()
