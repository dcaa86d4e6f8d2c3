"""How long a GPU process waits for its first kernel: SmolLM2-135M's decode step compiled ahead of time, from
cold caches and from warm ones (issue 57).

    python bench/cold_start.py [--targets sm_90,gfx942]

For each target, in processes of their own (nothing kept in memory between them): the checkpoint read (its
GGUF file, as ``from_pretrained`` reads a rank's share), the step's graph built from its config (528 workers:
an H100's 132 SMs x 4 programs), its kernel's source generated (``codegen``: ``mk_<hash>.py`` in MEGAKERNEL_CACHE_DIR)
and compiled by Triton (its cache, TRITON_CACHE_DIR, keyed by the source and options); first with both
caches empty, then again with what the first run left in them, as a second process of a machine would.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

WORKERS = 528


def child(target: str) -> dict[str, float]:
    """The seconds of each stage of one process's first kernel for ``target``."""
    start = time.perf_counter()
    from helpers import smollm2_path  # the tests' checkpoint

    from megakernel import Graph
    from megakernel.aot import triton_compiled
    from megakernel.models.decoder import decode_step
    from megakernel.models.gguf import build_gguf
    from megakernel.models.serving_config import ServingConfig
    imported = time.perf_counter()
    config = build_gguf(Path(smollm2_path()), ServingConfig(max_batch=8, max_seq_len=2048)).config
    read = time.perf_counter()
    graph = decode_step(config, Graph(world_size=1, rank=0, parallelism=WORKERS))
    built = time.perf_counter()
    triton_compiled(graph.specs, target, row_words=16)
    compiled = time.perf_counter()
    return {"import": imported - start, "checkpoint": read - imported, "graph": built - read,
            "compile": compiled - built, "tasks": len(graph.tasks.opcode), "opcodes": len(graph.specs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--targets", default="sm_90,gfx942")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    import torch
    import triton
    print(f"# bench/cold_start.py: torch {torch.__version__}, triton {triton.__version__}, python "
          f"{sys.version.split()[0]}, {os.cpu_count()} cores")
    print("| target | caches | import s | checkpoint s | graph s | codegen + compile s | total s |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for target in args.targets.split(","):
        with tempfile.TemporaryDirectory() as caches:
            env = os.environ | {"MEGAKERNEL_CACHE_DIR": f"{caches}/megakernel", "TRITON_CACHE_DIR": f"{caches}/triton"}
            for which in ("cold", "warm"):
                done = subprocess.run([sys.executable, __file__, "--child", target], env=env, capture_output=True,
                                      text=True, check=True)
                t = json.loads(done.stdout.strip().splitlines()[-1])
                stages = [t[stage] for stage in ("import", "checkpoint", "graph", "compile")]
                print(f"| {target} ({t['tasks']} tasks, {t['opcodes']} opcodes) | {which} | "
                      + " | ".join(f"{x:.2f}" for x in stages) + f" | {sum(stages):.2f} |", flush=True)


if __name__ == "__main__":
    main()
