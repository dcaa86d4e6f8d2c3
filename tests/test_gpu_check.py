"""bench/gpu_check.py stays runnable: its --smoke mode runs every section, small, on the torch backend (the
script's logic; the tiles and the persistent loop it launches on a GPU are proven under the interpreter
by the other tests)."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the GPU check's smoke run

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"


@pytest.mark.timeout(900)
def test_gpu_check_smoke_runs_every_section_and_passes_its_checks():
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--backend", "torch"], capture_output=True,
                          text=True, timeout=840)
    table = done.stdout[done.stdout.index("| check |"):]
    assert done.returncode == 0, f"gpu_check failed:\n{table}\n{done.stderr[-4000:]}"
    for row in ("task types", "decode, random Llama", "layer 128x256 bf16", "dispatch: empty tasks",
                "virtual ranks: put chains written", "virtual ranks: all_reduce"):
        assert row in table, f"no row {row!r} in\n{table}"
    assert "dispatch: empty tasks" in table.split("[spin protocol]")[0] and "| virtual ranks: signal round trip " \
        "(2 puts + waits) [spin protocol] |" in table, "the old protocol's rows are there to compare"
    assert "FAILED" not in table and "| NO |" not in table, table
