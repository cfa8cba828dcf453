"""`inspect_runtime`: what each width of a GraphRuntime captured, how long it replays, and
whether replay equals graphs off. Re-exports the hazard finder and the graph reader.

Without CUDA the report says so (``available`` False) and still lists hazards per width.
"""
from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch

from .graph_nodes import (  # noqa: F401 - re-exported: the debug tool's whole surface
    GraphInspectError, GraphNode, NeedsCudaError, NodeDiff, diff_nodes, graph_nodes, node_counts,
    short_kernel_name, to_dot,
)
from .hazards import (  # noqa: F401 - re-exported
    ERROR, HAZARD_KINDS, Hazard, explain_capture_failure, find_capture_hazards,
)


# --------------------------------------------------------------------------------------
# A whole runtime
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutputDiff:
    """Graphs on vs graphs off for one output leaf (``path`` like ``"tokens"`` or ``"[0]"``).
    ``first_row``: first row (leading index) that differs at all, None if bit-identical."""

    path: str
    max_abs: float
    max_rel: float
    first_row: int | None
    note: str = ""

    @property
    def equal(self) -> bool:
        return self.first_row is None and not self.note

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "equal": self.equal}


@dataclass(frozen=True)
class WidthReport:
    """Everything known about one captured width. Times in seconds (replay: median of
    event-timed replays); None where the runtime did not say or the step was not run."""

    width: int
    capture_s: float | None = None
    replay_s: float | None = None
    pool_bytes: int | None = None
    counts: dict[str, int] = field(default_factory=dict)
    static_inputs: dict[str, int] = field(default_factory=dict)   # name -> data_ptr
    hazards: tuple[Hazard, ...] = ()
    diffs: tuple[OutputDiff, ...] = ()
    error: str | None = None
    nodes: tuple[GraphNode, ...] = field(default=(), repr=False)
    layout: tuple[str, ...] = ()  # a width in pieces: ("piece 1", "eager <call>", "piece 2", ...)

    @property
    def kernels(self) -> tuple[GraphNode, ...]:
        return tuple(n for n in self.nodes if n.type == "kernel")

    @property
    def copies(self) -> tuple[GraphNode, ...]:
        return tuple(n for n in self.nodes if n.type in ("memcpy", "memset"))

    @property
    def node_hazards(self) -> tuple[GraphNode, ...]:
        return tuple(n for n in self.nodes if n.hazard)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "nodes"}
        d["hazards"] = [h.to_json() for h in self.hazards]
        d["diffs"] = [x.to_json() for x in self.diffs]
        d["kernels"] = [k.to_json() for k in self.kernels]
        d["copies"] = [c.to_json() for c in self.copies]
        d["node_hazards"] = [n.to_json() for n in self.node_hazards]
        return d


@dataclass(frozen=True)
class InspectReport:
    """Per-width facts of one runtime, plus what changes between neighbouring widths.

    ``available`` is False (``reason`` says why, e.g. "needs CUDA") when graphs could not
    be read; the hazard lists are still filled where the step function could be run.
    """

    available: bool
    reason: str
    device: str
    widths: tuple[WidthReport, ...]
    width_diffs: tuple[tuple[int, int, NodeDiff], ...] = ()

    @property
    def ok(self) -> bool:
        """Nothing found: no hazard, no graph hazard, graphs on == graphs off, no failed
        width. Where graphs could not be read (``available`` False) only the hazard finder
        ran, and ``ok`` is its verdict."""
        return not any(w.hazards or w.node_hazards or w.error or not all(d.equal for d in w.diffs)
                       for w in self.widths)

    @property
    def exit_code(self) -> int:
        """What ``cgrt inspect`` exits with: 0 when :attr:`ok`, else 1 (its JSON's "ok"
        says the same)."""
        return 0 if self.ok else 1

    def to_json(self) -> dict:
        return {"available": self.available, "reason": self.reason, "device": self.device,
                "ok": self.ok, "widths": [w.to_json() for w in self.widths],
                "width_diffs": [{"a": a, "b": b, **d.to_json()} for a, b, d in self.width_diffs]}


def _capture_facts(report, width: int) -> dict:
    """capture_s / pool_bytes / error of one width from ``rt.capture_report``
    (a CaptureReport: ``.widths`` holds WidthCapture entries; a mapping width -> entry
    works too). For kept graphs the runtime instantiates inside the timed capture, so
    capture_s includes instantiation."""
    entries = getattr(report, "widths", None) or ()
    if isinstance(entries, Mapping):
        entry = entries.get(width)
    else:
        entry = next((e for e in entries if getattr(e, "width", None) == width), None)
    get = (lambda k: entry.get(k)) if isinstance(entry, Mapping) else (lambda k: getattr(entry, k, None))
    return {k: get(k) for k in ("capture_s", "pool_bytes", "error")}


def _graphs(rt) -> Mapping[int, Any]:
    return getattr(rt, "graphs_captured", None) or {}


def _leaves(obj, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path or "out", obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")


def _compare(path: str, a: torch.Tensor, b: torch.Tensor) -> OutputDiff:
    if a.shape != b.shape:
        return OutputDiff(path, float("inf"), float("inf"), 0, f"shape {tuple(a.shape)} vs {tuple(b.shape)}")
    a, b = a.detach().double(), b.detach().double()
    neq = (a != b) & ~(a.isnan() & b.isnan())
    if not bool(neq.any()):
        return OutputDiff(path, 0.0, 0.0, None)
    diff = torch.where(neq, (a - b).abs().nan_to_num(nan=float("inf")), torch.zeros_like(a))
    rel = torch.where(neq, diff / b.abs().clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    rel = rel.nan_to_num(nan=float("inf"))   # NaN on one side only
    rows = neq.reshape(neq.shape[0], -1).any(1) if neq.dim() else neq.reshape(1)
    return OutputDiff(path, float(diff.max()), float(rel.max()), int(rows.nonzero()[0, 0]))


def _replay_seconds(graph, replays: int) -> float:
    torch.cuda.synchronize()             # nothing of the runtime's streams still pending
    graph.replay()                       # instantiates a kept graph on first use
    torch.cuda.synchronize()
    times = []
    for _ in range(max(1, replays)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def inspect_runtime(rt, *, widths=None, replays: int = 20, reference=None,
                    inputs: Callable[[int], Mapping[str, Any]] | None = None,
                    hazards: bool = True, on_width: Callable[[int], None] | None = None) -> InspectReport:
    """Gather per-width facts of a GraphRuntime: capture time and pool bytes (as
    ``rt.capture_report`` gives them), replay time (CUDA events, median of ``replays``),
    node counts, kernel and memcpy/memset nodes, static input addresses, hazards found by
    :func:`find_capture_hazards` on ``rt.step_fn(rt.static_inputs(w))``, and graphs on
    vs off per output.

    ``rt`` must have been built with ``keep_graphs=True`` and captured. ``reference``: a
    graphs-off runtime computing the same function with the same state (build both from
    one seeded factory), or a zero-argument callable returning one; ``inputs(T)`` gives
    step inputs of T rows. Both are needed for the on/off comparison, which runs
    ``rt.step`` and ``reference.step`` once per width with T = width. ``on_width(w)`` is
    called before each width (a progress bar).

    Side effects: replays each graph ``replays + 1`` times on its current static inputs
    and runs the step eagerly once per width for the hazard finder (both rewrite what the
    last step wrote, e.g. its KV cells; results of earlier steps become invalid). Never
    raises for a width: its ``error`` says what failed. Without CUDA, or without
    captured graphs, the report has ``available=False`` and only the hazards.
    """
    graphs = _graphs(rt)
    widths = tuple(sorted(widths if widths is not None else (graphs or getattr(rt, "widths", ()))))
    device = str(getattr(rt, "device", "?"))
    reason = ""
    if not torch.cuda.is_available():
        reason = "needs CUDA: torch.cuda.is_available() is False"
    elif not graphs:
        reason = "no captured graphs: build the runtime with graphs=True, keep_graphs=True and call capture()"
    if reason:
        return InspectReport(False, reason, device, tuple(
            WidthReport(w, hazards=_step_hazards(rt, w) if hazards else (), layout=_layout(rt, w)) for w in widths))
    ref = reference() if callable(reference) and not hasattr(reference, "step") else reference
    compare = (ref, inputs) if ref is not None and inputs else None
    reports = []
    for w in widths:
        if on_width is not None:
            on_width(w)
        reports.append(_width_report(rt, w, replays, hazards, compare))
    all_nodes = {r.width: r.nodes for r in reports if r.nodes}
    ws = sorted(all_nodes)
    pairs = tuple((a, b, diff_nodes(all_nodes[a], all_nodes[b])) for a, b in zip(ws, ws[1:]))
    return InspectReport(True, "", device, tuple(reports), pairs)


def _width_report(rt, w: int, replays: int, hazards: bool, compare) -> WidthReport:
    """One width's facts; never raises (an error is reported in the width's row).
    ``compare``: (graphs-off reference, inputs(T)) for the on/off comparison, or None."""
    facts = _capture_facts(getattr(rt, "capture_report", None), w)
    error, graphs = facts.pop("error"), _graphs(rt)
    try:
        if w not in graphs:
            raise GraphInspectError(error or f"width {w} has no captured graph")
        g = graphs[w]
        nodes = tuple(n for piece in getattr(g, "pieces", (g,)) for n in graph_nodes(piece))
        return WidthReport(
            w, **facts, layout=_layout(rt, w), replay_s=_replay_seconds(g, replays), counts=node_counts(nodes),
            static_inputs={k: v.data_ptr() for k, v in rt.static_inputs(w).items()},
            hazards=_step_hazards(rt, w) if hazards else (),
            diffs=_on_off(rt, compare[0], compare[1], w) if compare else (), nodes=nodes)
    except Exception as exc:   # one width's failure must not hide the others
        return WidthReport(w, **facts, error=f"{type(exc).__name__}: {exc}")


def _layout(rt, width: int) -> tuple[str, ...]:
    """What a width in pieces runs, in order (its graph's ``layout``); () for a whole graph."""
    return tuple(getattr(_graphs(rt).get(width), "layout", ()))


def _step_hazards(rt, width: int) -> tuple[Hazard, ...]:
    try:
        fn = rt.step_fn
        values = getattr(getattr(rt, "config", None), "step_values", None)
        if values is not None:  # the step's marked calls read step values: those of padding rows
            from ..graphs.pieces import StepValues
            fn = StepValues(values, rt.input_specs).on_pads(fn)
        return find_capture_hazards(fn, dict(rt.static_inputs(width)))
    except Exception as exc:   # no static inputs (an unfinished runtime): say so
        return (Hazard(ERROR, type(exc).__name__, "<runtime>", 0, "", f"could not run the step: {exc}"),)


def _on_off(rt, ref, inputs, width: int) -> tuple[OutputDiff, ...]:
    step_in = dict(inputs(width))
    on = {p: t.clone() for p, t in _leaves(rt.step(**step_in).outputs)}  # views die next step
    return compare_outputs(on, ref.step(**step_in).outputs)


def compare_outputs(on, off) -> tuple[OutputDiff, ...]:
    """Compare two step outputs of the same structure (Tensor, or dict/tuple/list of them)
    leaf by leaf: max abs and rel difference, first differing row (NaN == NaN). A leaf
    present in one only, or of another shape, is reported with a ``note``."""
    a, b = dict(_leaves(on)), dict(_leaves(off))
    diffs = [_compare(p, a[p], b[p]) for p in a if p in b]
    diffs += [OutputDiff(p, float("inf"), float("inf"), 0, "missing in one run")
              for p in sorted(a.keys() ^ b.keys())]
    return tuple(diffs)
