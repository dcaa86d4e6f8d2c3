"""The task DAG of kernel images as Graphviz DOT, for ``megakernel graph``.

Nodes are tasks, one per table row of each image given (several images: one per rank, joined by
their cross-rank edges). Edges are the orderings the kernel enforces:

- a **wait** (solid): the tasks, local or on another rank, that raise the event a task waits on in
  its step (the drawing is one step: waits on the previous step's signals are left out);
- the **queue order** (dotted grey): a worker runs its queue one task after another. The scheduler
  drops every wait that this order already implies, so without these edges the drawing would miss
  most same-worker dependencies.

A producer on a rank whose image was not given is drawn as a dashed stub node named by rank and task.
Fill colour is the op kind (the op name without its scope: ``layer3/linear`` -> ``linear``), border
colour the rank. The critical path, highlighted in red, is the longest chain of tasks through both
kinds of edges, counted in tasks (no cost model; the table order is a topological order per rank):
the longest sequence this schedule forces to run one after another, the static counterpart of
``Trace.critical_path``, which follows the same two kinds of edges through a run's timestamps.

The writer only builds strings, so the command needs no Graphviz; ``render`` runs the ``dot`` binary
for SVG/PNG/PDF when it is installed.
"""
from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from graphlib import TopologicalSorter
from pathlib import Path

from ..scheduler import NO_EVENT, OPCODE, WAIT_EVENT, QueueTables
from ..trace import producer_map

Node = tuple[int, int]  # (rank, task)

# Fill colours for op kinds (assigned in sorted kind order) and border colours for ranks.
FILLS = ["#a6cee3", "#b2df8a", "#fdbf6f", "#cab2d6", "#fb9a99", "#ffff99", "#8dd3c7", "#bebada", "#80b1d3",
         "#fccde5", "#d9d9d9", "#ccebc5"]
BORDERS = ["#1f78b4", "#33a02c", "#ff7f00", "#6a3d9a", "#b15928", "#e31a1c", "#01665e", "#8c510a"]
CRITICAL = "#d7191c"


@dataclass(frozen=True)
class TaskInfo:
    op: str          # op name with its scope ("layer3/linear"); "" for a stub from an image not given
    tile: int        # index among its op's tiles
    task_type: str
    worker: int

    @property
    def kind(self) -> str:
        return self.op.rsplit("/", 1)[-1]


@dataclass
class TaskDag:
    tasks: dict[Node, TaskInfo] = field(default_factory=dict)
    waits: list[tuple[Node, Node]] = field(default_factory=list)
    queues: dict[tuple[int, int], list[Node]] = field(default_factory=dict)  # (rank, worker) -> tasks in order

    def queue_edges(self, keep: set[Node]) -> list[tuple[Node, Node]]:
        """Consecutive kept tasks of each worker's queue (a filter keeps the order between what is left)."""
        edges = []
        for queue in self.queues.values():
            kept = [n for n in queue if n in keep]
            edges.extend(zip(kept, kept[1:]))
        return edges


class TooManyNodes(ValueError):
    """The selection is larger than the caller's cap."""


class RenderError(RuntimeError):
    """Graphviz's ``dot`` is missing or failed."""


def task_dag(images: list[QueueTables]) -> TaskDag:
    """Nodes and edges of one or several ranks' tables."""
    dag = TaskDag()
    for t in images:
        owner = t.worker_of().tolist()
        first_of_op: dict[int, int] = {}
        for task, (row, op) in enumerate(zip(t.rows.tolist(), t.task_op.tolist())):
            first_of_op.setdefault(op, task)
            dag.tasks[(t.rank, task)] = TaskInfo(t.op_names[op], task - first_of_op[op], t.specs[row[OPCODE]].task_type,
                                                 owner[task])
        for w in range(t.workers):
            dag.queues[(t.rank, w)] = [(t.rank, task) for task in t.worker_queue(w).tolist()]
        raisers = producer_map(t)
        for task, event in enumerate(t.rows[:, WAIT_EVENT].tolist()):
            if event != NO_EVENT:
                dag.waits.extend((producer, (t.rank, task)) for producer in raisers[event])
    for producer, _ in dag.waits:
        dag.tasks.setdefault(producer, TaskInfo("", -1, "", -1))
    return dag


def critical_path(dag: TaskDag) -> list[Node]:
    """The longest chain of tasks through waits and queue order (ties go to the earliest task)."""
    predecessors: dict[Node, list[Node]] = {n: [] for n in dag.tasks}
    for p, c in dag.waits + dag.queue_edges(set(dag.tasks)):
        predecessors[c].append(p)
    length: dict[Node, int] = {}
    best: dict[Node, Node | None] = {}
    for node in TopologicalSorter(predecessors).static_order():
        before = min(predecessors[node], key=lambda p: (-length[p], p), default=None)
        best[node] = before
        length[node] = 1 + (length[before] if before is not None else 0)
    if not length:
        return []
    node: Node | None = min(length, key=lambda n: (-length[n], n))
    path = []
    while node is not None:
        path.append(node)
        node = best[node]
    return path[::-1]


def select(dag: TaskDag, op: str | None = None, layer: int | None = None) -> set[Node]:
    """Tasks whose op name contains ``op`` and lies in scope ``layer{layer}`` (any depth)."""
    scope = f"layer{layer}"
    return {n for n, info in dag.tasks.items()
            if (op is None or op in info.op) and (layer is None or scope in info.op.split("/")[:-1])}


def to_dot(dag: TaskDag, keep: set[Node] | None = None, max_nodes: int | None = None) -> str:
    """DOT text of the kept tasks (all by default) and the edges between them."""
    keep = set(dag.tasks) if keep is None else keep
    if max_nodes is not None and len(keep) > max_nodes:
        raise TooManyNodes(f"{len(keep)} tasks selected, more than --max-nodes {max_nodes}: narrow the selection "
                           f"with --layer N or --op NAME, or raise --max-nodes")
    path = critical_path(dag)
    on_path = set(path)
    path_edges = set(zip(path, path[1:]))
    kinds = sorted({info.kind for info in dag.tasks.values() if info.op})
    fill = {kind: FILLS[i % len(FILLS)] for i, kind in enumerate(kinds)}
    lines = ["digraph megakernel {",
             f'  graph [rankdir=TB, fontname=Helvetica, label="{_legend(dag, fill, keep, path)}", labelloc=b];',
             '  node [shape=box, style="filled,rounded", fontname=Helvetica, fontsize=10, penwidth=1.5];',
             "  edge [arrowsize=0.6];"]
    for node in sorted(keep):
        lines.append(f"  {_id(node)} [{_node_attrs(node, dag.tasks[node], fill, node in on_path)}];")
    for p, c in dag.waits:
        if p in keep and c in keep:
            lines.append(f"  {_id(p)} -> {_id(c)}{_edge_attrs((p, c) in path_edges, queue=False)};")
    for p, c in dag.queue_edges(keep):
        lines.append(f"  {_id(p)} -> {_id(c)}{_edge_attrs((p, c) in path_edges, queue=True)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _id(node: Node) -> str:
    return f"r{node[0]}t{node[1]}"


def _node_attrs(node: Node, info: TaskInfo, fill: dict[str, str], critical: bool) -> str:
    rank, task = node
    border = f'color="{BORDERS[rank % len(BORDERS)]}"'
    if not info.op:  # a producer on a rank whose image was not given
        return f'label="rank {rank}\\ntask {task}", style="dashed,rounded", {border}'
    label = f"{task}: {_escape(info.op)} #{info.tile}\\n{_escape(info.task_type)} r{rank} w{info.worker}"
    attrs = f'label="{label}", fillcolor="{fill[info.kind]}", {border}'
    return attrs + (", penwidth=2.5, peripheries=2" if critical else "")


def _edge_attrs(critical: bool, queue: bool) -> str:
    if critical:
        return f' [color="{CRITICAL}", penwidth=3{", style=dotted" if queue else ""}]'
    return ' [style=dotted, color="#999999"]' if queue else ""


def _legend(dag: TaskDag, fill: dict[str, str], keep: set[Node], path: list[Node]) -> str:
    ranks = sorted({rank for rank, _ in dag.tasks})
    fills = ", ".join(f"{kind} {colour}" for kind, colour in fill.items())
    borders = ", ".join(f"rank {r} {BORDERS[r % len(BORDERS)]}" for r in ranks)
    lines = [f"{len(keep)} of {len(dag.tasks)} tasks", f"fill: {fills}", f"border: {borders}",
             f"solid: waits; dotted: queue order; red: critical path ({len(path)} tasks, longest chain by task count)"]
    return "\\n".join(map(_escape, lines))


def _escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


def render(dot: str, path: Path) -> None:
    """Write ``dot`` to ``path``: as text for .dot/.gv, else through Graphviz's ``dot`` (format from the suffix)."""
    fmt = path.suffix.lstrip(".").lower()
    if fmt in ("dot", "gv", ""):
        path.write_text(dot)
        return
    binary = shutil.which("dot")
    if binary is None:
        raise RenderError(f"writing {path.name} needs Graphviz's `dot` program, which is not on PATH: "
                          f"install Graphviz (e.g. apt-get install graphviz), or write DOT text with "
                          f"-o {path.with_suffix('.dot').name} and render it elsewhere")
    done = subprocess.run([binary, f"-T{fmt}", "-o", str(path)], input=dot, text=True, capture_output=True)
    if done.returncode:
        raise RenderError(f"dot -T{fmt} failed: {done.stderr.strip()}")


__all__ = ["RenderError", "TaskDag", "TaskInfo", "TooManyNodes", "critical_path", "render", "select", "task_dag",
           "to_dot"]
