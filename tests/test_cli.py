"""The ``megakernel`` command line, run as a user would."""
import subprocess
import sys

import numpy as np

from megakernel.image import load
from megakernel.scheduler import serialize


def megakernel(*args, timeout=300):
    result = subprocess.run([sys.executable, "-m", "megakernel.tools.cli", *args], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_demo_then_disasm_execute(tmp_path):
    out = megakernel("demo", "--steps", "2", "--out", str(tmp_path))
    assert "step 1:" in out and "max relative error" in out
    image = tmp_path / "kernel.npz"
    listing = megakernel("disasm", str(image), "--execute")
    assert "megakernel task table v1" in listing and "worker 1:" in listing
    # --execute prints the reference executor's output: it must match the image's tables run here
    loaded = load(image)
    from megakernel.reference import execute
    execute(loaded.tables, loaded.heap)
    assert f"sum {loaded.output('y').double().sum().item():.6g}" in listing


def test_disasm_round_trips_a_bare_table(tmp_path):
    image = load(_demo_image(tmp_path))
    path = tmp_path / "tables.mkt"
    path.write_bytes(serialize(image.tables))
    listing = megakernel("disasm", str(path))
    assert f"{len(image.tables.tasks)} tasks" in listing
    assert np.array_equal(load(path).tables.tasks, image.tables.tasks)


def _demo_image(tmp_path):
    megakernel("demo", "--steps", "1", "--out", str(tmp_path))
    return tmp_path / "kernel.npz"


def test_aot_command():
    out = megakernel("aot", "--target", "gfx942")
    assert "gfx942: hsaco" in out
