"""Tables, goals and plots of ``cgrt bench``, all from the JSON-able section results."""
from __future__ import annotations

from typing import Any

from rich.table import Table
from rich.text import Text

from ..console import SplitTable

MiB = 1024 * 1024


def _us(t: Any) -> str:
    if isinstance(t, dict):
        t = t.get("median_us")
    return "—" if t is None else f"{t:.1f}"


def _x(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def _mib(b: int | None) -> str:
    return "—" if b is None else f"{b / MiB:.1f}"


def _table(title: str, cols: list[str], rows: list[list[Any]], caption: str | None = None) -> SplitTable:
    """Plain text everywhere (Text, not markup: reasons and errors may hold brackets). On a
    console narrower than the table, its columns split over several tables, the first
    column repeated in each (SplitTable): no figure is cut at 80 columns."""
    return SplitTable(title, cols, rows, caption)


def setup_line(c: dict) -> str:
    """One compile setup in a caption: how it ran, compile time, CUDA graph skips, tokens."""
    head = f"{c['label']}: {c['status']}"
    if c["status"] in ("skipped", "unavailable"):
        return f"{head}: {c.get('reason') or ''}"
    bits = []
    if c.get("seconds") is not None:
        bits.append(f"{c['seconds']:.1f} s compile + warm-up" + (f" (mode {c['mode']})" if c.get("mode") else ""))
    if c.get("capture_s") is not None:
        bits.append(f"cgrt capture {c['capture_s']:.2f} s")
    n = c.get("cudagraph_skips")
    if n:
        why = (c.get("skip_reasons") or ["TORCH_LOGS=cudagraphs says why"])[0]
        bits.append(f"CUDA graphs SKIPPED {n}x, so it runs without them ({why[:160]})")
    elif n == 0 and c["setup"] in ("static", "default"):
        bits.append("CUDA graphs on (0 skips)")
    tc = c.get("tokens_check")
    if tc:
        bits.append("tokens = eager" if not tc["mismatched"] else
                    f"TOKENS DIFFER from eager in {tc['mismatched']}/{tc['rows']} rows")
    if c.get("reason"):
        bits.append(f"{c['status']}: {c['reason']}")
    return f"{head}: " + "; ".join(bits)


def compile_caption(comp: dict) -> str:
    """The compile setups, one line each, and which one the cgrt/compile ratio uses."""
    setups = comp["setups"]
    if setups and all(c["status"] == "skipped" for c in setups) and len({c["reason"] for c in setups}) == 1:
        return f"torch.compile setups ({', '.join(c['label'] for c in setups)}): skipped: {setups[0]['reason']}"
    lines = [setup_line(c) for c in setups]
    ref = comp.get("reference")
    lines.append(f"compile/cgrt and goal 3 use {comp.get('reference_note')}" if ref else
                 f"compile/cgrt: no reduce-overhead figure ({comp.get('reference_note')})")
    return "\n".join(lines)


def tables(key: str, sec: dict) -> list[SplitTable]:
    """The rich tables for one section result."""
    if key == "step_time":
        setups = sec["compile"]["setups"]
        cols = [c["variant"] for c in setups]
        labels = {c["variant"]: c["label"] for c in setups}
        ref = sec["compile"]["reference"]
        cap = compile_caption(sec["compile"])
        return [_table("1. step time per width, median µs (call → synchronize)",
                       ["T", "N", "eager", "cgrt", "bare", *(labels[v] for v in cols), "cgrt/bare", "eager/cgrt",
                        f"{labels.get(ref, 'compile')} / cgrt", "cgrt+compile / cgrt", "cgrt/bare pipelined"],
                       [[str(r["width"]), str(r["padded"]), _us(r["eager"]), _us(r["cgrt"]), _us(r.get("bare")),
                         *(_us(r.get(v)) for v in cols), _x(r["cgrt_over_bare"]), _x(r["eager_over_cgrt"]),
                         _x(r["compile_over_cgrt"]), _x(r.get("cgrt_compile_over_cgrt")),
                         _x(r.get("cgrt_over_bare_pipelined"))]
                        for r in sec["rows"]], cap)]
    if key == "mixed_trace":
        v, s = sec["variants"], sec["setup_s"]
        cg = v["cgrt"].get("total_ms")
        labels = {c["variant"]: c["label"] for c in sec["compile"]["setups"]}
        rows = []
        for name in ("eager", "cgrt", "bare", *labels):
            d = v.get(name)
            if d is None:
                continue
            label = labels.get(name, name)
            if d["status"] != "ok":
                rows.append([label, d["status"], "", "", (d.get("reason") or "")[:70]])
                continue
            setup = {"cgrt": s.get("cgrt_capture"), "bare": s.get("bare_capture")}.get(name, s.get(name))
            rows.append([label, f"{d['total_ms']:.1f}", f"{d['mean_step_us']:.1f}",
                         _x(d["total_ms"] / cg if cg else None), "" if setup is None else f"{setup:.2f} s"])
        b = sec["T_buckets"]
        return [_table(f"2. mixed trace, {sec['steps']} steps (T 1-8: {b['1-8']}, 9-32: {b['9-32']}, "
                       f"33-64: {b['33-64']})", ["variant", "total ms", "µs/step", "vs cgrt", "setup (separate)"],
                       rows, "each step: inputs in, tokens read back (a sync per step); setup: cgrt = the "
                       "first capture in the process (cold); compile setups = compile + warm-up of every width "
                       "(cgrt+compile: + capture), in their child process\n" + compile_caption(sec["compile"]))]
    if key == "host_overhead":
        return [_overhead_table(sec)]
    if key == "memory":
        sh, sep = sec["shared"], sec["separate"]
        rows = [["shared pool, all widths", _mib(sh["pool_bytes"]), f"{sh['capture_s']:.3f}"],
                ["separate pools (sum)", _mib(sep["total_bytes"]), f"{sep['total_capture_s']:.3f}"],
                ["widest (64) alone", _mib(sec["widest_alone_bytes"]), ""]]
        rows += [[f"  width {w} alone", _mib(s["pool_bytes"]), f"{s['capture_s']:.3f}"]
                 for w, s in sep["per_width"].items() if w != "64"]
        return [_table("4. graph pool memory and capture time", ["what", "pool MiB", "capture s"], rows,
                       f"shared/widest {_x(sec['shared_over_widest'])}, shared/separate "
                       f"{_x(sec['shared_over_separate'])}; first capture in the process "
                       f"{sec['first_capture_s'] or 0:.3f} s")]
    if key == "padding":
        rows = [[s["name"], str(len(s["widths"])), str(s["padded_rows"]), f"{s['padding_pct']:.1f}%",
                 f"{s['trace_ms']:.1f}", f"{s['mean_step_us']:.1f}", _mib(s["pool_bytes"]), f"{s['capture_s']:.3f}"]
                for s in sec["sets"]]
        return [_table(f"5. padding waste over the {sec['steps']}-step trace",
                       ["widths", "graphs", "pad rows", "pad/real", "trace ms", "µs/step", "pool MiB", "capture s"],
                       rows, "user = " + ",".join(map(str, sec["sets"][-1]["widths"])))]
    if key == "dispatch":
        from .dispatch import table
        return [table(sec)]
    if key == "host_rows":
        names = ("captured_gather", "runtime_device", "runtime_host", "copy_all", "item_select")
        rows = [[str(r["accepted"]), *(_us(r[n]) for n in names), _x(r["captured_gather"]["median_us"]
                                                                      / r["copy_all"]["median_us"])]
                for r in sec["rows"]]
        sweep = [[str(r["T"]), _us(r["captured_gather"]), _us(r["copy_all"]), _us(r["item_select"])]
                 for r in sec["T_sweep"]]
        bad = [r["accepted"] for r in sec["rows"] + sec["T_sweep"] if not r.get("rows_agree", True)]
        return [_table(f"6. host rows, H={sec['H']} bf16, T={sec['T']}: µs until rows are readable on the host",
                       ["accepted", "captured", "rt device", "rt host", "(a) copy all", "(b) item+sel",
                        "captured/(a)"], rows,
                       "rows agree across methods" if not bad else f"ROWS DISAGREE at accepted {bad}"),
                _table("6b. accepted = 8, varying T", ["T", "captured", "(a) copy all", "(b) item+sel"], sweep)]
    return []


def _range(sp: dict | None) -> str:
    """A per-repeat ratio spread as "median (min–max)"; — for JSON from before repeats."""
    return "—" if not sp else f"{sp['median']:.2f}x ({sp['min']:.2f}–{sp['max']:.2f})"


def _overhead_table(sec: dict) -> SplitTable:
    """Section 3: pooled medians and Δ over replay; the whole zero-copy step; per-repeat
    ratio spreads of step and whole zero-copy over replay (host time)."""
    rows = [[str(r["inputs"]), str(r["width"]), _us(r["bare_host"]), _us(r["step_host"]),
             f"{r['step_overhead_host_us']:+.1f}", _us(r["zero_copy_host"]),
             f"{r['zero_copy_overhead_host_us']:+.1f}", _us(r.get("zero_copy_whole_host")),
             f"{r['zero_copy_whole_overhead_host_us']:+.1f}" if "zero_copy_whole_overhead_host_us" in r else "—",
             _range(r.get("step_over_bare_host")), _range(r.get("zero_copy_whole_over_bare_host")),
             _us(r["bare_latency"]), _us(r["step_latency"]), f"{r['step_overhead_latency_us']:+.1f}"]
            for r in sec["rows"]]
    return _table("3. host overhead of step() over replay() of the same graph, median µs",
                  ["inputs", "T", "replay host", "step host", "Δ", "zero-copy step() host", "Δ",
                   "whole zero-copy host", "Δ", "step/replay", "whole/replay", "replay lat", "step lat", "Δ lat"],
                  rows, "host = until the call returns (device idle before); lat = until synchronize; "
                  "zero-copy step() = step(**views) alone; whole zero-copy = host_inputs(T) + fill + step(**views); "
                  f"x/replay = ratio of medians, median (min–max) over {sec.get('repeats', 1)} interleaved repeats")


# --------------------------------------------------------------------------------- goals
def _goal(goal: str, target: str, measured: str | None, ok: bool | str | None, why: str = "") -> dict:
    """``ok``: True / False, None (n/a), or a status string already decided (``unclear``)."""
    status = ok if isinstance(ok, str) else "n/a" if ok is None else ("met" if ok else "missed")
    return {"goal": goal, "target": target, "measured": measured if measured is not None else why, "status": status}


def spread_status(lo: float, hi: float, limit: float) -> bool | str:
    """A "≤ limit" goal judged over repeats: met when every repeat is within the limit
    (``hi <= limit``), missed when none is (``lo > limit``), else "unclear"."""
    if hi <= limit:
        return True
    return False if lo > limit else "unclear"


def _ratio_goal(ho: dict | None, goal: str, limit: float, variant: str, inputs: tuple[int, ...],
                kind: str = "host") -> dict:
    """Host time (or latency) of ``variant`` over replay() at every width of the given
    input counts, from the per-repeat ratios: status over the worst case's spread and
    every case's."""
    target = f"≤ {limit:g}x replay() {'host time' if kind == 'host' else 'latency'}, every T"
    key = f"{variant}_over_bare_{kind}"
    rows = [r for r in ho["rows"] if r["inputs"] in inputs and key in r] if ho else []
    if not rows:
        return _goal(goal, target, None, None, "needs section 3 on CUDA (with repeats)")
    sp = {(r["inputs"], r["width"]): r[key] for r in rows}
    (n, w), worst = max(sp.items(), key=lambda kv: kv[1]["median"])
    hi, lo = max(s["max"] for s in sp.values()), max(s["min"] for s in sp.values())
    status = spread_status(lo, hi, limit)
    return _goal(goal, target, f"worst {worst['median']:.2f}x at {n} inputs T={w} (repeats {worst['min']:.2f}–"
                 f"{worst['max']:.2f}x; {len(worst['repeats'])} repeats)", status)


def goals(results: dict) -> list[dict]:
    """Each goal of the brief, met / missed / n/a (section skipped or not run)."""
    out = []

    def sec(key):
        s = results.get(key)
        return s if s and s.get("status") == "ok" else None

    graphs = results.get("meta", {}).get("graphs", False)
    st = sec("step_time")
    pairs = [(r["width"], r["cgrt_over_bare"]) for r in st["rows"] if r["cgrt_over_bare"]] if st else []
    worst = max(pairs, key=lambda p: p[1]) if pairs else None
    out.append(_goal("cgrt vs bare replay, every width", "≤ 1.10x",
                     f"worst {worst[1]:.2f}x at T={worst[0]}" if worst else None,
                     worst[1] <= 1.10 if worst else None, "needs section 1 on CUDA"))
    sp = [(r["width"], r["eager_over_cgrt"]) for r in st["rows"] if r["width"] <= 8] if st and graphs else []
    low = min(sp, key=lambda p: p[1]) if sp else None
    out.append(_goal("speed-up over eager, T = 1..8", "≥ 3x", f"least {low[1]:.2f}x at T={low[0]}" if low else None,
                     low[1] >= 3 if low else None, "needs section 1 on CUDA (graphs on)"))
    mt = sec("mixed_trace")
    c = mt["variants"] if mt else {}
    ref, ref_note = (mt["compile"]["reference"], mt["compile"]["reference_note"]) if mt else (None, "")
    name = "mixed trace vs torch.compile reduce-overhead"
    if ref and c.get(ref, {}).get("status") == "ok" and c["cgrt"]["status"] == "ok":
        r = c["cgrt"]["total_ms"] / c[ref]["total_ms"]
        out.append(_goal(name, "cgrt ≤ compile", f"{c['cgrt']['total_ms']:.1f} vs {c[ref]['total_ms']:.1f} ms "
                         f"({r:.2f}x); compile = {ref_note}", r <= 1.0))
    else:
        out.append(_goal(name, "cgrt ≤ compile", None, None,
                         f"compile unavailable: {ref_note}" if mt else "needs section 2"))
    mem = sec("memory")
    r = mem["shared_over_widest"] if mem else None
    out.append(_goal("shared pool vs widest alone", "≤ 1.25x",
                     f"{r:.2f}x ({_mib(mem['shared']['pool_bytes'])} / {_mib(mem['widest_alone_bytes'])} MiB)"
                     if r else None, r <= 1.25 if r else None, "needs section 4 on CUDA"))
    cs = mem["shared"]["capture_s"] if mem else None
    out.append(_goal("capture of the 7 default widths", "< 1 s", f"{cs:.3f} s" if cs is not None else None,
                     cs < 1.0 if cs is not None else None, "needs section 4 on CUDA"))
    out += _host_overhead_goals(sec("host_overhead"))
    hr = sec("host_rows")
    row = next((r for r in hr["rows"] if r["accepted"] == 8), None) if hr else None
    if row:
        g, a, b = (row[k]["median_us"] for k in ("captured_gather", "copy_all", "item_select"))
        agree = all(r.get("rows_agree", True) for r in hr["rows"] + hr["T_sweep"])
        out.append(_goal("host rows at accepted=8", "≤ 0.5x (a) and < (b), rows right",
                         f"{g:.1f} µs: {g / a:.2f}x (a), {g / b:.2f}x (b)" + ("" if agree else "; ROWS WRONG"),
                         g <= 0.5 * a and g < b and agree))
        ts = [r["captured_gather"]["median_us"] for r in hr["T_sweep"]]
        out.append(_goal("host rows grow with accepted, not T", "max/min over T∈{8,64,256} ≤ 1.25",
                         f"{max(ts) / min(ts):.2f}", max(ts) / min(ts) <= 1.25))
    else:
        out.append(_goal("host rows at accepted=8", "≤ 0.5x (a) and < (b)", None, None, "needs section 6 on CUDA"))
    from .dispatch import goal_values
    dispatch = sec("dispatch")
    for name, value, target, ok in goal_values(dispatch or {}, toy=True) if dispatch and graphs else []:
        out.append(_goal(name, target, None if value is None else f"{value:.2f}", None if value is None else ok,
                         "needs conditional nodes (CUDA 12.4+ driver, cuda-python)"))
    if not (dispatch and graphs):
        out.append(_goal("device dispatch / the faster host-driven loop, 1 seq, k=4", f">= {1.5}x", None, None,
                         "needs section 7 on CUDA"))
    return out


def _host_overhead_goals(ho: dict | None) -> list[dict]:
    """Goal 6 (Δ host of step() at 4 inputs, T = 1; its status from the per-repeat Δ when
    the JSON has them) and issue 15's two ratio goals over replay()."""
    row = next((r for r in ho["rows"] if r["inputs"] == 4 and r["width"] == 1), None) if ho else None
    if row is None:
        out = [_goal("host overhead of step(), 4 host inputs, T=1", "≤ 15 µs over replay()", None, None,
                     "needs section 3 on CUDA")]
    else:
        d, per = row["step_overhead_host_us"], row.get("step_overhead_host_repeats_us")
        ok = spread_status(min(per), max(per), 15) if per else d <= 15
        rng = f"; repeats {min(per):+.1f}..{max(per):+.1f}" if per else ""
        whole = row.get("zero_copy_whole_overhead_host_us")
        out = [_goal("host overhead of step(), 4 host inputs, T=1", "≤ 15 µs over replay()",
                     f"{d:+.1f} µs{rng} (zero-copy step() {row['zero_copy_overhead_host_us']:+.1f}"
                     + (f", whole zero-copy step {whole:+.1f}" if whole is not None else "")
                     + f"; latency {row['step_overhead_latency_us']:+.1f})", ok)]
    out.append(_ratio_goal(ho, "whole zero-copy step (host_inputs + fill + step) vs replay()", 1.5,
                           "zero_copy_whole", (4, 5)))
    out.append(_ratio_goal(ho, "step() with four fresh CPU tensors vs replay()", 2.5, "step", (4,)))
    out.append(_ratio_goal(ho, "latency of step() (fresh CPU tensors) vs replay()", 1.03, "step", (4, 5),
                           kind="latency"))
    return out


def goals_table(gs: list[dict]) -> SplitTable:
    """The goals with met (green) / missed (red) / unclear (magenta: the repeats
    disagree) / n/a (yellow)."""
    style = {"met": "green", "missed": "red", "unclear": "magenta", "n/a": "yellow"}
    return _table("goals", ["goal", "target", "measured", "status"],
                  [[g["goal"], g["target"], g["measured"] or "", Text(g["status"], style=style[g["status"]])]
                   for g in gs])


# --------------------------------------------------------------------------------- plots
def write_plots(results: dict, folder: str) -> list[str]:
    """PNGs into ``folder`` (an existing folder: the command checks it before the run):
    step time per width for every variant measured; host-rows time vs accepted."""
    import os

    from cudagraph_rt.extras import require

    matplotlib = require("plot", "cgrt bench --plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    st = results.get("step_time")
    if st and st.get("status") == "ok":
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ws = [r["width"] for r in st["rows"]]
        labels = {c["variant"]: c["label"] for c in st["compile"]["setups"]}
        for name in ("eager", "cgrt", "bare", *labels):
            ys = [r.get(name)["median_us"] if r.get(name) else None for r in st["rows"]]
            pts = [(w, y) for w, y in zip(ws, ys) if y is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=labels.get(name, name))
        ax.set(xscale="log", yscale="log", xlabel="step width T (rows)", ylabel="median µs per step",
               title="step time per width")
        ax.set_xticks(ws if len(ws) <= 8 else [1, 2, 4, 8, 16, 32, 64], labels=None)
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        written.append(_save(fig, os.path.join(folder, "step_time.png")))
    hr = results.get("host_rows")
    if hr and hr.get("status") == "ok":
        fig, ax = plt.subplots(figsize=(7, 4.5))
        acc = [r["accepted"] for r in hr["rows"]]
        for name, label in (("captured_gather", "captured gather"), ("runtime_device", "runtime, device mode"),
                            ("runtime_host", "runtime, host mode"), ("copy_all", "(a) copy all, select on host"),
                            ("item_select", "(b) .item(), index_select, copy")):
            ax.plot(acc, [r[name]["median_us"] for r in hr["rows"]], marker="o", label=label)
        ax.set(xlabel="accepted rows", ylabel="median µs until readable on host",
               title=f"host rows, H={hr['H']} bf16, T={hr['T']}")
        ax.grid(True, alpha=0.3)
        ax.legend()
        written.append(_save(fig, os.path.join(folder, "host_rows.png")))
    return written


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
