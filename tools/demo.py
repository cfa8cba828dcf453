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
import json
import random
import sys

import torch

from ..errors import CgrtError, InputError, expected
from ..models import Decoder, ToyConfig, ToyDecoder
from ..models.hf import SIZES, build, parse_model
from ..device_drafter import DeviceDrafter
from ..runner import PHASES, ReferenceDrafter, Request, RunReport, SpecRunner, ToyDrafter
from ..testing.checks import Tolerance

# Hidden rows against the unbatched reference: fp32 differs by reduction order only;
# bf16 by a few ulps per layer (the toy's own GPU test allows 0.25 on the bench size).
_ROW_TOL = {torch.float32: 1e-3, torch.float16: 0.25, torch.bfloat16: 0.25}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sequences", type=int, default=12, help="prompts to serve (default 12)")
    p.add_argument("--k", type=int, default=4, help="draft tokens per sequence and step (default 4)")
    p.add_argument("--accept-prob", type=float, default=0.7, help="chance each draft token is right (default 0.7)")
    p.add_argument("--max-new", type=int, default=32,
                   help="most tokens per sequence; each draws its own limit in [max_new/2, max_new] (default 32)")
    p.add_argument("--rounds", type=int, default=0, help="stop after this many steps (default 0: serve everything)")
    p.add_argument("--graphs", choices=("on", "off", "both"), default="both",
                   help="CUDA graphs on, off or both (default both; a CPU runs off only)")
    p.add_argument("--device", default=None, help="cuda or cpu (default cuda if available)")
    p.add_argument("--bench-size", choices=("tiny", "bench"), default="tiny",
                   help="toy model size: tiny (fp32, 64 hidden) or bench (bf16, 1024 hidden, 6 layers)")
    p.add_argument("--model", default="toy",
                   help="toy (default) | hf:llama | hf:qwen2 | hf:qwen3 | hf:mistral (transformers, random weights; "
                        "drafts follow the model's own greedy decoding, right with --accept-prob)")
    p.add_argument("--size", default="tiny", help="hf models: tiny (default, fp32, CPU) | 1b (Llama-3.2-1B shape, bf16)")
    p.add_argument("--drafter", choices=("host", "gpu"), default="host",
                   help="host: numpy drafter on the host (default); gpu: a small draft model in its own GraphRuntime "
                        "on its own stream, fed the committed hidden rows (toy only; graphs as --graphs)")
    p.add_argument("--slots", type=int, default=None, help="sequences served at once (default: the model's max_seqs)")
    p.add_argument("--lanes", type=int, default=2, help="groups of sequences that take turns on the GPU (default 2)")
    p.add_argument("--chunk", type=int, default=128,
                   help="prompt rows per step and lane; wider than the dynamic limit (96) gets sliced (default 128)")
    p.add_argument("--seed", type=int, default=0, help="toy weights, prompts, limits and drafter RNG (default 0)")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (launch with torchrun --nproc-per-node N; default 1)")
    p.add_argument("--profile", metavar="FILE", default=None,
                   help="cProfile the timed run(s) only; the top functions by own time go to FILE "
                        "(one section per run)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


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

    from .console import make_console

    out, c = make_console(), report["config"]
    out.print(f"cgrt demo: {c.get('model', 'toy')} {c['size']} ({c['dtype']}, {c['hidden']} hidden, {c['layers']} layers) on "
              f"{c['device']}; {c['sequences']} sequences ({c['slots']} at once, {c['lanes']} lanes), k={c['k']}, "
              f"p={c['accept_prob']}, max-new {c['max_new']}, chunk {c['chunk']}, drafter {c.get('drafter', 'host')}",
              markup=False)
    for note in report["notes"]:
        out.print(f"note: {note}", markup=False)
    t = Table()
    for h in ("graphs", "steps", "tokens", "seconds", "tokens/s", "steps/s", "accepted", "GPU busy", "capture s",
              "check"):
        t.add_column(h, justify="left" if h in ("graphs", "check") else "right")
    for r in report["runs"]:
        rate = r["accepted"] / r["proposed"] if r["proposed"] else 0.0
        busy = r.get("gpu_busy")
        t.add_row("on" if r["graphs"] else "off", str(r["steps"]), str(r["tokens"]), f"{r['seconds']:.3f}",
                  f"{r['tokens_per_s']:.1f}", f"{r['steps_per_s']:.1f}", f"{rate:.2f}",
                  "n/a" if busy is None else f"{100 * busy:.0f}%", f"{r['capture_s']:.2f}",
                  "ok" if r["check"]["ok"] else "FAIL")
    out.print(t)
    out.print(_phase_table(report["runs"]))
    for r in report["runs"]:
        hist, top = r["accept_hist"], max(r["accept_hist"] + [1])
        lines = [f"graphs {'on' if r['graphs'] else 'off'}: accepted drafts per verify group (of up to k={c['k']})"]
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
    """Host µs per step per phase (runner.PHASES), one row per run, and their sum."""
    from rich.table import Table

    t = Table(title="host time per step, µs, by phase (GPU busy: steps' device time / wall; n/a on a CPU)",
              title_justify="left")
    for h in ("graphs", *PHASES, "sum"):
        t.add_column(h, justify="left" if h == "graphs" else "right")
    for r in runs:
        ph = r.get("host_phases_us_per_step") or {}
        t.add_row("on" if r["graphs"] else "off", *(f"{ph.get(n, 0.0):.1f}" for n in PHASES),
                  f"{sum(ph.values()):.1f}")
    return t


def run(args) -> int:
    if getattr(args, "tp", 1) > 1 and getattr(args, "drafter", "host") != "host":
        print("cgrt demo: --drafter: expected host with --tp (the device drafter runs on one GPU), got gpu",
              file=sys.stderr)
        return 2
    if getattr(args, "tp", 1) > 1:  # one process per rank, under torchrun
        from .demo_tp import run_tp
        return run_tp(args)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("cgrt demo: --device: expected a device this machine has, got cuda (no CUDA here)", file=sys.stderr)
        return 2
    notes, modes = [], {"on": [True], "off": [False], "both": [True, False]}[args.graphs]
    if device.type != "cuda":
        if args.graphs == "on":
            print("cgrt demo: --graphs on: expected a CUDA device (CUDA graphs need a GPU), got cpu",
                  file=sys.stderr)
            return 2
        if args.graphs == "both":
            notes.append("graphs on skipped: CUDA graphs need a GPU; graphs off only")
        modes = [False]
    try:
        family = parse_model(args.model)
        if family is None:
            if args.size != "tiny":
                raise InputError(expected("--size", "tiny for the toy (its GPU config is --bench-size bench)",
                                          repr(args.size)))
            size = ToyConfig.bench if args.bench_size == "bench" else ToyConfig.tiny
            model = ToyDecoder(size(seed=args.seed), device)
        else:
            if args.size not in SIZES:
                raise InputError(expected("--size", " | ".join(SIZES), repr(args.size)))
            if args.bench_size != "tiny":
                raise InputError(expected("--bench-size", "the toy only (hf models take --size)", args.model))
            model = build(family, args.size, device=device, seed=args.seed)
    except (ValueError, ImportError) as e:  # ImportError: hf models without the hf extra
        print(f"cgrt demo: {e}", file=sys.stderr)
        return 2
    try:
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
    report = {"config": {"model": args.model, "size": args.bench_size if family is None else args.size, "dtype": str(cfg.dtype).replace("torch.", ""),
                         "hidden": cfg.hidden, "layers": cfg.layers, "device": str(device),
                         "sequences": args.sequences, "slots": args.slots or cfg.max_seqs, "lanes": args.lanes,
                         "k": args.k, "accept_prob": args.accept_prob, "max_new": args.max_new,
                         "chunk": args.chunk, "rounds": args.rounds, "seed": args.seed,
                         "drafter": args.drafter},
              "notes": notes, "runs": runs, "ok": all(r["check"]["ok"] for r in runs)}
    return publish(report, args.json)


def publish(report: dict, as_json: bool) -> int:
    """Print the report (a table, or JSON) and return the exit code: 0 when every run's
    check passed."""
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0 if report["ok"] else 1
