"""How a captured graph is launched: torch's ``CUDAGraph.replay()``, or the graph's
instantiated executable launched straight through cuda.bindings where that is the same.

``replay()`` is ``cudaGraphLaunch`` plus a device guard, a replay prologue for every
generator the capture drew random numbers from (it refreshes their seed and offset on the
device and advances their offsets) and Python binding overhead. A graph that drew no
random numbers needs none of it: ``GraphLaunch`` launches such a graph's executable
itself (a fraction of replay()'s host time). Whether a graph drew random numbers is seen
at its first launch, which goes through ``replay()``: the default CUDA generator's offset
moves over it exactly when it did (a capture can only draw from generators registered
with the graph, and the runtime registers none but torch's default one).
"""
from __future__ import annotations

from typing import Any

import torch

from .._cuda import cudart
from ..errors import CgrtError


class GraphLaunch:
    """Launches one captured graph on the caller's current stream (``__call__``).

    The first call replays through torch and watches the device's default generator; when
    its offset did not move (no random numbers in the graph) and cuda.bindings and torch's
    ``raw_cuda_graph_exec`` are there, later calls launch the executable directly, else
    they keep calling ``replay()``. ``raw`` says which (None before the first call).
    Lifetime: the graph's (it holds the graph). Failure: a launch error raises CgrtError.
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, device: torch.device):
        self.graph, self.device_index = graph, device.index if device.index is not None else torch.cuda.current_device()
        self.raw: bool | None = None
        self._rt = cudart()
        self._exec: Any = None  # set once the first launch found the graph draws no random numbers
        self._streams: dict[int, Any] = {}
        self._ok = self._rt.cudaError_t.cudaSuccess if self._rt is not None else None
        self._launch_exec = self._rt.cudaGraphLaunch if self._rt is not None else None
        # (no bound method of self is kept on self: that cycle would leave the graph, and
        # its pool, to the garbage collector, which may free it during a later capture)

    def __call__(self) -> None:
        if self._exec is None:
            if self.raw is None:
                self._first()
            else:
                self.graph.replay()
            return
        if torch._C._cuda_getDevice() != self.device_index:
            # cudaGraphLaunch on stream 0 means the current device's default stream:
            # replay() enters the graph's device first
            self.graph.replay()
            return
        sid = torch._C._cuda_getCurrentRawStream(self.device_index)
        stream = self._streams.get(sid)
        if stream is None:
            if len(self._streams) >= 16:  # bounded, whatever streams a caller steps on
                self._streams.clear()
            stream = self._streams[sid] = self._rt.cudaStream_t(init_value=sid)
        err, = self._launch_exec(self._exec, stream)
        if err != self._ok:
            raise CgrtError(f"cudaGraphLaunch of a captured graph failed: {err!r}")

    def _first(self) -> None:
        gen = torch.cuda.default_generators[self.device_index]
        try:
            before = gen.get_offset()
        except RuntimeError:  # a stream is capturing (torch refuses the read): decide later
            self.graph.replay()
            return
        self.graph.replay()
        drew = gen.get_offset() != before
        self._exec = None if drew else self._raw_exec()
        self.raw = self._exec is not None

    def _raw_exec(self) -> Any:
        get = getattr(self.graph, "raw_cuda_graph_exec", None)
        if self._rt is None or get is None:
            return None
        try:
            handle = get()
        except RuntimeError:  # an older torch that keeps the executable private
            return None
        exec_t = self._rt.cudaGraphExec_t
        return handle if isinstance(handle, exec_t) else exec_t(init_value=int(handle))
