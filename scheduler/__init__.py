"""Pure host-side scheduling: dependencies, placement, events, the queue format, pre-launch checks.

Nothing here imports Triton or the task library: the scheduler sees tasks only as opcodes, argument
words, regions and costs.
"""
from __future__ import annotations

from .checks import Capacity, check_acyclic, check_tables, find_cycle
from .deps import infer_dependencies
from .events import NO_EVENT, Events, encode_events
from .placement import POLICIES, Placement, bottom_levels, place, task_cost
from .tables import (ARG0, FAN_IN, OPCODE, SIGNAL_COUNT, SIGNAL_START, VERSION, WAIT_EVENT, FormatError,
                     QueueTables, Spec, build_tables, deserialize, disassemble, serialize)
from .task import Region, Task


def schedule(tasks: list[Task], shapes: dict[int, tuple[int, int]], *, specs: list[Spec], op_names: list[str],
             workers: int, policy: str = "critical_path", rank: int = 0, world_size: int = 1,
             describe=str) -> QueueTables:
    """Tasks in program order -> checked queue tables for ``workers`` workers."""
    producers = infer_dependencies(tasks, shapes)
    check_acyclic(producers, describe)
    placement = place(tasks, producers, workers, policy)
    events = encode_events(placement, producers, workers)
    tables = build_tables(tasks, placement, events, specs=specs, op_names=op_names, workers=workers,
                          rank=rank, world_size=world_size)
    check_tables(tables)
    return tables


__all__ = [
    "ARG0", "FAN_IN", "NO_EVENT", "OPCODE", "POLICIES", "SIGNAL_COUNT", "SIGNAL_START", "VERSION", "WAIT_EVENT",
    "Capacity", "Events", "FormatError", "Placement", "QueueTables", "Region", "Spec", "Task", "bottom_levels",
    "build_tables", "check_acyclic", "check_tables", "deserialize", "disassemble", "encode_events", "find_cycle",
    "infer_dependencies", "place", "schedule", "serialize", "task_cost",
]
