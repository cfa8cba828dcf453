"""Models that ship with cudagraph_rt (no weights to fetch), on one paged KV pool.

``pool`` (:class:`KVPool`, every model's KV cells), ``protocol`` (:class:`Decoder`, the
surface the runner, the sweep and the tools use), ``toy``, ``tp`` (the toy split over
ranks), ``hf`` (transformers causal LMs; it needs the ``hf`` extra only when a model is
built: importing it here costs nothing without transformers).
"""
from .hf import HFDecoder, HFSpec
from .pool import KVPool
from .protocol import Decoder, DecoderConfig
from .toy import ToyConfig, ToyDecoder

__all__ = ["Decoder", "DecoderConfig", "HFDecoder", "HFSpec", "KVPool", "ToyConfig", "ToyDecoder"]
