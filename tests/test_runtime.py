"""The runtime: reruns without reset, bad input, the watchdog, worker failures, no leftovers."""
import os
import tempfile
import time

import numpy as np
import pytest
import torch

import megakernel as mk
from megakernel.backends.cpu import WorkerPool
from megakernel.scheduler import WAIT_EVENT, Tasks
from megakernel.tools.examples import mlp_block

from helpers import assert_close, random_inputs


def _mlp_reference(i):
    d = {k: v.double() for k, v in i.items()}
    h = torch.nn.functional.rms_norm(d["x"], d["norm"].shape, d["norm"], 1e-6)
    return d["x"] + (torch.nn.functional.silu(h @ d["gate"].T) * (h @ d["up"].T)) @ d["down"].T


def test_three_runs_in_a_row_with_fresh_inputs_and_no_reset(backend):
    g = mlp_block(hidden=96, intermediate=200, batch=2)
    with mk.Megakernel(g, workers=3) as kernel:
        for step in range(3):
            inputs = random_inputs(g, seed=100 + step, scale=0.3)
            kernel.poison()
            out = kernel.run(inputs)["y"]
            assert kernel.epoch == step + 1
            assert_close(out, _mlp_reference(inputs), 1e-5, f"run {step + 1}")


def test_inputs_stay_bound_between_runs():
    g = mlp_block(hidden=64, intermediate=96)
    with mk.Megakernel(g, workers=2) as kernel:
        inputs = random_inputs(g, seed=1, scale=0.3)
        first = kernel.run(inputs)["y"]
        x = torch.randn(1, 64) * 0.3
        second = kernel.run({"x": x})["y"]  # weights bound by the first run stay on the heap
        assert_close(second, _mlp_reference(dict(inputs, x=x)), 1e-5, "second run")
        assert not torch.equal(first, second)


def test_a_captured_launch_replays_with_fresh_inputs_and_the_epoch_kept_on_the_device(backend):
    g = mlp_block(hidden=64, intermediate=96, batch=2)
    with mk.Megakernel(g, workers=2, timeout=10) as kernel:
        with pytest.raises(mk.GraphError, match="'x' was never bound"):
            kernel.capture()
        kernel.bind(random_inputs(g, seed=5, scale=0.3))
        captured = kernel.capture(steps=2)  # every launch has the same arguments: no epoch among them
        assert kernel.launches == 0
        for replay in range(2):
            inputs = random_inputs(g, seed=50 + replay, scale=0.3)
            kernel.bind(inputs)
            kernel.poison()
            captured.replay()
            kernel.check()
            assert (kernel.epoch, kernel.launches) == (2 * replay + 2, replay + 1)
            assert_close(kernel.tensor(g.outputs["y"]), _mlp_reference(inputs), 1e-5, f"replay {replay + 1}")
        inputs = random_inputs(g, seed=60, scale=0.3)
        assert_close(kernel.run(inputs)["y"], _mlp_reference(inputs), 1e-5, "a run after the replays")
    with mk.Megakernel(g, workers=1, trace=True) as kernel:
        with pytest.raises(mk.GraphError, match="trace=False to capture"):
            kernel.capture()


def test_outputs_are_copies():
    g = mlp_block(hidden=64, intermediate=96)
    with mk.Megakernel(g, workers=1) as kernel:
        inputs = random_inputs(g, seed=2)
        out = kernel.run(inputs)["y"]
        out.fill_(0)
        assert not torch.equal(kernel.run()["y"], out)


def test_bad_inputs_name_the_tensor():
    g = mlp_block(hidden=64, intermediate=96)
    with mk.Megakernel(g, workers=1) as kernel:
        inputs = random_inputs(g)
        with pytest.raises(mk.GraphError, match="input 'down' was never bound"):
            kernel.run({k: v for k, v in inputs.items() if k != "down"})
        with pytest.raises(mk.GraphError, match=r"input 'x' has shape \(2, 64\); the graph declares \(1, 64\)"):
            kernel.run(dict(inputs, x=torch.randn(2, 64)))
        with pytest.raises(mk.GraphError, match="input 'x' has dtype torch.float64"):
            kernel.run(dict(inputs, x=torch.randn(1, 64, dtype=torch.float64)))
        with pytest.raises(mk.GraphError, match="'nope' is not an input"):
            kernel.run(dict(inputs, nope=torch.randn(1)))
        assert kernel.epoch == 0  # nothing was launched
        assert_close(kernel.run(inputs)["y"], _mlp_reference(inputs), 1e-5, "after errors")


def test_graph_errors_name_the_op_and_shapes():
    g = mk.Graph()
    x = g.input("x", (2, 64), torch.float32)
    w = g.input("w", (32, 48), torch.float32)
    with pytest.raises(mk.GraphError, match=r"linear: x has shape \(2, 64\) but w has shape \(32, 48\)"):
        g.linear(x, w)
    with pytest.raises(mk.GraphError, match=r"add: shapes differ: a \(2, 64\), b \(32, 48\)"):
        g.add(x, w)
    with pytest.raises(mk.GraphError, match="rms_norm: weight has shape"):
        g.rms_norm(x, w[0])
    xb = g.input("xb", (2, 64), torch.bfloat16)
    with pytest.raises(mk.GraphError, match="mul: dtypes differ"):
        g.mul(x, xb)
    with pytest.raises(mk.GraphError, match="input 'x' is defined twice"):
        g.input("x", (1,), torch.float32)
    with pytest.raises(mk.GraphError, match="dtype torch.int32 is not supported"):
        g.input("i", (4,), torch.int32)
    with pytest.raises(mk.GraphError, match="out of range"):
        x[5]
    with pytest.raises(mk.GraphError, match="not a tensor of this graph"):
        g.add(x, mk.Graph().input("x", (2, 64), torch.float32))
    with pytest.raises(AttributeError, match="no op 'conv'"):
        g.conv(x)
    assert (g.tasks, g.op_names, len(g.buffers)) == (Tasks(), [], 3)  # failed ops left nothing behind
    with pytest.raises(mk.GraphError, match="no tasks"):
        mk.Megakernel(g)
    g.add(x, x)
    with pytest.raises(mk.GraphError, match="no outputs"):
        mk.Megakernel(g)


def _injected_deadlock_kernel(pool, timeout=1.5):
    """An MLP kernel whose first cross-worker signal is removed: its consumer waits forever."""
    g = mlp_block(hidden=64, intermediate=96)
    kernel = mk.Megakernel(g, workers=2, timeout=timeout, pool=pool)
    t = kernel.tables
    waits = np.nonzero(t.rows[:, WAIT_EVENT] >= 0)[0]
    consumer = int(waits[0])
    event = int(t.rows[consumer, WAIT_EVENT])
    producer = t.producers_of(event)[0]
    saved = t.signals.copy()
    t.signals[t.signals[:, 1] == event, 2] = 0  # the producer signals, but adds nothing
    kernel.upload_tables()
    return g, kernel, consumer, producer, event, saved


def test_missing_signal_gives_deadlock_error_within_the_timeout_and_no_orphans(backend, tmp_path, monkeypatch):
    pool = WorkerPool()
    try:
        g, kernel, consumer, producer, event, saved = _injected_deadlock_kernel(pool)
        inputs = random_inputs(g, seed=4, scale=0.3)
        start = time.monotonic()
        with pytest.raises(mk.DeadlockError) as info:
            kernel.run(inputs)
        elapsed = time.monotonic() - start
        assert elapsed < 1.5 + 10, f"the watchdog took {elapsed:.1f} s"
        report = info.value.report
        assert f"at task {consumer} " in report and f"event {event} observed 0, expected" in report
        assert "(report: " in info.value.message and report in str(info.value)
        assert f"producer task {producer} " in report and ": ran" in report
        captured = kernel.capture()  # a replay checks nothing; check() reports its stall
        captured.replay()
        captured.replay()  # finds the rank stopped: runs nothing, and the first replay's records stay
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a reports folder that others can write
        (tmp_path / f"megakernel-{os.getuid()}").mkdir(mode=0o777)
        os.chmod(tmp_path / f"megakernel-{os.getuid()}", 0o777)
        with pytest.raises(mk.DeadlockError, match=r"launches 2 to 3 \(steps 1 to 2\)") as info:
            kernel.check()
        assert f"at task {consumer} " in info.value.report and ": timed out" in info.value.report, info.value.report
        assert "the report could not be written to a file" in info.value.message
        # the kernel recovers: fix the tables, run again, right answer
        kernel.tables.signals[:] = saved
        kernel.upload_tables()
        assert_close(kernel.run(inputs)["y"], _mlp_reference(inputs), 1e-5, "after the deadlock")
        kernel.close()
        processes = [w.process for w in pool.workers]
    finally:
        pool.close()
    assert all(p.poll() is not None for p in processes), "a worker process outlived its pool"


def test_dead_worker_gives_backend_error(backend):
    pool = WorkerPool()
    try:
        g = mlp_block(hidden=64, intermediate=96)
        kernel = mk.Megakernel(g, workers=2, timeout=5, pool=pool)
        pool.workers[1].process.kill()
        pool.workers[1].process.wait()
        with pytest.raises(mk.BackendError, match="worker 1: worker process .* died"):
            kernel.run(random_inputs(g))
        kernel.close()
    finally:
        pool.close()


def test_heap_segment_is_unlinked_once_mapped():
    g = mlp_block(hidden=64, intermediate=96)
    with mk.Megakernel(g, workers=2) as kernel:
        assert not os.path.exists(f"/dev/shm/{kernel.backend.segments[0].name}")
        kernel.run(random_inputs(g))
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("megakernel-")]


def test_generated_kernel_source_is_cached_by_content_and_readable():
    g1, g2 = mlp_block(hidden=64, intermediate=96), mlp_block(hidden=64, intermediate=96)
    with mk.Megakernel(g1, workers=1) as k1, mk.Megakernel(g2, workers=1) as k2:
        assert k1.kernel_path == k2.kernel_path
        source = k1.kernel_path.read_text()
        assert "def megakernel(" in source and "persistent_loop(" in source and "rms_norm_tile(" in source


def test_the_kernel_runs_a_sealed_copy_and_leaves_the_graph_as_it_was():
    g = mlp_block(hidden=64, intermediate=96)
    tasks, buffers = len(g.tasks), len(g.buffers)
    with mk.Megakernel(g, workers=1) as kernel:
        with pytest.raises(mk.GraphError, match="add: this is a kernel's sealed copy of a graph"):
            kernel.graph.add(g.inputs["x"], g.inputs["x"])
        g.output("twice", g.add(g.inputs["x"], g.inputs["x"]))  # the caller's graph takes more ops
        assert len(kernel.graph.tasks) == tasks and len(kernel.graph.buffers) == buffers
        assert list(kernel.run(random_inputs(g))) == ["y"]


def test_an_output_that_peers_write_is_read_from_a_copy_in_the_sealed_graph():
    g = mk.Graph(world_size=2, rank=0)
    x = g.input("x", (2, 8), torch.float32)
    g.output("x", x)
    g.output("y", g.all_reduce(x, algorithm="two_shot"))
    tasks, y = len(g.tasks), g.outputs["y"]
    sealed = g.sealed(remote_targets={y.buffer.index})
    assert sealed.outputs["x"] is x and sealed.outputs["y"].buffer.name == "y.copy"
    assert sealed.op_names[-1] == "outputs/y.copy" and len(sealed.tasks) > tasks
    assert g.outputs["y"] is y and len(g.tasks) == tasks and "y.copy" not in [b.name for b in g.buffers]
    with pytest.raises(mk.GraphError, match="input 'x' is written by other ranks' puts"):
        g.sealed(remote_targets={x.buffer.index})


def test_unknown_backend():
    with pytest.raises(mk.BackendError, match="unknown backend 'tpu'"):
        mk.Megakernel(mlp_block(hidden=64, intermediate=96), backend="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the backends are checked by bench/gpu_check.py")
def test_gpu_backends_without_a_gpu_are_a_clear_error():
    g = mlp_block(hidden=64, intermediate=96)
    with pytest.raises(mk.BackendError, match="backend 'cuda' needs a CUDA build of torch and a visible GPU; "
                                              "this process has no GPU"):
        mk.Megakernel(g, backend="cuda")
    with pytest.raises(mk.BackendError, match="backend 'hip' needs a ROCm build"):
        mk.launch(print, world_size=2, backend="hip", virtual=True)
    with mk.Megakernel(g, workers=1) as kernel:  # "auto" falls back to the cpu backend
        assert kernel.backend.name == "cpu"
