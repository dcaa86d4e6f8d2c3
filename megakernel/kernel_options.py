"""``KernelOptions``: the ``Megakernel`` arguments that a model loader (``serving.from_hf``,
``from_pretrained``, vLLM's plugin) takes besides the serving config, checked where they are made and the
backend resolved there once, so that the serving defaults (prefill rows), the step's tiles and the
kernel all follow the same backend."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .backends import KINDS, BackendKind, resolve
from .backends.cpu import WorkerPool
from .errors import GraphError, check_timeout, is_count


@dataclass(frozen=True)
class KernelOptions:
    """``Megakernel``'s keyword arguments (see it), ``backend`` resolved: a key of ``backends.KINDS``."""

    backend: str = "auto"
    workers: int | None = None      # persistent workers of a rank; None: the backend's
    policy: str = "critical_path"   # how the scheduler orders and places tasks
    timeout: float = 60.0           # seconds any single wait may take
    trace: bool = False             # record every task's span
    pool: WorkerPool | None = None  # the worker processes of a host backend; None: the shared pool

    def __post_init__(self):
        object.__setattr__(self, "backend", resolve(self.backend))
        if self.workers is not None and not is_count(self.workers):
            raise GraphError(f"workers must be a positive integer, got {self.workers!r}")
        object.__setattr__(self, "timeout", check_timeout(self.timeout))

    @classmethod
    def of(cls, options: dict[str, Any]) -> KernelOptions:
        """The record of a loader's keyword arguments that are not the serving config's: a ``GraphError``
        names any that is neither."""
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            raise GraphError(f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: a loader takes "
                             f"the ServingConfig's fields and the kernel's ({', '.join(names)})")
        return cls(**options)

    @property
    def kind(self) -> BackendKind:
        return KINDS[self.backend]

    def arguments(self) -> dict[str, Any]:
        """These options as ``Megakernel``'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in fields(self)}
