"""Streams, events and the raw CUDA runtime calls the hot path uses.

Each helper does what a torch call does, minus its Python overhead (several microseconds
per call on a step's path), and falls back to torch where cuda-python is missing.
"""
from __future__ import annotations

from typing import Any

import torch

_STREAMS: dict[tuple, "torch.cuda.Stream"] = {}  # a cache of immutable wrappers, not state


def current_stream(device_index: int) -> "torch.cuda.Stream":
    """``torch.cuda.current_stream()`` without its Python overhead: the Stream object is
    built once per stream id and reused."""
    sid, dev, kind = torch._C._cuda_getCurrentStream(device_index)
    stream = _STREAMS.get((sid, dev))
    if stream is None:
        stream = _STREAMS[(sid, dev)] = torch.cuda.Stream(stream_id=sid, device_index=dev, device_type=kind)
    return stream


def raw_stream(device_index: int) -> int:
    """The current stream's cudaStream_t, as an int."""
    return torch._C._cuda_getCurrentRawStream(device_index)


def record_event(ev: "torch.cuda.Event", device_index: int) -> None:
    """``ev.record()`` on the current stream (see ``current_stream``)."""
    torch._C._CudaEventBase.record(ev, current_stream(device_index))


def external_event() -> "torch.cuda.Event | None":
    """An event whose record inside a capture becomes a node of the graph (None where this
    torch cannot make one: fed graphs are then off)."""
    try:
        return torch.cuda.Event(external=True)
    except TypeError:
        return None


def cudart() -> Any:
    """cuda.bindings' runtime module, or None (cuda-python missing: torch does the same,
    more slowly)."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    return runtime


class RawEvent:
    """A torch event recorded through cudart with its raw handle once torch has created it
    (a fraction of torch's cost); torch's record until then, or without cuda-python."""

    def __init__(self, device_index: int, rt: Any):
        self.device_index, self._rt = device_index, rt
        self.event: "torch.cuda.Event | None" = None
        self._raw: int | None = None

    def record(self) -> None:
        if self._raw is not None:
            err, = self._rt.cudaEventRecord(self._raw, raw_stream(self.device_index))
            if err == self._rt.cudaError_t.cudaSuccess:
                return
        if self.event is None:
            self.event = torch.cuda.Event()
        record_event(self.event, self.device_index)
        if self._rt is not None:
            self._raw = self.event._as_parameter_.value

    def synchronize(self) -> None:
        """Wait for the last record (nothing to wait for before the first)."""
        if self.event is not None:
            self.event.synchronize()


def copy_h2d(rt: Any, dst: torch.Tensor, src: torch.Tensor, nbytes: int, device_index: int) -> None:
    """Stream-ordered copy of ``nbytes`` from pinned ``src`` to device ``dst`` (both byte
    buffers): one cudaMemcpyAsync where cuda-python is there, else torch's copy_."""
    if rt is not None:
        err, = rt.cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), nbytes,
                                  rt.cudaMemcpyKind.cudaMemcpyHostToDevice, raw_stream(device_index))
        if err == rt.cudaError_t.cudaSuccess:
            return
    dst[:nbytes].copy_(src[:nbytes], non_blocking=True)
