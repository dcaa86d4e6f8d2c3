"""The reference executor: the deserialized task tables run in global order with torch, no Triton.

An oracle for the kernel and for the scheduler at once: it runs each row's torch reference tile, and
it replays the events, checking that every task's wait is already met by the signals of the tasks
before it in the global order (the order any worker interleaving must respect).
"""
from __future__ import annotations

import numpy as np
import torch

from .errors import GraphError
from .scheduler import ARG0, FAN_IN, NO_EVENT, OPCODE, SIGNAL_COUNT, SIGNAL_START, WAIT_EVENT, QueueTables
from .tasks import TASK_TYPES, HeapView


def execute(tables: QueueTables, heap: torch.Tensor) -> None:
    """Run one epoch of ``tables`` on ``heap`` (a flat uint8 tensor laid out like the kernel's heap)."""
    view = HeapView(heap)
    raised = np.zeros(max(tables.events, 1), dtype=np.int64)
    for task, row in enumerate(tables.tasks.tolist()):
        event = row[WAIT_EVENT]
        if event != NO_EVENT and raised[event] < row[FAN_IN]:
            raise GraphError(f"task {task} waits for event {event} to reach {row[FAN_IN]}, but the tasks "
                             f"before it in the global order raise it only to {raised[event]}")
        spec = tables.specs[row[OPCODE]]
        args = dict(zip(spec.arg_names, row[ARG0:]))
        TASK_TYPES[spec.task_type].reference(view, args, dict(spec.constexprs))
        start = row[SIGNAL_START]
        for dst, ev, increment in tables.signals[start:start + row[SIGNAL_COUNT]].tolist():
            if dst == tables.rank:
                raised[ev] += increment
