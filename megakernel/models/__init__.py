"""Building a model: decoder layers and decode steps as graphs, the weight schema, and this rank's share of a
model read from ``transformers``, a checkpoint directory or a GGUF file for a ``ServingConfig``
(``build_hf``, ``build_pretrained``: a ``ModelBuild``, which ``megakernel.serving`` compiles and serves)."""
from .decoder import KVCache, Shard, decode_step, decoder_layer, layer_inputs
from .decoder_config import DecoderConfig
from .checkpoint import build_pretrained
from .hf import ModelBuild, build_hf
from .serving_config import SERVER, ServingConfig

__all__ = ["DecoderConfig", "KVCache", "ModelBuild", "SERVER", "ServingConfig", "Shard", "build_hf", "build_pretrained",
           "decode_step", "decoder_layer", "layer_inputs"]
