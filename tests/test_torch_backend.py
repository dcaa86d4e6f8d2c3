"""The torch backend: the engine's atomics across processes, its loop against the reference executor, and
a real checkpoint (SmolLM2-135M) decoding exactly as transformers does, at TP 1 and 2."""
import dataclasses
from contextlib import contextmanager
import multiprocessing as mp
import time

import numpy as np
import pytest
import torch

import megakernel as mk
from megakernel import atomics
from megakernel.heap import SharedHeap
from megakernel.scheduler import infer_dependencies
from megakernel.tasks import TASK_TYPES
from megakernel.tools.examples import every_task_type, example_inputs, mlp_block

from helpers import SMOLLM2_NEW_TOKENS, SMOLLM2_PROMPT, random_inputs, run_checked

ADDS = 20_000


def _adder(name: str, size: int, word: int, adds: int) -> None:
    heap = SharedHeap(name, size)
    at = atomics.addresses(heap.address + 8 * word)
    one = np.ones(1, dtype=np.int64)
    for _ in range(adds):
        atomics.add(at, one)


def _messenger(name: str, size: int, rounds: int) -> None:
    """Word 0: the flag (released after the payload); words 1..8: the payload of round r, all r."""
    heap = SharedHeap(name, size)
    words = heap.tensor.view(torch.int64).numpy()
    flag = atomics.addresses(heap.address)
    for r in range(1, rounds + 1):
        words[1:9] = r
        atomics.add(flag, np.ones(1, dtype=np.int64))
        while words[0] != 2 * r:  # the reader's acknowledgement
            pass


def _forked(target, *args) -> mp.Process:
    process = mp.get_context("fork").Process(target=target, args=args, daemon=True)
    process.start()
    return process


def _finish(processes: list[mp.Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in processes:
        p.join(max(deadline - time.monotonic(), 0.1))
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    assert not alive, f"{len(alive)} processes did not finish in {timeout} s"
    assert all(p.exitcode == 0 for p in processes), [p.exitcode for p in processes]


@contextmanager
def _shared_words():
    """A zeroed shared-memory segment as int64 words, and a list for the processes that use it: they are
    killed and the segment unlinked however the test ends."""
    heap, processes = SharedHeap.create(4096), []
    try:
        words = heap.tensor.view(torch.int64).numpy()
        words[:] = 0
        yield heap, words, processes
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
        heap.unlink()


def test_adds_from_four_processes_on_one_word_lose_no_update():
    with _shared_words() as (heap, words, processes):
        processes += [_forked(_adder, heap.name, heap.size, 3, ADDS) for _ in range(4)]
        _finish(processes, timeout=120)
        assert words[3] == 4 * ADDS and not words[:3].any() and not words[4:].any()


def test_what_a_release_add_follows_is_seen_after_an_acquire():
    rounds = 2000
    with _shared_words() as (heap, words, processes):
        processes.append(_forked(_messenger, heap.name, heap.size, rounds))
        flag = atomics.addresses(heap.address)
        deadline = time.monotonic() + 120
        for r in range(1, rounds + 1):
            while words[0] != 2 * r - 1:
                assert time.monotonic() < deadline, f"round {r}: no message"
            assert atomics.load_acquire(flag) == 2 * r - 1
            assert (words[1:9] == r).all(), f"round {r}: the payload {words[1:9]} is not the released one"
            atomics.add(flag, np.ones(1, dtype=np.int64))
        _finish(processes, timeout=60)


def test_a_worker_preempted_twice_in_a_short_while_polls_briefly(monkeypatch):
    """Cores shared with another program, which no count of cores tells: two involuntary context switches
    within SHARED_S make a worker's waits poll SHORT_SPIN_S and nap at most SHARED_NAP_S for SHARED_S; a
    single one (a passing kernel thread) does not. (The speed it buys: bench/torch_backend.py.)"""
    from types import SimpleNamespace
    from megakernel.backends import torch_loop
    switches = iter([0, 1, 2, 2, 2])
    monkeypatch.setattr(torch_loop.resource, "getrusage", lambda _: SimpleNamespace(ru_nivcsw=next(switches)))
    waits = torch_loop.Waits(np.zeros(4, np.int64), 0, 0, 1, np.zeros(8, np.int64), 10**9, torch_loop.SPIN_S, {})
    alone, shared = (torch_loop.SPIN_S, torch_loop.MAX_NAP_S), (torch_loop.SHORT_SPIN_S, torch_loop.SHARED_NAP_S)
    window = torch_loop.SHARED_S
    assert waits._spin(10.0) == alone                     # never preempted
    assert waits._spin(11.0) == alone                     # preempted once
    assert waits._spin(11.0 + window / 2) == shared       # again, soon after
    assert waits._spin(11.0 + window) == shared           # for a while
    assert waits._spin(11.0 + 2 * window) == alone        # then not


def test_every_task_type_gives_what_the_reference_executor_gives():
    """The loop runs each task type's reference: with the tables and heap the kernel ran, the executor's
    outputs are the kernel's, bit for bit."""
    g = every_task_type()
    assert {s.task_type for s in g.specs} == set(TASK_TYPES)
    with mk.Megakernel(g, workers=3, backend="torch") as kernel:
        run_checked(g, example_inputs(g, seed=3), kernel=kernel, exact=True)


def test_queues_dealt_out_over_fewer_workers_give_what_the_reference_executor_gives(monkeypatch):
    """With fewer cores free than workers (``core_share``), a worker runs several queues' tasks in the global
    order and the others run none: the same outputs, bit for bit, whichever plan each launch gets."""
    from megakernel.backends import torch_loop
    from megakernel.backends.core_share import plan
    assert plan(3, 3.0) == ((0,), (1,), (2,)) and plan(3, 0.4) == ((0, 1, 2), (), ())
    assert plan(3, 2.0) == ((0, 2), (1,), ()) and plan(2, 1.6) == ((0,), (1,))
    plans = iter([plan(3, 1.0), plan(3, 3.0), plan(3, 2.0), plan(3, 1.0)])
    monkeypatch.setattr(torch_loop, "plan", lambda workers, free: next(plans))
    g = every_task_type()
    with mk.Megakernel(g, workers=3, backend="torch") as kernel:
        for seed in range(4):
            run_checked(g, example_inputs(g, seed=seed), kernel=kernel, exact=True)
    assert next(plans, None) is None  # a launch each


def test_a_busy_program_leaves_one_core_of_two():
    """``CoreShare.look``: the job's cores less what another program kept busy since the last look."""
    import os
    import subprocess
    import sys
    from megakernel.backends.core_share import CoreShare
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("one core: nothing to share")
    share = CoreShare(frozenset(cores[:2]), lambda: [os.getpid()])
    share.look()
    loop = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cores[0]}}})\nwhile True: pass"])
    try:
        time.sleep(0.6)
        assert share.look() < 1.5
    finally:
        loop.kill()
        loop.wait()


def test_the_hosts_work_around_a_launch_is_on_one_torch_thread(monkeypatch):
    """Binding inputs and copying outputs on one torch thread (after a parallel op torch's other threads spin
    on the cores the workers run on); the caller's thread count is its own again after a run, and after a
    run refused."""
    g = mlp_block()
    seen = []
    outputs = mk.Megakernel._outputs
    monkeypatch.setattr(mk.Megakernel, "_outputs", lambda self: seen.append(torch.get_num_threads()) or outputs(self))
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with mk.Megakernel(g, workers=2, backend="torch") as kernel:
            kernel.run(random_inputs(g, seed=3, scale=0.2))
            assert seen == [1] and torch.get_num_threads() == 3
            with pytest.raises(mk.GraphError):
                kernel.run({"no such input": torch.zeros(1)})
            assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(threads)


def test_a_worker_keeps_the_memory_its_tiles_free(monkeypatch):
    """Worker processes start with glibc's malloc settings that keep freed blocks (``cpu.MALLOC_SETTINGS``:
    a tile's temporaries are not faulted in afresh each step), unless the caller's environment sets one."""
    import os
    from megakernel.backends.cpu import MALLOC_SETTINGS, WorkerPool
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "12345")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    pool = WorkerPool()
    try:
        (worker,) = pool.ensure(1)
        with open(f"/proc/{worker.process.pid}/environ", "rb") as f:
            environ = dict(entry.decode().split("=", 1) for entry in f.read().split(b"\0") if b"=" in entry)
    finally:
        pool.close()
    assert environ["MALLOC_MMAP_THRESHOLD_"] == MALLOC_SETTINGS["MALLOC_MMAP_THRESHOLD_"]
    assert environ["MALLOC_TRIM_THRESHOLD_"] == "12345" and "MALLOC_TRIM_THRESHOLD_" in MALLOC_SETTINGS


def test_a_traced_run_stamps_every_task_once_in_dependency_order():
    from test_trace import _check_order, _check_spans
    g = mlp_block()
    with mk.Megakernel(g, workers=2, trace=True, backend="torch") as kernel:
        kernel.run(random_inputs(g, seed=3, scale=0.2))
        trace = kernel.trace
    _check_spans(trace, {0: len(g.tasks)})
    dag = infer_dependencies(g.tasks, g.buffer_shapes())  # same-worker edges included
    _check_order(trace, [((0, p), (0, c)) for c, producers in enumerate(dag) for p in producers])
    assert {s.worker for s in trace.spans} == {0, 1} and "linear" in trace.summary()


def test_a_worker_keeps_a_laid_out_weight_until_the_host_writes_it_again():
    """A linear tile's weight, laid out for oneDNN (``tasks.common.linear_rows``), is kept between launches
    while no one writes it: each way the host may write it (bind, bind of the same input again, a view from
    ``tensor``), and a weight a task writes, computes with the new values, as float64 does. Which inputs
    count as written only by ``bind`` (``HostWrites``): not the one a task writes, not one handed out."""
    g = mk.Graph(world_size=1, rank=0, parallelism=2, few_tiles=True)
    x = g.input("x", (3, 64), torch.float32)
    w = g.input("w", (40, 64), torch.float32)
    t, m = g.input("t", (40, 16), torch.float32), g.input("m", (64, 16), torch.float32)
    u = g.linear(t, m, out=g.input("u", (40, 64), torch.float32))  # an input that a task writes: t @ m.T
    g.output("y", g.linear(x, w))
    g.output("z", g.linear(x, u))
    xs, ms = torch.randn(3, 64, dtype=torch.float64), torch.randn(64, 16, dtype=torch.float64)
    with mk.Megakernel(g, backend="torch", workers=2) as kernel:
        counted = {name for name, given in kernel.graph.inputs.items()
                   if given.buffer.index in kernel.host_writes.areas}
        assert counted == {"x", "w", "t", "m"}
        weights = [torch.randn(40, 64) for _ in range(3)]
        for i, bound in enumerate([weights[0], weights[0], weights[1]]):  # kept, then others bound; u anew
            ts = torch.randn(40, 16, dtype=torch.float64)
            out = run_checked(g, {"x": xs.float(), "w": bound, "t": ts.float(), "m": ms.float(), "u": bound},
                              kernel=kernel, exact=True)
            assert torch.allclose(out["y"].double(), xs @ bound.double().T, atol=1e-4)
            assert torch.allclose(out["z"].double(), xs @ (ts @ ms.T).T, atol=1e-3)
        kernel.tensor(kernel.graph.inputs["w"]).copy_(weights[2])  # through a view: compared from now on
        assert kernel.graph.inputs["w"].buffer.index not in kernel.host_writes.areas
        out = run_checked(g, {"x": xs.float()}, kernel=kernel, exact=True)
        assert torch.allclose(out["y"].double(), xs @ weights[2].double().T, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_linear_multiplies_the_rows_that_hold_a_sequence_each_to_the_same_bits_whichever_are_beside_it(dtype):
    """``linear(..., pos=)`` on the torch backend multiplies only the rows that hold a sequence (the first
    ones, a few apart, one alone, none) and zeroes the others: bit for bit what the reference executor gives,
    and each live row the bits it has when every row holds one (K = 1536, where oneDNN would sum one row
    alone in another order: ``linear_rows``), so that a sequence's logits do not depend on its batch."""
    rows, k, n = 9, 1536, 48
    g = mk.Graph()
    x, w, pos = g.input("x", (rows, k), dtype), g.input("w", (n, k), dtype), g.input("pos", (rows,), torch.int64)
    g.output("y", g.linear(x, w, pos=pos))
    xs, ws = torch.randn(rows, k).to(dtype), torch.randn(n, k).to(dtype)
    with mk.Megakernel(g, workers=2, backend="torch") as kernel:
        every = run_checked(g, {"x": xs, "w": ws, "pos": torch.arange(rows)}, kernel=kernel, exact=True)["y"].clone()
        for live in ([0, 1, 2], [0], [4], [1, 5, 8], []):
            pos = torch.full((rows,), -1)
            pos[live] = torch.tensor(live, dtype=torch.int64) + 3
            y = run_checked(g, {"pos": pos}, kernel=kernel, exact=True)["y"]
            assert torch.equal(y[live], every[live]), live
            assert not y[pos < 0].any(), live


def test_a_workers_heap_reads_runs_of_words_as_the_reference_heap_does():
    """``WorkerHeap.words`` (numpy, one call: positions of a tile's rows) against ``HeapView.words``."""
    from megakernel.backends.torch_loop import WorkerHeap
    from megakernel.errors import GraphError
    from megakernel.heap import HeapView, RankHeap
    whole = torch.zeros(512, dtype=torch.uint8)
    whole.view(torch.int64)[:] = torch.randint(-5, 1 << 40, (64,))
    worker, reference = WorkerHeap(whole), HeapView(RankHeap(whole, whole[:0]))
    for offset, count, step in ((0, 1, 8), (16, 8, 8), (24, 5, 16), (504, 1, 8), (40, 4, 0)):
        assert worker.words(offset, count, step) == reference.words(offset, count, step) == [
            int(whole.view(torch.int64)[(offset + i * step) // 8]) for i in range(count)]
    for offset, count, step in ((4, 2, 8), (0, 2, 12), (504, 2, 8)):  # unaligned, not whole words, past the end
        with pytest.raises(GraphError):
            reference.words(offset, count, step)
        with pytest.raises(GraphError):
            worker.words(offset, count, step)


def test_a_task_type_without_a_torch_implementation_is_named(monkeypatch):
    g = mk.Graph()
    x = g.input("x", (4, 32), torch.float32)
    g.output("y", g.add(x, x))
    monkeypatch.setitem(TASK_TYPES, "binary", dataclasses.replace(TASK_TYPES["binary"], reference=None))
    with pytest.raises(mk.BackendError, match="task type 'binary' has none"):
        mk.Megakernel(g, backend="torch")


# -- a real checkpoint ---------------------------------------------------------------------------------
def _smollm2_tokens(model, tokens_per_launch: int | None):
    from megakernel.serving import from_hf
    decoder = from_hf(model, max_seq_len=32, backend="torch", workers=2)
    try:
        return decoder.generate(SMOLLM2_PROMPT, SMOLLM2_NEW_TOKENS, tokens_per_launch=tokens_per_launch)
    finally:
        decoder.close()


@pytest.mark.parametrize("world", [1, 2])
def test_smollm2_greedy_tokens_are_transformers_tokens(smollm2, world):
    """At TP 2 its 3 KV heads (and 9 heads) are padded to 4 across the ranks."""
    with torch.no_grad():
        expected = smollm2.generate(SMOLLM2_PROMPT, max_new_tokens=SMOLLM2_NEW_TOKENS, do_sample=False, pad_token_id=0)
    results = mk.launch(lambda: _smollm2_tokens(smollm2, 5 if world == 2 else None), world_size=world,
                        virtual=True, backend="torch", timeout=600)
    for rank, tokens in enumerate(results):
        assert torch.equal(tokens, expected), f"rank {rank}: {tokens.tolist()} vs transformers {expected.tolist()}"
