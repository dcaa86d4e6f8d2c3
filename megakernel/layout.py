"""Where everything lives on a kernel's heap, declared for the host first.

The heap holds the graph's buffers, then the kernel's regions: event counters, the status records,
the task tables and, with tracing, the timestamps. ``device.py`` wraps the record layouts below as
constexprs for the kernel; the runtime and the hang diagnosis read the same numbers.

Status region: a header record of the rank, then one record of STATUS_WORDS per worker. The
header's ABORT word is set by a worker that stops the rank's run (a stall, or the host stopping
it); its FAULTED word is the last step in which a tile of the rank met an index out of range. The
host reads these two words after a run and the workers' records only when one of them says so.
A worker writes DONE (tasks finished in this step) and EPOCH (the step it is in: run ``e`` of a
kernel that ran one step per launch; a launch starts after it, so the host passes no epoch) as it
goes, and on a stall the rest: STATE, the TASK it waited for, that task's EVENT, the count it
OBSERVED and the count it EXPECTED. CLOCK_SLOT is the kernel's own scratch word. A tile that met a
data-dependent index out of range (a token id, a position) sets FAULT to the step's epoch and records
the VALUE, the BOUND it had to stay below, and FAULT_AT: the worker's DONE count then, i.e. the queue
position of the task that met it. Nothing here is reset between runs: epochs tell runs apart.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from .scheduler import QueueTables

HEAP_ALIGN = 256  # bytes: every buffer and region starts at a multiple

STATUS_WORDS = 12
(STATE, TASK, EVENT, OBSERVED, EXPECTED, DONE, EPOCH, CLOCK_SLOT,
 FAULT, FAULT_AT, FAULT_VALUE, FAULT_BOUND) = range(STATUS_WORDS)
RUNNING, TIMED_OUT, STOPPED = range(3)  # values of STATE
ABORT, FAULTED = 0, 1  # words of the header record

TRACE_WORDS = 3  # per task: wait start, run start, end (ns on the backend's clock)


def align(size: int) -> int:
    """``size`` rounded up to a multiple of HEAP_ALIGN."""
    return -(-size // HEAP_ALIGN) * HEAP_ALIGN


@dataclass(frozen=True)
class HeapLayout:
    """Byte offsets of the kernel's regions, named as the kernel arguments they become, and the heap size.

    Buffers, events and status are at the same offsets on every rank (peers write them); the region
    sizes are the largest any rank needs, so the whole layout is symmetric.
    """

    events_off: int
    status_off: int
    tasks_off: int
    signals_off: int
    queue_off: int
    index_off: int
    trace_off: int
    size: int

    @staticmethod
    def sizes(tables: QueueTables, trace: bool) -> list[int]:
        """This rank's bytes per region, in field order (the ranks agree on the largest of each)."""
        return [8 * max(tables.num_events, 1), 8 * STATUS_WORDS * (tables.workers + 1), tables.rows.nbytes,
                tables.signals.nbytes, tables.queue.nbytes, tables.queue_index.nbytes,
                8 * TRACE_WORDS * len(tables.rows) if trace else 8]

    @classmethod
    def of(cls, buffers_bytes: int, sizes: list[int]) -> "HeapLayout":
        offsets, at = [], align(buffers_bytes)
        for size in sizes:
            offsets.append(at)
            at = align(at + max(size, 8))
        return cls(*offsets, size=at)

    def offsets(self) -> dict[str, int]:
        """The kernel arguments: every region's offset."""
        return {name: value for name, value in asdict(self).items() if name != "size"}

    @classmethod
    def offset_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name != "size")
