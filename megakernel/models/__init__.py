"""Whole-layer builders: decoder layers and decode steps, and loading from ``transformers``."""
from .decoder import DecoderConfig, KVCache, Shard, decode_step, decoder_layer, layer_inputs
from .checkpoint import from_pretrained
from .engine import DecodeModel, SamplingParams, SequenceFault, Statistics
from .hf import from_hf
from .pages import KVCacheFull, PagePool

__all__ = ["DecodeModel", "DecoderConfig", "KVCache", "KVCacheFull", "PagePool", "SamplingParams", "SequenceFault", "Shard", "Statistics", "decode_step",
           "decoder_layer", "from_hf", "from_pretrained", "layer_inputs"]
