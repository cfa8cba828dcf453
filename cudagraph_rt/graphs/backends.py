"""How a runtime's widths run: as CUDA graphs, eagerly, or as emulated graphs.

One backend object per :class:`~cudagraph_rt.graphs.Graphs` choice, made once from
GraphRuntime's ``graphs`` argument (:func:`backend_for`): it checks the device, makes the
feed's event, the capturer of the widths and the launcher of a captured width. The runtime
never asks which backend it holds; ``name`` is what ``stats()`` and ``CaptureReport`` say
(``graph_mode``). The emulated one's graphs and capturer are in ``emulation``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .._cuda import external_event
from ..errors import CgrtError, InputError, expected
from . import Graphs, as_graphs
from .capture import CaptureSettings, WidthCapturer
from .emulation import EmulatedCapturer, EmulatedGraph, NoEvent, NoPool
from .launch import GraphLaunch


class GraphBackend:
    """What ``graphs=`` chose, as the object that does it. ``choice`` is the :class:`Graphs`
    member; ``value`` reads back as ``GraphRuntime.graphs`` (True, False or "emulate");
    ``captures`` whether ``capture()`` makes a graph per width."""

    name = "off"
    choice = Graphs.OFF
    value: Any = False
    captures = False

    def check_device(self, device: torch.device) -> None:
        """InputError where this mode cannot run on ``device``."""

    def feed_event(self, device: torch.device):
        """The event of a feed for fed graphs, or None (no feed)."""
        return None

    def capturer(self, settings: CaptureSettings):
        return NoPool(settings)

    def launcher(self, graph, device: torch.device) -> Callable[[], None]:
        raise CgrtError(f"graphs={self.value!r} captures no graph")

    def before_launch(self, replaying: Callable[[], None]) -> Callable[[], None]:
        """What a graph step calls before its launch: the host-row choice's ``replaying``
        where the launch runs the captured gather without Python (CUDA graphs)."""
        return replaying


class GraphsOff(GraphBackend):
    """``graphs=Graphs.OFF`` (or False): every width runs eagerly over the same static buffers."""


class CudaGraphs(GraphBackend):
    """``graphs=True``: one CUDA graph per width, in one pool; fed where torch can."""

    name, choice, value, captures = "cuda", Graphs.ON, True, True

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise InputError(expected("graphs", "False on a CPU device (CUDA graphs need a GPU; graphs='emulate' "
                                      "runs the graph path without them)", True))

    def feed_event(self, device: torch.device):
        return external_event()  # recorded inside a capture: a node of the graph

    def capturer(self, settings: CaptureSettings) -> WidthCapturer:
        return WidthCapturer(settings)

    def launcher(self, graph, device: torch.device) -> Callable[[], None]:
        return GraphLaunch(graph, device)


class EmulatedGraphs(GraphBackend):
    """``graphs=Graphs.EMULATE`` (or "emulate"): the graph path run eagerly (see ``emulation``)."""

    name, choice, value, captures = "emulated", Graphs.EMULATE, "emulate", True

    def feed_event(self, device: torch.device):
        return torch.cuda.Event() if device.type == "cuda" else NoEvent()  # recorded eagerly, never captured

    def capturer(self, settings: CaptureSettings) -> EmulatedCapturer:
        return EmulatedCapturer(settings)

    def launcher(self, graph: EmulatedGraph, device: torch.device) -> Callable[[], None]:
        return graph.replay

    def before_launch(self, replaying: Callable[[], None]) -> Callable[[], None]:
        # the replay runs the body, whose gather says ``replaying`` itself, when it gets there:
        # a step function that raises before it wrote no snapshot (and uses up no turn)
        return _nothing


def _nothing() -> None:
    pass


BACKENDS: dict[Graphs, type[GraphBackend]] = {Graphs.ON: CudaGraphs, Graphs.OFF: GraphsOff,
                                              Graphs.EMULATE: EmulatedGraphs}


def backend_for(graphs: Any) -> GraphBackend:
    """The backend of GraphRuntime's ``graphs`` argument, resolved by :func:`as_graphs`
    (InputError naming ``graphs`` for anything else)."""
    return BACKENDS[as_graphs(graphs)]()
