"""The error types of the public API, and the checks of the arguments every entry point shares."""
import math


class MegakernelError(Exception):
    """Base of every error megakernel raises."""


class GraphError(MegakernelError, ValueError):
    """A bad graph or bad input: the message names the op, the tensor and the shapes."""


class FaultError(GraphError):
    """A launch ran to its end but a tile met data it cannot use (an index out of range, clamped; logits
    that are not finite): its outputs are not valid; ``faults`` lists each (``diagnosis.Fault``), and
    ``outputs`` are the run's outputs as ``run`` returns them (where a caller knows which parts the
    faults spare: ``SequenceFault``). The kernel stays usable."""

    def __init__(self, message: str, faults: tuple = (), outputs: dict | None = None):
        super().__init__(message, faults)  # both in args, so the error pickles across processes whole
        self.message, self.faults, self.outputs = message, tuple(faults), outputs

    def __str__(self) -> str:
        return self.message


class DeadlockError(MegakernelError, RuntimeError):
    """The watchdog stopped a run: ``report`` says which task waited on which event, and why."""

    def __init__(self, message: str, report: str = ""):
        super().__init__(message, report)  # both in args, so the error pickles across processes whole
        self.message, self.report = message, report

    def __str__(self) -> str:
        return f"{self.message}\n{self.report}" if self.report else self.message


class BackendError(MegakernelError, RuntimeError):
    """No such device, a worker process died, an IPC failure, a peer gone."""


MAX_TIMEOUT = 1e6  # seconds (11.6 days): past it a wait's deadline in nanoseconds no longer fits an int64


def is_int(value) -> bool:
    """An int, not a bool (which Python counts as one)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value) -> bool:
    """A positive int (not a bool)."""
    return is_int(value) and value >= 1


def is_number(value) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_timeout(value, what: str = "timeout") -> float:
    """``value`` as seconds in (0, MAX_TIMEOUT]; anything else is a ``GraphError``."""
    ok = is_number(value) and 0 < value <= MAX_TIMEOUT
    if not ok or math.isnan(value):
        raise GraphError(f"{what} must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {value!r}")
    return float(value)
