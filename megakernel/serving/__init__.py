"""Serving a model: a rank's model compiled into one kernel (``CompiledModel``, which runs the steps vLLM
plans), the engine that decodes with it on the device (``DecodeModel``: fixed-batch ``generate`` and
continuous batching ``add``/``step``/``cancel``), its KV cache's pages, text in and out (tokenizer, chat
template, stop strings), and the serving loop that joins many clients' requests into one running batch.
``from_hf`` and ``from_pretrained`` compile a model that ``megakernel.models`` built for a ``ServingConfig``."""
from ..models.serving_config import SERVER, ServingConfig
from .compiled import CompiledModel, Statistics
from .engine import DecodeModel
from .load import from_hf, from_pretrained
from .loop import Request, ServingLoop, Update, follow
from .pages import KVCacheFull, PagePool
from .sampling_params import SamplingParams
from .sequences import Sequence, SequenceFault
from .text import Streamer, Text

__all__ = ["CompiledModel", "DecodeModel", "KVCacheFull", "PagePool", "Request", "SERVER", "SamplingParams", "Sequence",
           "SequenceFault", "ServingConfig", "ServingLoop", "Statistics", "Streamer", "Text", "Update", "follow",
           "from_hf", "from_pretrained"]
