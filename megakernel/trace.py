"""Task-graph traces: who ran what, where and when, and what waited on what.

The kernel records, per task, when its worker started waiting for it, started running it and
finished it (just before its signals), on the backend's clock (``device.CLOCKS``): host
``CLOCK_MONOTONIC`` nanoseconds on the cpu backend, shared by every process of the machine;
``%globaltimer`` on CUDA and ``s_memrealtime`` on AMD, each shared by the whole GPU, so the virtual
ranks of one GPU are on one time base. Process ranks on different GPUs are not aligned to each other
(no host/device timestamp pair is taken at launch yet). Edges come from the task tables: a
consumer's wait event and the tasks, local or remote, that raise it.

``Trace.save`` writes Chrome trace JSON that Perfetto and chrome://tracing open: one process per rank,
one thread per worker, a span per task and per wait, flow arrows from producer to consumer. The
same file carries the raw spans and edges, so ``Trace.load`` reads it back exactly.
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .scheduler import NO_EVENT, OPCODE, SIGNAL_START, WAIT_EVENT, QueueTables, read_signals
from .tasks import TASK_TYPES


@dataclass(frozen=True)
class Span:
    rank: int
    worker: int
    task: int        # row in its rank's tables (global order)
    op: str          # op name, with its scope ("layer3/linear")
    op_index: int
    tile: int        # the task's index among its op's tiles
    task_type: str
    wait_start: int  # ns; wait_start <= start <= end
    start: int
    end: int
    comm: bool = False  # a communication tile (its task type stores into peers' heaps)

    @property
    def key(self) -> tuple[int, int]:
        return self.rank, self.task


def producer_map(t: QueueTables) -> dict[int, list[tuple[int, int]]]:
    """event -> the (rank, task) pairs that raise it, local and remote."""
    raisers: dict[int, list[tuple[int, int]]] = defaultdict(list)
    if len(t.signals):
        owner = np.searchsorted(t.rows[:, SIGNAL_START], np.arange(len(t.signals)), side="right") - 1
        for signal, task in zip(read_signals(t.signals), owner.tolist()):
            if signal.rank == t.rank:
                raisers[signal.event].append((t.rank, task))
    for event, remote in t.remote_producers.items():
        raisers[event].extend((rank, task) for rank, task, *_ in remote)
    return raisers


def rank_trace(t: QueueTables, stamps: np.ndarray) -> tuple[list[Span], list]:
    """Spans and incoming edges of one rank's finished tasks, from its tables and [tasks, 3] timestamps
    (zero where a task did not finish: a partial trace after a hang)."""
    owner = t.worker_of()
    first_of_op: dict[int, int] = {}
    spans, edges = [], []
    raisers = producer_map(t)
    for task, (row, op_index) in enumerate(zip(t.rows.tolist(), t.task_op.tolist())):
        first_of_op.setdefault(op_index, task)
        wait_start, start, end = (int(v) for v in stamps[task])
        if end == 0:
            continue
        task_type = t.specs[row[OPCODE]].task_type
        spans.append(Span(t.rank, int(owner[task]), task, t.op_names[op_index], op_index, task - first_of_op[op_index],
                          task_type, wait_start, start, end, TASK_TYPES[task_type].needs_peers))
        if row[WAIT_EVENT] != NO_EVENT:
            edges.extend((producer, (t.rank, task)) for producer in raisers[row[WAIT_EVENT]])
    return spans, edges


class Trace:
    def __init__(self, spans: list[Span], edges: list[tuple[tuple[int, int], tuple[int, int]]]):
        self.spans = sorted(spans, key=lambda s: (s.rank, s.worker, s.start))
        by_key = {s.key for s in self.spans}
        self.edges = [(p, c) for p, c in edges if p in by_key and c in by_key]

    # -- files ------------------------------------------------------------------------------------
    def chrome(self) -> dict:
        origin = min((s.wait_start for s in self.spans), default=0)
        us = lambda ns: (ns - origin) / 1e3  # noqa: E731
        events: list[dict] = []
        for rank in sorted({s.rank for s in self.spans}):
            events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        for rank, worker in sorted({(s.rank, s.worker) for s in self.spans}):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": worker,
                           "args": {"name": f"worker {worker}"}})
        for s in self.spans:
            common = {"pid": s.rank, "tid": s.worker}
            if s.start > s.wait_start:
                events.append({**common, "ph": "X", "name": "wait", "cat": "wait", "ts": us(s.wait_start),
                               "dur": us(s.start) - us(s.wait_start), "args": {"task": s.task}})
            events.append({**common, "ph": "X", "name": s.op, "cat": "comm" if s.comm else "compute",
                           "ts": us(s.start), "dur": us(s.end) - us(s.start),
                           "args": {"task": s.task, "op": s.op_index, "tile": s.tile, "type": s.task_type}})
        spans = {s.key: s for s in self.spans}
        for n, (p, c) in enumerate(self.edges):
            producer, consumer = spans[p], spans[c]
            events.append({"ph": "s", "id": n, "name": "dependency", "cat": "flow", "pid": producer.rank,
                           "tid": producer.worker, "ts": us(producer.end) - 1e-3})
            events.append({"ph": "f", "bp": "e", "id": n, "name": "dependency", "cat": "flow", "pid": consumer.rank,
                           "tid": consumer.worker, "ts": us(consumer.start)})
        return {"traceEvents": events, "displayTimeUnit": "ns",
                "megakernel": {"spans": [asdict(s) for s in self.spans], "edges": self.edges}}

    def save(self, path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.chrome()))
        return path

    @classmethod
    def load(cls, path) -> "Trace":
        data = json.loads(Path(path).read_text())["megakernel"]
        return cls([Span(**s) for s in data["spans"]], [(tuple(p), tuple(c)) for p, c in data["edges"]])

    # -- analysis ---------------------------------------------------------------------------------
    def critical_path(self) -> list[Span]:
        """The chain that set the end time: from the last task to finish, back through the producer
        (or the previous task of the same worker) that finished last before it started."""
        if not self.spans:
            return []
        spans = {s.key: s for s in self.spans}
        producers: dict[tuple[int, int], list[Span]] = defaultdict(list)
        for p, c in self.edges:
            producers[c].append(spans[p])
        previous: dict[tuple[int, int], Span] = {}
        by_worker: dict[tuple[int, int], list[Span]] = defaultdict(list)
        for s in self.spans:
            by_worker[(s.rank, s.worker)].append(s)
        for chain in by_worker.values():
            for before, after in zip(chain, chain[1:]):
                previous[after.key] = before
        path = [max(self.spans, key=lambda s: s.end)]
        seen = {path[0].key}  # a file's edges may form a cycle: never step onto a task twice
        while True:
            candidates = producers[path[-1].key] + ([previous[path[-1].key]] if path[-1].key in previous else [])
            candidates = [s for s in candidates if s.key not in seen]
            if not candidates:
                return path[::-1]
            path.append(max(candidates, key=lambda s: s.end))
            seen.add(path[-1].key)

    def summary(self, top: int = 5) -> str:
        if not self.spans:
            return "empty trace"
        begin, finish = min(s.wait_start for s in self.spans), max(s.end for s in self.spans)
        total = max(finish - begin, 1)  # ns; all stamps equal in a trace from a coarse clock
        lines = [f"{len(self.spans)} tasks on {len({s.rank for s in self.spans})} rank(s), "
                 f"{len({(s.rank, s.worker) for s in self.spans})} worker(s); {total / 1e6:.3f} ms end to end"]
        per_op: dict[str, list[int]] = defaultdict(list)
        for s in self.spans:
            per_op[s.op.split("/")[-1]].append(s.end - s.start)
        lines.append("time per op (sum of task spans):")
        for op, times in sorted(per_op.items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"  {op:<28} {sum(times) / 1e6:10.3f} ms  {len(times):6d} tasks  "
                         f"mean {sum(times) / len(times) / 1e3:9.1f} us")
        lines.append("workers (busy = running tasks; idle = waiting or between tasks):")
        by_worker: dict[tuple[int, int], list[Span]] = defaultdict(list)
        for s in self.spans:
            by_worker[(s.rank, s.worker)].append(s)
        for (rank, worker), spans in sorted(by_worker.items()):
            busy = sum(s.end - s.start for s in spans)
            waiting = sum(s.start - s.wait_start for s in spans)
            lines.append(f"  rank {rank} worker {worker}: {len(spans):5d} tasks, busy {busy / total:6.1%}, "
                         f"waiting {waiting / 1e6:8.3f} ms, idle {(total - busy) / 1e6:8.3f} ms")
        path = self.critical_path()
        lines.append(f"critical path executed: {len(path)} tasks, {(path[-1].end - path[0].wait_start) / 1e6:.3f} ms")
        for s in path[-top:]:
            lines.append(f"  ... rank {s.rank} worker {s.worker} task {s.task} {s.op} tile {s.tile}: "
                         f"{(s.end - s.start) / 1e3:.1f} us")
        lines.append("longest waits:")
        for s in sorted(self.spans, key=lambda s: s.wait_start - s.start)[:top]:
            lines.append(f"  rank {s.rank} worker {s.worker} task {s.task} {s.op} tile {s.tile}: waited "
                         f"{(s.start - s.wait_start) / 1e3:.1f} us")
        return "\n".join(lines)


__all__ = ["Span", "Trace", "producer_map", "rank_trace"]
