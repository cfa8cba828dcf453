"""How one slice of a step runs, and what is done with its outputs.

One executor per slice kind, chosen at capture: a captured graph (``GraphSlice``), a width
captured in pieces with the marked calls run between them (``PiecewiseSlice``), the step
function run eagerly at a padded width (graphs off, or a width whose capture fell back:
``EagerSlice``), and the dynamic path run unpadded (``DynamicSlice``). Each writes its rows
through its stager (``stager``: the arena stager for the eager kinds, the graph stager
for graphs, the feed where they are fed), runs, and returns the static outputs of its
width. Each says what it runs as (``mode_name``: what ``stats().width_modes`` reports).
`OutputLayout` checks the output structure and cuts and joins outputs.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .errors import StepFunctionError, expected
from .widths import Slice


@dataclass
class Counters:
    """What ran since construction or ``reset_stats`` (mutable; RuntimeStats is the
    frozen view a caller gets)."""

    steps: int = 0
    slices: int = 0
    padding: int = 0
    commits: int = 0
    replays: Counter = field(default_factory=Counter)
    eager: Counter = field(default_factory=Counter)
    dynamic: Counter = field(default_factory=Counter)

    def slice_ran(self, padding: int) -> None:
        """One slice of a sliced step ran, with ``padding`` padding rows."""
        self.slices += 1
        self.padding += padding

    def step_ran(self, padding: int = 0, slices: int = 0) -> None:
        """A step ran to its end: a one-slice step's slice and padding counted with it (the
        general path and the short path alike), a sliced step's already (``slice_ran``)."""
        self.steps += 1
        self.slices += slices
        self.padding += padding

    def reset(self) -> None:
        self.steps = self.slices = self.padding = self.commits = 0
        self.replays, self.eager, self.dynamic = Counter(), Counter(), Counter()


class OutputLayout:
    """The structure of the step function's outputs, fixed by its first call: every leaf a
    tensor with the width as leading dimension (except a device-mode count leaf), the
    same structure at every width. Cuts a width's outputs to T rows; joins slices."""

    def __init__(self, count_leaf: Callable[[Any, list], int]):
        self._count_leaf = count_leaf
        self.spec = None
        self.count_index = -1
        self.flat_dict = False

    def check(self, n: int, out: Any) -> None:
        leaves, spec = tree_flatten(out)
        if not leaves:
            raise StepFunctionError(expected("step_fn output", "at least one tensor", repr(out)))
        cnt = self._count_leaf(out, leaves)
        for i, t in enumerate(leaves):
            if not isinstance(t, torch.Tensor):
                unknown = (" (a container torch's pytree does not take apart: return a plain dict, list, tuple or a "
                           "NamedTuple, or register it with torch.utils._pytree.register_pytree_node)"
                           if isinstance(t, (dict, list, tuple)) else "")
                raise StepFunctionError(expected(f"step_fn output leaf {i}", "a tensor", type(t).__name__ + unknown))
            if i != cnt and (t.dim() == 0 or t.shape[0] != n):
                raise StepFunctionError(expected(f"step_fn output leaf {i}", f"leading dimension {n} (the step "
                                                 f"width)", f"shape {tuple(t.shape)}"))
        if self.spec is None:
            self.spec, self.count_index = spec, cnt
            self.flat_dict = cnt < 0 and type(out) is dict and all(type(v) is torch.Tensor for v in out.values())
        elif spec != self.spec:
            raise StepFunctionError(expected("step_fn output", f"the same structure at every width ({self.spec})",
                                             f"{spec} at width {n}"))

    def cut(self, out: Any, T: int) -> Any:
        if self.flat_dict:  # the common case (a dict of tensors), fast
            return {k: v[:T] for k, v in out.items()}
        if type(out) is torch.Tensor:
            return out[:T]
        leaves, spec = tree_flatten(out)
        cnt = self.count_index
        return tree_unflatten([t if i == cnt else t[:T] for i, t in enumerate(leaves)], spec)

    def join_into(self, bufs: list | None, out: Any, s: Slice, T: int) -> list:
        """Copy a slice's rows out of graph memory into ``bufs`` (made on the first slice:
        the next slice overwrites graph memory)."""
        leaves, _ = tree_flatten(out)
        if bufs is None:
            bufs = [t.clone() if i == self.count_index else
                    torch.empty((T, *t.shape[1:]), dtype=t.dtype, device=t.device) for i, t in enumerate(leaves)]
        for i, t in enumerate(leaves):
            if i != self.count_index:
                bufs[i][s.start:s.start + s.length].copy_(t[:s.length])
        return bufs

    def joined(self, bufs: list) -> Any:
        return tree_unflatten(bufs, self.spec)


class StepBody:
    """The step function at width ``n`` plus the host-row work of the same replay: what
    each width captures, and the eager path. It holds no reference to the runtime, so
    dropping the runtime frees its buffers at once (no cycle for the garbage collector)."""

    def __init__(self, step_fn: Callable, layout: OutputLayout, row_choice, control: Callable, values):
        self.step_fn, self.layout, self.row_choice, self.control = step_fn, layout, row_choice, control
        self.values = values  # the runtime's step_values function, per slice

    def __call__(self, n: int, views: dict, fn: Callable | None = None) -> Any:
        out = (fn or self.step_fn)(views)
        self.layout.check(n, out)
        self.row_choice.gather_in_graph(out, n, self.control)
        return out

    def at_width(self, w: int, inputs, calls: list[int]) -> tuple[Callable[[], Any], Callable[[], Any]]:
        """(run, replay): what width ``w`` captures (a graph starts with its stager's
        prologue: a fed graph's copies the feed in, the others' does nothing), counted in
        ``calls[0]``, and the same work uncounted, for an emulated graph to re-run (it holds
        the buffers and this body, never the runtime). ``run`` sees the step values of
        padding rows; ``replay`` those of the slice that replays it."""
        views = inputs.views(w)
        prologue = inputs.graph_stager.prologue
        values = self.values

        def replay():
            prologue()
            return self(w, views)

        def run():
            calls[0] += 1
            with values.scope(None, 0, 0, w):
                return replay()
        return run, replay


class EagerSlice:
    """The step function run eagerly at a padded width, over the same static buffers (the
    graphs-off path, and a width whose capture fell back). Synchronous on a CPU. Its rows
    go through the arena stager (``stager``; ``inputs.write``)."""

    mode_name = "eager"
    graph = None

    def __init__(self, width: int, body: Callable, inputs, counters: Counters, values):
        self.width, self._body, self._inputs, self._counters = width, body, inputs, counters
        self._values = values

    @property
    def stager(self):
        """The arena stager (read when asked: a closed runtime builds these over no inputs)."""
        return self._inputs.stager

    def run(self, prep, s: Slice, control) -> Any:
        self._inputs.write(prep, s.start, s.length, self.width, control)
        self._counters.eager[self.width] += 1
        with torch.inference_mode(), self._values.scope(prep, s.start, s.length, self.width):
            return self._body(self.width, self._inputs.views(self.width))

    def outputs(self, prep, s: Slice, control, layout: OutputLayout) -> Any:
        """One-slice step: run and cut to its T rows (views until the next step)."""
        return layout.cut(self.run(prep, s, control), s.length)


class DynamicSlice(EagerSlice):
    """A step wider than the widest graph, run eagerly on exactly its rows (no padding)."""

    def __init__(self, body: Callable, inputs, counters: Counters, values):
        super().__init__(0, body, inputs, counters, values)

    def run(self, prep, s: Slice, control) -> Any:
        n = s.length
        self._inputs.write(prep, s.start, n, n, control)
        self._counters.dynamic[n] += 1
        with torch.inference_mode(), self._values.scope(prep, s.start, n, n):
            return self._body(n, self._inputs.views(n))


class GraphSlice:
    """A captured graph of one width. Its rows go through the graph stager (``stager``):
    the feed where graphs are fed, which they copy in themselves (one node at the start
    of the graph), so a replay costs the host no copy call; ``launch`` starts
    the graph (the graph mode's launcher: ``GraphLaunch`` for a CUDA graph, an emulated
    graph's ``replay``). Outputs are the graph's static tensors: the same objects
    every replay, cut once per T (``cut``). ``direct``: the short path (``DirectStep``)
    may launch it."""

    mode_name = "graph"
    direct = True

    def __init__(self, width: int, graph, static_out: Any, inputs, counters: Counters,
                 replaying: Callable[[], None], launch: Callable[[], None]):
        self.width, self.graph, self.static_out = width, graph, static_out
        self._inputs, self._counters, self._replaying = inputs, counters, replaying
        self.stager = inputs.graph_stager
        self.launch = launch
        self._cuts: dict[int, Any] = {}

    def run(self, prep, s: Slice, control) -> Any:
        self._inputs.write_via(self.stager, prep, s.start, s.length, self.width, control)
        self.replay()
        return self.static_out

    def replay(self) -> None:
        """Count and launch a replay over the rows already written (the short path's too)."""
        self._counters.replays[self.width] += 1
        self._replaying()
        self.launch()

    def cut(self, T: int, layout: OutputLayout) -> Any:
        """The static outputs cut to ``T`` rows: made once per T, the same objects after
        (a dict is copied by the caller, who hands it out)."""
        cut = self._cuts.get(T)
        if cut is None:
            cut = self._cuts[T] = layout.cut(self.static_out, T)
        return cut

    def outputs(self, prep, s: Slice, control, layout: OutputLayout) -> Any:
        self.run(prep, s, control)
        cut = self.cut(s.length, layout)
        return cut.copy() if type(cut) is dict else cut


class PiecewiseSlice(GraphSlice):
    """A width captured in pieces (``pieces``): a replay writes the rows as a graph step
    does, then launches each piece with the marked calls between them (``launch``: the
    graph's launcher, the host-row bookkeeping before the last piece), under this slice's
    step values. The short path takes it only where the runtime has no ``step_values``
    function (it computes none)."""

    mode_name = "pieces"

    def __init__(self, width: int, graph, static_out: Any, inputs, counters: Counters, launch: Callable[[], None],
                 values):
        super().__init__(width, graph, static_out, inputs, counters, _nothing, launch)
        self._values = values
        self.direct = values.none

    def run(self, prep, s: Slice, control) -> Any:
        with self._values.scope(prep, s.start, s.length, self.width):
            return super().run(prep, s, control)


def _nothing() -> None:
    pass


def eager_executors(widths, body: StepBody, dynamic_fn, inputs, counters: Counters) -> tuple[dict, DynamicSlice]:
    """Every width run eagerly (graphs off, or before capture), and the dynamic path
    (``dynamic_fn`` or the step function)."""
    values = body.values if body is not None else None  # (None: the runtime was closed)
    by_width = {w: EagerSlice(w, body, inputs, counters, values) for w in widths}
    return by_width, DynamicSlice(lambda n, v: body(n, v, dynamic_fn), inputs, counters, values)
