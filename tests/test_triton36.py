"""The GPU machine's image, rehearsed: it has triton 3.6 (torch 2.11), not the 3.9 these tests run under,
numpy 2.5, no package registry and no install of the project (only the working tree travels, commands run
from its root). ``.ci/run`` makes ``.venv36`` like it (triton 3.6.0, the newest numpy this Python takes,
the image's packages, the project not installed), and these tests run a bare copy of the tree there, as
the device tool copies it: ``bench/gpu_check.py``'s own command (``--smoke``, on both host backends) and
the ahead-of-time tests with 3.6's compiler (its ptxas, its spin protocol)."""
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv36" / "bin" / "python"
SETUP = ("python3 -m venv .venv36 && .venv36/bin/pip install torch==2.13.0 && .venv36/bin/pip install triton==3.6.0 "
         "numpy pytest pytest-timeout transformers accelerate safetensors")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def python36() -> Path:
    if not PYTHON.exists():
        if os.environ.get("MEGAKERNEL_REQUIRE_TRITON36"):  # CI: the environment must be there
            pytest.fail(f"{PYTHON} is missing; make it with: {SETUP}")
        pytest.skip(f"no triton 3.6 environment; make it with: {SETUP}")
    found = run(PYTHON, "-c", "import importlib.util, numpy, triton; print(triton.__version__, numpy.__version__, "
                              "importlib.util.find_spec('megakernel'))", cwd=Path("/"), timeout=120).split()
    assert found[0].startswith("3.6.") and found[2] == "None", found  # triton 3.6, the project not installed
    return PYTHON


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """The working tree as the device tool carries it: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    copy = tmp_path_factory.mktemp("tree")
    archive = copy / "tree.tar"
    with tarfile.open(archive, "w") as tar:
        for name in filter(None, names):
            if (ROOT / name).is_file():
                tar.add(ROOT / name, arcname=name)
    with tarfile.open(archive) as tar:
        tar.extractall(copy / "tree", filter="data")
    return copy / "tree"


def run(python: Path, *args: str, cwd: Path, timeout: int) -> str:
    """``python args`` in ``cwd``; its output, and a failure with the output's tail if it fails. ``timeout``
    stays under the test's own, so the child is the one killed."""
    return Child(python, args, cwd).output(timeout)


class Child:
    """``python args`` started in ``cwd`` now, in the environment of a bare machine (none of this run's
    pytest, Triton or megakernel settings, nor its virtual environment); ``output`` waits for it."""

    def __init__(self, python: Path, args: tuple[str, ...], cwd: Path):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTEST_", "TRITON_", "MEGAKERNEL_", "PYTHONPATH", "VIRTUAL_ENV"))
               or k == "MEGAKERNEL_REQUIRE_NVSHMEM"}
        self.process = subprocess.Popen([str(python), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, cwd=cwd, env=env)

    def output(self, timeout: float) -> str:
        """Its output once it ended (killed at ``timeout`` seconds from now), and a failure with the output's
        tail if it failed."""
        try:
            output = self.process.communicate(timeout=timeout)[0]
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.communicate()
        assert self.process.returncode == 0, output[-6000:]
        return output


@pytest.fixture(scope="module")
def children(python36, tree):
    """The three runs of this module started together: the compile tests and the two smoke runs take a core
    each for minutes, so side by side they end sooner than one after another. Each test waits for its own."""
    started = {"aot": Child(python36, ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "aot and not slow",
                                       "tests/test_aot.py"), tree)}
    for backend in ("cpu", "torch"):
        started[backend] = Child(python36, ("bench/gpu_check.py", "--smoke", "--backend", backend), tree)
    yield started
    for child in started.values():
        if child.process.poll() is None:
            child.process.kill()
            child.process.communicate()


@pytest.mark.timeout(600)
def test_the_ahead_of_time_tests_pass_under_triton_36(children):
    """Every fast-tier compile test (sm_90 and gfx942, the H200's target among them) with 3.6's compiler."""
    output = children["aot"].output(timeout=540)
    assert " passed" in output and " failed" not in output


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_the_gpu_checks_own_command_runs_on_a_bare_tree_under_triton_36(children, backend):
    """``python bench/gpu_check.py --smoke`` (the docstring's command, small shapes) from the root of the
    copy, every section, on the interpreter's backend (every tile under 3.6's interpreter with the newest
    numpy) and torch's: no row fails."""
    output = children[backend].output(timeout=840)
    assert "triton 3.6." in output
    rows = [line for line in output.splitlines() if line.startswith("| ") and not line.startswith(("| check", "| ---"))]
    assert len(rows) > 20, output[-6000:]
    assert any("task types" in row and row.rstrip().endswith("| yes |") for row in rows), rows
    assert any("all_reduce" in row and row.rstrip().endswith("| yes |") for row in rows), rows
    assert not any(row.rstrip().endswith(("| NO |", "| FAILED |")) for row in rows), rows
