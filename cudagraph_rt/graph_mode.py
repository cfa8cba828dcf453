"""How a runtime's widths run: as CUDA graphs, eagerly, or as emulated graphs.

One object per mode, chosen once from GraphRuntime's ``graphs`` argument
(:func:`graph_mode_for`): it checks the device, makes the feed's event, the capturer of
the widths and the launcher of a captured width. The runtime never asks which mode it
holds; ``name`` is what ``stats()`` and ``CaptureReport`` say.

``graphs="emulate"`` (:class:`EmulatedGraphs`) runs the graph path's own code on any
device, a CPU included: the feed (unpinned on a CPU) and its prologue, the short path,
handed views, staging and padding bookkeeping run as with fed CUDA graphs. Capture runs
each width (warm-up, then one run whose outputs become that width's static outputs);
a replay runs the same width again over the same static input buffers and copies what it
produced into those same output tensors, so an output kept past the next replay of its
width is overwritten exactly as a CUDA graph overwrites it. Not emulated: kernels (the
step runs eagerly, op by op), timing, the CUDA context and what a capture refuses (a host
sync, a pinned allocation: they run fine here; ``find_capture_hazards`` finds them),
stream concurrency, and events (no-ops on a CPU).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from ._cuda import external_event
from .capture import CaptureSettings, WidthCapture, WidthCapturer
from .errors import CaptureError, CgrtError, InputError, expected
from .launch import GraphLaunch
from .pieces import frozen


class NoEvent:
    """The feed's event where nothing runs asynchronously (emulated graphs on a CPU):
    recording and waiting are no-ops."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class EmulatedGraph:
    """One width's graph under ``graphs="emulate"``: ``replay()`` runs the width's body
    (the feed's prologue, the step function, the in-graph gather) over the static input
    buffers and copies its outputs into the static output tensors of the capture (the
    same objects every replay), under inference mode as a capture runs. It is what
    ``graphs_captured[w]`` holds: a replay by hand re-runs the step. ``reset()`` is
    refused (CgrtError; ``recapture()`` instead), as the runtime forbids it for CUDA graphs.
    Lifetime: the runtime's graphs (until ``recapture()`` or ``close()``)."""

    def __init__(self, width: int, body: Callable[[], Any], static_out: Any):
        self.width, self._body = width, body
        self._static = tree_flatten(static_out)[0]

    def replay(self) -> None:
        with torch.inference_mode(), frozen():
            new = tree_flatten(self._body())[0]
            for dst, src in zip(self._static, new):
                if dst is not src:
                    dst.copy_(src)

    def reset(self) -> None:
        raise CgrtError("an emulated graph cannot be reset (steps replay it): call recapture() instead")


class NoPool:
    """The capturer of a mode without CUDA graphs: no pool, no stream, no bytes. It counts
    the pools a CUDA capture would use (``pool_index``, for ``WidthCapture.pool``): the
    capture loop ``renew``s after a failed attempt, as it does the CUDA capturer's."""

    pool = None
    stream = None

    def __init__(self, settings: CaptureSettings):
        self.settings = settings
        self.pool_index = 0

    def begin(self) -> None:
        self.pool_index = 0

    def renew(self) -> None:
        self.pool_index += 1

    def pool_bytes(self) -> int:
        return 0

    def drop(self) -> None:
        pass


class EmulatedCapturer(NoPool):
    """Captures widths as :class:`EmulatedGraph` (``warmup`` runs, then one run whose
    outputs become the width's static outputs) or in pieces as ``pieces.EmulatedPieces``.
    A step function that raises (or reads ``step_values()`` outside a marked call, which a
    real capture would freeze) becomes a CaptureError naming the width, as a failed CUDA
    warm-up does; no hazard finder runs. What a failed width does next is the policy's."""

    def width(self, w: int, run: Callable[[], Any], replay: Callable[[], Any], explain: Callable[[], tuple]):
        st = self.settings
        t0 = time.perf_counter()
        try:
            for _ in range(st.warmup):
                run()
            t1 = time.perf_counter()
            with frozen():  # what a capture records: step_values() may not be read here
                out = run()
        except CaptureError as e:
            raise CaptureError(f"width {w}: {e}", width=w, cause=e) from e
        except CgrtError:
            raise
        except Exception as e:  # noqa: BLE001 - as capture_width: every failure a CaptureError
            raise CaptureError(f"width {w}: the step function raised during emulated capture: "
                               f"{type(e).__name__}: {e}", width=w, cause=e) from e
        return (EmulatedGraph(w, replay, out), out,
                WidthCapture(w, t1 - t0, time.perf_counter() - t1, 0, pool=self.pool_index))

    def pieces(self, w: int, run: Callable[[], Any], replay: Callable[[], Any], explain: Callable[[], tuple]):
        from .piece_capture import emulate_pieces
        graph, out, tw, tc = emulate_pieces(w, run, replay, self.settings.warmup)
        return graph, out, WidthCapture(w, tw, tc, 0, pool=self.pool_index)

    def body(self, fn: Callable[[], None]) -> EmulatedGraph:
        """A graph of ``fn`` (a host-row mode's own, e.g. commit's gather)."""
        return EmulatedGraph(0, fn, None)


class GraphMode:
    """What ``graphs=`` chose. ``value`` reads back as ``GraphRuntime.graphs``; ``captures``
    whether ``capture()`` makes a graph per width."""

    name = "off"
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
        """What a graph step calls before its launch: the host-row mode's ``replaying``
        where the launch runs the captured gather without Python (CUDA graphs)."""
        return replaying


class GraphsOff(GraphMode):
    """``graphs=False``: every width runs eagerly over the same static buffers."""


class CudaGraphs(GraphMode):
    """``graphs=True``: one CUDA graph per width, in one pool; fed where torch can."""

    name, value, captures = "cuda", True, True

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


class EmulatedGraphs(GraphMode):
    """``graphs="emulate"``: the graph path run eagerly (module docstring)."""

    name, value, captures = "emulated", "emulate", True

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


def graph_mode_for(graphs: Any) -> GraphMode:
    """The mode object of GraphRuntime's ``graphs`` argument: True, False or "emulate"
    (InputError for anything else)."""
    if isinstance(graphs, str):
        if graphs == "emulate":
            return EmulatedGraphs()
    elif type(graphs) is bool or (type(graphs) is int and graphs in (0, 1)):
        return CudaGraphs() if graphs else GraphsOff()
    raise InputError(expected("graphs", "True, False or 'emulate'", repr(graphs)))
