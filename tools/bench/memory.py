"""Sections 4-5 of ``cgrt bench``: graph pool memory and capture time, padding waste."""
from __future__ import annotations

import functools
import statistics

from .common import padded_width, time_total
from .context import Context

USER_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def _capture(ctx: Context, widths: tuple[int, ...]) -> dict:
    rt = ctx.make_runtime(widths=widths)
    try:
        rep = rt.capture()
    finally:
        rt.close()
    return {"widths": list(widths), "pool_bytes": rep.pool_bytes, "capture_s": rep.seconds,
            "per_width": [vars(w) for w in rep.widths]}


def memory(ctx: Context) -> dict:
    """4. Pool bytes: all widths in one pool, each width in its own runtime, the widest
    alone; capture seconds (fresh runtimes in a warm process)."""
    if not ctx.graphs:
        return {"status": "skipped", "reason": "needs CUDA (graph pools)"}
    ctx.runtime  # noqa: B018 - the process's first (cold) capture happens here, not below
    ctx.note("memory: shared pool")
    shared = _capture(ctx, ctx.widths)
    separate = {}
    for w in ctx.widths:
        ctx.note(f"memory: width {w} alone")
        separate[w] = _capture(ctx, (w,))
    widest = separate[ctx.widths[-1]]["pool_bytes"]
    total = sum(s["pool_bytes"] for s in separate.values())
    return {
        "status": "ok", "shared": shared,
        "separate": {"per_width": {str(w): s for w, s in separate.items()}, "total_bytes": total,
                     "total_capture_s": sum(s["capture_s"] for s in separate.values())},
        "widest_alone_bytes": widest,
        "shared_over_widest": shared["pool_bytes"] / widest if widest else None,
        "shared_over_separate": shared["pool_bytes"] / total if total else None,
        "first_capture_s": ctx.first_capture.seconds if ctx.first_capture else None,
        "method": "CaptureReport.pool_bytes (memory_reserved after capture minus before, after "
                  "empty_cache) of fresh runtimes over the same model; separate = one runtime per width "
                  "(own pool, own capture stream); capture_s = CaptureReport.seconds (probe, warm-up and "
                  "capture of every width) in a process that has captured once already",
    }


def _padding_case(ctx: Context, name: str, ws: tuple[int, ...]) -> dict:
    ctx.note(f"padding: {name} widths")
    tr = ctx.trace
    rt = ctx.make_runtime(widths=ws)

    def run(idx):
        for i in idx:
            rt.step(**tr.host[i]).outputs["tokens"].cpu()

    try:
        rep = rt.capture()
        run(tr.first_of_each_width())
        rt.reset_stats()
        totals = [time_total(functools.partial(run, range(len(tr.Ts))), ctx.sync) for _ in range(ctx.trace_passes)]
        st = rt.stats()
    finally:
        rt.close()
    total, real = statistics.median(totals), sum(tr.Ts)
    padded = sum(padded_width(T, ws) - T for T in tr.Ts)
    return {
        "name": name, "widths": list(ws), "real_rows": real, "padded_rows": padded,
        "padded_rows_counted": st.padding_rows // ctx.trace_passes,
        "padding_pct": 100.0 * padded / real, "trace_ms": total * 1e3,
        "mean_step_us": total / len(tr.Ts) * 1e6, "pool_bytes": rep.pool_bytes, "capture_s": rep.seconds,
        "replays": {str(k): v // ctx.trace_passes for k, v in sorted(st.graph_replays.items())},
    }


def padding(ctx: Context) -> dict:
    """5. The mixed trace on the default and a denser user width set: padding rows, time,
    pool bytes, capture time."""
    tr, sets = ctx.trace, {"default": ctx.widths, "user": USER_WIDTHS}
    if ctx.graphs:
        ctx.runtime  # noqa: B018 - keep the first (cold) capture out of these figures
    out = [_padding_case(ctx, name, ws) for name, ws in sets.items()]
    return {"status": "ok", "sets": out, "steps": len(tr.Ts),
            "method": "GraphRuntime.step over the section-2 trace (pageable host inputs, tokens read back each "
                      f"step), median of {ctx.trace_passes} passes; padded_rows from plan(T), "
                      "padded_rows_counted from RuntimeStats"}
