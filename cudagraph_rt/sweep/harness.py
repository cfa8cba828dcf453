"""Run a width sweep: plan the steps, run them through the runtime in each graph mode,
check every step against the eager reference, and return a frozen SweepReport.

Lifetimes: one runtime per graph mode, built by the adapter, closed when that mode ends
(also on an exception). Reference outputs are computed once per sequence (lazily, just
before its first step) and shared by both modes. Failure modes: bad options or a
malformed adapter raise InputError before any step runs; an exception inside
``rt.step`` is recorded as that step's failure and the sweep goes on; an exception
anywhere else (adapter.build, capture, the reference) propagates.
"""
from __future__ import annotations

import logging
import random
import shlex
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import InputError, expected
from ..runtime import GraphRuntime
from .adapter import check_adapter, hook
from .checks import (
    Tolerance,
    check_counters,
    check_hidden,
    check_rows,
    check_slices,
    check_tokens,
    describe,
    expected_slices,
)
from .checks import check_pad_rows as pad_rows_problem
from .graph_modes import mode_flag, mode_name, resolve_graphs
from .plans import StepPlan, SweepOptions, SweepPlan, make_plan
from .report import Failure, ModeReport, SweepReport, WidthSummary

log = logging.getLogger(__name__)
Repro = Callable[[int, "int | None", "bool | str | None"], str]  # (seed, step, graphs) -> command
Progress = Callable[[str, int, int], None]  # (mode name, steps done, steps in this mode)


def fresh_seed() -> int:
    """A seed from the OS: every run explores new steps; the report prints it."""
    return random.SystemRandom().randrange(2**31)


def default_repro(adapter: Any, options: SweepOptions) -> Repro:
    """One-line reproduction: a ``cgrt sweep`` command when the adapter can be rebuilt from
    CLI flags (``cli_args``), else a ``run_sweep`` call."""
    cli = hook(adapter, "cli_args")()
    base = SweepOptions()

    def make(seed: int, step: int | None, graphs: bool | str | None) -> str:
        g = None if graphs is None else mode_flag(graphs)
        if cli is not None:
            parts = ["cgrt sweep", f"--seed {seed}"]
            parts += [f"--only-step {step}"] if step is not None else []
            parts += [f"--graphs {g}"] if g else []
            parts += [shlex.quote(str(a)) for a in cli]  # a checkpoint path may hold spaces
            parts += [f"--repeats {options.repeats}"] if options.repeats != base.repeats else []
            if options.extras != base.extras:
                parts.append(f"--extras {','.join(map(str, options.extras)) or 'none'}")
            parts += ["--no-pad-check"] if not options.check_pad_rows else []
            return " ".join(parts)
        kw = [f"seed={seed}"] + ([f"only_step={step}"] if step is not None else []) + ([f"graphs={g!r}"] if g else [])
        kw += [f"repeats={options.repeats}"] if options.repeats != base.repeats else []
        kw += [f"extras={options.extras!r}"] if options.extras != base.extras else []
        kw += ["check_pad_rows=False"] if not options.check_pad_rows else []
        return f"run_sweep(<{adapter.name} adapter>, {', '.join(kw)})"

    return make


def run_sweep(
    adapter: Any,
    *,
    graphs: str | bool = "auto",
    seed: int | None = None,
    repeats: int = 6,
    extras: tuple[int, ...] = (96, 97),
    only_step: int | None = None,
    check_pad_rows: bool = True,
    tolerance: Tolerance | None = None,
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
    repro: Repro | None = None,
    max_details: int = 20,
) -> SweepReport:
    """Sweep every step width ``1..max_width+1`` and ``extras``, ``repeats`` times each, in
    a shuffled order, through ``adapter``'s runtime in each graph mode; check every step.

    ``seed`` None draws a fresh one (it is in the report and logged first, so a crash still
    shows it). ``log`` receives the seed line and notes as they happen; ``progress`` each
    finished step. ``tolerance`` overrides the adapter's and the dtype default. ``repro``
    formats the reproduction command of a failed step (default: ``default_repro``).
    See SweepOptions for ``only_step`` and ``check_pad_rows``.
    """
    check_adapter(adapter)
    if isinstance(max_details, bool) or not isinstance(max_details, int) or max_details < 0:
        raise InputError(expected("max_details", "an int >= 0", repr(max_details)))
    options = SweepOptions(repeats, tuple(extras) if not isinstance(extras, int) else extras,
                           only_step, check_pad_rows)
    if seed is None:
        seed = fresh_seed()
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InputError(expected("seed", "an int >= 0 or None", repr(seed)))
    if tolerance is not None and not isinstance(tolerance, Tolerance):
        raise InputError(expected("tolerance", "a Tolerance or None", type(tolerance).__name__))
    modes, notes = resolve_graphs(graphs, adapter.device)
    repro = repro or default_repro(adapter, options)
    rerun = repro(seed, None, None if graphs == "auto" else (None if len(modes) > 1 else modes[0]))
    log = log or (lambda _msg: None)
    log(f"cgrt sweep: seed {seed} ({adapter.name} on {adapter.device}, "
        f"{' + '.join(mode_name(g) for g in modes)}). Rerun: {rerun}")
    for n in notes:
        log(n)
    runner = _Runner(adapter, options, seed, tolerance, repro, max_details)
    reports = []
    for g in modes:
        reports.append(runner.run_mode(g, progress))
    plan = runner.plan
    reused = sum(len(s.released) for s in plan.steps) if plan else 0
    return SweepReport(seed, adapter.name, options, tuple(reports), notes,
                       len(plan.sequences) if plan else 0, reused, rerun)


@dataclass
class _WidthTally:
    """Running totals of one step width (becomes a WidthSummary)."""

    plan: str = ""
    steps: int = 0
    slices: int = 0
    padding_rows: int = 0
    mismatches: int = 0
    seconds: float = 0.0

    def add(self, planned: tuple, seconds: float, failed: bool) -> None:
        self.plan = describe(planned, rows=False)
        self.steps += 1
        self.slices += len(planned)
        self.padding_rows += sum(s.padding for s in planned)
        self.mismatches += failed
        self.seconds += seconds


class _Runner:
    """State of one sweep shared by its modes: the plan and the reference outputs."""

    def __init__(self, adapter, options: SweepOptions, seed: int, tolerance, repro: Repro, max_details: int):
        self.adapter, self.options, self.seed = adapter, options, seed
        self.tolerance, self.repro, self.max_details = tolerance, repro, max_details
        self.plan: SweepPlan | None = None
        self.widths: tuple[int, ...] | None = None
        self.refs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.clear: dict[int, torch.Tensor | None] = {}  # uid -> [L] bool from adapter.clear, or None
        self.extent: dict[int, int] = {}  # uid -> positions the plan feeds
        self.outputs = hook(adapter, "outputs")
        self.release = hook(adapter, "release")
        self.check_state = hook(adapter, "check_state")
        self.clear_hook = hook(adapter, "clear")

    # -- reference ---------------------------------------------------------------------
    def reference(self, uid: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Greedy tokens (host, int64) and hidden rows of sequence ``uid``, computed once.
        Also proves the planned continuation is the reference's own greedy decode."""
        if uid in self.refs:
            return self.refs[uid]
        seq = self.plan.sequences[uid]
        # Only the positions the plan feeds (a sequence that stopped early never reaches
        # the rest): the reference is causal, so a prefix gives the same rows.
        L = max(self.extent[uid], seq.prompt_len)
        with torch.no_grad():
            greedy, hidden = self.adapter.reference(seq.tokens[:L])
        if not isinstance(greedy, torch.Tensor) or tuple(greedy.shape) != (L,):
            raise InputError(expected("adapter.reference(tokens)[0]", f"greedy tokens of shape ({L},)",
                                      getattr(greedy, "shape", type(greedy).__name__)))
        if hidden is not None and (not isinstance(hidden, torch.Tensor) or hidden.dim() != 2 or hidden.shape[0] != L):
            raise InputError(expected("adapter.reference(tokens)[1]", f"None or hidden rows [{L}, H]",
                                      getattr(hidden, "shape", type(hidden).__name__)))
        greedy = greedy.to("cpu", torch.int64)
        with torch.no_grad():
            clear = self.clear_hook(seq.tokens[:L])
        if clear is not None:
            clear = torch.as_tensor(clear, dtype=torch.bool).cpu()
            if tuple(clear.shape) != (L,):
                raise InputError(expected("adapter.clear(tokens)", f"None or a bool tensor of shape ({L},)",
                                          tuple(clear.shape)))
        self.clear[uid] = clear
        g = greedy.tolist()
        ok = clear.tolist() if clear is not None else [True] * L
        for p in range(seq.prompt_len - 1, L - 1):
            if g[p] != seq.tokens[p + 1] and ok[p]:  # a near-tie may go either way
                raise InputError(expected(
                    "adapter.continuation(prompt, n)", "the reference's greedy tokens",
                    f"token {seq.tokens[p + 1]} at position {p + 1} where the reference gives {g[p]}"))
        self.refs[uid] = (greedy, hidden)
        return greedy, hidden

    def expected(self, step: StepPlan) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Expected tokens [T] (-1 where no token is wanted), hidden rows or None, and [T]
        bool: rows whose token counts (False only at a near-tie the adapter reported)."""
        toks, hids, counts = [], [], []
        for c in step.chunks:
            greedy, hidden = self.reference(c.uid)
            rows = slice(c.start, c.start + c.length)
            toks.append(torch.where(torch.tensor(c.want), greedy[rows], -1))
            hids.append(None if hidden is None else hidden[rows])
            clear = self.clear.get(c.uid)
            want = torch.tensor(c.want, dtype=torch.bool)
            counts.append(torch.ones(c.length, dtype=torch.bool) if clear is None else (clear[rows] | ~want))
        return (torch.cat(toks), (None if any(h is None for h in hids) else torch.cat(hids)), torch.cat(counts))

    # -- one mode ----------------------------------------------------------------------
    def run_mode(self, graphs: bool | str, progress: Progress | None) -> ModeReport:
        log.info("%s: building the runtime and capturing", mode_name(graphs))
        rt = self.adapter.build(graphs)
        if not isinstance(rt, GraphRuntime):
            raise InputError(expected("adapter.build(graphs)", "a GraphRuntime", type(rt).__name__))
        if rt.graphs != graphs:
            raise InputError(expected(f"adapter.build(graphs={graphs})", f"a runtime with graphs={graphs}",
                                      f"graphs={rt.graphs}"))
        try:
            t0 = time.perf_counter()
            rt.capture()
            capture_s = time.perf_counter() - t0
            if self.plan is None:
                self.widths = rt.widths
                self.plan = make_plan(self.seed, rt.widths[-1], self.options, self.adapter.capacity,
                                      hook(self.adapter, "continuation"))
                for step in self.plan.steps:
                    for c in step.chunks:
                        self.extent[c.uid] = c.start + c.length
            elif rt.widths != self.widths:
                raise InputError(expected(f"adapter.build(graphs={graphs}).widths",
                                          f"the widths of the first mode {self.widths}", rt.widths))
            log.info("%s: %d steps", mode_name(graphs), len(self.plan.steps))
            return self._steps(rt, graphs, capture_s, progress)
        finally:
            rt.close()

    def _steps(self, rt: GraphRuntime, graphs: bool, capture_s: float, progress) -> ModeReport:
        only, steps = self.options.only_step, self.plan.steps
        per_width: dict[int, _WidthTally] = defaultdict(_WidthTally)
        failures, failed, kinds, worst = [], 0, Counter(), 0.0
        self.tol_used = ""
        self.near_ties = 0
        t_mode = time.perf_counter()
        with torch.no_grad():
            for step in steps:
                for s in step.released:
                    self.release(s)
                planned = expected_slices(rt, step.T)
                before = rt.stats()
                res, error, dt = self._run(rt, step)
                if progress:
                    progress(mode_name(graphs), step.index + 1, len(steps))
                if only is not None and step.index != only:
                    continue  # history for only_step: run, not checked
                msgs, err = [error], 0.0
                if res is not None:
                    msgs, err = self._check(rt, graphs, step, res, before, planned)
                    msgs += [f"model state: {m}" for m in self.check_state()]
                worst = max(worst, err)
                per_width[step.T].add(planned, dt, bool(msgs))
                if msgs:
                    failed += 1
                    kinds.update(m.split(":", 1)[0] for m in msgs)
                    if len(failures) < self.max_details:
                        ran = describe(res.slices) if res is not None else describe(planned) + " (planned)"
                        failures.append(Failure(graphs, step.index, step.T, ran,
                                                tuple(m.split(":", 1)[0] for m in msgs), tuple(msgs),
                                                self.repro(self.seed, step.index, graphs)))
        widths = tuple(WidthSummary(T, **vars(v)) for T, v in sorted(per_width.items()))
        return ModeReport(graphs, str(rt.device), len(steps), sum(w.steps for w in widths), failed,
                          tuple(sorted(kinds.items())), tuple(failures), widths, capture_s,
                          time.perf_counter() - t_mode, worst, self.tol_used, self.near_ties)

    def _run(self, rt: GraphRuntime, step: StepPlan) -> tuple[Any, str | None, float]:
        """One ``rt.step``, timed (synchronized on CUDA). An exception is a finding: it
        becomes the step's ``error:`` message and the sweep goes on."""
        inputs = self.adapter.step_inputs(step)
        cuda = rt.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(rt.device)
        t0 = time.perf_counter()
        try:
            res = rt.step(**inputs)
            if cuda:
                torch.cuda.synchronize(rt.device)
        except Exception as e:  # noqa: BLE001
            return None, f"error: rt.step raised {type(e).__name__}: {e}", time.perf_counter() - t0
        return res, None, time.perf_counter() - t0

    def _check(self, rt: GraphRuntime, graphs: bool, step: StepPlan, res, before, planned) -> tuple[list[str], float]:
        """Every check of one step, in order: plan, counters, rows, tokens, hidden, padding.
        Returns the failure messages and the worst hidden error as a fraction of tolerance."""
        T, msgs, worst = step.T, [], 0.0
        msgs.append(check_slices(T, res.slices, planned))
        msgs.append(check_counters(before, rt.stats(), planned, graphs))
        try:
            tokens, hidden = self.outputs(res.outputs)
        except Exception as e:  # noqa: BLE001 - outputs nobody can read are a finding
            unreadable = f"rows: adapter.outputs could not read the step's outputs: {type(e).__name__}: {e}"
            return [m for m in msgs if m] + [unreadable], worst
        exp_tokens, exp_hidden, counts = self.expected(step)
        rows = [check_rows(T, "tokens", tokens)]
        if exp_hidden is not None:
            rows.append(check_rows(T, "hidden", hidden) if hidden is not None
                        else "rows: the reference has hidden rows, the step returned none")
        msgs += rows
        if not any(rows):
            got = tokens.cpu().to(torch.int64)
            ties = ~counts & (got != exp_tokens)  # differs at a near-tie: counted, not a failure
            self.near_ties += int(ties.sum())
            msgs.append(check_tokens(step, torch.where(ties, exp_tokens, got), exp_tokens))
            if exp_hidden is not None:
                tol = (self.tolerance or getattr(self.adapter, "tolerance", None)
                       or Tolerance.for_dtype(exp_hidden.dtype, device=hidden.device))
                self.tol_used = f"|diff| <= {tol} of {str(exp_hidden.dtype).replace('torch.', '')} x |row|"
                err, bound = tol.errors(hidden, exp_hidden)
                worst = float((err / bound).max())
                msgs.append(check_hidden(step, err, bound, tol, exp_hidden.dtype))
        if self.options.check_pad_rows and res.slices:
            msgs.append(pad_rows_problem(rt, res.slices[-1]))
        return [m for m in msgs if m], worst
