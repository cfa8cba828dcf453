"""Sections 1-3 of ``cgrt bench``: step time per width, the mixed trace, host overhead."""
from __future__ import annotations

import statistics
from typing import Any

import torch

from .common import N_SETS, measure, measure_trace, pack, padded_width, summarize, time_interleaved
from .compile_setups import SETUPS
from .context import Context

VARIANTS = ("eager", "cgrt", "bare", *(s.variant for s in SETUPS.values()))

STEP_WHAT = {
    "eager": "step_fn at exactly T rows; inputs: one pinned packed host-to-device copy; until synchronize",
    "cgrt": "GraphRuntime.step(**inputs) with T rows of pageable CPU tensors (one per input): validation, "
            "packing into pinned staging, pad fill, host-to-device copy, replay, result; until synchronize",
    "bare": "hand-captured torch.cuda.CUDAGraph at the padded width: replay() only (inputs placed "
            "untimed beforehand); until synchronize",
    "pipelined_us": "per call of back-to-back calls, one synchronize at the end (host work overlaps the "
                    "device work of earlier calls; bare replays without placing inputs)",
    **{s.variant: s.what + " [timed in a child process: bench.compile_child]" for s in SETUPS.values()},
}

COMPILE_METHOD = (
    "each compile setup runs in a child process of its own (python -m cudagraph_rt.tools.bench.compile_child, "
    "one after another, this process idle meanwhile, timeout per child) over the same ToyConfig and seed, "
    "the same input sets and trace (this process's CPU tensors, passed in a file) and the same timing "
    "helpers and settings (common.measure / measure_trace); a crash or timeout makes it "
    "'unavailable' with the reason and the child's last output lines")


def _ratio(a: dict | None, b: dict | None) -> float | None:
    if not a or not b:
        return None
    return a["median_us"] / b["median_us"]


def _width_calls(ctx: Context, w: int) -> tuple[dict, dict]:
    """This process's variants at T = w (call i uses input set i mod N_SETS) and the
    untimed input placement of the bare replay."""
    m, rt, rows = ctx.model, ctx.runtime, ctx.rows
    N = padded_width(w, ctx.widths)
    raw = ctx.width_sets[w]
    host = [rows.host(p) for p in raw]
    packed = pack(raw, ctx.pin)
    calls = {"eager": lambda i: m.step(ctx.feed(packed[i % N_SETS])),
             "cgrt": lambda i: rt.step(**host[i % N_SETS])}
    prep = {}
    if ctx.bare:
        g = ctx.bare[0][N]
        dev = [p.to(ctx.device) for p in pack([rows.padded(p, N) for p in raw], ctx.pin)]
        calls["bare"] = lambda i: g.graph.replay()
        prep["bare"] = lambda i: g.static.copy_(dev[i % N_SETS])
    return calls, prep


def step_time(ctx: Context) -> dict:
    """1. Median per-call latency per width: eager, cgrt and bare here; the compile
    setups from their child processes (run first, over the same input sets)."""
    ctx.runtime, ctx.bare, ctx.width_sets  # noqa: B018 - build (and time) them before any width
    runs = ctx.compiled
    ref, ref_note = runs.reference("step_time")
    kw = {"repeats": ctx.repeats, "warmup": ctx.warmup, "sync": ctx.sync}
    out_rows = []
    for w in ctx.step_widths:
        ctx.note(f"step time: width {w}")
        calls, prep = _width_calls(ctx, w)
        r: dict[str, Any] = {"width": w, "padded": padded_width(w, ctx.widths), "pipelined_us": {}}
        for name, call in calls.items():
            r[name], r["pipelined_us"][name] = measure(call, prepare=prep.get(name), inference=name == "eager", **kw)
        for rec in runs:
            if w in rec["step_time"]:
                r[rec["variant"]] = rec["step_time"][w]
                r["pipelined_us"][rec["variant"]] = rec["pipelined_us"][w]
        pipe = r["pipelined_us"]
        r["cgrt_over_bare_pipelined"] = pipe["cgrt"] / pipe["bare"] if "bare" in pipe else None
        r["cgrt_over_bare"] = _ratio(r["cgrt"], r.get("bare"))
        r["eager_over_cgrt"] = _ratio(r["eager"], r["cgrt"])
        r["compile_over_cgrt"] = _ratio(r.get(ref), r["cgrt"]) if ref else None
        r["cgrt_compile_over_cgrt"] = _ratio(r.get("cgrt_compile"), r["cgrt"])
        out_rows.append(r)
    return {
        "status": "ok", "what": STEP_WHAT, "widths": ctx.step_widths, "rows": out_rows,
        "method": "median of per-call host-clock latency, device synchronized before each call; "
                  f"{ctx.repeats} calls after {ctx.warmup} warm-up, {N_SETS} random input sets rotated; "
                  + COMPILE_METHOD,
        "capture": ctx.first_capture.to_json() if ctx.first_capture else None,
        "bare_capture_s": ctx.bare[1] if ctx.bare else None,
        "compile": {"reference": ref, "reference_note": ref_note, "setups": runs.to_json()},
    }


def mixed_trace(ctx: Context) -> dict:
    """2. Total time of the mixed trace per variant (each step reads its tokens back to the
    host, as a decode loop does); the compile setups from their child processes."""
    tr, m, rt, sync = ctx.trace, ctx.model, ctx.runtime, ctx.sync
    bare = ctx.bare[0] if ctx.bare else None
    runs = ctx.compiled

    def eager(idx):
        with torch.inference_mode():
            for i in idx:
                m.step(ctx.feed(tr.packed[i]))["tokens"].cpu()

    def cgrt(idx):
        for i in idx:
            rt.step(**tr.host[i]).outputs["tokens"].cpu()

    def bare_run(idx):
        for i in idx:
            g = bare[tr.padded[i].shape[1]]
            g.static.copy_(tr.padded[i], non_blocking=True)
            g.graph.replay()
            g.outputs["tokens"][:tr.Ts[i]].cpu()

    runs_here = {"eager": eager, "cgrt": cgrt}
    if bare is not None:
        runs_here["bare"] = bare_run
    variants: dict[str, Any] = {}
    for name, fn in runs_here.items():
        ctx.note(f"mixed trace: {name}")
        try:
            variants[name] = measure_trace(fn, tr, ctx.trace_passes, sync)
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            variants[name] = {"status": "unavailable", "reason": f"{type(e).__name__}: {e}"[:300]}
    if "bare" not in variants:
        variants["bare"] = {"status": "unavailable", "reason": "needs CUDA"}
    setup_s = {"cgrt_capture": ctx.first_capture.seconds if ctx.first_capture else None,
               "bare_capture": ctx.bare[1] if ctx.bare else None}
    for rec in runs:
        v = rec["variant"]
        if rec.get("trace"):
            variants[v] = {**rec["trace"], "process": "child"}
        else:
            status = "unavailable" if rec["status"] != "skipped" else "skipped"
            variants[v] = {"status": status, "reason": rec.get("reason") or "the child did not reach the trace"}
        if rec.get("seconds") is not None:
            setup_s[v] = rec["seconds"] + (rec.get("capture_s") or 0.0)
    ref, ref_note = runs.reference("trace")
    Ts = tr.Ts
    return {
        "status": "ok", "steps": len(Ts), "real_rows": sum(Ts),
        "mix": "70% T in 1..8, 22% in 16..40, 8% in 33..64 (seeded)",
        "T_buckets": {"1-8": sum(T <= 8 for T in Ts), "9-32": sum(8 < T <= 32 for T in Ts),
                      "33-64": sum(T > 32 for T in Ts)},
        "method": f"host clock around the whole trace (device idle at both ends), median of {ctx.trace_passes} "
                  "passes after one untimed step per distinct T; every step copies its inputs in and reads its "
                  "tokens back (.cpu(), a sync per step); " + COMPILE_METHOD,
        "variants": variants,
        "compile": {"reference": ref, "reference_note": ref_note, "setups": runs.to_json()},
        "setup_s": setup_s,
    }


def _four_input_step(model):
    def step(x):  # `want` made on the device: the step takes four host inputs
        return model.step({**x, "want": torch.ones_like(x["tokens"])})
    return step


OVERHEAD_REPEATS = 5  # interleaved repeats of section 3: each goal's spread comes from these


def _fill(arrays: dict, rows: dict, names: list[str]) -> None:
    """Write one input set (numpy rows) into ``host_inputs(numpy=True)`` arrays in place
    (the runner's own writes)."""
    for n in names:
        arrays[n][:] = rows[n]


def overhead_variants(rt, replay, host: list[dict], names: list[str], w: int) -> dict:
    """Section 3's variants at T = w, as ``time_interleaved`` takes them (call, untimed
    prepare): bare = ``replay()`` (inputs placed by a step before, untimed); step =
    ``step(**pageable CPU tensors)``; zero_copy = ``step(**views)`` after an untimed
    ``host_inputs(w, numpy=True)`` and fill (the old figure: step() alone); zero_copy_whole
    = ``host_inputs(w, numpy=True)``, fill and ``step(**arrays)`` all timed, what every
    zero-copy step costs (views are good for one step). ``host``: N_SETS dicts of CPU rows
    per name. The arrays of zero_copy live in a dict of this closure until its next fill."""
    views: dict = {}
    rows_np = [{n: t.numpy() for n, t in h.items()} for h in host]  # a runner's rows: numpy or lists

    def place(i):
        rt.step(**host[i % N_SETS])

    def fill(i):
        views.clear()
        views.update(rt.host_inputs(w, numpy=True))
        _fill(views, rows_np[i % N_SETS], names)

    def whole(i):
        v = rt.host_inputs(w, numpy=True)
        _fill(v, rows_np[i % N_SETS], names)
        rt.step(**v)

    return {"bare": (lambda i: replay(), place), "step": (place, None),
            "zero_copy": (lambda i: rt.step(**views), fill), "zero_copy_whole": (whole, None)}


def _overhead_repeat(variants: dict, kw: dict, acc: dict) -> dict:
    """One interleaved measurement of every variant, host time then latency; appends the
    raw nanoseconds to ``acc[kind]`` and returns ``{kind: {variant: median µs}}``."""
    out = {}
    for kind, include_sync in (("host", False), ("latency", True)):
        t = time_interleaved(variants, include_sync=include_sync, raw=acc.setdefault(kind, {}), **kw)
        out[kind] = {name: t[name]["median_us"] for name in variants}
    return out


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "repeats": xs}


def overhead_row(inputs: int, w: int, medians: list[dict], acc: dict) -> dict:
    """One case's figures from its repeats. Pooled over every repeat (the keys of before):
    ``{variant}_{kind}`` summaries, ``*_overhead_{kind}_us`` = median(variant) -
    median(bare), ``*_paired_us`` = median of per-round differences. Per repeat (new):
    ``*_overhead_{kind}_repeats_us`` and ``{variant}_over_bare_{kind}``, the ratio of
    medians as {median, min, max, repeats}."""
    r: dict[str, Any] = {"inputs": inputs, "width": w, "repeats": len(medians)}
    for kind, raw in acc.items():
        for name, ns in raw.items():
            r[f"{name}_{kind}"] = summarize(ns)
        bare = r[f"bare_{kind}"]["median_us"]
        for name in [n for n in raw if n != "bare"]:
            r[f"{name}_overhead_{kind}_us"] = r[f"{name}_{kind}"]["median_us"] - bare
            r[f"{name}_overhead_{kind}_paired_us"] = statistics.median(
                a - b for a, b in zip(raw[name], raw["bare"])) / 1e3
            r[f"{name}_overhead_{kind}_repeats_us"] = [m[kind][name] - m[kind]["bare"] for m in medians]
            r[f"{name}_over_bare_{kind}"] = _spread([m[kind][name] / m[kind]["bare"] for m in medians])
    return r


def host_overhead(ctx: Context) -> dict:
    """3. Host time per call of step() (and of a whole zero-copy step) against a bare
    replay of the same captured graph, from OVERHEAD_REPEATS interleaved repeats."""
    if not ctx.graphs:
        return {"status": "skipped", "reason": "needs CUDA graphs (a bare replay to compare with)"}
    m = ctx.model
    specs4 = {k: v for k, v in m.inputs().items() if k != "want"}
    rt4 = ctx.make_runtime(widths=(1, 64), step_fn=_four_input_step(m), inputs=specs4)
    rt4.capture()
    reps = max(ctx.repeats * 5, 50)
    per = max(reps // OVERHEAD_REPEATS, 10)
    kw = {"repeats": per, "warmup": ctx.warmup, "sync": ctx.sync}
    try:
        rows = _overhead_cases(ctx, [(rt4, list(specs4)), (ctx.runtime, ctx.rows.names)], kw)
    finally:
        rt4.close()
    return {"status": "ok", "rows": rows, "repeats": OVERHEAD_REPEATS, "calls_per_repeat": per,
            "method": OVERHEAD_METHOD.format(R=OVERHEAD_REPEATS, per=per, n=N_SETS)}


def _overhead_cases(ctx: Context, runtimes: list, kw: dict) -> list[dict]:
    """Every (runtime, width) case, measured OVERHEAD_REPEATS times: each repeat runs every
    case once in turn (so the repeats of a case are interleaved with the other cases)."""
    cases = []
    for rt, names in runtimes:
        for w in (1, 64):
            host = [{n: v for n, v in ctx.rows.host(ctx.rows.rows(w)).items() if n in names} for _ in range(N_SETS)]
            cases.append((len(names), w, overhead_variants(rt, rt.graphs_captured[w].replay, host, names, w)))
    medians: list[list[dict]] = [[] for _ in cases]
    accs: list[dict] = [{} for _ in cases]
    for k in range(OVERHEAD_REPEATS):
        for c, (n, w, variants) in enumerate(cases):
            ctx.note(f"host overhead: {n} inputs, width {w}, repeat {k + 1}/{OVERHEAD_REPEATS}")
            medians[c].append(_overhead_repeat(variants, kw, accs[c]))
    return [overhead_row(n, w, medians[c], accs[c]) for c, (n, w, _) in enumerate(cases)]


OVERHEAD_METHOD = (
    "host clock, device synchronized before each call (so nothing waits on the device). *_host: until the call "
    "returns (host time to issue it); *_latency: until a synchronize after it. {R} repeats; each repeat times "
    "every case in turn, each case {per} calls of each variant, interleaved call by call, {n} random input sets. "
    "bare = replay() of the runtime's own graph for that width (inputs placed untimed by a step before); "
    "step = step(**pageable CPU tensors); zero_copy = step(**arrays) after host_inputs(T, numpy=True) and filling "
    "the pinned arrays in place from numpy rows (both untimed); zero_copy_whole = host_inputs(T, numpy=True) + fill "
    "+ step(**arrays), all timed (what "
    "every zero-copy step pays). Pooled over the repeats: summaries, overhead = median(variant) - median(bare), "
    "*_paired_us = median over rounds of (variant - bare). Per repeat: *_repeats_us and *_over_bare_* "
    "(ratio of the repeat's medians; median, min, max); a goal's status is met or missed only when every "
    "repeat agrees, else unclear.")
