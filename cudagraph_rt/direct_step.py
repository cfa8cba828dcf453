"""The common step in few Python operations: one captured graph, host rows in.

``DirectStep`` runs a step of a runtime without HostRows whose graph stager allows it
(``short_path``: the feed of fed graphs, see ``inputs.feed``) when every input is a
contiguous CPU tensor of its declared dtype (or they are the views ``host_inputs`` handed
out) and T fits a captured width. What the general path works out per step (the plan, the
executor, the cut outputs, the padding) it looks up per T, built once; the checks it makes
are the general path's for such inputs. Anything else it declines before writing
anything, and the general path runs the step (and raises its errors), so both paths give
the same results and the same failures.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

from .executor import Counters, GraphSlice, OutputLayout
from .results import StepResult


class _PerT:
    """What a step of T rows runs (slots: built once per T, read every step)."""

    __slots__ = ("slices", "replay", "cut", "is_dict", "padding")

    def __init__(self, slices, executor: GraphSlice, layout: OutputLayout, T: int):
        self.slices, self.replay = slices, executor.replay
        self.cut = executor.cut(T, layout)
        self.is_dict = type(self.cut) is dict
        self.padding = slices[0].padding


class DirectStep:
    """``__call__(inputs)`` -> StepResult, or None (declined: nothing checked twice is
    missed, nothing written). Built after capture, dropped with the graphs; the runtime
    calls it under its step lock. Outputs: the graph's static tensors, valid until the
    next step (as the general path's). ``stager``: the graph stager its rows go into (a
    ``short_path`` one: ``write_rows``, ``all_host``)."""

    def __init__(self, inputs, executors: Callable[[int], Any], planner: Callable[[int], tuple],
                 layout: OutputLayout, counters: Counters, token: object, watch):
        self._inputs, self._validator = inputs, inputs.validator
        self.stager = self._feed = inputs.graph_stager
        self._executors, self._planner, self._layout = executors, planner, layout
        self._counters, self._token, self._watch = counters, token, watch
        self._watching = watch.watching
        self._per_t: dict[int, _PerT | None] = {}  # T up to the arena's rows only: bounded
        self._rows = inputs.rows

    def __call__(self, inputs: Mapping[str, Any]) -> StepResult | None:
        feed = self._feed
        if not feed.all_host:  # the last step fed some input from the device: the general write
            return None
        T, ptrs = self._inputs.handed_rows(inputs), None
        if T is None:
            got = self._validator.host_rows(inputs)
            if got is None:
                return None
            T, ptrs = got
        elif T < 0:  # another thread holds the next step's views: the general path refuses
            return None
        e = self._per_t.get(T, False)
        if e is False:
            if T > self._rows:  # wider than any graph: the general path slices it
                return None
            e = self._per_t[T] = self._plan(T)
        if e is None:
            return None
        if self._watching:
            self._watch.check()  # raises StaleCaptureError before anything is written
        self._inputs.consume()
        feed.write_rows(ptrs, T)
        e.replay()
        self._counters.step_ran(e.padding, 1)  # as the general path counts a one-slice step
        return StepResult(e.cut.copy() if e.is_dict else e.cut, T, e.slices, None, None, self._token)

    def runs(self, T: Any) -> bool:
        """Whether a step of ``T`` rows replays one captured graph (a fed one)."""
        if type(T) is not int or T > self._rows:
            return False
        e = self._per_t.get(T, False)
        if e is False:
            e = self._per_t[T] = self._plan(T)
        return e is not None

    def _plan(self, T: int) -> _PerT | None:
        if T < 1:
            return None
        slices = self._planner(T)
        if len(slices) != 1 or slices[0].path != "graph":
            return None
        ex = self._executors(slices[0].width)
        return _PerT(slices, ex, self._layout, T) if isinstance(ex, GraphSlice) and ex.direct else None
