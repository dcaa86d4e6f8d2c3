"""Periodic schedules: many steps per launch and launches with no host between them.

Random programs carry a state from one step to the next (a put into a buffer read at the start of
the step, on this rank or a peer) and are run for several steps in one launch and over several
launches: bitwise equal to each other and to the reference executor running the same steps one
after another. A small explicit-state search over every interleaving of the workers shows that no
wait is ever satisfied early and no count passes a target its waiter has not seen.
"""
import functools
import os
import re
import signal
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megakernel as mk
from megakernel.backends import cpu as cpu_backend
from megakernel.heap import HeapView
from megakernel.reference import execute_ranks
from megakernel.scheduler import (CARRY_EVENT, CARRY_FAN_IN, FAN_IN, SIGNAL_COUNT, SIGNAL_START, WAIT_EVENT,
                                  check_periodic, deserialize, serialize)

ROWS, COLS = 2, 24


@st.composite
def programs(draw):
    """Ops over a pool that starts with the state and an input; the last value goes into a rank's state."""
    ops = [(draw(st.sampled_from(["add", "mul", "all_reduce", "slice_add"])), draw(st.integers(0, 99)),
            draw(st.integers(0, 99))) for _ in range(draw(st.integers(1, 5)))]
    return ops, draw(st.integers(0, 2))  # ops, and which rank (me + shift) receives the new state


def periodic_graph(ops, shift: int) -> tuple[mk.Graph, mk.graph.Tensor]:
    g = mk.Graph()
    state = g.new_tensor((ROWS, COLS), torch.float32, name="state", comm=True)
    values = [state, g.input("x", (ROWS, COLS), torch.float32)]
    for kind, a, b in ops:
        t = values[a % len(values)]
        same = [v for v in values if v.shape == t.shape]
        u = same[b % len(same)]
        if kind == "all_reduce":
            values.append(g.all_reduce(t) if g.world_size > 1 else g.add(t, u))
        elif kind == "slice_add" and t.cols == COLS:  # half a buffer: dependencies on rectangles, not buffers
            values.append(g.add(t[:, : COLS // 2], u[:, COLS // 2:]))
        elif kind == "slice_add":
            values.append(g.add(t, u))
        else:
            values.append(getattr(g, kind)(t, u))
    last = values[-1] if values[-1].shape == (ROWS, COLS) else g.add(values[1], values[1])
    g.put(last, to_rank=(g.rank + shift) % g.world_size, into=state)
    g.output("state", state)
    g.output("last", last)
    return g, state


def _value(rank: int, seed: int) -> torch.Tensor:
    return torch.rand((ROWS, COLS), generator=torch.Generator().manual_seed(seed * 7 + rank)) * 0.2 + 0.9


def periodic_job(ops, shift: int, steps: int, split: list[int], workers: int, policy: str):
    """One rank: ``steps`` steps in one launch, then again from the same state in launches of ``split``;
    the tables, the heap before the first launch and both results."""
    g, state = periodic_graph(ops, shift)
    me = g.rank
    with mk.Megakernel(g, workers=workers, policy=policy, timeout=60) as kernel:
        kernel.bind({"x": _value(me, 1)})
        kernel.tensor(state).copy_(_value(me, 2))
        before = kernel.heap.cpu().clone()
        once = kernel.run(steps=steps)
        kernel.poison()  # a collective once the ranks have run: the host may write what peers write
        kernel.tensor(state).copy_(_value(me, 2))
        barriers = kernel.host_barriers
        for count in split:
            apart = kernel.run(steps=count)
        assert kernel.host_barriers == barriers + (g.world_size > 1)  # one meeting after the collective poison
        assert kernel.launches == 1 + len(split) and kernel.epoch == 2 * steps
        where = {name: (t.addr(0, 0), t.dtype, t.rows, t.cols, t.row_stride) for name, t in kernel.graph.outputs.items()}
        return serialize(kernel.tables), before, once, apart, where


@pytest.mark.timeout(900)
@settings(max_examples=16, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # one backend a test
@given(program=programs(), world=st.integers(1, 3), workers=st.integers(1, 3),
       policy=st.sampled_from(["round_robin", "critical_path"]), steps=st.sampled_from([1, 2, 5]), data=st.data())
@pytest.mark.slow
def test_steps_in_one_launch_equal_steps_over_launches_and_the_reference(backend, program, world, workers, policy,
                                                                         steps, data):
    ops, shift = program
    split = data.draw(st.sampled_from([c for c in _compositions(steps)]))
    job = functools.partial(periodic_job, ops, shift, steps, split, workers, policy)
    results = mk.launch(job, world_size=world, virtual=True, timeout=600) if world > 1 else [job()]
    tables = [deserialize(r[0]) for r in results]
    heaps = [r[1] for r in results]
    execute_ranks(tables, heaps, steps)
    what = f"{ops} shift {shift}, {world} ranks, {workers} workers, {policy}, {steps} steps as {split}"
    for me, (_, _, once, apart, where) in enumerate(results):
        view = HeapView(heaps[me])
        for name, (offset, dtype, rows, cols, stride) in where.items():
            expected = view.tensor(offset, dtype, rows, cols, stride)
            torch.testing.assert_close(once[name], expected, rtol=0, atol=0, equal_nan=True,
                                       msg=f"rank {me} {name}, one launch vs reference: {what}")
            torch.testing.assert_close(apart[name], once[name], rtol=0, atol=0, equal_nan=True,
                                       msg=f"rank {me} {name}, launches vs one launch: {what}")


def _compositions(n: int) -> list[list[int]]:
    """A few ways to cut ``n`` steps into launches: one by one, and a first launch of one then the rest."""
    return [[1] * n, [1, n - 1]] if n > 1 else [[1]]


# -- the protocol, over every interleaving ----------------------------------------------------------------
def interleavings(every: list, epochs: int = 3) -> int:
    """Explore every order in which the workers of every rank (``every[r]``: rank r's tables) may run their
    queues for ``epochs`` steps, each task atomic (its waits, its tile, its signals), under the weakest
    wait there is: a count at or above the target. Asserts, in every reachable state, that

    - a task passes a wait only when every producer of the event signalled for the step it waits on
      (no wait satisfied early, whatever ran ahead);
    - a signal never takes a count past the target of a wait that has not passed yet (an equality poll
      would miss it);
    - some worker can go on until every worker has finished (no deadlock).

    Returns the number of states visited.
    """
    workers = [(r, w) for r, t in enumerate(every) for w in range(t.workers)]
    queues = [every[r].worker_queue(w).tolist() for r, w in workers]
    producers: dict[tuple[int, int], set[tuple[int, int]]] = {}  # (rank, event) -> (rank, task) that raise it
    for r, t in enumerate(every):
        for task in range(len(t.rows)):
            start = t.rows[task, SIGNAL_START]
            for dst, event, _ in t.signals[start:start + t.rows[task, SIGNAL_COUNT]].tolist():
                producers.setdefault((dst, event), set()).add((r, task))
    waiters: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (rank, event) -> (worker, position, lag)
    for index, (r, _) in enumerate(workers):
        for position, task in enumerate(queues[index]):
            for word, lag in ((WAIT_EVENT, 0), (CARRY_EVENT, 1)):
                if every[r].rows[task, word] >= 0:
                    waiters.setdefault((r, int(every[r].rows[task, word])), []).append((index, position, lag))
    length = [len(q) for q in queues]
    where = {(r, task): (index, position) for index, (r, _) in enumerate(workers)
             for position, task in enumerate(queues[index])}

    def finished(pcs, r, task) -> int:
        """How many steps of rank r's ``task`` have finished in state ``pcs``."""
        index, position = where[r, task]
        return pcs[index] // length[index] + (pcs[index] % length[index] > position)

    def count(pcs, key) -> int:
        return sum(finished(pcs, r, task) for r, task in producers.get(key, ()))

    seen, stack = set(), [tuple([0] * len(workers))]
    while stack:
        pcs = stack.pop()
        if pcs in seen:
            continue
        seen.add(pcs)
        moves = 0
        for index, (r, _) in enumerate(workers):
            if pcs[index] == epochs * length[index]:
                continue
            step, position = divmod(pcs[index], length[index])
            step += 1
            task = queues[index][position]
            row = every[r].rows[task]
            ready = True
            for event, fan_in, target_step in ((row[WAIT_EVENT], row[FAN_IN], step),
                                               (row[CARRY_EVENT], row[CARRY_FAN_IN], step - 1)):
                if event < 0 or target_step < 1:
                    continue
                key = (r, int(event))
                if count(pcs, key) < target_step * fan_in:
                    ready = False
                    continue
                early = [p for p in producers[key] if finished(pcs, *p) < target_step]
                assert not early, f"rank {r} task {task} passes its wait on event {event} in step {step} before {early}"
            if not ready:
                continue
            moves += 1
            after = list(pcs)
            after[index] += 1
            after = tuple(after)
            start = row[SIGNAL_START]
            for dst, event, _ in every[r].signals[start:start + row[SIGNAL_COUNT]].tolist():
                key = (dst, event)
                total = count(after, key)
                fan_in = len(producers[key])
                for waiter, at, lag in waiters.get(key, ()):
                    passed = after[waiter]
                    for s in range(1 + lag, epochs + 1):  # the waiter's step s waits for (s - lag) * fan_in
                        if passed <= (s - 1) * length[waiter] + at:  # step s of the waiter has not passed its wait
                            assert total <= (s - lag) * fan_in, (
                                f"rank {r} task {task} takes event {event} of rank {dst} to {total}, past the "
                                f"target {(s - lag) * fan_in} of a wait in step {s} that has not passed")
                            break
            stack.append(after)
        assert moves or all(pcs[i] == epochs * length[i] for i in range(len(workers))), f"deadlock at {pcs}"
    return len(seen)


def model_job(ops, shift: int, workers: int):
    g, _ = periodic_graph(ops, shift)
    with mk.Megakernel(g, workers=workers, policy="round_robin") as kernel:  # spread: waits between workers
        return serialize(kernel.tables)


@pytest.mark.parametrize("world,workers,program", [
    (1, 2, ([("add", 0, 1), ("mul", 1, 1), ("add", 2, 3)], 0)),
    (1, 3, ([("slice_add", 0, 1), ("mul", 1, 1), ("add", 0, 1), ("mul", 5, 3)], 0)),
    (2, 1, ([("all_reduce", 0, 0)], 1)),
    (2, 2, ([("mul", 1, 1), ("all_reduce", 0, 0), ("add", 3, 2)], 1)),
])
@pytest.mark.slow
def test_no_wait_is_satisfied_early_in_any_interleaving(world, workers, program):
    ops, shift = program
    job = functools.partial(model_job, ops, shift, workers)
    every = [deserialize(blob) for blob in (mk.launch(job, world_size=world, virtual=True, timeout=300)
                                            if world > 1 else [job()])]
    check_periodic(every)
    assert interleavings(every) > 1 + 3 * sum(len(t.rows) for t in every)  # more than one order was explored


def test_the_checks_catch_a_lapped_counter():
    """Two producers on one counter, their consumer on a third worker, and no credit back: the pre-launch
    check and the interleavings both find that a producer running ahead laps the count."""
    g = mk.Graph(world_size=1, rank=0)
    a, b = g.input("a", (1, 8), torch.float32), g.input("b", (1, 8), torch.float32)
    g.output("y", g.add(g.add(a, a), g.add(b, b)))
    with mk.Megakernel(g, workers=3, policy="round_robin") as kernel:
        t = kernel.tables
    consumer = int(np.flatnonzero(t.rows[:, FAN_IN] == 2)[0])
    t.rows[consumer, CARRY_EVENT] = -1  # nothing here needs a carry; take the producers' credits away instead
    for producer in range(len(t.rows)):
        t.rows[producer, CARRY_EVENT] = -1
    with pytest.raises(mk.GraphError, match="lapped"):
        check_periodic([t])
    with pytest.raises(AssertionError, match="past the target|early"):
        interleavings([t])


# -- a rank that stops in the middle of a multi-step launch -----------------------------------------------
def stalled_in_a_long_launch(steps: int):
    """Rank 1's worker is stopped (SIGSTOP) for 6 s, 0.5 s into a launch of ``steps`` steps: rank 0's watchdog
    names it, with the step each side was in."""
    g = mk.Graph()
    g.output("y", g.all_reduce(g.input("x", (2, 32), torch.float32)))
    with mk.Megakernel(g, workers=1, timeout=2) as kernel:
        kernel.run({"x": torch.randn(2, 32)})  # the first launch meets; the next one does not
        if g.rank == 1:
            worker = cpu_backend.default_pool().workers[0].process.pid
            threading.Timer(0.5, os.kill, (worker, signal.SIGSTOP)).start()
            threading.Timer(6.5, os.kill, (worker, signal.SIGCONT)).start()
        try:
            kernel.run(steps=steps)
        except mk.DeadlockError as error:
            return error.report
        return "no error"


@pytest.mark.slow
def test_a_rank_stalled_in_a_multi_step_launch_is_named_with_its_step(backend, monkeypatch):
    from test_multirank import _TAG, _shm_segments, assert_nothing_left
    monkeypatch.setenv(*_TAG.decode().split("=", 1))
    before = _shm_segments()
    steps = {"cpu": 1000, "torch": 10**6}[backend]  # more than half a second's worth
    report, _ = mk.launch(functools.partial(stalled_in_a_long_launch, steps), world_size=2, timeout=120)
    waiting = re.search(r"rank 0 worker 0: step (\d+): timed out at task \d+", report)
    assert waiting and int(waiting.group(1)) > 2, report  # in the middle of the launch (step 1 was the first run)
    peer = re.search(r"producer task \d+ \([^)]*\) on rank 1 worker 0 queue position \d+: did not run "
                     r"\(rank 1 worker 0 (finished \d+ tasks of|is at) step (\d+)\)", report)
    assert peer and int(peer.group(2)) <= int(waiting.group(1)), report
    assert_nothing_left(before)
