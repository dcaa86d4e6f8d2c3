"""Whole-layer builders: decoder layers and decode steps, and loading from ``transformers``."""
from .decoder import DecoderConfig, Shard, decode_step, decoder_layer
from .hf import DecodeModel, from_hf, from_pretrained

__all__ = ["DecodeModel", "DecoderConfig", "Shard", "decode_step", "decoder_layer", "from_hf", "from_pretrained"]
