"""megakernel: a GPU-driven persistent megakernel scheduler in Python and Triton."""
from .errors import BackendError, DeadlockError, GraphError, MegakernelError
from .graph import Graph, Tensor
from .launcher import RankError, launch
from .runtime import Megakernel

__all__ = ["BackendError", "DeadlockError", "Graph", "GraphError", "Megakernel", "MegakernelError", "RankError",
           "Tensor", "launch"]
__version__ = "0.1.0"
