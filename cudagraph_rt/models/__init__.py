"""Models that ship with cudagraph_rt (no weights to fetch)."""
from .toy import ToyConfig, ToyDecoder

__all__ = ["ToyConfig", "ToyDecoder"]
