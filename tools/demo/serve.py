"""One run of ``cgrt demo``: the requests, the drafter, the served run and its check.

``serve`` captures, warms up and serves the requests timed through a ``SpecRunner``; its
report (a dict) carries ``check``: every generated token against greedy decoding of the
same prompt and every committed hidden row against the reference's row at that position.
``bench --model hf:...`` serves its spec section through here too.
"""
from __future__ import annotations

import random

import torch

from cudagraph_rt.errors import InputError, expected
from cudagraph_rt.models import Decoder, ToyConfig, ToyDecoder
from cudagraph_rt.speculative.device_drafter import DeviceDrafter
from cudagraph_rt.tools import options
from cudagraph_rt.speculative.runner import ReferenceDrafter, Request, RunReport, SpecRunner, ToyDrafter
from cudagraph_rt.sweep.checks import Tolerance
from cudagraph_rt.sweep.graph_modes import mode_name

# Hidden rows against the unbatched reference: fp32 differs by reduction order only;
# bf16 by a few ulps per layer (the toy's own GPU test allows 0.25 on the bench size).
_ROW_TOL = {torch.float32: 1e-3, torch.float16: 0.25, torch.bfloat16: 0.25}


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


def served_sequences(runner: SpecRunner) -> list:
    """The runner's finished sequences and those still decoding (a run cut by --rounds)."""
    return runner.finished + [s for lane in runner.lanes for s in lane.seqs if s.decoding]


def check(model: Decoder, seqs, sampled: bool = False) -> dict:
    """Generated tokens against greedy decoding and host rows against the reference.

    ``reference(prompt + generated)`` gives the greedy next token and the hidden row at
    every position in one call: the output equals greedy decoding iff each generated
    token is the greedy token after everything before it.

    transformers models (random weights, near-ties): a generated token that differs where
    the reference's top-1/top-2 margin is not clear (``HFDecoder.clear_positions``) is
    counted in ``near_ties``, not as a mismatch; host rows are compared normwise
    (``||row - ref|| <= tol * ||ref||``, the sweep's rule) since they are normed rows.

    ``seqs``: the served sequences (``uid``, ``prompt``, ``tokens``, ``generated`` and
    ``rows``, one hidden row per generated token: the host runner's and the device loop's).
    ``sampled``: the requests sample (temperature > 0), so their tokens are not greedy
    decoding's: only the host rows are checked (against the reference of the tokens served).
    """
    bad, worst, rows, ties = [], 0.0, 0, 0
    hf = hasattr(model, "clear_positions")
    tol = Tolerance.for_dtype(model.config.dtype, model.device) if hf else None
    for seq in seqs:
        p0, gen = len(seq.prompt) - 1, seq.generated
        if hf:
            logits, hidden = model.reference_logits(seq.tokens)
            greedy, clear = logits.argmax(-1).cpu(), model.clear_positions(logits).cpu()
        else:
            greedy, hidden = model.reference(seq.tokens)
            clear = torch.ones(greedy.shape[0], dtype=torch.bool)
        differs = greedy[p0:p0 + len(gen)].cpu() != torch.tensor(gen, dtype=torch.int64)
        if sampled:
            differs = torch.zeros_like(differs)
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
    return {"ok": not bad and worst <= limit, "token_mismatches": sorted(set(bad)), "near_ties": ties, "sampled": sampled,
            "tokens_checked": not sampled, "rows_checked": rows, "rows_max_err": worst, "rows_tol": limit,
            "rows_rule": f"normwise, fraction of {tol}" if hf else "max |err|"}


def make_drafter(model: Decoder, accept_prob: float, seed: int, requests: list[Request], kind: str = "coin", k: int = 4,
                 graphs: bool = False, lanes: int = 2):
    """The drafter ``--drafter kind`` names (``tools/options.py``): prompt lookup, a trained
    head or draft model (built here, graphs as the target's; UsageError naming --drafter
    when it does not fit the model), or a coin (a test double): the toy's rule-based one on
    the host or (``gpu``) in its own GraphRuntime, or for other models one that follows
    the model's own greedy decoding (planned here, before timing)."""
    from cudagraph_rt.speculative.ngram import NgramDrafter
    from ..options import UsageError

    what, _, path = kind.partition(":")
    if what == "ngram":
        return NgramDrafter()
    if what in ("head", "model"):
        try:
            if what == "head":
                from cudagraph_rt.speculative.head_drafter import HeadDrafter
                d = HeadDrafter(model, path, k=max(k, 1), graphs=graphs)
            else:
                from cudagraph_rt.speculative.draft_model import DraftModelDrafter
                d = DraftModelDrafter.from_path(model, path, k=max(k, 1), graphs=graphs)
        except InputError as e:
            raise UsageError(expected("--drafter", f"a {what} for this model", f"{kind} ({e})")) from None
        d.capture()
        return d
    if kind == "gpu":
        if not isinstance(model, ToyDecoder):
            raise InputError(expected("--drafter", "coin for transformers models (gpu drafts the toy)", kind))
        d = DeviceDrafter(model, accept_prob, seed, k=max(k, 1), graphs=graphs, depth=max(3, lanes + 1))
        d.capture()
        return d
    if isinstance(model, ToyDecoder):
        return ToyDrafter(model, accept_prob, seed)
    drafter = ReferenceDrafter(model, accept_prob, seed)
    drafter.prepare(requests)
    return drafter


def drafter_label(kind: str, accept_prob: float) -> str:
    """How reports name the drafter (a coin says it is a test double)."""
    return f"{kind} (a test double: each draft right with probability {accept_prob})" if options.is_coin(kind) else kind


def timing(rep: RunReport) -> dict:
    """The run's time split (JSON): host µs per step per phase (runner.PHASES, summing to
    the wall time), the same in seconds, and on CUDA the steps' device seconds and the GPU
    busy fraction (device / wall; None on a CPU)."""
    return {"host_phases_us_per_step": rep.phase_us_per_step(), "host_phases_s": dict(rep.phases),
            "device_seconds": rep.device_seconds, "gpu_busy": rep.gpu_busy}


def warm_requests(model: Decoder, requests: list[Request], sampling) -> list[Request]:
    """The warm-up before a timed run: the first requests' own prompts (as many as the
    model's sequence slots, whatever --slots: the timed requests' uids, which key the coin
    drafters, then do not depend on it), a few tokens each, so the timed run meets no
    first-time cost (the dynamic path's kernels, cuBLAS plans)."""
    return [Request(r.prompt, min(4, r.max_new), sampling) for r in requests[:model.config.max_seqs]]


def serve(model: Decoder, requests: list[Request], graphs: bool, args, plans=None) -> dict:
    """Capture, warm up on the first wave's prompts, then serve ``requests`` timed. ``plans``:
    served sequences whose tokens the reference drafter follows (``prepare_from``)."""
    model.reset_cache()
    # every request's settings; request i's seed derives from --seed and i (not from its uid
    # in the runner, which the warm-up's requests would shift)
    sampling = options.sampling_params(args)
    requests = [Request(r.prompt, r.max_new, sampling.seeded(args.seed, i)) for i, r in enumerate(requests)]
    warm = warm_requests(model, requests, sampling)
    kind = getattr(args, "drafter", "coin")
    drafter = make_drafter(model, args.accept_prob, args.seed, (requests + warm if args.k else []) if plans is None
                           else [], kind, args.k, graphs, args.lanes)
    if plans is not None and isinstance(drafter, ReferenceDrafter):
        drafter.prepare_from(plans)
    runner = SpecRunner(model, drafter, k=args.k, slots=args.slots,
                        lanes=args.lanes, chunk=args.chunk, graphs=graphs, record_rows=True, seed=args.seed)
    cap = runner.rt.capture()
    runner.submit(warm)
    runner.run()
    runner.reset_stats()
    runner.rt.reset_stats()
    if isinstance(drafter, ReferenceDrafter):  # the warm-up's re-plans are not the timed run's
        drafter.replans, drafter.replan_seconds = 0, 0.0
    uids = runner.submit(requests)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    rep: RunReport = profiled(lambda: runner.run(max_steps=args.rounds or None), getattr(args, "profile", None),
                               f"{mode_name(graphs)}, drafter {kind}")
    st = runner.rt.stats()
    if hasattr(drafter, "close"):
        drafter.close()
    served = {s.uid: s.generated for s in runner.finished + [s for lane in runner.lanes for s in lane.seqs]}
    return {
        "graphs": graphs, "drafter": kind, "steps": rep.steps, "tokens": rep.tokens, "seconds": rep.seconds,
        "tokens_per_s": rep.tokens_per_s, "steps_per_s": rep.steps_per_s, "capture_s": cap.seconds,
        "finished": len(runner.finished), "accept_hist": list(rep.accept_hist), "proposed": rep.proposed,
        "accepted": rep.accepted, "rows_consumed": rep.rows, **timing(rep),
        "drafter_label": drafter_label(kind, args.accept_prob), "mean_accepted": rep.mean_accepted,
        "acceptance_by_position": list(rep.acceptance_by_position), "proposed_at": list(rep.proposed_at),
        "widths": {"graph_replays": dict(sorted(st.graph_replays.items())),
                   "eager_calls": dict(sorted(st.eager_calls.items())),
                   "dynamic_calls": dict(sorted(st.dynamic_calls.items())),
                   "padding_rows": st.padding_rows, "slices": st.slices},
        "check": check(model, served_sequences(runner), sampled=not sampling.greedy),
        "generated": [served.get(u, []) for u in uids],  # one list per request, in submission order
        "replans": getattr(drafter, "replans", 0), "replan_seconds": getattr(drafter, "replan_seconds", 0.0),
        "finished_seqs": runner.finished,
    }


def profiled(fn, path: str | None, title: str):
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
