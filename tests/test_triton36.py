"""The GPU machine's stack: its image has triton 3.6 (torch 2.11), not the 3.9 these tests run under, and
no package registry, so what ``bench/gpu_check.py`` needs is checked here under a second virtual
environment holding ``triton==3.6.0`` (``.ci/run`` makes it): the ahead-of-time tests with that Triton's
compiler (its ptxas, its spin protocol), and the interpreter path of the check's sections that run
every tile and the cross-rank signals."""
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv36" / "bin" / "python"
SETUP = ("python3 -m venv .venv36 && .venv36/bin/pip install torch==2.13.0 && "
         ".venv36/bin/pip install -e '.[test]' triton==3.6.0 'numpy<2.4'")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def python36() -> Path:
    if not PYTHON.exists():
        if os.environ.get("MEGAKERNEL_REQUIRE_TRITON36"):  # CI: the environment must be there
            pytest.fail(f"{PYTHON} is missing; make it with: {SETUP}")
        pytest.skip(f"no triton 3.6 environment; make it with: {SETUP}")
    version = subprocess.run([str(PYTHON), "-c", "import triton; print(triton.__version__)"], capture_output=True,
                             text=True, timeout=120, cwd=ROOT).stdout.strip()
    assert version.startswith("3.6."), version
    return PYTHON


def run(python: Path, *args: str, timeout: int) -> str:
    """``python args`` in the checkout; its output, and a failure with the output's tail if it fails.
    ``timeout`` stays under the test's own (pytest-timeout's 600 s), so the child is the one killed."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST_", "TRITON_", "MEGAKERNEL_")) or k == "MEGAKERNEL_REQUIRE_NVSHMEM"}
    done = subprocess.run([str(python), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


def test_the_ahead_of_time_tests_pass_under_triton_36(python36):
    """Every fast-tier compile test (sm_90 and gfx942, the H200's target among them) with 3.6's compiler."""
    output = run(python36, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "aot and not slow",
                 "tests/test_aot.py", timeout=540)
    assert " passed" in output and " failed" not in output


def test_the_gpu_checks_interpreter_path_runs_under_triton_36(python36):
    """The check's every-task-type section (every tile under 3.6's interpreter against the reference
    executor) and its virtual ranks (puts, signals and an all-reduce between two ranks), on the cpu backend."""
    output = run(python36, "bench/gpu_check.py", "--smoke", "--only", "types,virtual", timeout=540)
    assert "triton 3.6." in output
    rows = [line for line in output.splitlines() if line.startswith("| ") and not line.startswith("| check")]
    assert any("task types" in row and row.rstrip().endswith("| yes |") for row in rows), rows
    assert any("all_reduce" in row and row.rstrip().endswith("| yes |") for row in rows), rows
    assert not any(row.rstrip().endswith("| NO |") for row in rows), rows
