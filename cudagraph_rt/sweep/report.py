"""What a width sweep found: frozen reports, a text summary, a rich table, JSON and a plot.

Reports are plain immutable values, built once by the harness at the end of a run; the
rendering functions only read them (matplotlib through its Agg canvas, so no global
backend is switched in the caller's process).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from .graph_modes import mode_name
from .plans import SweepOptions


@dataclass(frozen=True)
class Failure:
    """One failed step: every check it failed (``kinds`` / ``messages``, in check order)
    and the one-line command that reproduces it."""

    graphs: bool | str
    step: int
    T: int
    ran: str
    kinds: tuple[str, ...]
    messages: tuple[str, ...]
    repro: str

    def __str__(self) -> str:
        lines = [f"FAIL {mode_name(self.graphs)}, step {self.step} (T={self.T}, ran {self.ran}):"]
        lines += [f"  - {m}" for m in self.messages]
        lines.append(f"  reproduce: {self.repro}")
        return "\n".join(lines)


@dataclass(frozen=True)
class WidthSummary:
    """Checked steps of one step width ``T``: ``plan`` says what they run (by the plan
    rule, ``checks.rule_slices``); ``mismatches`` counts the steps that failed any check;
    ``seconds`` is the summed wall time of their ``rt.step`` calls (synchronized on CUDA)."""

    T: int
    plan: str
    steps: int
    slices: int
    padding_rows: int
    mismatches: int
    seconds: float

    @property
    def mean_ms(self) -> float:
        return 1e3 * self.seconds / self.steps if self.steps else 0.0

    @property
    def padding_waste(self) -> float:
        """Padding rows per row computed."""
        rows = self.T * self.steps + self.padding_rows
        return self.padding_rows / rows if rows else 0.0


@dataclass(frozen=True)
class ModeReport:
    """One graph mode (on or off) of a sweep. ``failures`` holds the first failed steps in
    detail (up to the harness's ``max_details``); ``failed`` counts all of them and
    ``kinds`` counts failed checks by kind. ``worst_hidden`` is the largest hidden-row
    error seen as a fraction of its tolerance (< 1 passes): the headroom left;
    ``tolerance`` says which rule (see checks.Tolerance). ``near_ties`` counts tokens that
    differed from the reference where the adapter's ``clear`` said the reference's top-1/top-2
    margin was not clear (not failures; always 0 for adapters without ``clear``)."""

    graphs: bool | str
    device: str
    steps_run: int
    steps_checked: int
    failed: int
    kinds: tuple[tuple[str, int], ...]
    failures: tuple[Failure, ...]
    widths: tuple[WidthSummary, ...]
    capture_s: float
    seconds: float
    worst_hidden: float
    tolerance: str = ""
    near_ties: int = 0

    @property
    def ok(self) -> bool:
        return self.failed == 0


@dataclass(frozen=True)
class SweepReport:
    """The result of ``run_sweep``: one ModeReport per graph mode, the seed, and notes (for
    example that graphs on was skipped for want of CUDA). ``ok`` is False on any failure;
    ``rerun`` is the command that repeats the whole sweep."""

    seed: int
    adapter: str
    options: SweepOptions
    modes: tuple[ModeReport, ...]
    notes: tuple[str, ...]
    sequences: int
    reused_ids: int
    rerun: str

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.modes)

    @property
    def failures(self) -> tuple[Failure, ...]:
        return tuple(f for m in self.modes for f in m.failures)

    def summary(self, details: int = 5) -> str:
        """Human text: the verdict with the seed, the first ``details`` failures per mode,
        and how to reproduce."""
        lines = []
        for m in self.modes:
            head = (f"{mode_name(m.graphs)} on {m.device}: {m.steps_checked} steps checked"
                    + (f" (after {m.steps_run - m.steps_checked} unchecked history steps)"
                       if m.steps_run > m.steps_checked else "")
                    + f", {m.seconds:.1f} s, hidden error <= {m.worst_hidden:.2g} of tolerance"
                    + (f" ({m.tolerance})" if m.tolerance else "")
                    + (f", {m.near_ties} token(s) differed at near-ties (not counted)" if m.near_ties else "")
                    + ": ")
            if m.ok:
                lines.append(head + "all passed")
                continue
            kinds = ", ".join(f"{k} {n}" for k, n in m.kinds)
            lines.append(head + f"{m.failed} steps FAILED ({kinds})")
            lines += [str(f) for f in m.failures[:details]]
            if m.failed > details:
                lines.append(f"  ... {m.failed - details} more failed steps")
        verdict = "PASSED" if self.ok else "FAILED"
        lines.append(f"sweep {verdict}: {self.adapter}, seed {self.seed}, {self.sequences} sequences "
                     f"({self.reused_ids} ids reused). Rerun: {self.rerun}")
        if not self.ok:
            lines.append(f"first failure: {self.failures[0].repro}")
        return "\n".join(self.notes + tuple(lines))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        for m, md in zip(self.modes, d["modes"]):
            md["ok"] = m.ok
            md["kinds"] = dict(m.kinds)
            for w, wd in zip(m.widths, md["widths"]):
                wd["mean_ms"] = w.mean_ms
                wd["padding_waste"] = w.padding_waste
        return d

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)


def rich_tables(report: SweepReport) -> list:
    """One rich Table per mode: per step width, steps, slices, padding rows, mismatches and
    mean step time."""
    from rich.table import Table

    out = []
    for m in report.modes:
        t = Table(title=f"{mode_name(m.graphs)} on {m.device} - {report.adapter}, seed {report.seed}")
        for col in ("T", "plan", "steps", "slices", "padding rows", "mismatches", "ms/step"):
            t.add_column(col, justify="left" if col == "plan" else "right", overflow="fold")  # fold, never cut
        for w in m.widths:
            style = "bold red" if w.mismatches else None
            t.add_row(str(w.T), w.plan, str(w.steps), str(w.slices), str(w.padding_rows),
                      str(w.mismatches), f"{w.mean_ms:.3f}", style=style)
        out.append(t)
    return out


def plot(report: SweepReport, path: str) -> None:
    """Per step width: mean step time per mode (top) and padding waste (bottom), as a PNG.
    MissingExtraError (an ImportError) without matplotlib, the [plot] extra."""
    from ..extras import require

    require("plot", "the sweep's plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    fig = Figure(figsize=(10, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    top, bottom = fig.subplots(2, 1, sharex=True)
    for m in report.modes:
        ws = [w for w in m.widths if w.steps]
        top.plot([w.T for w in ws], [w.mean_ms for w in ws], marker=".", label=mode_name(m.graphs))
        bad = [w for w in ws if w.mismatches]
        if bad:
            top.scatter([w.T for w in bad], [w.mean_ms for w in bad], color="red", zorder=3,
                        label=f"{mode_name(m.graphs)}: mismatches")
    top.set_ylabel("mean step time (ms)")
    top.set_yscale("log")  # graphs on and off may differ tenfold
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    top.yaxis.set_major_formatter(plain)
    top.yaxis.set_minor_formatter(plain)
    top.legend()
    top.set_title(f"cgrt sweep - {report.adapter}, seed {report.seed}")
    if report.modes:
        ws = [w for w in report.modes[0].widths if w.steps]
        bottom.bar([w.T for w in ws], [100 * w.padding_waste for w in ws], color="tab:gray")
    bottom.set_ylabel("padding waste (% of rows run)")
    bottom.set_xlabel("step width T (rows)")
    fig.savefig(path, dpi=110)
