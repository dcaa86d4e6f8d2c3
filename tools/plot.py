"""A trace as a Gantt chart (PNG, SVG or PDF from the file suffix), for ``megakernel trace plot``.

One row per (rank, worker), grouped per rank and separated by a line, time on x in ms from the first
wait. Compute tiles are filled blue, communication tiles orange and hatched, waits light grey behind
them. Each row is drawn with one ``broken_barh`` call per kind of span, so a trace of thousands of
tasks is a handful of collections, not thousands of artists.
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..trace import Span, Trace

COMPUTE = dict(facecolor="#4c78a8", edgecolor="#1f3b57", linewidth=0.3)
COMM = dict(facecolor="#f58518", edgecolor="#7a3d00", linewidth=0.3, hatch="////")
WAIT = dict(facecolor="#d9d9d9", edgecolor="none", alpha=0.7)
BAR = 0.7      # bar height, in rows
RANK_GAP = 0.6  # extra space between two ranks' groups of rows


def plot_timeline(trace: Trace, path: str | Path, title: str | None = None) -> Path:
    """Draw ``trace`` into ``path``; returns the path."""
    import matplotlib
    matplotlib.use("Agg")  # files only: no display needed, none is opened
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = _rows(trace.spans)
    origin = min((s.wait_start for s in trace.spans), default=0)
    fig, ax = plt.subplots(figsize=(12, max(2.5, 0.45 * len(rows) + 1.5)))
    y = _row_positions(list(rows))
    for key, spans in rows.items():
        bar = (y[key] - BAR / 2, BAR)
        ax.broken_barh(_ranges(spans, origin, waits=True), bar, **WAIT)
        ax.broken_barh(_ranges([s for s in spans if not s.comm], origin), bar, **COMPUTE)
        ax.broken_barh(_ranges([s for s in spans if s.comm], origin), bar, **COMM)
    for boundary in _rank_boundaries(y):
        ax.axhline(boundary, color="#555555", linewidth=0.8)
    ax.set_yticks([y[k] for k in rows], [f"rank {r} worker {w}" for r, w in rows])
    ax.set_ylim(max(y.values(), default=0) + 1, -1)  # rank 0 worker 0 on top
    ax.set_xlabel("time (ms)")
    ax.set_title(title or _default_title(trace))
    ax.grid(axis="x", linewidth=0.3)
    ax.legend(handles=[Patch(**COMPUTE, label="compute tile"), Patch(**COMM, label="communication tile"),
                       Patch(**WAIT, label="wait")], loc="upper left", bbox_to_anchor=(1.005, 1), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _rows(spans: list[Span]) -> dict[tuple[int, int], list[Span]]:
    rows: dict[tuple[int, int], list[Span]] = defaultdict(list)
    for s in spans:
        rows[(s.rank, s.worker)].append(s)
    return dict(sorted(rows.items()))


def _row_positions(keys: list[tuple[int, int]]) -> dict[tuple[int, int], float]:
    """y of each row: one unit per worker, plus a gap whenever the rank changes."""
    y, at = {}, 0.0
    for i, key in enumerate(keys):
        if i and key[0] != keys[i - 1][0]:
            at += RANK_GAP
        y[key] = at
        at += 1
    return y


def _rank_boundaries(y: dict[tuple[int, int], float]) -> list[float]:
    keys = list(y)
    return [(y[a] + y[b]) / 2 for a, b in zip(keys, keys[1:]) if a[0] != b[0]]


def _ranges(spans: list[Span], origin: int, waits: bool = False) -> list[tuple[float, float]]:
    """(start, width) in ms of each span's run, or of its wait."""
    if waits:
        return [((s.wait_start - origin) / 1e6, (s.start - s.wait_start) / 1e6)
                for s in spans if s.start > s.wait_start]
    return [((s.start - origin) / 1e6, (s.end - s.start) / 1e6) for s in spans]


def _default_title(trace: Trace) -> str:
    if not trace.spans:
        return "empty trace"
    ranks = len({s.rank for s in trace.spans})
    total = (max(s.end for s in trace.spans) - min(s.wait_start for s in trace.spans)) / 1e6
    return f"{len(trace.spans)} tasks on {ranks} rank(s), {total:.3f} ms"


__all__ = ["plot_timeline"]
