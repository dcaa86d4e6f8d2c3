"""The task library: one module per family, each exporting ``TASK_TYPES`` and ``OPS``.

Every module of this package is imported here and its task types and graph ops collected, so a new
task type is one new module and needs no edit elsewhere.
"""
from __future__ import annotations

import importlib
import pkgutil

from .common import DTYPES, TORCH_DTYPES, HeapView, TaskType


def _collect():
    task_types: dict[str, TaskType] = {}
    ops: dict = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name == "common":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for task_type in module.TASK_TYPES:
            assert task_type.name not in task_types, f"task type {task_type.name} defined twice"
            task_types[task_type.name] = task_type
        for name, build in module.OPS.items():
            assert name not in ops, f"graph op {name} defined twice"
            ops[name] = build
    return task_types, ops


TASK_TYPES, OPS = _collect()

__all__ = ["DTYPES", "OPS", "TASK_TYPES", "TORCH_DTYPES", "HeapView", "TaskType"]
