"""megakernel: a GPU-driven persistent megakernel scheduler in Python and Triton."""
from .checkout import use_checkout

use_checkout()  # from a checkout that is not installed: tasks/, scheduler/, tools/ as subpackages
from .errors import BackendError, DeadlockError, FaultError, GraphError, MegakernelError
from .graph import Graph, Tensor
from .launcher import RankError, launch
from .runtime import Megakernel

__all__ = ["BackendError", "DeadlockError", "FaultError", "Graph", "GraphError", "Megakernel", "MegakernelError",
           "RankError", "Tensor", "launch"]
__version__ = "0.1.0"
