"""The reference executor: deserialized task tables run in global order with torch, no Triton.

An oracle for the kernel and for the scheduler at once: it runs each row's torch reference tile, and
it replays the events, checking that every task's waits (in its step and on the previous one) are
already met by the signals of the tasks before it in the global order (the order any interleaving
of workers and ranks must respect). With several ranks the global order is (step, op, rank, row):
ranks advance op by op.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from .device import NO_SEQUENCE
from .errors import GraphError
from .heap import HeapView, RankHeap
from .scheduler import (ARG0, CARRY_EVENT, CARRY_FAN_IN, FAN_IN, GUARD, NO_EVENT, NO_GUARD, OPCODE, SIGNAL_COUNT,
                        SIGNAL_START, WAIT_EVENT, QueueTables, read_signals)
from .tasks import TASK_TYPES


def execute(tables: QueueTables, heap: RankHeap, steps: int = 1) -> None:
    """Run ``steps`` steps of a single rank's ``tables`` on ``heap`` (laid out like the kernel's)."""
    execute_ranks([tables], [heap], steps)


def execute_ranks(tables: list[QueueTables], heaps: list[RankHeap], steps: int = 1) -> None:
    """Run ``steps`` steps of every rank's tables (``tables[r]`` is rank r's, or a world of one) on its heap,
    one after another: the order (step, op, rank, row)."""
    views = {t.rank: HeapView(h) for t, h in zip(tables, heaps)}
    raised = {t.rank: np.zeros(max(t.num_events, 1), dtype=np.int64) for t in tables}
    by_rank = {t.rank: t for t in tables}
    rows = {t.rank: t.rows.tolist() for t in tables}
    order = sorted((int(op), t.rank, row) for t in tables for row, op in enumerate(t.task_op.tolist()))
    for step in range(1, steps + 1):
        for _, rank, tid in order:
            t, row = by_rank[rank], rows[rank][tid]
            for event, fan_in, target in ((row[WAIT_EVENT], row[FAN_IN], step), (row[CARRY_EVENT], row[CARRY_FAN_IN],
                                                                                   step - 1)):
                if event != NO_EVENT and raised[rank][event] < target * fan_in:
                    raise GraphError(f"rank {rank} task {tid} waits in step {step} for event {event} to reach "
                                     f"{target * fan_in}, but the tasks before it in the global order raise it only to "
                                     f"{raised[rank][event]}")
            spec = t.specs[row[OPCODE]]
            task_type = TASK_TYPES[spec.task_type]
            task = SimpleNamespace(**dict(zip(spec.arg_names, row[ARG0:])), **dict(spec.constexprs))
            guard = row[GUARD]
            if guard == NO_GUARD or int(views[rank].tensor(guard, torch.int64, 1, 1, 1)) != NO_SEQUENCE.value:
                try:
                    task_type.reference(views[rank], task, *([views] if task_type.needs_peers else []))
                except (ArithmeticError, LookupError, RuntimeError, TypeError, ValueError) as error:
                    # a table read from a file may hold words or constants no graph makes (a zero count, an
                    # unknown OP): the tile fails as Python does, and the task is named
                    raise GraphError(f"rank {rank} task {tid} ({spec.task_type}, {t.op_names[t.task_op[tid]]}): its "
                                     f"reference tile failed: {type(error).__name__}: {error}") from error
            start = row[SIGNAL_START]
            for signal in read_signals(t.signals[start:start + row[SIGNAL_COUNT]]):
                if signal.rank in raised:
                    raised[signal.rank][signal.event] += signal.increment
