"""What a skeptical user or a hostile file can do: interrupts, threads, closed kernels, bad indices,
integer tensors, killed launchers, a tampered kernel cache, hang reports, oversized graphs, leaked
segments, a rank that never arrives, hostile files for the command line, bad arguments."""
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import megakernel as mk
from helpers import assert_close
from megakernel import codegen, diagnosis
from megakernel import graph as graph_module
from megakernel.backends import largest_heap
from megakernel.bootstrap import Group
from megakernel.backends.cpu import CpuBackend, WorkerPool
from megakernel.errors import BackendError
from megakernel.files import reports_dir
from megakernel.heap import SHM_DIR, SharedHeap
from megakernel.launcher import STORE_PREFIX
from megakernel.scheduler import FormatError, OPCODE, deserialize, infer_dependencies, schedule, serialize
from megakernel.tools.cli import main as cli
from megakernel.trace import Span, Trace


def linear_graph(n: int = 1024, k: int = 2048) -> mk.Graph:
    g = mk.Graph()
    g.output("y", g.linear(g.input("x", (1, k), torch.float32), g.input("w", (n, k), torch.float32)))
    return g


def linear_inputs(seed: int, n: int = 1024, k: int = 2048) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(1, k, generator=gen), "w": torch.randn(n, k, generator=gen)}


def expected(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return inputs["x"].double() @ inputs["w"].double().T


# -- 1. interrupts ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_an_interrupted_run_leaves_the_kernel_and_the_pool_correct(backend):
    """Ctrl-C in the middle of a run (0.3 s into it): the workers are stopped before the interrupt goes
    on, so no late reply is taken for a later run's, of this kernel or of a new one."""
    g = linear_graph(512)
    with mk.Megakernel(g, workers=2) as kernel:
        kernel.run(linear_inputs(0, 512))  # warm: the interrupt lands in a launch, not in a first compile
        timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        # Python's own handler, whatever this process inherited (a shell starts background jobs ignoring SIGINT)
        inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                kernel.run(linear_inputs(1, 512))
                time.sleep(5)  # a run that finished before the signal: let it land here, not elsewhere
        finally:
            timer.cancel()
            signal.signal(signal.SIGINT, inherited)
        inputs = linear_inputs(2, 512)
        kernel.poison()
        assert_close(kernel.run(inputs)["y"], expected(inputs), 1e-5, "the interrupted kernel, next run")
    inputs = linear_inputs(3, 512)
    with mk.Megakernel(linear_graph(512), workers=2) as fresh:
        assert_close(fresh.run(inputs)["y"], expected(inputs), 1e-5, "a new kernel on the same pool")


# -- 2. threads ---------------------------------------------------------------------------------------
def test_kernels_of_several_threads_take_turns_on_the_pool(backend):
    results, errors = {}, []

    def work(name: str, n: int) -> None:
        try:
            with mk.Megakernel(linear_graph(n, 512), workers=2) as kernel:
                for seed in range(3):
                    inputs = linear_inputs(seed, n, 512)
                    results[name, seed] = (kernel.run(inputs)["y"], expected(inputs))
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(f"{name}: {error!r}")

    threads = [threading.Thread(target=work, args=(f"t{i}", 64 * (i + 1))) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a thread is still running after 180 s"
    assert not errors, errors
    assert len(results) == 6
    for key, (out, want) in results.items():
        assert_close(out, want, 1e-5, str(key))


def test_close_from_another_thread_lets_the_run_finish_first():
    g = _specs(1e-6)
    x, w = torch.randn(1, 8), torch.rand(8) + 0.5
    kernel = mk.Megakernel(g, workers=1)
    outcome: dict = {}
    started = threading.Event()

    def run():
        started.set()
        try:
            outcome["y"] = kernel.run({"x": x, "w": w}, steps=40)["y"]
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    started.wait()
    time.sleep(0.2)  # the launch is under way
    kernel.close()   # waits for it
    thread.join(timeout=120)
    assert "error" not in outcome, outcome.get("error")
    want = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert_close(outcome["y"], want, 1e-5, "the run closed under")
    with pytest.raises(mk.BackendError, match="is closed"):
        kernel.run({"x": x, "w": w})


# -- 3. closed kernels --------------------------------------------------------------------------------
CLOSED_SCRIPT = """
import gc, torch, megakernel as mk
g = mk.Graph()
x = g.input("x", (4, 64), torch.float32)
g.output("y", g.add(x, x))
kernel = mk.Megakernel(g, workers=1)
value = torch.randn(4, 64)
kernel.run({"x": value})
view = kernel.tensor(g.outputs["y"])
kernel.close()
try:
    kernel.run({"x": value})
    print("ran after close")
except mk.BackendError as error:
    print("refused:", error)
del kernel
gc.collect()
print("view intact:", bool(torch.equal(view, 2 * value)))
"""


def test_a_closed_kernel_refuses_to_run_and_its_views_stay_valid():
    done = subprocess.run([sys.executable, "-c", CLOSED_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert "refused: this kernel (mk_" in done.stdout and "is closed" in done.stdout, done.stdout
    assert "view intact: True" in done.stdout, done.stdout


# -- 4. data-dependent indices ------------------------------------------------------------------------
def test_a_token_id_past_the_table_is_clamped_and_reported(backend):
    g = mk.Graph()
    tokens = g.input("tokens", (2,), torch.int64)
    table = g.input("table", (4, 32), torch.float32)
    g.input("secret", (4, 32), torch.float32)  # the next buffer: an unchecked id 8 would read it
    g.output("rows", g.embedding(tokens, table))
    values = {"table": torch.randn(4, 32), "secret": torch.full((4, 32), 7.0)}
    with mk.Megakernel(g, workers=1) as kernel:
        with pytest.raises(mk.GraphError, match=r"task 1 \(embedding op 0, embedding\): index 8 is outside \[0, 4\)"):
            kernel.run({"tokens": torch.tensor([1, 8]), **values})
        assert not (kernel.tensor(g.outputs["rows"]) == 7.0).any(), "the neighbouring buffer was read"
        out = kernel.run({"tokens": torch.tensor([3, 0])})["rows"]  # the kernel stays usable
        assert torch.equal(out, values["table"][[3, 0]])
        captured = kernel.capture()  # replays are checked by check(), for every replay since the last
        captured.replay()
        kernel.bind({"tokens": torch.tensor([-1, 2])})
        captured.replay()
        with pytest.raises(mk.GraphError, match=r"launches 3 to 4 \(steps 3 to 4\).*\n.*step 4 task 0 .*index -1 is"):
            kernel.check()
        kernel.bind({"tokens": torch.tensor([2, 1])})
        captured.replay()
        kernel.check()
        assert torch.equal(kernel.tensor(g.outputs["rows"]), values["table"][[2, 1]])


def test_a_position_past_the_cache_writes_nothing_outside_it(backend):
    g = mk.Graph()
    x, pos = g.input("x", (1, 16), torch.float32), g.input("pos", (1,), torch.int64)
    cache = g.input("cache", (4, 16), torch.float32)
    g.input("after", (4, 16), torch.float32)  # what an unchecked position 4 would overwrite
    q = g.input("q", (1, 16), torch.float32)
    g.output("out", g.decode_attention(q, g.kv_append(cache, x, pos, batch=1), cache, pos, batch=1, head_dim=16))
    values = {"x": torch.randn(1, 16), "cache": torch.randn(4, 16), "after": torch.randn(4, 16), "q": torch.randn(1, 16)}
    with mk.Megakernel(g, workers=2) as kernel:
        for bad in (4, 1000, -2):
            with pytest.raises(mk.GraphError, match=rf"kv_append.*index {bad} is outside \[0, 4\)"):
                kernel.run({**values, "pos": torch.tensor([bad])})
            assert torch.equal(kernel.tensor(g.inputs["after"]), values["after"])
            assert torch.equal(kernel.tensor(g.inputs["cache"]), values["cache"]), "no cache row was overwritten"
        out = kernel.run({**values, "pos": torch.tensor([-1])})["out"]  # -1: a row of no sequence, no fault
        assert torch.equal(out, torch.zeros(1, 16)) and torch.equal(kernel.tensor(g.inputs["cache"]), values["cache"])


# -- 5. integer tensors ---------------------------------------------------------------------------------
def test_ops_that_compute_in_float_refuse_integers():
    g = mk.Graph()
    a = g.input("a", (1, 4), torch.int64)
    w = g.input("w", (4, 4), torch.int64)
    for op, call in [("add", lambda: g.add(a, a)), ("mul", lambda: g.mul(a, a)), ("silu_mul", lambda: g.silu_mul(a, a)),
                     ("linear", lambda: g.linear(a, w)), ("rms_norm", lambda: g.rms_norm(a, w[0])),
                     ("all_reduce", lambda: g.all_reduce(a))]:
        with pytest.raises(mk.GraphError, match=rf"{op}: \w+ is torch.int64; {op} takes floating-point tensors only"):
            call()
    assert not g.tasks, "a refused op leaves no task"


def test_attention_refuses_caches_its_tiles_would_misread():
    """The attention tiles read K and V with one row stride and in q's dtype: a cache of another dtype,
    or a V that is a view of wider rows, is a clear error, not wrong numbers."""
    g = mk.Graph(world_size=1, rank=0)
    q, pos = g.input("q", (16, 32), torch.bfloat16), g.input("pos", (16,), torch.int64)
    cache = g.input("cache", (32, 16), torch.bfloat16)
    other_dtype, wider_rows = g.input("k32", (32, 16), torch.float32), g.input("wide", (32, 48), torch.bfloat16)[:, :16]
    for k, v in [(other_dtype, cache), (cache, wider_rows)]:
        for op, call in [("chunk_attention", lambda: g.chunk_attention(q, k, v, pos, 16)),
                         ("decode_attention", lambda: g.decode_attention(q[:2], k, v, pos[:2], 2, 16))]:
            with pytest.raises(mk.GraphError, match=rf"{op}: caches \(32, 16\) .* must match each other and q's dtype"):
                call()
    assert not g.tasks, "a refused op leaves no task"


# -- 6. a launcher killed outright ---------------------------------------------------------------------
LAUNCHER_SCRIPT = """
import os, sys, time
import megakernel as mk

def rank_job():
    open(os.path.join(sys.argv[1], f"rank-{os.getpid()}"), "w").close()
    time.sleep(120)

if __name__ == "__main__":
    mk.launch(rank_job, world_size=2, backend="cpu", timeout=300)
"""


@pytest.mark.slow
def test_ranks_die_with_a_killed_launcher_and_its_store_is_swept(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER_SCRIPT)
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("rank-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        ranks = [int(p.name.split("-")[1]) for p in tmp_path.glob("rank-*")]
        assert len(ranks) == 2, "the ranks did not start"
        stores = list(Path(tempfile.gettempdir()).glob(f"{STORE_PREFIX}{launcher.pid}-*"))
        assert stores, "the launch's store is where the sweep looks for it"
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [pid for pid in ranks if _alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, f"ranks {survivors} outlived their launcher"
    assert all(store.exists() for store in stores)
    from megakernel.heap import sweep_orphans
    sweep_orphans(tempfile.gettempdir(), STORE_PREFIX)  # what the next launch does first
    assert not any(store.exists() for store in stores)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead too
        return stat.read().split(")")[-1].split()[0] != "Z"


# -- 7. the kernel cache --------------------------------------------------------------------------------
def _specs(eps: float):
    g = mk.Graph()
    x = g.input("x", (1, 8), torch.float32)
    g.output("y", g.rms_norm(x, g.input("w", (8,), torch.float32), eps))
    return g


def test_the_kernel_cache_is_checked_against_its_names(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAKERNEL_CACHE_DIR", str(tmp_path / "cache"))
    eps = 1e-3 * (1 + os.getpid() % 97)
    g = _specs(eps)  # a kernel no earlier test imported
    path = codegen.kernel_path(g.specs, "interpreter")
    source = path.read_text()
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    marker = tmp_path / "ran"
    path.write_text(source + f"\nopen({str(marker)!r}, 'w').close()\n")  # code appended to a cached kernel
    with pytest.raises(BackendError, match="does not hash to its name"):
        codegen.load_kernel(path)
    assert not marker.exists()
    assert codegen.kernel_path(g.specs, "interpreter") == path and path.read_text() == source  # written again
    path.write_text(source[:100])  # truncated
    codegen.kernel_path(g.specs, "interpreter")
    assert path.read_text() == source
    planted = path.with_suffix(f".{os.getpid()}.tmp")  # the temp name the cache used to write through
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    path.unlink()
    planted.symlink_to(victim)
    codegen.kernel_path(g.specs, "interpreter")
    assert victim.read_text() == "untouched" and path.read_text() == source
    with mk.Megakernel(g, workers=1) as kernel:  # workers import the checked file
        out = kernel.run({"x": torch.ones(1, 8), "w": torch.ones(8)})["y"]
    assert torch.allclose(out, torch.full((1, 8), (1 + eps) ** -0.5))


def test_a_cache_folder_others_can_write_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    (shared / "kernels").mkdir(parents=True)
    (shared / "kernels").chmod(0o777)
    monkeypatch.setenv("MEGAKERNEL_CACHE_DIR", str(shared))
    with pytest.raises(BackendError, match="not a folder that only this user can write"):
        codegen.kernel_path(_specs(1e-6).specs, "interpreter")


# -- 8. hang reports ------------------------------------------------------------------------------------
def test_hang_reports_are_new_files_of_a_private_folder():
    g = _specs(1e-6)
    tables = schedule(g.tasks, g.buffer_shapes(), specs=g.specs, op_names=g.op_names, workers=1)
    first = diagnosis.write_hang_files("report", tables, 1, None)
    second = diagnosis.write_hang_files("report", tables, 1, None)  # a second kernel, the same run number
    try:
        assert first != second and all(f.parent == reports_dir() for f in first + second)
        assert (reports_dir().stat().st_mode & 0o777) == 0o700 and reports_dir().stat().st_uid == os.getuid()
    finally:
        for f in first + second:
            f.unlink()


def test_a_hostile_reports_folder_keeps_the_diagnosis(tmp_path, monkeypatch):
    g = _specs(1e-6)
    tables = schedule(g.tasks, g.buffer_shapes(), specs=g.specs, op_names=g.op_names, workers=1)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / f"megakernel-{os.getuid()}").symlink_to(tmp_path)  # a folder another user could have planted
    saved = diagnosis.save_hang_report("the report", tables, 1, None)
    assert saved.startswith("the report could not be written to a file: ") and "only this user can write" in saved
    (tmp_path / f"megakernel-{os.getuid()}").unlink()
    (tmp_path / f"megakernel-{os.getuid()}").mkdir(mode=0o777)
    os.chmod(tmp_path / f"megakernel-{os.getuid()}", 0o777)
    assert diagnosis.save_hang_report("the report", tables, 1, None).startswith("the report could not be written")
    assert not list((tmp_path / f"megakernel-{os.getuid()}").iterdir())


# -- 9. resources ---------------------------------------------------------------------------------------
def test_a_graph_larger_than_memory_is_refused_as_it_is_built(monkeypatch):
    g = mk.Graph()
    g.input("x", (4, 4), torch.float32)
    start = time.monotonic()
    for shape in ((10**6, 10**6), (largest_heap() // 4 + 1,)):  # the first ran for minutes in g.add
        with pytest.raises(mk.GraphError, match=rf"huge \({shape[0]}.* the graph's buffers would take"):
            g.add(g.input("huge", shape, torch.float32), g.input("other", shape, torch.float32))
    assert time.monotonic() - start < 1
    assert g.op_calls == [] and [b.name for b in g.buffers] == ["x"]  # nothing half-built
    monkeypatch.setattr(graph_module, "largest_heap", lambda: 1 << 70)  # the later checks, on a bigger machine
    g.output("t", g.touch(g.input("huge", (10**9, 10**9), torch.float32)))
    start = time.monotonic()
    with pytest.raises(mk.GraphError, match=r"buffers take 4,000,000,000,000,000,256 bytes"):
        mk.Megakernel(g, workers=1)
    assert time.monotonic() - start < 30
    with pytest.raises(mk.GraphError, match="dependency cells"):
        infer_dependencies(g.tasks, g.buffer_shapes())


def test_an_op_past_the_task_cap_is_refused_and_leaves_nothing(monkeypatch):
    monkeypatch.setattr(graph_module, "MAX_TASKS", 10)
    g = mk.Graph()
    x = g.input("x", (1, 8), torch.float32)
    y = g.add(x, x)
    with pytest.raises(mk.GraphError, match=r"linear: the graph would have \d+ tasks; at most 10"):
        g.linear(y, g.input("w", (4096, 8), torch.float32))
    assert len(g.tasks) == 1 and len(g.op_calls) == 1 and g.op_calls[0].startswith("add(")  # the add alone


def test_more_cpu_workers_than_cores_is_a_warning(tmp_path):
    with pytest.warns(UserWarning, match=rf"64 cpu workers on {os.cpu_count()} cores"):
        CpuBackend(Group(1, 0), tmp_path / "mk_unused.py", 64, WorkerPool())  # starts no process


# -- 10. segments of a killed process --------------------------------------------------------------------
def test_segments_whose_creator_is_gone_are_swept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = Path(SHM_DIR) / f"megakernel-{dead.pid}-none-{os.urandom(8).hex()}"
    orphan.write_bytes(b"\0" * 4096)
    heap = SharedHeap.create(4096)
    try:
        assert not orphan.exists(), "the orphaned segment is still there"
        assert f"-{os.getpid()}-" in f"-{heap.name.split('-', 1)[1]}"
    finally:
        heap.unlink()
        heap.close()
        orphan.unlink(missing_ok=True)


# -- 11. a rank that never builds its kernel -------------------------------------------------------------
def _late_rank() -> None:
    from megakernel.bootstrap import current_world
    _, rank = current_world()
    if rank == 1:
        time.sleep(4)
    g = mk.Graph()
    g.output("y", g.all_reduce(g.input("x", (1, 8), torch.float32)))
    mk.Megakernel(g, workers=1, timeout=1.0).close()


def test_a_rank_that_does_not_arrive_is_named_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(mk.RankError, match="missing: rank 1") as caught:
        mk.launch(_late_rank, world_size=2, virtual=True, timeout=60)
    assert caught.value.rank == 0 and "within 1.0 s" in str(caught.value)
    assert time.monotonic() - start < 15  # rank 1's sleep, then its own failure to meet the others


# -- 12. hostile files for the command line ---------------------------------------------------------------
def test_trace_summary_survives_cycles_and_equal_timestamps(tmp_path):
    spans = [Span(0, 0, t, "op", 0, t, "binary", 5, 5, 5) for t in range(3)]  # all at one nanosecond
    cyclic = Trace(spans, [((0, 0), (0, 1)), ((0, 1), (0, 2)), ((0, 2), (0, 0))]).save(tmp_path / "cycle.json")
    done = subprocess.run([sys.executable, "-m", "megakernel.tools.cli", "trace", "summary", str(cyclic)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "3 tasks on 1 rank(s)" in done.stdout and "critical path executed: 3 tasks" in done.stdout


def _deflate_bomb(image: Path, bomb: Path, member: str, size: int) -> Path:
    """``image`` with ``member`` replaced by a truthful .npy of ``size`` zero bytes, deflated."""
    with zipfile.ZipFile(image) as source, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            if info.filename != f"{member}.npy":
                target.writestr(info.filename, source.read(info))
        header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.uint8)) | {"shape": (size,)}
        with target.open(f"{member}.npy", "w", force_zip64=True) as out:
            np.lib.format.write_array_header_1_0(out, header)
            for _ in range(size >> 20):
                out.write(bytes(1 << 20))
    assert bomb.stat().st_size < size // 256
    return bomb


def test_hostile_images_and_garbage_end_in_one_line(tmp_path, capsys):
    g = _specs(1e-6)
    with mk.Megakernel(g, workers=1) as kernel:
        image = tmp_path / "image.npz"
        kernel.save_image(image)
    bomb = tmp_path / "bomb.npz"  # a small file whose heap claims 6 GiB
    with zipfile.ZipFile(image) as source, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as target:
        for name in ("tables.npy", "outputs.npy"):
            target.writestr(name, source.read(name))
        header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.uint8)) | {"shape": (6 << 30,)}
        with target.open("heap.npy", "w") as heap:
            np.lib.format.write_array_header_1_0(heap, header)
            heap.write(b"\0" * 1024)
    assert cli(["disasm", str(bomb)]) == 0  # the tables alone: the heap is not read
    assert "task table v3" in capsys.readouterr().out
    assert cli(["disasm", str(bomb), "--execute"]) == 1
    assert "claims uint8 (6442450944,)" in capsys.readouterr().err
    for member in ("tables", "heap"):  # a real bomb: the header tells the truth, the bytes deflate ~1000x
        deflated = _deflate_bomb(image, tmp_path / f"{member}-bomb.npz", member, 64 << 20)
        assert cli(["disasm", str(deflated), "--execute"]) == 1
        assert f"its {member!r} array expands from" in capsys.readouterr().err
    assert cli(["graph", str(deflated)]) == 0  # the task DAG needs no heap: a heap bomb is not read
    assert capsys.readouterr().out.startswith("digraph")
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(os.urandom(4096))
    for argv in (["disasm", str(garbage)], ["graph", str(garbage)], ["trace", "summary", str(garbage)]):
        assert cli(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"megakernel {argv[0]}") and "\n" not in err, err


# -- 13. arguments ----------------------------------------------------------------------------------------
def test_command_line_counts_are_checked_in_one_line(capsys):
    for argv in (["demo", "--workers", "0"], ["demo", "--ranks", "-1"], ["demo", "--tokens", "x"],
                 ["trace", "summary", "t.json", "--top", "0"], ["graph", "k.npz", "--max-nodes", "0"]):
        with pytest.raises(SystemExit) as info:
            cli(argv)
        assert info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith("must be a positive integer, got "
                                                                        f"{argv[-1]!r}")


def test_bad_arguments_are_graph_errors():
    g = _specs(1e-6)
    for timeout in (0, -1, float("nan"), float("inf"), 1e12, True, "60"):
        with pytest.raises(mk.GraphError, match="timeout must be a number of seconds"):
            mk.Megakernel(g, timeout=timeout)
    with pytest.raises(mk.GraphError, match="workers must be a positive integer, got True"):
        mk.Megakernel(g, workers=True)
    start = time.monotonic()
    with pytest.raises(mk.GraphError, match="workers=1,000,000,000: the cpu backend runs at most 256"):
        mk.Megakernel(g, workers=10**9, backend="cpu")
    assert time.monotonic() - start < 10
    with pytest.raises(mk.GraphError, match="shape must be 1-D or 2-D of positive ints"):
        g.input("bad", (True, 2), torch.float32)
    with pytest.raises(mk.GraphError, match="eps must be a positive number, got 'x'"):
        g.rms_norm(g.inputs["x"], g.inputs["w"], "x")
    with mk.Megakernel(g, workers=1) as kernel:
        with pytest.raises(mk.GraphError, match="inputs must be a mapping"):
            kernel.run([torch.ones(1, 8)])
    t = schedule(g.tasks, g.buffer_shapes(), specs=g.specs, op_names=g.op_names, workers=1)
    t.rows[0, OPCODE] = -1
    with pytest.raises(FormatError, match=r"an opcode outside \[0, 1\): -1"):
        deserialize(serialize(t))
