"""``cgrt demo``'s report: the tables (80 columns) and ``--json``, and the exit code."""
from __future__ import annotations

from cudagraph_rt.speculative.runner import PHASES
from cudagraph_rt.sweep.graph_modes import mode_flag, mode_name

from .. import options


def publish(report: dict, json_target: str | None) -> int:
    """Print the report (tables, unless the JSON goes to stdout), write ``--json``'s JSON,
    and return the exit code: 0 when every run's check passed (the JSON's "ok")."""
    if json_target is not None:
        options.write_json(json_target, report)
    if json_target != options.STDOUT:
        _print(report)
        if json_target is not None:
            print(f"json: {json_target}")
    return 0 if report["ok"] else 1


def _print(report: dict) -> None:
    from rich.table import Table

    from ..console import fit, make_console

    out, c = make_console(), report["config"]
    how = (f"{c['lanes']} lanes" if c.get("lanes") is not None
           else f"up to {c.get('launch_rounds')} rounds a launch")
    chunk = f", chunk {c['chunk']}" if c.get("chunk") is not None else ""
    out.print(f"cgrt demo: {c.get('model', 'toy')} {c['size']} ({c['dtype']}, {c['hidden']} hidden, {c['layers']} layers) on "
              f"{c['device']}; {c['sequences']} sequences ({c['slots']} at once, {how}), k={c['k']}, "
              f"max-new {c['max_new']}{chunk}, drafter {c.get('drafter_label', c.get('drafter', 'coin'))}, "
              f"sampling {c.get('sampling', 'greedy')}, dispatch {c.get('dispatch', 'host')}",
              markup=False)
    for note in report["notes"]:
        out.print(f"note: {note}", markup=False)
    t = Table(caption="GPU busy: the steps' device time / wall time (n/a on a CPU)", caption_justify="left")
    for h in ("graphs", "steps", "tokens", "tokens/s", "steps/s", "accepted", "GPU busy", "check"):
        t.add_column(h, justify="left" if h in ("graphs", "check") else "right")
    for r in report["runs"]:
        rate = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
        busy = r.get("gpu_busy")
        t.add_row(mode_flag(r["graphs"]), str(r["steps"]), str(r["tokens"]),
                  f"{r['tokens_per_s']:.1f}", f"{r['steps_per_s']:.1f}", f"{rate:.2f}",
                  "n/a" if busy is None else f"{100 * busy:.0f}%", "ok" if r["check"]["ok"] else "FAIL")
    out.print(fit(t))
    if any(r.get("host_phases_us_per_step") for r in report["runs"]):
        out.print(_phase_table(report["runs"]))
    for r in report["runs"]:
        hist, top = r["accept_hist"], max(r["accept_hist"] + [1])
        lines = [f"{mode_name(r['graphs'])}: {r['tokens']} tokens in {r['seconds']:.3f} s (capture "
                 f"{r['capture_s']:.2f} s); accepted drafts per verify group (of up to k={c['k']}):"]
        lines += [f"  {a:>2} | {'#' * round(40 * n / top):<40} {n}" for a, n in enumerate(hist)]
        by = r.get("acceptance_by_position") or []
        if by:
            lines.append(f"  mean accepted {r.get('mean_accepted', 0.0):.2f} of k={c['k']}; draft j accepted in "
                         + ", ".join(f"j={j + 1}: {100 * a:.0f}%" for j, a in enumerate(by)) + " of the rounds that proposed it")
        loop = r.get("loop")
        if loop:
            per = loop["launches_per_64_tokens"]
            lines.append(f"  device loop: {loop['rounds']} rounds in {loop['loop_launches']} loop launches, run by "
                         f"{_RAN_BY.get(loop['rounds_ran'], loop['rounds_ran'])}; host launches {loop['launches']} (the loop's and "
                         f"{loop['prefill_slices']} slices of {loop['prefill_steps']} prompt steps), "
                         f"{'-' if per is None else f'{per:.2f}'} per 64 tokens; stops {', '.join(loop['stops'])}")
        w, ch = r["widths"], r["check"]
        steps = loop["prefill_steps"] if loop else r["steps"]
        lines.append(f"  {'the prompts’ steps' if loop else 'widths'}: graph replays {w['graph_replays'] or '-'}; eager {w['eager_calls'] or '-'}; "
                     f"dynamic {w['dynamic_calls'] or '-'}; {w['slices']} slices in {steps} steps; "
                     f"padding rows {w['padding_rows']}")
        ties = f" (near-ties not counted: {ch['near_ties']})" if ch.get("near_ties") else ""
        tokens = ("tokens sampled (checked by their rows only)" if ch.get("sampled")
                  else f"greedy mismatches {ch['token_mismatches'] or 'none'}{ties}")
        lines.append(f"  check: {r['finished']} finished; {tokens}; "
                     f"host rows {ch['rows_checked']} (= rows consumed {r['rows_consumed']}), "
                     f"{ch.get('rows_rule', 'max |err|')} {ch['rows_max_err']:.2e} (tol {ch['rows_tol']:g})")
        out.print("\n".join(lines), markup=False, style=None if ch["ok"] else "bold red")


_RAN_BY = {"conditional": "one outer graph of conditional nodes per launch", "host": "the host (round by round)"}


def _phase_table(runs: list[dict]):
    """Host µs per step per phase (runner.PHASES) and their sum: one row per phase, one
    column per run (so it fits 80 columns)."""
    from rich.table import Table

    from ..console import fit

    t = Table(title="host µs per step, by phase", title_justify="left", min_width=30)
    t.add_column("phase", justify="left")
    for r in runs:
        t.add_column(mode_name(r["graphs"]), justify="right")
    per_run = [r.get("host_phases_us_per_step") or {} for r in runs]
    for n in PHASES:
        t.add_row(n, *(f"{ph.get(n, 0.0):.1f}" for ph in per_run))
    t.add_row("sum", *(f"{sum(ph.values()):.1f}" for ph in per_run))
    return fit(t)
