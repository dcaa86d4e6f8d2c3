"""megakernel: a GPU-driven persistent megakernel scheduler in Python and Triton."""
from .errors import BackendError, DeadlockError, GraphError, MegakernelError
from .graph import Graph, Tensor
from .runtime import Megakernel

__all__ = ["BackendError", "DeadlockError", "Graph", "GraphError", "Megakernel", "MegakernelError", "Tensor"]
__version__ = "0.1.0"
