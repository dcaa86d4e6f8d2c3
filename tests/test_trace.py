"""Task-graph tracing and debugging: traces that respect the DAG, their files, the ``trace`` and ``graph``
commands, and a hang in a two-rank run named by its consumer and producer."""
import json
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pydot
import pytest
import torch

import megakernel as mk
from megakernel.files import reports_dir
from megakernel.image import load
from megakernel.models import DecoderConfig, ServingConfig, decode_step
from megakernel.scheduler import WAIT_EVENT, deserialize, infer_dependencies, schedule, serialize
from megakernel.tools.cli import main as cli
from megakernel.tools.dot import select, task_dag, to_dot
from megakernel.tools.examples import mlp_block
from megakernel.trace import Trace

from helpers import random_inputs

HANG_TIMEOUT = 2.0
TP_HIDDEN, TP_INTER = 64, 96
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:pydot.dot_parser")  # pydot's old pyparsing names


# -- a traced single-rank run ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One traced run of the MLP block on two workers: graph, tables, trace, its JSON file, the kernel image."""
    folder = tmp_path_factory.mktemp("single")
    g = mlp_block()
    with mk.Megakernel(g, workers=2, trace=True) as kernel:
        kernel.run(random_inputs(g, seed=3, scale=0.2))
        kernel.save_image(folder / "kernel.npz")
        tables, trace = kernel.tables, kernel.trace
    return g, tables, trace, trace.save(folder / "trace.json"), folder / "kernel.npz"


def _check_spans(trace: Trace, tasks_per_rank: dict[int, int]) -> None:
    """Every task exactly once, stamps ordered, and no two spans of one worker overlapping."""
    keys = [s.key for s in trace.spans]
    assert len(keys) == len(set(keys)) == sum(tasks_per_rank.values())
    assert set(keys) == {(r, t) for r, n in tasks_per_rank.items() for t in range(n)}
    by_worker = defaultdict(list)
    for s in trace.spans:
        assert s.wait_start <= s.start <= s.end, s
        by_worker[(s.rank, s.worker)].append(s)
    for spans in by_worker.values():
        spans.sort(key=lambda s: s.wait_start)
        for before, after in zip(spans, spans[1:]):
            assert before.end <= after.wait_start, f"{before} overlaps {after}"


def _check_order(trace: Trace, edges) -> None:
    spans = {s.key: s for s in trace.spans}
    for p, c in edges:
        assert spans[p].end <= spans[c].start, f"{spans[c]} started before its producer {spans[p]} ended"


def _check_chrome(path: Path, trace: Trace) -> None:
    """The file is Chrome trace JSON whose flow arrows start inside a producer's span and end at the start
    of a consumer's span, and which ``Trace.load`` reads back exactly."""
    events = json.loads(path.read_text())["traceEvents"]
    assert {"X", "M", "s", "f"} <= {e["ph"] for e in events}
    tasks = [e for e in events if e["ph"] == "X" and e["cat"] != "wait"]
    assert len(tasks) == len(trace.spans)
    flows = defaultdict(dict)
    for e in events:
        if e["ph"] in "sf":
            flows[e["id"]][e["ph"]] = e
    assert len(flows) == len(trace.edges) and all(set(pair) == {"s", "f"} for pair in flows.values())
    for pair in flows.values():
        s, f = pair["s"], pair["f"]
        assert any(x["pid"] == s["pid"] and x["tid"] == s["tid"] and x["ts"] <= s["ts"] <= x["ts"] + x["dur"]
                   for x in tasks), f"flow start {s} is in no task span"
        assert any(x["pid"] == f["pid"] and x["tid"] == f["tid"] and abs(x["ts"] - f["ts"]) < 1e-6
                   for x in tasks), f"flow end {f} is at no task's start"
    loaded = Trace.load(path)
    assert loaded.spans == trace.spans and loaded.edges == trace.edges


def test_single_rank_trace_respects_the_whole_dependency_dag(single):
    g, tables, trace, _, _ = single
    assert list(tables.task_op) == list(g.tasks.op)  # table rows are task ids: program order
    _check_spans(trace, {0: len(g.tasks)})
    dag = infer_dependencies(g.tasks, g.buffer_shapes())  # before pruning: same-worker edges included
    _check_order(trace, [((0, p), (0, c)) for c, producers in enumerate(dag) for p in producers])
    assert {s.worker for s in trace.spans} == {0, 1}


def test_trace_file_is_chrome_json_and_round_trips(single):
    _, _, trace, path, _ = single
    _check_chrome(path, trace)


def test_trace_summary_and_plot_commands(single, tmp_path, capsys):
    _, _, trace, path, _ = single
    assert cli(["trace", "summary", str(path)]) == 0
    assert f"{len(trace.spans)} tasks on 1 rank(s), 2 worker(s)" in capsys.readouterr().out
    png = tmp_path / "timeline.png"
    assert cli(["trace", "plot", str(path), "-o", str(png)]) == 0
    data = png.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


# -- the graph command -----------------------------------------------------------------------------
def _dot_graph(text: str) -> pydot.Dot:
    (graph,) = pydot.graph_from_dot_data(text)
    return graph


def _nodes(graph: pydot.Dot) -> set[str]:
    return {n.get_name() for n in graph.get_nodes()} - {"node", "edge", "graph"}  # minus the default statements


def _graph_command(capsys, *args: str) -> pydot.Dot:
    assert cli(["graph", *args]) == 0
    return _dot_graph(capsys.readouterr().out)


def test_graph_dot_parses_with_a_node_per_task_and_the_waits(single, capsys):
    g, tables, _, _, image = single
    graph = _graph_command(capsys, str(image))
    nodes = _nodes(graph)
    assert nodes == {f"r0t{t}" for t in range(len(g.tasks))}
    edges = {(e.get_source(), e.get_destination()) for e in graph.get_edges()}
    assert edges and all(p in nodes and c in nodes for p, c in edges)
    waits = {(f"r0t{p}", f"r0t{c}") for c, event in enumerate(tables.rows[:, WAIT_EVENT].tolist()) if event >= 0
             for p in tables.producers_of(event)}
    assert waits <= edges
    critical = [n for n in graph.get_nodes() if n.get("peripheries") == "2"]
    assert critical and f"r0t{len(g.tasks) - 1}" in {n.get_name() for n in critical}  # the residual add ends it


def test_graph_op_filter_and_node_cap(single, capsys, tmp_path):
    g, tables, _, _, image = single
    linear = sum(tables.op_names[op] == "linear" for op in tables.task_op.tolist())
    assert len(_nodes(_graph_command(capsys, str(image), "--op", "linear"))) == linear
    assert cli(["graph", str(image), "--max-nodes", "5"]) == 2
    assert f"{len(g.tasks)} tasks selected, more than --max-nodes 5" in capsys.readouterr().err
    out = tmp_path / "dag.dot"
    assert cli(["graph", str(image), "--op", "add", "-o", str(out)]) == 0
    assert len(_nodes(_dot_graph(out.read_text()))) == 1


def test_graph_image_format_without_graphviz_is_a_clear_error(single, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot binary on PATH, whatever is installed
    assert cli(["graph", str(single[4]), "-o", str(tmp_path / "dag.svg")]) == 2
    assert "needs Graphviz's `dot` program" in capsys.readouterr().err
    assert not (tmp_path / "dag.svg").exists()


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed")
def test_graph_renders_svg_with_graphviz(single, tmp_path):
    out = tmp_path / "dag.svg"
    assert cli(["graph", str(single[4]), "-o", str(out)]) == 0
    assert b"<svg" in out.read_bytes()


def _table_file(g: mk.Graph, path: Path) -> Path:
    tables = schedule(g.tasks, g.buffer_shapes(), specs=g.specs, op_names=g.op_names, workers=2)
    path.write_bytes(serialize(tables))
    return path


@pytest.fixture(scope="module")
def decode30(tmp_path_factory):
    """A 30-layer decode step (layers scoped ``layer{i}``), scheduled but not run, and its table file."""
    c = DecoderConfig(hidden=96, heads=4, kv_heads=2, head_dim=48, intermediate=200, layers=30, vocab=128, eps=1e-6,
                      qk_norm=False, serving=ServingConfig(max_seq_len=64, prefill_chunk=0))
    g = decode_step(c, mk.Graph(world_size=1, rank=0))
    return g, _table_file(g, tmp_path_factory.mktemp("decode") / "decode.mkt")


def test_thirty_layer_decode_graph_to_dot_in_seconds(decode30):
    g, path = decode30
    tables = load(path).tables
    start = time.monotonic()
    dag = task_dag([tables])
    text = to_dot(dag, select(dag), max_nodes=5000)
    assert time.monotonic() - start < 5
    assert len(re.findall(r"^  r0t\d+ \[", text, re.M)) == len(g.tasks) > 1000
    norms = sum(g.op_names[op].endswith("/rms_norm") for op in g.tasks.op)
    assert len(_nodes(_dot_graph(to_dot(dag, select(dag, op="rms_norm"))))) == norms == 2 * 30 + 1


def test_graph_layer_filter(decode30, capsys):
    g, path = decode30
    names = [g.op_names[op] for op in g.tasks.op]
    layer1 = {f"r0t{t}" for t, name in enumerate(names) if name.startswith("layer1/")}  # not layer10/ .. layer19/
    assert layer1 and _nodes(_graph_command(capsys, str(path), "--layer", "1")) == layer1
    linear = {f"r0t{t}" for t, name in enumerate(names) if name == "layer1/linear"}
    assert _nodes(_graph_command(capsys, str(path), "--layer", "1", "--op", "linear")) == linear
    assert cli(["graph", str(path), "--layer", "30"]) == 2
    assert "no task matches the filters; op names: embedding, head/linear" in capsys.readouterr().err


# -- two ranks: a traced run, then an injected hang --------------------------------------------------
def _tp_mlp() -> mk.Graph:
    """This rank's shards of a tensor-parallel MLP ending in an all_reduce (put tiles between the ranks)."""
    g = mk.Graph()
    shard = TP_INTER // g.world_size
    x = g.input("x", (1, TP_HIDDEN), torch.float32)
    gate = g.input("gate", (shard, TP_HIDDEN), torch.float32)
    up = g.input("up", (shard, TP_HIDDEN), torch.float32)
    down = g.input("down", (TP_HIDDEN, shard), torch.float32)
    g.output("y", g.all_reduce(g.linear(g.silu_mul(g.linear(x, gate), g.linear(x, up)), down)))
    return g


def _hang(inputs: dict) -> dict:
    """Every rank removes the increments of its signals for the peer's first cross-rank event, so each
    rank's consumer of that event waits forever: each rank's watchdog fires on its own, and no rank
    waits for another after the failed run."""
    g = _tp_mlp()
    with mk.Megakernel(g, workers=2, timeout=HANG_TIMEOUT, trace=True) as kernel:
        t = kernel.tables
        events = kernel.group.all_gather(min(t.remote_producers))
        peer = 1 - g.rank
        t.signals[(t.signals[:, 0] == peer) & (t.signals[:, 1] == events[peer]), 2] = 0
        kernel.upload_tables()
        kernel.group.barrier(timeout=60)  # no rank signals a peer before the peer has cleared its events
        start = time.monotonic()
        try:
            kernel.run(inputs)
        except mk.DeadlockError as error:
            event = events[g.rank]
            return dict(elapsed=time.monotonic() - start, message=str(error), report=error.report,
                        consumers=np.nonzero(t.rows[:, WAIT_EVENT] == event)[0].tolist(),
                        producers=[(rank, task) for rank, task, *_ in t.remote_producers[event]])
    return {}


def two_rank_job() -> tuple[Trace, bytes, dict]:
    """A traced run (every rank's trace and tables), then the injected hang."""
    g = _tp_mlp()
    inputs = random_inputs(g, seed=10 + g.rank, scale=0.2)
    with mk.Megakernel(g, workers=2, trace=True) as kernel:
        kernel.run(inputs)
        trace, tables = kernel.trace, serialize(kernel.tables)
    return trace, tables, _hang(inputs)


def _hang_files(hang: dict) -> list[Path]:
    """The files a DeadlockError's message names: the report and the partial trace."""
    return [Path(f) for f in re.search(r"\(report: ([^)]*)\)", hang["message"]).group(1).split(", ")]


@pytest.fixture(scope="module")
def two_ranks():
    """Each rank's (trace, serialized tables, hang outcome); the hang files are removed afterwards."""
    results = mk.launch(two_rank_job, world_size=2, timeout=300)
    yield results
    for _, _, hang in results:
        for f in _hang_files(hang) if hang else []:
            f.unlink(missing_ok=True)


@pytest.mark.slow
def test_two_rank_trace_has_every_task_once_and_respects_cross_rank_edges(two_ranks, tmp_path):
    trace = two_ranks[0][0]
    tables = [deserialize(blob) for _, blob, _ in two_ranks]
    assert trace.spans == two_ranks[1][0].spans  # every rank gathers every rank's spans
    _check_spans(trace, {t.rank: len(t.rows) for t in tables})
    cross = [(p, c) for p, c in trace.edges if p[0] != c[0]]
    assert cross, "an all_reduce has cross-rank edges"
    expected = {((r, task), (t.rank, consumer)) for t in tables for event, remote in t.remote_producers.items()
                for consumer in np.nonzero(t.rows[:, WAIT_EVENT] == event)[0].tolist() for r, task, *_ in remote}
    assert set(cross) == expected
    _check_order(trace, trace.edges)
    spans = {s.key: s for s in trace.spans}
    assert all(spans[p].comm for p, _ in cross), "cross-rank producers are put tiles"
    _check_chrome(trace.save(tmp_path / "trace.json"), trace)


@pytest.mark.slow
def test_two_rank_graph_joins_the_ranks(two_ranks, tmp_path, capsys):
    files = []
    for rank, (_, blob, _) in enumerate(two_ranks):
        files.append(tmp_path / f"rank{rank}.mkt")
        files[-1].write_bytes(blob)
    tables = [deserialize(blob) for _, blob, _ in two_ranks]
    graph = _graph_command(capsys, *map(str, files))
    assert _nodes(graph) == {f"r{t.rank}t{task}" for t in tables for task in range(len(t.rows))}
    assert any(e.get_source().startswith("r1") and e.get_destination().startswith("r0") for e in graph.get_edges())
    alone = _graph_command(capsys, str(files[0]))
    stubs = {n.get_name() for n in alone.get_nodes() if "dashed" in (n.get("style") or "")}
    in_step = set(tables[0].rows[:, WAIT_EVENT].tolist())  # the graph of one step: no waits on the step before
    assert stubs == {f"r1t{task}" for event, remote in tables[0].remote_producers.items() if event in in_step
                     for _, task, *_ in remote}


@pytest.mark.slow
def test_injected_hang_names_consumer_and_producer_and_leaves_a_partial_trace(two_ranks, capsys):
    for rank, (_, blob, hang) in enumerate(two_ranks):
        assert hang, f"rank {rank}: the run with a missing signal did not stop"
        assert hang["elapsed"] < HANG_TIMEOUT + 10, f"rank {rank}: the watchdog took {hang['elapsed']:.1f} s"
        report = hang["report"]
        assert any(f"timed out at task {c} (" in report for c in hang["consumers"]), report
        assert all(f"producer task {task} (" in report and f"on rank {r} " in report
                   for r, task in hang["producers"]), report
        files = _hang_files(hang)
        assert [re.fullmatch(rf"hang-rank{rank}-pid\d+-run1-\w+\.(txt|json)", f.name)[1] for f in files] \
            == ["txt", "json"]
        assert all(f.parent == reports_dir() for f in files) and reports_dir().stat().st_mode & 0o777 == 0o700
        assert files[0].read_text().strip() == report
        partial = Trace.load(files[1])
        finished = {s.task for s in partial.spans}
        assert {s.rank for s in partial.spans} == {rank}
        assert not finished & set(hang["consumers"]) and len(finished) < len(deserialize(blob).rows)
        assert cli(["trace", "summary", str(files[1])]) == 0
        assert f"{len(partial.spans)} tasks on 1 rank(s)" in capsys.readouterr().out
