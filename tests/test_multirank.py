"""Several ranks (processes) per test: collectives, tensor parallelism, reruns, divergence, faults."""
import ctypes
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch

import megakernel as mk
from megakernel import bootstrap
from megakernel.backends import cpu as cpu_backend
from megakernel import RankError
from megakernel.launcher import FAILED_GRACE

from megakernel.reference import execute_ranks
from megakernel.scheduler import deserialize, serialize
from megakernel.heap import HeapView, RankHeap, kernel_bases
from megakernel.layout import COMM, HeapLayout, device_words

from helpers import assert_close

pytestmark = pytest.mark.slow  # several ranks: processes and virtual ranks

ROWS, COLS = 3, 100


def _value(rank: int, run: int, shape, seed: int = 0) -> torch.Tensor:
    """Rank- and run-specific random data, reproducible in the parent for the reference."""
    g = torch.Generator().manual_seed(seed * 100003 + run * 1009 + rank)
    return torch.randn(shape, generator=g)


def _collectives_graph() -> mk.Graph:
    g = mk.Graph()
    me, world = g.rank, g.world_size
    x = g.input("x", (ROWS, COLS), torch.float32)
    big = g.input("big", (20, 1000), torch.float32)  # 80 kB: two-shot by default
    ring = g.new_tensor((ROWS, COLS), torch.float32, name="ring", comm=True)
    g.output("put", g.add(g.put(x, to_rank=(me + 1) % world, into=ring), x))
    g.output("one_shot", g.all_reduce(x, algorithm="one_shot"))
    g.output("two_shot", g.all_reduce(x, algorithm="two_shot"))
    g.output("auto", g.all_reduce(big))
    g.output("gather0", g.all_gather(x, dim=0))
    g.output("gather1", g.all_gather(x[:, :7], dim=1))
    g.output("scatter", g.reduce_scatter(g.mul(x, x)[:, : (COLS // world) * world], dim=1))
    g.output("scatter_rows", g.reduce_scatter(big[: 4 * world], dim=0))
    return g


def collectives(workers: int):
    g = _collectives_graph()
    me = g.rank
    outputs = []
    with mk.Megakernel(g, workers=workers, timeout=60) as kernel:
        for run in range(2):
            kernel.poison()
            outputs.append(kernel.run({"x": _value(me, run, (ROWS, COLS)), "big": _value(me, run, (20, 1000), 1)}))
    return outputs


# the tiles under the interpreter at 2 and 3 process ranks (1 and 2 workers) and on virtual ranks; the torch
# references at 4 process ranks and on 3 virtual ranks of 2 workers each
@pytest.mark.parametrize("world,workers,virtual,host", [
    (2, 2, False, "cpu"), (3, 1, False, "cpu"), (2, 2, True, "cpu"), (4, 1, False, "torch"), (3, 2, True, "torch")])
def test_collectives_against_torch_and_bitwise_equal_across_ranks(world, workers, virtual, host, monkeypatch):
    monkeypatch.setattr(bootstrap, "_process_backend", host)
    results = mk.launch(functools.partial(collectives, workers), world_size=world, timeout=300, virtual=virtual)
    for run in range(2):
        xs = [_value(r, run, (ROWS, COLS)).double() for r in range(world)]
        bigs = [_value(r, run, (20, 1000), 1).double() for r in range(world)]
        total, big_total = sum(xs), sum(bigs)
        chunk = COLS // world
        squares = sum(x[:, : chunk * world] ** 2 for x in xs)
        for me in range(world):
            out = results[me][run]
            what = f"rank {me} of {world}, {workers} workers, run {run}"
            assert_close(out["put"], xs[(me - 1) % world] + xs[me], 1e-6, f"put {what}")
            for name in ("one_shot", "two_shot"):
                assert_close(out[name], total, 1e-5, f"{name} {what}")
            assert_close(out["auto"], big_total, 1e-5, f"auto {what}")
            assert_close(out["gather0"], torch.cat(xs, 0), 1e-7, f"gather0 {what}")
            assert_close(out["gather1"], torch.cat([x[:, :7] for x in xs], 1), 1e-7, f"gather1 {what}")
            assert_close(out["scatter"], squares[:, me * chunk:(me + 1) * chunk], 1e-5, f"scatter {what}")
            assert_close(out["scatter_rows"], big_total[4 * me: 4 * me + 4], 1e-5, f"scatter_rows {what}")
            for name in ("one_shot", "two_shot", "auto"):
                assert torch.equal(out[name], results[0][run][name]), f"{name} differs between rank 0 and {me}"


def oracle_job(workers: int):
    """This rank's tables, its heap before the run (inputs bound, outputs poisoned) and its outputs."""
    g = _collectives_graph()
    with mk.Megakernel(g, workers=workers) as kernel:
        kernel.bind({"x": _value(g.rank, 0, (ROWS, COLS)), "big": _value(g.rank, 0, (20, 1000), 1)})
        kernel.poison()
        before = kernel.heap.cpu().clone()
        out = kernel.run()
        where = {name: (t.addr(0, 0), t.dtype, t.rows, t.cols, t.row_stride) for name, t in g.outputs.items()}
        return serialize(kernel.tables), before, out, where


def test_kernel_equals_multi_rank_reference_executor():
    world = 3
    results = mk.launch(functools.partial(oracle_job, 2), world_size=world, timeout=300)
    tables = [deserialize(r[0]) for r in results]
    heaps = [r[1] for r in results]
    execute_ranks(tables, heaps)
    for me, (_, _, out, where) in enumerate(results):
        view = HeapView(heaps[me])
        for name, (offset, dtype, rows, cols, stride) in where.items():
            expected = view.tensor(offset, dtype, rows, cols, stride).reshape(out[name].shape)
            assert_close(out[name], expected, 1e-6, f"rank {me} {name}: kernel vs reference executor")


def tensor_parallel_mlp(hidden: int, inter: int):
    """Column-parallel gate/up, silu_mul, row-parallel down, all_reduce: this rank's shards of one MLP."""
    g = mk.Graph()
    me, world = g.rank, g.world_size
    shard = inter // world
    x = g.input("x", (1, hidden), torch.float32)
    gate = g.input("gate", (shard, hidden), torch.float32)
    up = g.input("up", (shard, hidden), torch.float32)
    down = g.input("down", (hidden, shard), torch.float32)
    g.output("y", g.all_reduce(g.linear(g.silu_mul(g.linear(x, gate), g.linear(x, up)), down)))
    weights = {k: _value(0, 0, s, seed) * 0.2 for seed, (k, s) in
               enumerate([("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))])}
    rows = slice(me * shard, (me + 1) * shard)
    with mk.Megakernel(g, workers=2) as kernel:
        return [kernel.run({"x": _value(0, run, (1, hidden), 7), "gate": weights["gate"][rows],
                            "up": weights["up"][rows], "down": weights["down"][:, rows]})["y"]
                for run in range(3)]


def test_tensor_parallel_mlp_equals_single_rank(torch_backend):
    hidden, inter = 64, 96
    single = tensor_parallel_mlp(hidden, inter)  # no process group: world size 1, here
    for world, virtual in ((2, True), (3, False)):  # threads, and processes at a world that divides nothing
        results = mk.launch(functools.partial(tensor_parallel_mlp, hidden, inter), world_size=world, timeout=300,
                            virtual=virtual)
        for run in range(3):
            for me in range(world):
                assert_close(results[me][run], single[run], 1e-5, f"rank {me} of {world}, run {run}")
                assert torch.equal(results[me][run], results[0][run])


def diverging():
    g = mk.Graph()
    x = g.input("x", (2, 32), torch.float32)
    y = g.add(x, x) if g.rank == 0 else g.mul(x, x)
    g.output("y", g.all_reduce(y))
    mk.Megakernel(g, workers=1)


def test_diverging_graphs_are_rejected_naming_the_op():
    with pytest.raises(RankError) as info:
        mk.launch(diverging, world_size=2, timeout=120)
    assert isinstance(info.value.error, mk.GraphError)
    assert "op 0" in str(info.value.error) and "add" in str(info.value.error) and "mul" in str(info.value.error)


def _small_all_reduce() -> mk.Graph:
    g = mk.Graph()
    g.output("y", g.all_reduce(g.input("x", (2, 32), torch.float32)))
    return g


def silent_rank():
    """Rank 1 launches but one of its workers is stopped (SIGSTOP) for 6 s: rank 0's watchdog must name it."""
    g = _small_all_reduce()
    with mk.Megakernel(g, workers=1, timeout=2) as kernel:
        if g.rank == 1:
            worker = cpu_backend.default_pool().workers[0].process.pid
            os.kill(worker, signal.SIGSTOP)
            threading.Timer(6, os.kill, (worker, signal.SIGCONT)).start()
        start = time.monotonic()
        try:
            kernel.run({"x": torch.randn(2, 32)})
        except mk.DeadlockError as error:
            return time.monotonic() - start, error.report
        except mk.BackendError as error:  # rank 1, resumed: rank 0 has given up and left
            return str(error)
        return "no error"


def test_silent_rank_is_named_by_the_watchdog(backend):
    results = mk.launch(silent_rank, world_size=2, timeout=120)
    elapsed, report = results[0]
    assert elapsed < 2 + 5
    assert "on rank 1" in report and "did not run" in report, report


def absent_rank():
    """Rank 1 never launches: rank 0 stops at the pre-launch barrier, naming it."""
    g = _small_all_reduce()
    with mk.Megakernel(g, workers=1, timeout=2) as kernel:
        if g.rank == 1:
            time.sleep(6)
            return "absent"
        try:
            kernel.run({"x": torch.randn(2, 32)})
        except mk.BackendError as error:
            return str(error)
        return "no error"


def test_absent_rank_is_named_before_launch():
    message = mk.launch(absent_rank, world_size=2, timeout=120)[0]
    assert "did not all arrive" in message and "Ranks 1 failed" in message, message


def killed_rank():
    g = _small_all_reduce()
    with mk.Megakernel(g, workers=1, timeout=30) as kernel:
        if g.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        kernel.run({"x": torch.randn(2, 32)})


def _shm_segments():
    return {n for n in os.listdir("/dev/shm") if n.startswith("megakernel-")}


_TAG = f"MEGAKERNEL_TEST_OWNER={os.getpid()}".encode()  # inherited by ranks and workers: tells ours from others'


def _megakernel_processes() -> set[int]:
    """Pids of every live rank or worker process started by this test process (zombies excluded), from /proc."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{entry}/environ", "rb") as f:
                ours = _TAG in f.read().split(b"\0")
        except OSError:
            continue
        if ours and state != "Z" and (b"_worker_main" in cmdline or b"multiprocessing.spawn" in cmdline):
            found.add(int(entry))
    return found


def assert_nothing_left(segments_before: set[str]) -> None:
    """No shared-memory segment beyond ``segments_before`` and, within 10 s, no rank or worker process of
    this test process's making but its own pools' (tests set ``_TAG`` in their environment)."""
    assert _shm_segments() <= segments_before
    ours = cpu_backend.default_pool_pids()  # this test process's own pools
    deadline = time.monotonic() + 10
    while _megakernel_processes() - ours and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _megakernel_processes() - ours
    assert not left, f"outlived the launch: {[open(f'/proc/{p}/cmdline', 'rb').read() for p in left]}"


def test_killed_rank_gives_clear_error_and_leaves_nothing_behind(backend, monkeypatch):
    monkeypatch.setenv(*_TAG.decode().split("=", 1))  # other test runs on the machine are not ours
    before = _shm_segments()
    start = time.monotonic()
    with pytest.raises(mk.BackendError, match="rank 1 died"):
        mk.launch(killed_rank, world_size=2, timeout=120)
    assert time.monotonic() - start < 60
    assert_nothing_left(before)


def test_rank_exception_is_reraised_naming_the_rank():
    with pytest.raises(RankError, match="rank 1 raised ZeroDivisionError"):
        mk.launch(_fail_on_rank_1, world_size=2, timeout=120)


def _fail_on_rank_1():
    import torch.distributed as dist
    if dist.get_rank() == 1:
        1 / 0
    return "fine"


TORCHRUN_JOB = """
import functools, sys, torch, megakernel as mk
sys.path.insert(0, {tests!r})
from test_multirank import collectives
if __name__ == "__main__":
    results = mk.launch(functools.partial(collectives, 1), world_size=2)
    import torch.distributed as dist
    if dist.get_rank() == 0:
        torch.save(results, {out!r})
"""


def test_same_code_runs_under_torchrun(tmp_path):
    script = tmp_path / "job.py"
    out = tmp_path / "results.pt"
    script.write_text(TORCHRUN_JOB.format(tests=os.path.dirname(__file__), out=str(out)))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    launched = mk.launch(functools.partial(collectives, 1), world_size=2, timeout=300, virtual=True)
    torchrun = torch.load(out)
    for me in range(2):
        for run in range(2):
            for name, value in launched[me][run].items():
                assert torch.equal(torchrun[me][run][name], value), f"{name} rank {me} run {run}"


def _virtual_heaps():
    g = _collectives_graph()
    with mk.Megakernel(g, workers=1) as kernel:
        segment = kernel.backend.segments
        heap_at = kernel.heap.data.data_ptr() - segment[0].address
        return [s.name for s in segment.values()], heap_at, threading.current_thread().name


def test_virtual_ranks_are_threads_carving_one_heap():
    before = _shm_segments()
    results = mk.launch(_virtual_heaps, world_size=3, virtual=True, timeout=300)
    names = {tuple(r[0]) for r in results}
    assert len(names) == 1 and len(next(iter(names))) == 1, f"one segment for every rank, got {names}"
    offsets = [r[1] for r in results]
    assert offsets[0] == 0 and offsets == sorted(set(offsets)), f"each rank its own slice, got {offsets}"
    assert [r[2] for r in results] == [f"megakernel-rank-{r}" for r in range(3)]
    assert _shm_segments() <= before


def _replayed_all_reduce() -> list[torch.Tensor]:
    g = mk.Graph()
    x = g.input("x", (2, 24), torch.float32)
    g.output("y", g.all_reduce(g.mul(x, x), algorithm="two_shot"))  # puts into peers in both phases
    outputs = []
    with mk.Megakernel(g, workers=1, timeout=20) as kernel:
        kernel.bind({"x": _value(g.rank, 0, (2, 24))})
        captured = kernel.capture(steps=2)
        for replay in range(2):
            kernel.bind({"x": _value(g.rank, replay, (2, 24))})  # read by this rank's tiles alone
            captured.replay()
            kernel.check()
            outputs.append(kernel.tensor(kernel.graph.outputs["y"]).clone())
    return outputs


def test_captured_launches_replay_across_ranks(backend):
    results = mk.launch(_replayed_all_reduce, world_size=2, virtual=True, timeout=300)
    for replay in range(2):
        expected = sum(_value(r, replay, (2, 24)).double() ** 2 for r in range(2))
        assert torch.equal(results[0][replay], results[1][replay]), "ranks differ"
        assert_close(results[0][replay], expected, 1e-6, f"replay {replay + 1}")


def _fault_on_rank_1() -> str:
    g = mk.Graph()
    tokens = g.input("tokens", (2,), torch.int64)
    table = g.input("table", (4, 16), torch.float32)
    g.output("y", g.all_reduce(g.embedding(tokens, table)))
    with mk.Megakernel(g, workers=1, timeout=20) as kernel:
        try:
            kernel.run({"tokens": torch.tensor([1, 9 if g.rank == 1 else 2]), "table": torch.randn(4, 16)})
        except mk.GraphError as error:
            return str(error)
    return "no error"


def test_a_fault_on_one_rank_is_raised_on_every_rank_its_results_reach(backend):
    """Rank 0's output sums rank 1's clamped rows: rank 0 raises too (rank 1's header word is raised before
    the faulting task's signals, so rank 0 finds it however the ranks' launches end)."""
    for message in mk.launch(_fault_on_rank_1, world_size=2, virtual=True, timeout=300):
        assert re.search(r"rank 1 worker 0 step 1 .*index 9 is outside \[0, 4\)", message), message


# -- the comm area: what peers write -------------------------------------------------------------------------
def test_put_wants_a_communication_buffer_and_the_collectives_make_theirs():
    g = mk.Graph(world_size=2, rank=0)
    x = g.input("x", (2, 8), torch.float32)
    plain = g.new_tensor((2, 8), torch.float32, name="plain")
    with pytest.raises(mk.GraphError, match=r"put: into \('plain'\) is written by rank 0 on rank 1: it must be a "
                                            r"communication buffer, made with new_tensor\(..., comm=True\)"):
        g.put(x, to_rank=1, into=plain)
    g.put(x, to_rank=0, into=plain)  # into itself: no peer writes it
    assert not plain.buffer.comm
    assert g.put(x, to_rank=1, into=g.new_tensor((2, 8), torch.float32, comm=True)).buffer.comm
    written = {region[0] for remote in g.tasks.remote for _, region in remote}  # by this rank's puts, on rank 1
    g.all_reduce(x, algorithm="two_shot")
    g.all_gather(x)
    g.reduce_scatter(x)
    peers_write = {region[0] for remote in g.tasks.remote for _, region in remote}
    assert len(peers_write - written) == 4 and all(g.buffers[b].comm for b in peers_write)
    assert g.comm_bytes > 0 and all(b.offset >= COMM for b in g.buffers if b.comm)


def test_the_comm_area_is_reached_through_rewritten_offsets_wherever_it_lies():
    """Events and status go to the comm area; the kernel reaches comm offsets as ``delta`` + offset from its
    data area, and peers' comm areas through bases that need not be at any distance from their data (hip)."""
    lay = HeapLayout.of(1000, 300, [16, 200, 64, 48, 32, 24, 8])
    assert (lay.events_off, lay.status_off, lay.tasks_off) == (COMM + 512, COMM + 768, 1024)
    assert (lay.data_size, lay.comm_size) == (1024 + 5 * 256, 1024)
    assert lay.device_offsets(5000)["status_off"] == 5000 + 768 and lay.device_offsets(5000)["tasks_off"] == 1024
    words = np.array([[-1, 7, COMM + 40, 512]])
    assert device_words(words, 100).tolist() == [[-1, 7, 140, 512]]
    heaps = [RankHeap(torch.zeros(64, dtype=torch.uint8), torch.zeros(32, dtype=torch.uint8)) for _ in range(3)]
    for rank in range(3):  # areas of separate allocations, as on hip
        bases, delta = kernel_bases(heaps, rank)
        word = int(device_words(np.array([COMM + 16]), delta)[0])
        assert bases[rank] == heaps[rank].data.data_ptr()
        assert [b + word for b in bases] == [heap.comm.data_ptr() + 16 for heap in heaps]
    whole = torch.zeros(96, dtype=torch.uint8)  # cpu and cuda: one allocation, the comm area after the data
    heaps = [RankHeap.split(whole, 64)]
    assert kernel_bases(heaps, 0) == ([whole.data_ptr()], 64)


def test_the_rocm_comm_area_needs_hip_python_and_says_so(monkeypatch):
    from megakernel import finegrained
    monkeypatch.setitem(sys.modules, "hip", None)  # not installed
    with pytest.raises(mk.BackendError, match=r"fine-grained memory, allocated through hip-python: pip install "
                                              r"'megakernel\[rocm\]'"):
        finegrained.allocate(256, torch.device("cuda", 0))


def test_the_rocm_comm_area_is_shared_through_hip_ipc_handles(monkeypatch):
    """Against hip-python's conventions (every call returns (hipError_t, value...); a struct's int() is its
    address): the handle's 64 bytes go out and come back into the struct that opens the peer's memory,
    and the mapping is closed with its last view."""
    from megakernel import finegrained

    class Handle(ctypes.Structure):
        _fields_ = [("reserved", ctypes.c_char * 64)]

        def __int__(self):
            return ctypes.addressof(self)

    calls = []
    hip = types.SimpleNamespace(
        hipError_t=types.SimpleNamespace(hipSuccess=0), HIP_IPC_HANDLE_SIZE=64, hipIpcMemLazyEnablePeerAccess=1,
        hipIpcMemHandle_t=Handle, hipSetDevice=lambda index: (calls.append(("device", index)) or 0,),
        hipIpcGetMemHandle=lambda address: (0, Handle.from_buffer_copy(bytes(range(address % 7, address % 7 + 64)))),
        hipIpcOpenMemHandle=lambda handle, flags: (calls.append((bytes(handle), flags)) or 0, 4096),
        hipIpcCloseMemHandle=lambda address: calls.append(("close", address)))
    monkeypatch.setitem(sys.modules, "hip", types.SimpleNamespace(hip=hip))
    monkeypatch.setattr(finegrained, "_tensor", lambda memory: memory)  # no ROCm torch here
    raw = finegrained.export(types.SimpleNamespace(data_ptr=lambda: 8193))
    assert raw == bytes(range(3, 67))
    memory = finegrained.open_handle(raw, 256, torch.device("cuda", 1))
    assert (memory.address, calls) == (4096, [("device", 1), (raw, 1)])
    del memory
    assert calls[-1] == ("close", 4096)
    hip.hipIpcOpenMemHandle = lambda handle, flags: (2, 0)  # an error code
    with pytest.raises(mk.BackendError, match="hipIpcOpenMemHandle failed: 2"):
        finegrained.open_handle(raw, 256, torch.device("cuda", 1))


def test_virtual_rank_failure_names_the_rank_and_releases_the_others():
    def job():
        g = _collectives_graph()
        if g.rank == 1:
            raise ValueError("rank one gives up")
        mk.Megakernel(g, workers=1)  # waits for rank 1 at the first exchange: released by its failure

    start = time.monotonic()
    with pytest.raises(RankError, match="rank 1 raised ValueError: rank one gives up") as info:
        mk.launch(job, world_size=3, virtual=True, timeout=120)
    assert isinstance(info.value.error, ValueError)
    assert time.monotonic() - start < 30, "the other ranks were not released"


def test_a_virtual_rank_stuck_in_its_own_code_is_left_behind_in_time():
    """Rank 1 never arrives (stuck in code of its own): rank 0 names it at the barrier within its kernel's
    timeout, and launch raises then (plus the others' grace), not when the stuck thread returns."""
    release = threading.Event()

    def job():
        g = _small_all_reduce()
        if g.rank == 1:
            release.wait(120)
            return "late"
        mk.Megakernel(g, workers=1, timeout=2)

    start = time.monotonic()
    try:
        with pytest.raises(RankError, match=r"rank 0 raised BackendError: .*did not all arrive") as info:
            mk.launch(job, world_size=2, virtual=True, timeout=120)
        assert time.monotonic() - start < 2 + FAILED_GRACE + 10, "launch waited for the stuck rank"
        assert "virtual ranks [1] were still running" in str(info.value)
    finally:
        release.set()
