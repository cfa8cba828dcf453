"""The bench's statistics and what falls inside its timed regions, on a fake clock.

The real clock cannot show that a figure is right (CPU timings are noise), so the clock is
replaced: ``time.perf_counter(_ns)`` read a counter that only the test's own work
advances, and ``time.sleep`` advances it too. Every kind of work costs a distinct amount
(a timed call 1-2 µs, a synchronize 7 ns, untimed input placement 1 s, warm-up calls
1000 s), so a figure equal to the expected sum proves which work was timed and which was
not, and a statistic computed here independently pins median and percentiles: a "median"
that returns the max, a warm-up call or an input placement inside the clock, or a sleep
added to the eager baseline changes a figure and fails.

Random call costs are fresh each run; the seed is printed.
"""
from __future__ import annotations

import gc
import time

import pytest

from cudagraph_rt.cli import build_parser
from cudagraph_rt.tools.bench import common as bench_common, steps as bench_steps
from cudagraph_rt.tools.bench.context import Context
from cudagraph_rt.widths import default_widths
from tests.support.seeds import seeded_rng

WARM = 10**12  # ns of a warm-up call: if one is timed, every figure shows it
PREP = 10**9  # ns of an untimed prepare
SYNC = 7  # ns of a synchronize


class FakeClock:
    """A clock that moves only when told (``advance``) or slept on."""

    def __init__(self):
        self.ns = 0

    def advance(self, ns: int) -> None:
        self.ns += int(ns)

    def install(self, monkeypatch) -> "FakeClock":
        monkeypatch.setattr(time, "perf_counter_ns", lambda: self.ns)
        monkeypatch.setattr(time, "perf_counter", lambda: self.ns / 1e9)
        monkeypatch.setattr(time, "sleep", lambda s: self.advance(s * 1e9))
        return self


@pytest.fixture
def clock(monkeypatch):
    return FakeClock().install(monkeypatch)


@pytest.fixture
def rng():
    return seeded_rng("BENCH_TIMING_TEST_SEED")


def stats(ns: list[int]) -> dict:
    """The summary the bench promises, computed here: the median (mean of the middle two
    for an even count), 10th / 90th percentiles by nearest rank on ``round(p * (n - 1))``,
    in µs."""
    xs, n = sorted(ns), len(ns)
    mid = xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2
    return {"median_us": mid / 1e3, "p10_us": xs[round(0.1 * (n - 1))] / 1e3,
            "p90_us": xs[round(0.9 * (n - 1))] / 1e3, "n": n}


class Work:
    """A call whose i-th invocation costs ``costs[k]`` (k counts invocations; the first
    ``warm`` are warm-up calls and cost WARM), a prepare costing PREP, a sync costing
    SYNC; ``gc_on`` records whether GC was enabled inside each timed call."""

    def __init__(self, clock: FakeClock, costs: list[int], warm: int):
        self.clock, self.costs, self.warm, self.k, self.gc_on = clock, costs, warm, 0, []

    def call(self, i: int) -> None:
        self.clock.advance(WARM if self.k < self.warm else self.costs[self.k - self.warm])
        if self.k >= self.warm:
            self.gc_on.append(gc.isenabled())
        self.k += 1

    def prepare(self, i: int) -> None:
        self.clock.advance(PREP)

    def sync(self) -> None:
        self.clock.advance(SYNC)


@pytest.mark.parametrize("n", [1, 2, 9, 40])
def test_summarize_is_median_and_nearest_rank_percentiles(n, rng):
    ns = [rng.randrange(1, 10**6) for _ in range(n)]
    assert bench_common.summarize(ns) == pytest.approx(stats(ns))


@pytest.mark.parametrize("include_sync", [True, False])
def test_time_calls_times_the_call_and_nothing_else(include_sync, clock, rng):
    repeats, warmup = 25, 3
    costs = [rng.randrange(1000, 2000) for _ in range(repeats)]
    w = Work(clock, costs, warmup)
    got = bench_common.time_calls(w.call, repeats=repeats, warmup=warmup, sync=w.sync, prepare=w.prepare,
                                  include_sync=include_sync)
    # latency: the call and the synchronize after it; host time: the call alone. Never the
    # prepare, the synchronize before the call, or a warm-up call.
    assert got == pytest.approx(stats([c + SYNC * include_sync for c in costs]))
    assert w.gc_on == [False] * repeats and gc.isenabled()


def test_time_interleaved_times_each_variant_alone_and_pairs_the_rounds(clock, rng):
    repeats, warmup = 12, 2
    a = Work(clock, [rng.randrange(1000, 2000) for _ in range(repeats)], warmup)
    b = Work(clock, [rng.randrange(3000, 4000) for _ in range(repeats)], warmup)
    got = bench_common.time_interleaved({"a": (a.call, a.prepare), "b": (b.call, None)}, repeats=repeats,
                                        warmup=warmup, sync=a.sync)
    assert got["a"] == pytest.approx(stats([c + SYNC for c in a.costs]))
    assert got["b"] == pytest.approx(stats([c + SYNC for c in b.costs]))
    deltas = sorted(y - x for x, y in zip(a.costs, b.costs))  # round i: b's call i against a's call i
    assert got["_deltas"]["b"] == pytest.approx(stats(deltas)["median_us"])


def test_time_pipelined_and_time_total(clock, rng):
    repeats, warmup = 30, 4
    w = Work(clock, [rng.randrange(1000, 2000) for _ in range(repeats)], warmup)
    us = bench_common.time_pipelined(w.call, repeats=repeats, warmup=warmup, sync=w.sync)
    assert us == pytest.approx((sum(w.costs) + SYNC) / repeats / 1e3)  # one sync at the end, warm-up outside
    assert bench_common.time_total(lambda: clock.advance(5000), w.sync) == pytest.approx((5000 + SYNC) / 1e9)


def test_measure_trace_is_the_median_pass_after_an_untimed_warm_up(clock, rng):
    Ts = [rng.randrange(1, 65) for _ in range(40)]
    trace = bench_common.Trace(Ts, [], [], [])
    passes, per_pass, calls = 5, [rng.randrange(10**4, 10**5) for _ in range(5)], []

    def run(idx):
        idx = list(idx)
        calls.append(idx)
        if len(calls) == 1:  # the warm-up: one step per distinct T, untimed
            clock.advance(WARM)
        else:
            clock.advance(per_pass[len(calls) - 2])

    got = bench_common.measure_trace(run, trace, passes, lambda: clock.advance(SYNC))
    assert calls[0] == trace.first_of_each_width() and all(c == list(range(len(Ts))) for c in calls[1:])
    totals = sorted(p + SYNC for p in per_pass)
    assert got["total_ms"] == pytest.approx(totals[2] / 1e6)
    assert got["mean_step_us"] == pytest.approx(totals[2] / len(Ts) / 1e3)
    assert got["passes_ms"] == pytest.approx([(p + SYNC) / 1e6 for p in per_pass])


# ----------------------------------------------------------------------------- whole sections
COST = 1000  # ns per row of the fake step function


def _context(clock, argv):
    """A `cgrt bench --quick` context on the CPU whose model step costs COST ns per row it
    runs on the fake clock (and really runs, so outputs and the runtime stay real)."""
    args = build_parser().parse_args(["bench", "--quick", "--device", "cpu", *argv])
    ctx = Context(args)
    m = ctx.model
    real = m.step

    def step(x):
        clock.advance(COST * x["tokens"].shape[0])
        return real(x)

    m.step = step  # the eager baseline and the runtime both call this
    return ctx


def test_step_time_section_times_eager_at_T_and_cgrt_at_the_padded_width(clock):
    """Section 1 on the fake clock: eager runs exactly T rows, the runtime (graphs off on
    a CPU) the padded width N, and nothing else the bench does costs clock time. A sleep
    or any other work added to a timed baseline shows here."""
    ctx = _context(clock, ["--sections", "1", "--repeats", "5"])
    try:
        res = bench_steps.step_time(ctx)
    finally:
        ctx.close()
    ws = default_widths(64)
    assert [r["width"] for r in res["rows"]] == list(ws)
    for r in res["rows"]:
        T = r["width"]
        N = min(w for w in ws if w >= T)
        assert r["eager"] == pytest.approx({"median_us": COST * T / 1e3, "p10_us": COST * T / 1e3,
                                            "p90_us": COST * T / 1e3, "n": 5}), T
        assert r["cgrt"]["median_us"] == pytest.approx(COST * N / 1e3), T
        assert r["pipelined_us"]["eager"] == pytest.approx(COST * T / 1e3), T
        assert r["eager_over_cgrt"] == pytest.approx(T / N), T


def test_mixed_trace_section_times_whole_passes(clock):
    ctx = _context(clock, ["--sections", "2", "--trace-steps", "30"])
    try:
        res = bench_steps.mixed_trace(ctx)
        Ts = ctx.trace.Ts
    finally:
        ctx.close()
    ws = default_widths(64)
    assert res["steps"] == 30 and res["real_rows"] == sum(Ts)
    assert res["variants"]["eager"]["total_ms"] == pytest.approx(COST * sum(Ts) / 1e6)
    padded = sum(min(w for w in ws if w >= T) for T in Ts)
    assert res["variants"]["cgrt"]["total_ms"] == pytest.approx(COST * padded / 1e6)


# ----------------------------------------------------------------------------- section 3
HOST_INPUTS, STEP, REPLAY = 3_000, 20_000, 5_000  # ns on the fake clock


class FakeOverheadRuntime:
    """host_inputs costs HOST_INPUTS, step STEP (whatever it is given), on the fake clock;
    ``log`` records the calls. Views are plain CPU tensors (the fill costs no clock time)."""

    def __init__(self, clock: FakeClock, names: list[str]):
        self.clock, self.names, self.log = clock, names, []

    def host_inputs(self, w: int, numpy: bool = False):
        import torch
        self.clock.advance(HOST_INPUTS)
        self.log.append("host_inputs")
        views = {n: torch.zeros(w, dtype=torch.int64) for n in self.names}
        return {n: v.numpy() for n, v in views.items()} if numpy else views

    def step(self, **inputs):
        self.clock.advance(STEP)
        self.log.append("step")


def _overhead_fixture(clock, w=4):
    import torch
    names = ["tokens", "positions", "seq_ids", "cells"]
    rt = FakeOverheadRuntime(clock, names)
    host = [{n: torch.arange(w) + i for n in names} for i in range(bench_common.N_SETS)]
    variants = bench_steps.overhead_variants(rt, lambda: clock.advance(REPLAY), host, names, w)
    return rt, names, variants


def test_whole_zero_copy_step_times_host_inputs_and_the_old_figure_does_not(clock):
    """zero_copy_whole = host_inputs + fill + step, all inside the clock; zero_copy keeps
    the old figure (step alone, host_inputs and fill untimed); bare and step unchanged."""
    rt, names, variants = _overhead_fixture(clock)
    assert list(variants) == ["bare", "step", "zero_copy", "zero_copy_whole"]
    for include_sync in (False, True):
        got = bench_common.time_interleaved(variants, repeats=8, warmup=1, sync=lambda: clock.advance(SYNC),
                                            include_sync=include_sync)
        s = SYNC * include_sync
        for name, ns in (("bare", REPLAY), ("step", STEP), ("zero_copy", STEP),
                         ("zero_copy_whole", HOST_INPUTS + STEP)):
            assert got[name]["median_us"] == pytest.approx((ns + s) / 1e3), (name, include_sync)
        assert got["_deltas"]["zero_copy_whole"] == pytest.approx((HOST_INPUTS + STEP - REPLAY) / 1e3)
    # the whole variant asks for fresh views each call and fills them before stepping
    whole, _ = variants["zero_copy_whole"]
    rt.log.clear()
    whole(3)
    assert rt.log == ["host_inputs", "step"]


def test_overhead_row_pools_repeats_and_keeps_the_old_keys(clock):
    """Three repeats through _overhead_repeat: pooled summaries under the keys of before,
    per-repeat Δ and ratio spreads beside them."""
    _, _, variants = _overhead_fixture(clock)
    kw = {"repeats": 6, "warmup": 1, "sync": lambda: clock.advance(SYNC)}
    acc: dict = {}
    medians = [bench_steps._overhead_repeat(variants, kw, acc) for _ in range(3)]
    r = bench_steps.overhead_row(4, 4, medians, acc)
    assert r["repeats"] == 3 and r["bare_host"]["n"] == r["zero_copy_whole_latency"]["n"] == 18
    for key in ("step_overhead_host_us", "zero_copy_overhead_host_us", "step_overhead_latency_us",
                "step_overhead_host_paired_us", "zero_copy_overhead_latency_paired_us"):
        assert key in r
    assert r["zero_copy_overhead_host_us"] == pytest.approx((STEP - REPLAY) / 1e3)
    assert r["zero_copy_whole_overhead_host_us"] == pytest.approx((HOST_INPUTS + STEP - REPLAY) / 1e3)
    assert r["zero_copy_whole_overhead_host_repeats_us"] == pytest.approx([(HOST_INPUTS + STEP - REPLAY) / 1e3] * 3)
    sp = r["zero_copy_whole_over_bare_host"]
    assert sp["min"] == sp["max"] == sp["median"] == pytest.approx((HOST_INPUTS + STEP) / REPLAY)
    assert r["step_over_bare_latency"]["median"] == pytest.approx((STEP + SYNC) / (REPLAY + SYNC))
    from cudagraph_rt.tools.bench import report as bench_report
    (table,) = bench_report.tables("host_overhead", {"status": "ok", "rows": [r], "repeats": 3})
    assert len(table.columns) == 14 and table.row_count == 1
    import io

    from rich.console import Console
    con = Console(width=80, file=io.StringIO(), color_system=None)
    con.print(table)  # at 80 columns: split into parts, the key column in each, no figure cut
    text = con.file.getvalue()
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80, text
    words = set(text.split())
    assert not [w for cell in table.rows[0] for w in str(cell).split() if w not in words], text
    assert text.count("(continued)") >= 1


def test_goal_status_only_where_the_repeats_agree():
    from cudagraph_rt.tools.bench import report as bench_report
    assert bench_report.spread_status(1.2, 1.4, 1.5) is True
    assert bench_report.spread_status(1.6, 1.9, 1.5) is False
    assert bench_report.spread_status(1.4, 1.6, 1.5) == "unclear"

    def row(inputs, w, whole, step, d, lat=(1.01, 1.02, 1.02)):
        sp = lambda xs: {"median": sorted(xs)[len(xs) // 2], "min": min(xs), "max": max(xs), "repeats": xs}
        return {"inputs": inputs, "width": w, "zero_copy_whole_over_bare_host": sp(whole),
                "step_over_bare_host": sp(step), "step_over_bare_latency": sp(list(lat)),
                "step_overhead_host_us": sorted(d)[1],
                "step_overhead_host_repeats_us": d, "zero_copy_overhead_host_us": 5.0,
                "zero_copy_whole_overhead_host_us": 9.0, "step_overhead_latency_us": 20.0}

    sec = {"status": "ok", "rows": [row(4, 1, [1.3, 1.4, 1.45], [2.6, 2.7, 2.9], [13.0, 14.0, 16.0]),
                                    row(4, 64, [1.2, 1.3, 1.4], [2.0, 2.1, 2.2], [10.0, 11.0, 12.0]),
                                    row(5, 1, [1.4, 1.45, 1.49], [3.0, 3.0, 3.0], [1.0, 1.0, 1.0])]}
    gs = {g["goal"]: g for g in bench_report.goals({"host_overhead": sec})}
    lat = "latency of step() (fresh CPU tensors) vs replay()"
    assert gs[lat]["status"] == "met" and "latency" in gs[lat]["target"]
    sec["rows"][2]["step_over_bare_latency"]["max"] = 1.04  # one repeat of 5 inputs over 1.03
    assert {g["goal"]: g for g in bench_report.goals({"host_overhead": sec})}[lat]["status"] == "unclear"
    assert gs["host overhead of step(), 4 host inputs, T=1"]["status"] == "unclear"  # 13..16 around 15
    assert gs["whole zero-copy step (host_inputs + fill + step) vs replay()"]["status"] == "met"
    step_goal = gs["step() with four fresh CPU tensors vs replay()"]  # 5 inputs do not count here
    assert step_goal["status"] == "missed" and "T=1" in step_goal["measured"]
    sec["rows"][0]["step_over_bare_host"] = {"median": 2.4, "min": 2.3, "max": 2.6, "repeats": [2.3, 2.4, 2.6]}
    gs = {g["goal"]: g for g in bench_report.goals({"host_overhead": sec})}
    assert gs["step() with four fresh CPU tensors vs replay()"]["status"] == "unclear"


def test_pool_goals_judge_every_context_of_8k_cells_and_more():
    """bench --model hf's pool section: the attention-over-floor goal holds for every live
    context of 8k cells and more (8,192 included), the pool-size goal for every width."""
    from cudagraph_rt.tools.bench import pool as bench_pool
    lim = bench_pool.ATTENTION_GOAL
    sec = {"pool_scaling": [{"width": 1, "ratio": bench_pool.POOL_GOAL}, {"width": 8, "ratio": 1.5}],
           "context_scaling": [{"live": 4096, "width": 1, "attention_over_floor": 9.0},
                               {"live": 8192, "width": 1, "attention_over_floor": lim + 0.5},
                               {"live": 8192, "width": 8, "attention_over_floor": lim},
                               {"live": 32768, "width": 1, "attention_over_floor": lim - 0.5}]}
    got = [(name, value, ok) for name, value, _, ok in bench_pool.goals(sec)]
    assert got == [("pool 262,144 / 4,096 cells, width 1", bench_pool.POOL_GOAL, True),
                   ("pool 262,144 / 4,096 cells, width 8", 1.5, False),
                   ("attention / KV floor, 8k cells, width 1", lim + 0.5, False),
                   ("attention / KV floor, 8k cells, width 8", lim, True),
                   ("attention / KV floor, 32k cells, width 1", lim - 0.5, True)]


def test_overhead_cases_interleave_the_repeats_across_cases(clock, monkeypatch):
    """host_overhead's loop: every repeat runs every case once, in order (repeat 1 of all
    cases before repeat 2 of any); each case's row pools its own repeats only."""
    from types import SimpleNamespace

    from cudagraph_rt.models.toy import ToyConfig, ToyDecoder
    monkeypatch.setattr(bench_steps, "OVERHEAD_REPEATS", 3)
    rows = bench_common.ToyRows(ToyDecoder(ToyConfig.tiny(), "cpu"), 0)
    notes = []
    ctx = SimpleNamespace(rows=rows, note=notes.append)
    runtimes = []
    for cost, names in ((REPLAY, rows.names[:4]), (2 * REPLAY, rows.names)):
        rt = FakeOverheadRuntime(clock, names)
        replay = SimpleNamespace(replay=lambda c=cost: clock.advance(c))
        rt.graphs_captured = {1: replay, 64: replay}
        runtimes.append((rt, names))
    out = bench_steps._overhead_cases(ctx, runtimes, {"repeats": 4, "warmup": 1, "sync": lambda: None})
    assert [(r["inputs"], r["width"]) for r in out] == [(4, 1), (4, 64), (5, 1), (5, 64)]
    assert [n.split(", repeat ")[1] for n in notes] == ["1/3"] * 4 + ["2/3"] * 4 + ["3/3"] * 4
    for r, cost in zip(out, (REPLAY, REPLAY, 2 * REPLAY, 2 * REPLAY)):
        assert r["repeats"] == 3 and r["bare_host"]["n"] == 12
        assert r["bare_host"]["median_us"] == pytest.approx(cost / 1e3)
        assert r["zero_copy_whole_over_bare_host"]["max"] == pytest.approx((HOST_INPUTS + STEP) / cost)
