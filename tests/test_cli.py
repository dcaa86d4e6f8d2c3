"""The ``megakernel`` command line, run as a user would."""
import os
import socket
import subprocess
import sys
import uuid

import numpy as np

from helpers import marked_processes
from megakernel.image import load
from megakernel.scheduler import serialize


def megakernel(*args, timeout=300):
    result = subprocess.run([sys.executable, "-m", "megakernel.tools.cli", *args], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_demo_answers_with_smollm2_as_transformers_does():
    out = megakernel("demo", "--tokens", "8")
    assert "the megakernel on the torch backend" in out and "question: Name three colours" in out
    assert "tokens identical to transformers'" in out and "FAILED" not in out
    ours, theirs = (line.split(": ", 1)[1] for line in out.splitlines() if line.startswith(("megakernel ", "transformers ")))
    assert ours == theirs and len(ours) > 4


def test_demo_generates_what_transformers_generates(tmp_path):
    """The tensor-parallel demo on the torch backend (its interpreter run, the default, is the decode tests'
    tiles over ranks: tests/test_decode.py)."""
    out = megakernel("demo", "--tensor-parallel", "--tokens", "2", "--out", str(tmp_path), "--backend", "torch")
    assert "(torch backend)" in out
    assert "tokens identical to transformers on every rank" in out and "7 steps" in out and "in 1 launch per rank" in out
    from megakernel.trace import Trace
    trace = Trace.load(tmp_path / "trace.json")
    assert {s.rank for s in trace.spans} == {0, 1} and any(s.comm for s in trace.spans)
    image = load(tmp_path / "kernel-rank0.npz")
    assert (image.tables.rank, image.tables.world_size) == (0, 2)
    assert "megakernel task table v3" in megakernel("disasm", str(tmp_path / "kernel-rank0.npz"))


def test_disasm_execute_runs_the_reference_executor(tmp_path):
    import torch

    import megakernel as mk
    from megakernel.reference import execute
    from megakernel.tools.examples import mlp_block

    g = mlp_block()
    with mk.Megakernel(g, workers=2) as kernel:
        kernel.bind({name: torch.randn(t.shape) * 0.2 for name, t in g.inputs.items()})
        kernel.save_image(tmp_path / "kernel.npz")
    listing = megakernel("disasm", str(tmp_path / "kernel.npz"), "--execute")
    assert "megakernel task table v3" in listing and "worker 1:" in listing
    # --execute prints the reference executor's output: it must match the image's tables run here
    loaded = load(tmp_path / "kernel.npz")
    execute(loaded.tables, loaded.heap)
    assert f"sum {loaded.output('y').double().sum().item():.6g}" in listing


def test_disasm_round_trips_a_bare_table(tmp_path):
    image = load(_mlp_image(tmp_path))
    path = tmp_path / "tables.mkt"
    path.write_bytes(serialize(image.tables))
    listing = megakernel("disasm", str(path))
    assert f"{len(image.tables.rows)} tasks" in listing
    assert np.array_equal(load(path).tables.rows, image.tables.rows)


def _mlp_image(tmp_path):
    import megakernel as mk
    from megakernel.tools.examples import mlp_block

    with mk.Megakernel(mlp_block(), workers=2) as kernel:
        kernel.save_image(tmp_path / "kernel.npz")
    return tmp_path / "kernel.npz"


def test_aot_command():
    out = megakernel("aot", "--target", "gfx942")
    assert "gfx942: hsaco" in out


def test_serve_refuses_what_is_not_a_model_in_one_line(tmp_path, capsys):
    from megakernel.tools.cli import main
    (tmp_path / "notes.txt").write_text("not a model")
    for model in (tmp_path / "absent", tmp_path / "notes.txt"):  # refused before anything loads: in this process
        assert main(["serve", str(model)]) == 2
        assert "not a checkpoint directory or a .gguf file" in capsys.readouterr().err
    result = subprocess.run([sys.executable, "-m", "megakernel.tools.cli", "serve", str(tmp_path), "--port", "0"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "no config.json" in result.stderr and "Traceback" not in result.stderr


def _serve_fails(tmp_path, *options: str) -> str:
    """``megakernel serve`` of a folder that is no model, with ``options``: it must exit 1 within seconds
    with one line, and leave no process of its own behind (found by a mark in their environment)."""
    mark = f"MEGAKERNEL_TEST_MARK={uuid.uuid4().hex}"
    env = {**os.environ, "MEGAKERNEL_TEST_MARK": mark.split("=")[1]}
    result = subprocess.run([sys.executable, "-m", "megakernel.tools.cli", "serve", str(tmp_path), *options],
                            capture_output=True, text=True, timeout=120, env=env)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert not marked_processes(mark), "processes left behind"
    return lines[0]


def test_serve_exits_in_one_line_when_it_cannot_listen(tmp_path):
    """A port in use, a host that is no address: refused before anything loads (the socket is bound first)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        line = _serve_fails(tmp_path, "--port", str(port))
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line, line
    line = _serve_fails(tmp_path, "--host", "256.1.1.1", "--port", "0")
    assert "cannot listen on 256.1.1.1:0" in line, line
    for bad in (["--port", "70000"], ["--port", "-1"], ["--idle-timeout", "nan"], ["--max-request-bytes", "0"]):
        result = subprocess.run([sys.executable, "-m", "megakernel.tools.cli", "serve", str(tmp_path), *bad],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and f"argument {bad[0]}" in result.stderr, (bad, result.stderr)


def test_serve_over_ranks_exits_in_one_line_when_a_rank_cannot_load(tmp_path):
    line = _serve_fails(tmp_path, "--tp", "2", "--backend", "torch", "--port", "0")
    assert "no config.json" in line and "rank" in line, line


def test_serve_runs_the_fast_path_by_default(monkeypatch):
    """``megakernel serve`` without ``--backend``: the GPU where there is one, else the torch backend (not the
    interpreter, which runs only when asked for)."""
    from megakernel.tools import serve
    monkeypatch.setattr(serve, "gpu_flavour", lambda: None)
    assert serve.server_backend("auto") == "torch" and serve.server_backend("cpu") == "cpu"
    monkeypatch.setattr(serve, "gpu_flavour", lambda: "cuda")
    assert serve.server_backend("auto") == "cuda" and serve.server_backend("torch") == "torch"


def test_serve_dtype_reaches_the_loader(tmp_path, monkeypatch):
    """``megakernel serve --dtype bfloat16``: the checkpoint read in that dtype (``from_pretrained(dtype=...)``,
    tested on SmolLM2 in test_checkpoints); "auto" keeps what the checkpoint stores."""
    import torch
    from megakernel.tools import cli, serve
    asked = []
    monkeypatch.setattr(serve, "from_pretrained", lambda *args, **kwargs: asked.append(kwargs["dtype"]))
    monkeypatch.setattr(serve, "serve", serve.load_model)
    (tmp_path / "model.gguf").write_bytes(b"")
    for given in (["--dtype", "bfloat16"], []):
        cli.main(["serve", str(tmp_path / "model.gguf"), *given])
    assert asked == [torch.bfloat16, None]
