"""Where everything lives on a kernel's heap, declared for the host first.

A rank's heap has two areas. The data area holds the graph's buffers and the kernel's tables (task
rows, signals, queues, index, trace stamps): only this rank's programs touch it. The comm area
holds everything another rank writes: communication buffers (``Graph.new_tensor(..., comm=True)``:
what peers' puts write), the event counters and the status records. A backend maps the comm area
where peers' stores and system-scope atomics stay coherent (ROCm: fine-grained memory; elsewhere
the same allocation as the data area, right after it). Comm-area offsets are tagged: they start at
COMM, far above any size or index, and the host rewrites them into offsets from the data area's
base (``device_words``) for the kernel, whose tiles then address both areas as one heap.
``device.py`` wraps the record layouts below as constexprs for the kernel; the runtime and the hang
diagnosis read the same numbers. So do the queue tables' words (a task row, a signal): ``scheduler``
writes them, the kernel reads them. This module is the ground floor with ``errors`` and ``device``: it
imports nothing of ``scheduler`` or ``tasks``, which import it.

Status region: a header record of the rank, then one record of STATUS_WORDS per worker. The
header's ABORT word is set by a worker that stops the rank's run (a stall, or the host stopping
it); its FAULTED word is the last step in which a tile of the rank faulted (below). The
host reads these words after a run and the workers' records only when one of them says so. LOST (a
rank + 1; 0: none) names a peer found gone, by the transport of rank LOST_BY (``transport``), which
writes it here and in the headers of this rank's node, with ABORT.
A worker writes DONE (tasks finished in this step) and EPOCH (the step it is in: run ``e`` of a
kernel that ran one step per launch; a launch starts after it, so the host passes no epoch) as it
goes, and on a stall the rest: STATE, the TASK it waited for, that task's EVENT, the count it
OBSERVED and the count it EXPECTED. CLOCK_SLOT is the kernel's own scratch word. A tile that met data
it cannot use sets FAULT to the step's epoch and records FAULT_AT: the worker's DONE count then, i.e.
the queue position of the task that met it, and what it met: FAULT_KIND INDEX, a data-dependent index
out of range (a token id, a position), with its VALUE and the BOUND it had to stay below; NOT_FINITE,
logits that are not finite, with the batch row as VALUE and the position they sample as BOUND.
Nothing here is reset between runs: epochs tell runs apart.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from .errors import GraphError

HEAP_ALIGN = 256  # bytes: every buffer and region starts at a multiple

STATUS_WORDS = 13
(STATE, TASK, EVENT, OBSERVED, EXPECTED, DONE, EPOCH, CLOCK_SLOT,
 FAULT, FAULT_AT, FAULT_KIND, FAULT_VALUE, FAULT_BOUND) = range(STATUS_WORDS)
INDEX, NOT_FINITE = range(2)  # values of FAULT_KIND
RUNNING, TIMED_OUT, STOPPED = range(3)  # values of STATE
ABORT, FAULTED, LOST, LOST_BY = range(4)  # words of the header record

TRACE_WORDS = 3  # per task: wait start, run start, end (ns on the backend's clock)

# A task row's words (``scheduler.tables``), its argument words from ARG0 on; GUARD is NO_GUARD or a heap offset
OPCODE, WAIT_EVENT, FAN_IN, CARRY_EVENT, CARRY_FAN_IN, SIGNAL_START, SIGNAL_COUNT, GUARD, ARG0 = range(9)
NO_GUARD = -1
# A signal's words: the fields of ``scheduler.events.Signal``, whose lists are flattened into the table as they are
SIGNAL_WORDS = 3
SIGNAL_RANK, SIGNAL_EVENT, SIGNAL_INCREMENT = range(SIGNAL_WORDS)


COMM = 1 << 40  # heap offsets from here on are in the comm area, at offset - COMM


def align(size: int) -> int:
    """``size`` rounded up to a multiple of HEAP_ALIGN."""
    return -(-size // HEAP_ALIGN) * HEAP_ALIGN


def device_words(words: np.ndarray, delta: int) -> np.ndarray:
    """Table words or kernel arguments as the kernel reads them: a comm-area offset ``COMM + o`` becomes
    ``delta + o``, where ``delta`` is the comm area's address minus the data area's (the same in every
    process that runs this rank's programs); every other word is unchanged."""
    return np.where(words >= COMM, words - COMM + delta, words)


@dataclass(frozen=True)
class HeapLayout:
    """Byte offsets of the kernel's regions, named as the kernel arguments they become (events and status
    in the comm area, tagged), and the sizes of the two areas.

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
    data_size: int
    comm_size: int

    COMM_REGIONS = ("events_off", "status_off")  # what peers write

    @classmethod
    def of(cls, buffers_bytes: int, comm_bytes: int, sizes: list[int]) -> "HeapLayout":
        """After ``buffers_bytes`` of data buffers and ``comm_bytes`` of comm buffers, the regions of ``sizes``."""
        ends = {False: align(buffers_bytes), True: align(comm_bytes)}  # by area: in comm?
        offsets = []
        for name, size in zip(cls.offset_names(), sizes):
            comm = name in cls.COMM_REGIONS
            offsets.append(ends[comm] + (COMM if comm else 0))
            ends[comm] = align(ends[comm] + max(size, 8))
        if max(ends.values()) >= COMM:
            raise GraphError(f"a heap area of {max(ends.values()):,} bytes: the comm area's tag ({COMM:,}) bounds each")
        return cls(*offsets, data_size=ends[False], comm_size=ends[True])

    def device_offsets(self, delta: int) -> dict[str, int]:
        """The kernel arguments: every region's offset from the data area's base (``device_words``)."""
        names = self.offset_names()
        return dict(zip(names, device_words(np.array([getattr(self, n) for n in names]), delta).tolist()))

    @classmethod
    def offset_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls) if f.name.endswith("_off"))
