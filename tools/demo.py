"""`cgrt demo`: speculative decoding on the toy decoder (or ``--model hf:<family>``, a
transformers model with random weights) through cudagraph_rt.runner.

Serves ``--sequences`` random prompts (at most ``--slots`` at once, so sequences retire
and join), with graphs on and/or off, and reports tokens/s, steps/s, the acceptance
histogram and the widths that ran. Every generated token is checked against plain greedy
decoding of the same prompt (the eager reference, teacher-forced on the output) and
every committed hidden row the host received against the reference's hidden row at that
position; any mismatch exits 1.
"""
from __future__ import annotations

import argparse
import random
import sys

import torch

from ..errors import CgrtError, InputError, expected
from ..models import Decoder, ToyConfig, ToyDecoder
from ..models.hf import build
from ..device_drafter import DeviceDrafter
from ..runner import PHASES, ReferenceDrafter, Request, RunReport, SpecRunner, ToyDrafter
from ..testing.checks import Tolerance
from . import options

# Hidden rows against the unbatched reference: fp32 differs by reduction order only;
# bf16 by a few ulps per layer (the toy's own GPU test allows 0.25 on the bench size).
_ROW_TOL = {torch.float32: 1e-3, torch.float16: 0.25, torch.bfloat16: 0.25}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sequences", type=options.int_at_least(1), default=12, metavar="N",
                   help="prompts to serve (default 12)")
    p.add_argument("--k", type=options.int_at_least(0), default=4, metavar="N",
                   help="draft tokens per sequence and step (default 4)")
    p.add_argument("--accept-prob", type=options.probability, default=0.7, metavar="P",
                   help="chance each draft token is right (default 0.7)")
    p.add_argument("--max-new", type=options.int_at_least(1), default=32, metavar="N",
                   help="most tokens per sequence; each draws its own limit in [max_new/2, max_new] (default 32)")
    p.add_argument("--rounds", type=options.int_at_least(0), default=0, metavar="N",
                   help="stop after this many steps (default 0: serve everything)")
    options.add_graphs(p)
    options.add_device(p)
    options.add_model(p)
    p.add_argument("--drafter", type=options.one_of("host", "gpu"), default="host", metavar="D",
                   help="host: numpy drafter on the host (default); gpu: a small draft model in its own GraphRuntime "
                        "on its own stream, fed the committed hidden rows (toy only; graphs as --graphs)")
    p.add_argument("--slots", type=options.int_at_least(1), default=None, metavar="N",
                   help="sequences served at once (default: the model's max_seqs)")
    p.add_argument("--lanes", type=options.int_at_least(1), default=2, metavar="N",
                   help="groups of sequences that take turns on the GPU (default 2)")
    p.add_argument("--chunk", type=options.int_at_least(1), default=128, metavar="N",
                   help="prompt rows per step and lane; wider than the dynamic limit (96) gets sliced (default 128)")
    options.add_seed(p, 0, "the toy's weights, the prompts, the limits and the drafter")
    options.add_tp(p)
    p.add_argument("--profile", type=options.output_file, metavar="FILE", default=None,
                   help="cProfile the timed run(s) only; the top functions by own time go to FILE "
                        "(one section per run)")
    options.add_json(p)
    options.add_threads(p)


def make_requests(cfg: ToyConfig, n: int, max_new: int, seed: int) -> list[Request]:
    """``n`` random prompts of 1/16 .. 1/3 of ``max_len`` tokens (so that prompt and
    output fit), each with its own token limit in ``[max_new // 2, max_new]``."""
    if max_new < 1:
        raise ValueError(f"--max-new: expected at least 1, got {max_new}")
    rng = random.Random(seed)
    hi = min(cfg.max_len // 3, cfg.max_len + 1 - max_new)
    if hi < 1:
        raise ValueError(f"--max-new: expected at most {cfg.max_len} for this model, got {max_new}")
    lo = min(max(1, cfg.max_len // 16), hi)
    return [Request(tuple(rng.randrange(cfg.vocab) for _ in range(rng.randint(lo, hi))),
                    rng.randint(max(1, max_new // 2), max_new)) for _ in range(n)]


def check(model: Decoder, runner: SpecRunner) -> dict:
    """Generated tokens against greedy decoding and host rows against the reference.

    ``reference(prompt + generated)`` gives the greedy next token and the hidden row at
    every position in one call: the output equals greedy decoding iff each generated
    token is the greedy token after everything before it.

    transformers models (random weights, near-ties): a generated token that differs where
    the reference's top-1/top-2 margin is not clear (``HFDecoder.clear_positions``) is
    counted in ``near_ties``, not as a mismatch; host rows are compared normwise
    (``||row - ref|| <= tol * ||ref||``, the sweep's rule) since they are normed rows.
    """
    bad, worst, rows, ties = [], 0.0, 0, 0
    hf = hasattr(model, "clear_positions")
    tol = Tolerance.for_dtype(model.config.dtype, model.device) if hf else None
    for seq in runner.finished + [s for lane in runner.lanes for s in lane.seqs if s.decoding]:
        p0, gen = len(seq.prompt) - 1, seq.generated
        if hf:
            logits, hidden = model.reference_logits(seq.tokens)
            greedy, clear = logits.argmax(-1).cpu(), model.clear_positions(logits).cpu()
        else:
            greedy, hidden = model.reference(seq.tokens)
            clear = torch.ones(greedy.shape[0], dtype=torch.bool)
        differs = greedy[p0:p0 + len(gen)].cpu() != torch.tensor(gen, dtype=torch.int64)
        ties += int((differs & ~clear[p0:p0 + len(gen)]).sum())
        if bool((differs & clear[p0:p0 + len(gen)]).any()):
            bad.append(seq.uid)
        got = torch.cat(seq.rows).float()
        want = hidden[p0:p0 + len(gen)].float().cpu()
        if got.shape != want.shape:
            bad.append(seq.uid)
            continue
        rows += got.shape[0]
        if hf:
            err, bound = tol.errors(got, want)
            worst = max(worst, float((err / bound).max()))
        else:
            worst = max(worst, float((got - want).abs().max()))
    limit = 1.0 if hf else _ROW_TOL[model.config.dtype]
    return {"ok": not bad and worst <= limit, "token_mismatches": sorted(set(bad)), "near_ties": ties,
            "rows_checked": rows, "rows_max_err": worst, "rows_tol": limit,
            "rows_rule": f"normwise, fraction of {tol}" if hf else "max |err|"}


def make_drafter(model: Decoder, accept_prob: float, seed: int, requests: list[Request], kind: str = "host", k: int = 4,
                 graphs: bool = False, lanes: int = 2):
    """The toy's rule-based drafter (on the host, or ``kind="gpu"``: the device drafter,
    its graphs captured here), or for other models one that follows the model's own greedy
    decoding (planned here, before timing)."""
    if kind == "gpu":
        if not isinstance(model, ToyDecoder):
            raise InputError(expected("--drafter", "host for transformers models (gpu drafts the toy)", kind))
        d = DeviceDrafter(model, accept_prob, seed, k=max(k, 1), graphs=graphs, depth=max(3, lanes + 1))
        d.capture()
        return d
    if isinstance(model, ToyDecoder):
        return ToyDrafter(model, accept_prob, seed)
    drafter = ReferenceDrafter(model, accept_prob, seed)
    drafter.prepare(requests)
    return drafter


def timing(rep: RunReport) -> dict:
    """The run's time split (JSON): host µs per step per phase (runner.PHASES, summing to
    the wall time), the same in seconds, and on CUDA the steps' device seconds and the GPU
    busy fraction (device / wall; None on a CPU)."""
    return {"host_phases_us_per_step": rep.phase_us_per_step(), "host_phases_s": dict(rep.phases),
            "device_seconds": rep.device_seconds, "gpu_busy": rep.gpu_busy}


def serve(model: Decoder, requests: list[Request], graphs: bool, args, plans=None) -> dict:
    """Capture, warm up on the first wave's prompts, then serve ``requests`` timed. ``plans``:
    served sequences whose tokens the reference drafter follows (``prepare_from``)."""
    model.reset_cache()
    # Warm-up: the first wave's own prompts (as many as run at once), a few tokens each, so
    # the timed run meets no first-time cost (the dynamic path's kernels, cuBLAS plans).
    warm = [Request(r.prompt, min(4, r.max_new)) for r in requests[:args.slots or model.config.max_seqs]]
    kind = getattr(args, "drafter", "host")
    drafter = make_drafter(model, args.accept_prob, args.seed, (requests + warm if args.k else []) if plans is None
                           else [], kind, args.k, graphs, args.lanes)
    if plans is not None and isinstance(drafter, ReferenceDrafter):
        drafter.prepare_from(plans)
    runner = SpecRunner(model, drafter, k=args.k, slots=args.slots,
                        lanes=args.lanes, chunk=args.chunk, graphs=graphs, record_rows=True)
    cap = runner.rt.capture()
    runner.submit(warm)
    runner.run()
    runner.reset_stats()
    runner.rt.reset_stats()
    if isinstance(drafter, ReferenceDrafter):  # the warm-up's re-plans are not the timed run's
        drafter.replans, drafter.replan_seconds = 0, 0.0
    runner.submit(requests)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    rep: RunReport = _profiled(lambda: runner.run(max_steps=args.rounds or None), getattr(args, "profile", None),
                               f"graphs {'on' if graphs else 'off'}, drafter {kind}")
    st = runner.rt.stats()
    if hasattr(drafter, "close"):
        drafter.close()
    return {
        "graphs": graphs, "drafter": kind, "steps": rep.steps, "tokens": rep.tokens, "seconds": rep.seconds,
        "tokens_per_s": rep.tokens_per_s, "steps_per_s": rep.steps_per_s, "capture_s": cap.seconds,
        "finished": len(runner.finished), "accept_hist": list(rep.accept_hist), "proposed": rep.proposed,
        "accepted": rep.accepted, "rows_consumed": rep.rows, **timing(rep),
        "widths": {"graph_replays": dict(sorted(st.graph_replays.items())),
                   "eager_calls": dict(sorted(st.eager_calls.items())),
                   "dynamic_calls": dict(sorted(st.dynamic_calls.items())),
                   "padding_rows": st.padding_rows, "slices": st.slices},
        "check": check(model, runner),
        "replans": getattr(drafter, "replans", 0), "replan_seconds": getattr(drafter, "replan_seconds", 0.0),
        "finished_seqs": runner.finished,
    }


def _profiled(fn, path: str | None, title: str):
    """``fn()``, under cProfile when ``path`` is given: its top 40 functions by own time
    are appended to ``path`` under ``title``."""
    if not path:
        return fn()
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(fn)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    with open(path, "a") as f:
        f.write(f"==== {title}\n{buf.getvalue()}\n")
    return out


def _print(report: dict) -> None:
    from rich.table import Table

    from .console import fit, make_console

    out, c = make_console(), report["config"]
    out.print(f"cgrt demo: {c.get('model', 'toy')} {c['size']} ({c['dtype']}, {c['hidden']} hidden, {c['layers']} layers) on "
              f"{c['device']}; {c['sequences']} sequences ({c['slots']} at once, {c['lanes']} lanes), k={c['k']}, "
              f"p={c['accept_prob']}, max-new {c['max_new']}, chunk {c['chunk']}, drafter {c.get('drafter', 'host')}",
              markup=False)
    for note in report["notes"]:
        out.print(f"note: {note}", markup=False)
    t = Table(caption="GPU busy: the steps' device time / wall time (n/a on a CPU)", caption_justify="left")
    for h in ("graphs", "steps", "tokens", "tokens/s", "steps/s", "accepted", "GPU busy", "check"):
        t.add_column(h, justify="left" if h in ("graphs", "check") else "right")
    for r in report["runs"]:
        rate = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
        busy = r.get("gpu_busy")
        t.add_row("on" if r["graphs"] else "off", str(r["steps"]), str(r["tokens"]),
                  f"{r['tokens_per_s']:.1f}", f"{r['steps_per_s']:.1f}", f"{rate:.2f}",
                  "n/a" if busy is None else f"{100 * busy:.0f}%", "ok" if r["check"]["ok"] else "FAIL")
    out.print(fit(t))
    out.print(_phase_table(report["runs"]))
    for r in report["runs"]:
        hist, top = r["accept_hist"], max(r["accept_hist"] + [1])
        lines = [f"graphs {'on' if r['graphs'] else 'off'}: {r['tokens']} tokens in {r['seconds']:.3f} s (capture "
                 f"{r['capture_s']:.2f} s); accepted drafts per verify group (of up to k={c['k']}):"]
        lines += [f"  {a:>2} | {'#' * round(40 * n / top):<40} {n}" for a, n in enumerate(hist)]
        w, ch = r["widths"], r["check"]
        lines.append(f"  widths: graph replays {w['graph_replays'] or '-'}; eager {w['eager_calls'] or '-'}; "
                     f"dynamic {w['dynamic_calls'] or '-'}; {w['slices']} slices in {r['steps']} steps; "
                     f"padding rows {w['padding_rows']}")
        ties = f" (near-ties not counted: {ch['near_ties']})" if ch.get("near_ties") else ""
        lines.append(f"  check: {r['finished']} finished; greedy mismatches {ch['token_mismatches'] or 'none'}{ties}; "
                     f"host rows {ch['rows_checked']} (= rows consumed {r['rows_consumed']}), "
                     f"{ch.get('rows_rule', 'max |err|')} {ch['rows_max_err']:.2e} (tol {ch['rows_tol']:g})")
        out.print("\n".join(lines), markup=False, style=None if ch["ok"] else "bold red")


def _phase_table(runs: list[dict]):
    """Host µs per step per phase (runner.PHASES) and their sum: one row per phase, one
    column per run (so it fits 80 columns)."""
    from rich.table import Table

    from .console import fit

    t = Table(title="host µs per step, by phase", title_justify="left", min_width=30)
    t.add_column("phase", justify="left")
    for r in runs:
        t.add_column(f"graphs {'on' if r['graphs'] else 'off'}", justify="right")
    per_run = [r.get("host_phases_us_per_step") or {} for r in runs]
    for n in PHASES:
        t.add_row(n, *(f"{ph.get(n, 0.0):.1f}" for ph in per_run))
    t.add_row("sum", *(f"{sum(ph.values()):.1f}" for ph in per_run))
    return fit(t)


def _model(args, choice: options.ModelChoice, device: torch.device):
    """The model ``--model``/``--size`` name, built on ``device`` (progress while it builds)."""
    if choice.kind == "toy":
        size = ToyConfig.bench if choice.size == "bench" else ToyConfig.tiny
        return ToyDecoder(size(seed=args.seed), device)
    with options.building("cgrt demo", f"{choice.label} on {device.type}"):
        if choice.kind == "path":
            return build(choice.family, "tiny", device=device, seed=args.seed, path=choice.path)
        return build(choice.family, choice.size, device=device, seed=args.seed)


def run(args) -> int:
    if getattr(args, "tp", 1) > 1 and getattr(args, "drafter", "host") != "host":
        raise options.UsageError(expected("--drafter", "host with --tp (the device drafter runs on one GPU)", "gpu"))
    if getattr(args, "tp", 1) > 1:  # one process per rank, under torchrun
        from .demo_tp import run_tp
        return run_tp(args)
    choice = options.model_choice(args)
    device = options.device(args)
    modes, notes = options.graph_modes(args.graphs, device)
    try:
        model = _model(args, choice, device)
    except (ValueError, ImportError) as e:  # ImportError: hf models without the hf extra
        print(f"cgrt demo: {e}", file=sys.stderr)
        return 2
    try:
        with options.threads(options.thread_count(args, device, choice.tiny)):
            requests = make_requests(model.config, args.sequences, args.max_new, args.seed)
            runs = [serve(model, requests, g, args) for g in modes]
        for r in runs:
            r.pop("finished_seqs")
    except ValueError as e:  # a bad argument (InputError is a ValueError)
        print(f"cgrt demo: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, CgrtError) as e:  # the runner's own checks, capture, device rows
        print(f"cgrt demo: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    cfg = model.config
    report = {"config": {"model": args.model, "size": choice.size, "dtype": str(cfg.dtype).replace("torch.", ""),
                         "hidden": cfg.hidden, "layers": cfg.layers, "device": str(device),
                         "sequences": args.sequences, "slots": args.slots or cfg.max_seqs, "lanes": args.lanes,
                         "k": args.k, "accept_prob": args.accept_prob, "max_new": args.max_new,
                         "chunk": args.chunk, "rounds": args.rounds, "seed": args.seed,
                         "drafter": args.drafter},
              "notes": notes, "runs": runs, "ok": all(r["check"]["ok"] for r in runs)}
    return publish(report, args.json)


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
