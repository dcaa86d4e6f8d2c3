"""The error types of the public API."""


class MegakernelError(Exception):
    """Base of every error megakernel raises."""


class GraphError(MegakernelError, ValueError):
    """A bad graph or bad input: the message names the op, the tensor and the shapes."""


class DeadlockError(MegakernelError, RuntimeError):
    """The watchdog stopped a run: ``report`` says which task waited on which event, and why."""

    def __init__(self, message: str, report: str = ""):
        super().__init__(message, report)  # both in args, so the error pickles across processes whole
        self.message, self.report = message, report

    def __str__(self) -> str:
        return f"{self.message}\n{self.report}" if self.report else self.message


class BackendError(MegakernelError, RuntimeError):
    """No such device, a worker process died, an IPC failure, a peer gone."""
