"""Emulated graphs (``graphs="emulate"``): the graph path's own code run eagerly on any
device, a CPU included. The feed (unpinned on a CPU) and its prologue, the short path,
handed views, staging and padding bookkeeping run as with fed CUDA graphs. Capture runs
each width (warm-up, then one run whose outputs become that width's static outputs);
a replay runs the same width again over the same static input buffers and copies what it
produced into those same output tensors, so an output kept past the next replay of its
width is overwritten exactly as a CUDA graph overwrites it. Not emulated: kernels (the
step runs eagerly, op by op), timing, the CUDA context and what a capture refuses (a host
sync, a pinned allocation: they run fine here; ``find_capture_hazards`` finds them),
stream concurrency, and events (no-ops on a CPU).

Also the capturer of a runtime without graphs (:class:`NoPool`) and the event where nothing
runs asynchronously (:class:`NoEvent`).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from ..errors import CaptureError, CgrtError
from ..pieces import PLAIN, call_name, frozen, marked_calls, with_values
from .capture import CaptureSettings, WidthCapture
from .pieces import EagerCall, layout


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
    outputs become the width's static outputs) or in pieces as ``EmulatedPieces``.
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
        calls, out, tw, tc = emulate_pieces(w, run, self.settings.warmup)
        return EmulatedPieces(w, replay, out, calls), out, WidthCapture(w, tw, tc, 0, pool=self.pool_index)

    def body(self, fn: Callable[[], None]) -> EmulatedGraph:
        """A graph of ``fn`` (a host-row choice's own, e.g. commit's gather)."""
        return EmulatedGraph(0, fn, None)


class EmulatedPieces:
    """One width captured in pieces under ``graphs="emulate"``: a replay runs the width's
    body again; at each marked call the fresh arguments are copied into the capture's
    tensors (what the piece before it writes at a CUDA replay), the recorded call runs on
    those (as at a CUDA replay), what it left in them is copied back into the fresh ones
    (what it wrote in place, which the next piece reads) and the capture's outputs go on
    to the code after it (what the next piece reads). A call that differs from the capture's (another function, a
    constant that changed, one call more or fewer) raises CgrtError: a CUDA graph would
    silently replay the capture's. The width's outputs are copied into its static
    outputs, as an emulated whole graph's. Lifetime: the runtime's graphs."""

    def __init__(self, width: int, body: Callable[[], Any], static_out: Any, calls: tuple[EagerCall, ...]):
        self.width, self._body, self.calls = width, body, tuple(calls)
        self.pieces = tuple(f"piece {i + 1}" for i in range(len(calls) + 1))
        self._static = tree_flatten(static_out)[0]
        self._next = 0

    @property
    def layout(self) -> tuple[str, ...]:
        return layout(len(self.pieces), self.calls)

    def launcher(self, device: torch.device, before_last: Callable[[], None]) -> Callable[[], None]:
        return self.replay  # the body's gather does the host-row bookkeeping itself

    def _marked(self, fn, args, kwargs):
        i = self._next
        if i >= len(self.calls) or self.calls[i].fn is not fn:
            got = "one more marked call" if i >= len(self.calls) else f"{call_name(fn)}"
            raise CgrtError(f"width {self.width}: marked call {i + 1} at this replay is {got}, not what the capture "
                            "recorded: the step took another path than at capture")
        self._next = i + 1
        call = self.calls[i]
        copied = call.absorb(i + 1, args, kwargs)
        out = call.replay()
        call.give_back(copied)
        return out

    def replay(self, values: Any = None) -> None:
        self._next = 0
        with torch.inference_mode(), frozen(), marked_calls(self._marked), \
                (with_values(values) if values is not None else PLAIN):
            new = tree_flatten(self._body())[0]
        if self._next != len(self.calls):
            raise CgrtError(f"width {self.width}: {self._next} marked calls at this replay, {len(self.calls)} at "
                            "capture: the step took another path than at capture")
        with torch.inference_mode():
            for dst, src in zip(self._static, new):
                if dst is not src:
                    dst.copy_(src)

    def reset(self) -> None:
        raise CgrtError("an emulated graph cannot be reset (steps replay it): call recapture() instead")
