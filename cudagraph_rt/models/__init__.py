"""Models that ship with cudagraph_rt (no weights to fetch).

``hf`` (transformers causal LMs on a cell KV pool) needs the ``hf`` extra only when a model
is built: importing it here costs nothing without transformers.
"""
from .hf import HFDecoder, HFSpec
from .toy import ToyConfig, ToyDecoder

__all__ = ["HFDecoder", "HFSpec", "ToyConfig", "ToyDecoder"]
