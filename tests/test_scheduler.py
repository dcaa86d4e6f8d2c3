"""The pure host scheduler: dependency inference, placement, events, the queue format, checks."""
import numpy as np
import pytest
import torch

import megakernel as mk
from megakernel.scheduler import (FAN_IN, NO_EVENT, VERSION, WAIT_EVENT, FormatError, Task, Tasks, check_acyclic,
                                  deserialize, disassemble, encode_events, find_cycle, infer_dependencies, place,
                                  schedule, serialize)


def _tasks(*accesses) -> Tasks:
    """Tasks in program order from their (reads, writes); opcode, args, cost and op do not matter here."""
    tasks = Tasks()
    for reads, writes in accesses:
        tasks.append(0, (), tuple(reads), tuple(writes), 1.0, 0)
    return tasks


SHAPES = {0: (64, 1024), 1: (64, 1024)}


def test_dependencies_follow_region_overlap_not_pointers():
    tasks = _tasks(
        ((), [(0, 0, 8, 0, 100)]),              # 0 writes a block
        ((), [(0, 0, 8, 100, 200)]),            # 1 writes a disjoint block: independent
        ([(0, 4, 6, 90, 110)], ()),             # 2 reads across both: RAW on 0 and 1
        ([(0, 0, 8, 150, 160)], ()),            # 3 reads inside 1 only
        ((), [(0, 5, 6, 95, 96)]),              # 4 overwrites what 2 read: WAR on 2, WAW on 0
        ([(1, 0, 64, 0, 1024)], ()),            # 5 reads a buffer nobody writes
    )
    assert infer_dependencies(tasks, SHAPES) == [(), (), (0, 1), (1,), (0, 2), ()]


def test_full_overwrite_prunes_history_but_keeps_order():
    overwrite = ((), [(0, 0, 64, 0, 1024)])
    tasks = _tasks(overwrite, overwrite, overwrite, ([(0, 0, 1, 0, 1)], ()))
    deps = infer_dependencies(tasks, SHAPES)
    assert deps == [(), (0,), (1,), (2,)]


def test_tasks_are_columns_and_rows_are_views_of_them():
    tasks = _tasks(((), [(0, 0, 8, 0, 100)]), ([(0, 4, 6, 90, 110)], ()))
    tasks.append(3, (7, 8), (), (), 2.5, 1, ((1, (0, 0, 1, 0, 1)),))
    assert len(tasks) == 3 and list(tasks.opcode) == [0, 0, 3] and tasks.reads[1] == ((0, 4, 6, 90, 110),)
    assert tasks[2] == Task(3, (7, 8), (), (), 2.5, 1, ((1, (0, 0, 1, 0, 1)),))
    tasks.truncate(1)
    assert tasks == _tasks(((), [(0, 0, 8, 0, 100)]))  # every column cut, not just one


def test_cycle_is_found_and_named():
    assert find_cycle([(), (2,), (1,)]) in ([1, 2], [2, 1])
    assert find_cycle([(), (0,), (0, 1)]) is None
    with pytest.raises(mk.GraphError, match="cycle: T1 -> T2 -> T1|cycle: T2 -> T1 -> T2"):
        check_acyclic([(), (2,), (1,)], describe=lambda t: f"T{t}")


def _chain_graph(layers=3):
    g = mk.Graph()
    x = g.input("x", (2, 200), torch.float32)
    w = g.input("w", (200, 200), torch.float32)
    for _ in range(layers):
        x = g.add(x, g.linear(g.rms_norm(x, w[0]), w))
    g.output("y", x)
    return g


@pytest.mark.parametrize("policy", ["round_robin", "critical_path"])
@pytest.mark.parametrize("workers", [1, 2, 5])
def test_placement_is_a_topological_order_and_queues_follow_it(policy, workers):
    g = _chain_graph()
    producers = infer_dependencies(g.tasks, g.buffer_shapes())
    placement = place(g.tasks, producers, workers, policy)
    position = {t: i for i, t in enumerate(placement.order)}
    assert sorted(placement.order) == list(range(len(g.tasks)))
    assert all(position[p] < position[t] for t, ps in enumerate(producers) for p in ps)
    assert set(placement.worker) <= set(range(workers))


def test_implied_waits_are_dropped():
    g = _chain_graph()
    producers = infer_dependencies(g.tasks, g.buffer_shapes())
    one = encode_events(place(g.tasks, producers, 1, "round_robin"), producers, 1)
    assert one.count == 0 and set(one.wait_event) == {NO_EVENT}  # one worker: program order is enough
    three = encode_events(place(g.tasks, producers, 3, "round_robin"), producers, 3)
    assert 0 < sum(f for f in three.fan_in) < sum(len(p) for p in producers)
    assert max(three.fan_in) <= 2  # at most one producer per other worker


def test_every_wait_is_met_by_exactly_its_producers_signals():
    g = _chain_graph()
    t = schedule(g.tasks, g.buffer_shapes(), specs=g.specs, op_names=g.op_names, workers=3)
    raised = np.zeros(t.num_events, dtype=np.int64)
    np.add.at(raised, t.signals[:, 1], t.signals[:, 2])
    waits = t.rows[t.rows[:, WAIT_EVENT] != NO_EVENT]
    assert np.array_equal(raised[waits[:, WAIT_EVENT]], waits[:, FAN_IN])


def test_serialize_round_trip_and_disassembly():
    g = _chain_graph(2)
    t = schedule(g.tasks, g.buffer_shapes(), specs=g.specs, op_names=g.op_names, workers=2)
    back = deserialize(serialize(t))
    for name in ("rows", "signals", "queue", "queue_index", "task_op"):
        assert np.array_equal(getattr(back, name), getattr(t, name)), name
    assert back.specs == t.specs and back.op_names == t.op_names and back.num_events == t.num_events
    text = disassemble(back)
    assert f"{len(t.rows)} tasks" in text and "rms_norm" in text and "worker 1:" in text
    assert serialize(back) == serialize(t)


def test_other_format_versions_are_refused_clearly():
    g = _chain_graph(1)
    blob = bytearray(serialize(schedule(g.tasks, g.buffer_shapes(), specs=g.specs, op_names=g.op_names, workers=2)))
    blob[8:16] = np.int64(VERSION + 1).tobytes()
    with pytest.raises(FormatError, match=f"version {VERSION + 1}.*reads version {VERSION}"):
        deserialize(bytes(blob))
    with pytest.raises(FormatError, match="magic"):
        deserialize(b"\0" * 200)
    with pytest.raises(FormatError, match="bytes"):
        deserialize(serialize(schedule(g.tasks, g.buffer_shapes(), specs=g.specs, op_names=g.op_names,
                                       workers=2))[:-3])


def test_unknown_policy_and_bad_worker_count():
    g = _chain_graph(1)
    with pytest.raises(mk.GraphError, match="unknown placement policy 'fifo'"):
        schedule(g.tasks, g.buffer_shapes(), specs=g.specs, op_names=g.op_names, workers=2, policy="fifo")
    with pytest.raises(mk.GraphError, match="at least one worker"):
        schedule(g.tasks, g.buffer_shapes(), specs=g.specs, op_names=g.op_names, workers=0)


def test_capacity_is_checked():
    from megakernel.scheduler import Capacity, check_tables
    g = _chain_graph(1)
    t = schedule(g.tasks, g.buffer_shapes(), specs=g.specs, op_names=g.op_names, workers=2)
    with pytest.raises(mk.GraphError, match=f"needs {len(t.rows)} tasks; one kernel holds at most 3"):
        check_tables(t, Capacity(max_tasks=3))


def _random_program(seed: int) -> tuple[Tasks, dict]:
    """A random program on a few buffers: rectangles of every size (whole cells, cell edges, single
    elements, the whole buffer), repeated reads of one rectangle (read groups), tasks that read and write."""
    rng = np.random.default_rng(seed)
    shapes = {b: (int(rng.choice([1, 2, 17, 40])), int(rng.choice([1, 100, 256, 600]))) for b in range(3)}

    def region(b):
        rows, cols = shapes[b]
        if rng.random() < 0.2:
            return (b, 0, rows, 0, cols)
        r0, c0 = int(rng.integers(rows)), int(rng.integers(cols))
        return (b, r0, int(rng.integers(r0, rows)) + 1, c0, int(rng.integers(c0, min(cols, c0 + 300))) + 1)

    tasks, last = Tasks(), {}
    for _ in range(int(rng.integers(1, 40))):
        reads = []
        for _ in range(int(rng.integers(0, 3))):
            b = int(rng.integers(3))
            last[b] = last[b] if b in last and rng.random() < 0.6 else region(b)
            reads.append(last[b])
        writes = [region(int(rng.integers(3))) for _ in range(int(rng.integers(0, 3)))]
        tasks.append(0, (), tuple(reads), tuple(writes), 1.0, 0)
    return tasks, shapes


def _conflicts(tasks: Tasks, u: int, t: int) -> bool:
    """Whether tasks u and t touch a common element, one of them writing it."""
    def meet(x, y):
        return x[0] == y[0] and x[1] < y[2] and y[1] < x[2] and x[3] < y[4] and y[3] < x[4]
    return (any(meet(w, r) for w in tasks.writes[u] for r in (*tasks.reads[t], *tasks.writes[t]))
            or any(meet(r, w) for r in tasks.reads[u] for w in tasks.writes[t]))


@pytest.mark.parametrize("seed", range(60))
def test_inferred_dependencies_order_every_conflict_within_and_across_steps(seed):
    """Soundness against the regions themselves, not the cells: in two consecutive steps, every pair of
    conflicting tasks is ordered by the dependencies (within a step, carried across it) and by each
    task following itself from one step to the next on its worker."""
    from megakernel.scheduler import infer_periodic
    tasks, shapes = _random_program(seed)
    n = len(tasks)
    within, carried = infer_periodic(tasks, shapes)
    assert within == infer_dependencies(tasks, shapes)
    assert all(p < t for t, ps in enumerate(within) for p in ps) and all(p > t for t, ps in enumerate(carried) for p in ps)
    after = [set() for _ in range(2 * n)]  # task t of step 1 is node t, of step 2 node n + t
    for t in range(n):
        after[t] = set(within[t])
        after[n + t] = {n + p for p in within[t]} | set(carried[t]) | {t}
    reach = []
    for node in range(2 * n):  # every edge points to a smaller node: one pass in node order closes them
        reach.append(set().union(*({p} | reach[p] for p in after[node])) if after[node] else set())
    for t in range(n):
        for u in range(n):
            if _conflicts(tasks, u, t):
                if u < t:
                    assert u in reach[t] and n + u in reach[n + t], (u, t)
                elif u > t:
                    assert u in reach[n + t], (u, t)


def test_a_row_of_tasks_at_once_is_the_same_as_one_at_a_time():
    g, h = mk.Graph(), mk.Graph()
    rows = [(g.input("x", (4, 64), torch.float32), g.new_tensor((4, 64), torch.float32)),
            (h.input("x", (4, 64), torch.float32), h.new_tensor((4, 64), torch.float32))]
    from megakernel.tasks.elementwise import BINARY
    for graph, (x, out) in zip((g, h), rows):
        graph.op_names.append("rows")
        opcode = graph.opcode(BINARY, OP="add", DTYPE=torch.float32, BLOCK_M=1, BLOCK_N=64, MANY_BLOCKS=False)
        words = dict(a=x.addr(0, 0), b=x.addr(0, 0), cols=64, out_stride=64, a_stride=64, b_stride=64)
        regions = [((x.region(r, 1, 0, 64),), (out.region(r, 1, 0, 64),)) for r in range(4)]
        if graph is g:
            for r, (reads, writes) in enumerate(regions):
                graph.add_task(opcode, out=out.addr(r, 0), rows=r + 1, reads=reads, writes=writes, bytes=768, flops=64,
                               **words)
        else:
            graph.add_tasks(opcode, out=range(out.addr(0, 0), out.addr(4, 0), 256), rows=[1, 2, 3, 4],
                            reads=[r for r, _ in regions], writes=[w for _, w in regions], bytes=[768] * 4,
                            flops=[64] * 4, **words)
    assert g.tasks == h.tasks and len(g.tasks) == 4
    with pytest.raises(mk.GraphError, match="missing argument word 'rows'"):
        h.add_tasks(opcode, out=[0], reads=[()], writes=[()], bytes=[0], flops=[0], **words)
    with pytest.raises(mk.GraphError, match="2 tasks' writes, but reads, bytes, flops or an argument word"):
        h.add_tasks(opcode, out=[0, 1, 2], rows=1, reads=[(), ()], writes=[(), ()], bytes=[0, 0], flops=[0, 0], **words)
    assert len(h.tasks) == 4


def test_a_region_of_the_wrong_width_is_refused_and_truncating_restores_the_columns():
    g = mk.Graph()
    x = g.input("x", (4, 64), torch.float32)
    g.add(x, x)
    before = (list(g.tasks.reads), list(g.tasks.writes), len(g.tasks))
    from megakernel.tasks.elementwise import BINARY
    opcode = g.opcode(BINARY, OP="add", DTYPE=torch.float32, BLOCK_M=1, BLOCK_N=64, MANY_BLOCKS=False)
    with pytest.raises(ValueError, match="other than 5 ints"):
        g.add_task(opcode, out=0, a=0, b=0, rows=1, cols=64, out_stride=64, a_stride=64, b_stride=64,
                   reads=((0, 0, 1, 0),), writes=(), bytes=0, flops=0)
    g.tasks.truncate(before[2])
    assert (list(g.tasks.reads), list(g.tasks.writes), len(g.tasks)) == before
