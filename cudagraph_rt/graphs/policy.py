"""What each width runs as, chosen at capture: one whole graph, graphs in pieces split at
the calls marked ``cudagraph_rt.eager`` (``pieces``), or no graph (eager).

One object per mode (:data:`WHOLE`, :data:`PIECES`, :data:`EAGER`); the runtime never asks
which it holds. :class:`CapturePolicy` (from GraphRuntime's ``pieces`` and
``on_capture_error``) says which modes a width tries, in order, and whether a width whose
every try failed runs eagerly or raises; :func:`capture_widths` runs it over the widths.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from .capture import WidthCapture
from ..errors import CaptureError, InputError, expected
from ..executor import GraphSlice, PiecewiseSlice

log = logging.getLogger(__name__)


class WidthParts(NamedTuple):
    """What a width's executor is built from (the runtime's, handed over at capture)."""

    body: Any  # StepBody
    inputs: Any  # StaticInputs
    counters: Any
    backend: Any  # graphs.backends.GraphBackend
    replaying: Callable[[], None]  # the host-row choice's bookkeeping before a graph runs its gather
    device: Any
    explain: Callable[[int], tuple]  # the hazard finder on width w


class WidthMode:
    """How one width runs. ``name`` is what ``stats().width_modes`` and ``WidthCapture.mode``
    say; ``capture`` returns ``(graph, outputs, WidthCapture)`` or raises CaptureError."""

    name = "?"

    def capture(self, capturer, w: int, run: Callable, replay: Callable, explain: Callable) -> tuple:
        raise NotImplementedError

    def executor(self, w: int, graph, out: Any, parts: WidthParts):
        raise NotImplementedError


class WholeGraph(WidthMode):
    """The width is one graph (marked calls captured inline, as plain calls)."""

    name = "graph"

    def capture(self, capturer, w, run, replay, explain):
        return capturer.width(w, run, replay, explain)

    def executor(self, w, graph, out, parts: WidthParts) -> GraphSlice:
        backend = parts.backend
        return GraphSlice(w, graph, out, parts.inputs, parts.counters, backend.before_launch(parts.replaying),
                          backend.launcher(graph, parts.device))


class Pieces(WidthMode):
    """The width is graphs split at each marked call, the calls run between them."""

    name = "pieces"

    def capture(self, capturer, w, run, replay, explain):
        graph, out, report = capturer.pieces(w, run, replay, explain)
        return graph, out, dataclasses.replace(report, mode=self.name, pieces=len(graph.pieces),
                                               eager_calls=tuple(c.name for c in graph.calls))

    def executor(self, w, graph, out, parts: WidthParts) -> PiecewiseSlice:
        launch = graph.launcher(parts.device, parts.backend.before_launch(parts.replaying))
        return PiecewiseSlice(w, graph, out, parts.inputs, parts.counters, launch, parts.body.values)


class Eager(WidthMode):
    """No graph: the width runs eagerly over the same static buffers (its executor is the
    one it had before capture)."""

    name = "eager"


WHOLE, PIECES, EAGER = WholeGraph(), Pieces(), Eager()


@dataclass(frozen=True)
class CapturePolicy:
    """Which modes each width tries, in order, and what a width whose every try failed
    does: ``fallback`` EAGER (run eagerly, reported) or None (raise the last CaptureError).

    From GraphRuntime's arguments (:meth:`build`): ``pieces`` True (every width in
    pieces), an iterable of widths (those in pieces), or False; ``on_capture_error``
    ``"raise"``, ``"eager"`` (fall back to eager) or ``"pieces"`` (a width whose whole
    graph failed is captured in pieces; if that fails too, CaptureError)."""

    piece_widths: frozenset[int]
    then: tuple[WidthMode, ...]  # tried after the width's first mode failed
    fallback: WidthMode | None

    def attempts(self, w: int) -> tuple[WidthMode, ...]:
        first = PIECES if w in self.piece_widths else WHOLE
        return (first, *(m for m in self.then if m is not first))

    @classmethod
    def build(cls, pieces: Any, on_capture_error: Any, widths: tuple[int, ...]) -> "CapturePolicy":
        choices = {"raise": ((), None), "eager": ((), EAGER), "pieces": ((PIECES,), None)}
        if not isinstance(on_capture_error, str) or on_capture_error not in choices:
            raise InputError(expected("on_capture_error", "'raise', 'eager' or 'pieces'", repr(on_capture_error)))
        then, fallback = choices[on_capture_error]
        return cls(_piece_widths(pieces, widths), then, fallback)


def _piece_widths(pieces: Any, widths: tuple[int, ...]) -> frozenset[int]:
    if pieces is True or pieces is False:
        return frozenset(widths if pieces else ())
    what = f"True, False or widths of the runtime ({widths})"
    try:
        picked = tuple(pieces)
    except TypeError:
        raise InputError(expected("pieces", what, repr(pieces))) from None
    if any(isinstance(w, bool) or w not in widths for w in picked):
        raise InputError(expected("pieces", what, repr(pieces)))
    return frozenset(picked)


def capture_widths(policy: CapturePolicy, capturer, by_width: dict, parts: WidthParts, calls: list[int]
                   ) -> list[WidthCapture]:
    """Capture every width not captured yet, widest first, by ``policy``; each width's
    executor goes into ``by_width``. Returns the widths' reports (a width that fell back
    reports the error that made it). Raises the CaptureError of a width that could not be
    captured when the policy has no fallback; widths captured before it still replay."""
    reports = []
    todo = [w for w in sorted(by_width, reverse=True) if by_width[w].graph is None]  # a failure keeps the ones before
    for i, w in enumerate(todo, 1):
        log.info("capturing width %d (%d of %d)", w, i, len(todo))
        run, replay = parts.body.at_width(w, parts.inputs, calls)
        mode, graph, out, report = _capture_one(policy, capturer, w, run, replay, lambda w=w: parts.explain(w))
        if graph is not None:
            by_width[w] = mode.executor(w, graph, out, parts)
        reports.append(report)
    return reports


def _capture_one(policy: CapturePolicy, capturer, w: int, run, replay, explain) -> tuple:
    """The width's attempts in turn. A failed attempt may leave the capturer's stream and
    pool unusable: whatever is captured after it (the next attempt, the next width) gets
    fresh ones."""
    errors: list[CaptureError] = []
    for mode in policy.attempts(w):
        try:
            graph, out, report = mode.capture(capturer, w, run, replay, explain)
        except CaptureError as e:
            errors.append(e)
            capturer.renew()
            continue
        why = str(errors[0]) if errors else None
        return mode, graph, out, dataclasses.replace(report, error=why)
    if policy.fallback is None:
        raise errors[-1]
    return EAGER, None, None, WidthCapture(w, 0.0, 0.0, 0, error="; then ".join(map(str, errors)), mode=EAGER.name,
                                           pieces=0, pool=None)


def modes_of(by_width: dict) -> dict[int, str]:
    """``width -> mode name`` of each width's executor (what it runs as now)."""
    return {w: e.mode_name for w, e in sorted(by_width.items())}


__all__ = ["CapturePolicy", "EAGER", "PIECES", "WHOLE", "WidthMode", "WidthParts", "capture_widths", "modes_of"]
