"""The task library: one module per family, each exporting ``TASK_TYPES`` and ``OPS`` (beside the helpers
they share, ``HELPERS``).

Every module of this package is imported here, then the modules named in ``MEGAKERNEL_TASK_MODULES``
(comma-separated, importable: task types of your own, kept outside this package), and their task
types and graph ops collected. A task type is declared by its module alone: its tile's signature
gives its argument words and whether it is a communication tile, its registration its reference and
example (``common.TaskType``); code generation, the reference executor, the disassembler, traces and
the kernel with every task type read it from here.
"""
from __future__ import annotations

import importlib
import os
import pkgutil

from .common import DTYPES, TaskType

EXTRA_MODULES_ENV = "MEGAKERNEL_TASK_MODULES"  # inherited by worker processes, so they see the same library
HELPERS = {"common", "formats"}  # what the families share (tile helpers; quantized formats): no task types


def _modules() -> list[str]:
    own = [f"{__name__}.{m.name}" for m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name)
           if m.name not in HELPERS]
    extra = [name.strip() for name in os.environ.get(EXTRA_MODULES_ENV, "").split(",") if name.strip()]
    return own + extra


def _collect():
    task_types: dict[str, TaskType] = {}
    ops: dict = {}
    for name in _modules():
        module = importlib.import_module(name)
        for task_type in module.TASK_TYPES:
            if task_type.name in task_types:
                raise ImportError(f"task type {task_type.name!r} of {name} is defined twice")
            task_types[task_type.name] = task_type
        for op, build in module.OPS.items():
            if op in ops:
                raise ImportError(f"graph op {op!r} of {name} is defined twice")
            ops[op] = build
    return task_types, ops


TASK_TYPES, OPS = _collect()

__all__ = ["DTYPES", "OPS", "TASK_TYPES", "TaskType"]
