"""One run of ``cgrt demo --dispatch device``: the requests served by the device loop
(``cudagraph_rt.dispatch.DeviceLoop``), timed, and checked as ``serve.check`` checks the
host runner's (greedy tokens against the reference, every committed hidden row against
the reference's row). ``bench --sections dispatch`` serves through here too.

Requests sample as ``serve`` samples them (``--temperature`` etc., request i seeded from
``--seed`` and i). The loop's drafter is a coin (a test double) drawn on the device: the toy's rule
(``CoinRounds``) or, for other models, the model's own greedy decoding (``PlanRounds``)
taken from an untimed run of the same loop (which is also the warm-up).
"""
from __future__ import annotations

import time

import torch

from cudagraph_rt.dispatch.loop import DeviceLoop
from cudagraph_rt.models import Decoder, ToyDecoder
from cudagraph_rt.speculative.loop_drafter import CoinRounds, PlanRounds
from cudagraph_rt.speculative.runner import Request
from cudagraph_rt.sweep.graph_modes import mode_name

from .. import options
from . import serve


def loop_drafter(model: Decoder, accept_prob: float, seed: int):
    """The device loop's coin for ``model`` (plans, where it needs them, come later)."""
    if isinstance(model, ToyDecoder):
        return CoinRounds(model, accept_prob, seed)
    return PlanRounds(model, accept_prob, seed)


def acceptance(seqs, k: int) -> dict:
    """Per round of every sequence: drafts proposed (``min(k, left - 1)`` as the plan lays
    them out) and accepted (rows committed - 1); the histogram, totals, the mean and the
    acceptance of draft position j among the rounds that proposed it."""
    hist, by, at, proposed, accepted = [0] * (k + 1), [0] * k, [0] * k, 0, 0
    for q in seqs:
        left = q.max_new - 1  # tokens still to generate after the prefill's first
        for c in q.accepts:
            n = max(0, min(k, left - 1))
            hist[c - 1] += 1
            proposed, accepted = proposed + n, accepted + c - 1
            for j in range(n):
                at[j] += 1
                by[j] += c - 1 > j
            left -= c
    rounds = sum(hist)
    return {"accept_hist": hist, "proposed": proposed, "accepted": accepted,
            "mean_accepted": accepted / rounds if rounds else 0.0,
            "acceptance_by_position": [b / a if a else 0.0 for b, a in zip(by, at)], "proposed_at": at}


def serve_loop(model: Decoder, requests: list[Request], graphs, args, *, conditional: bool = True) -> dict:
    """Serve ``requests`` through a DeviceLoop (``graphs``: True or "emulate";
    ``conditional=False``: the host-driven rounds even where CUDA has conditional nodes),
    after an untimed run; the report ``serve.serve`` gives, with ``loop``: launches, rounds
    and which rounds ran (``conditional`` or ``host``)."""
    model.reset_cache()
    # request i's settings and seed as serve.serve gives them (the same seed, the same draws)
    sampling = options.sampling_params(args)
    requests = [Request(r.prompt, r.max_new, sampling.seeded(args.seed, i)) for i, r in enumerate(requests)]
    drafter = loop_drafter(model, args.accept_prob, args.seed)
    t0 = time.perf_counter()
    loop = DeviceLoop(model, drafter, k=args.k, graphs=graphs, rounds=args.launch_rounds, record_rows=True,
                      conditional=conditional, slots=args.slots, sampling=not sampling.greedy, seed=args.seed)
    capture_s = time.perf_counter() - t0
    # Untimed first: the warm-up serve.serve runs (so the timed requests get the uids, hence
    # the coin's drafts, of the host runner's timed run), or for PlanRounds every request
    # once (its plans: this loop's greedy tokens, rounded as the timed run's verify rounds them)
    plans = isinstance(drafter, PlanRounds)
    loop.submit(requests if plans else serve.warm_requests(model, requests, sampling))
    loop.run()
    if plans:
        drafter.prepare_from(loop.finished)
    done, launched, before, prefilled = len(loop.finished), len(loop.launches), loop.runner.launches, loop.prefills
    prefill_dev = loop.prefill_device_seconds
    loop.rt.reset_stats()
    uids = loop.submit(requests)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    serve.profiled(loop.run, getattr(args, "profile", None), f"{mode_name(graphs)}, dispatch device")
    sync()
    seconds = time.perf_counter() - t0
    seqs = loop.finished[done:]
    reports = loop.launches[launched:]
    tokens = sum(len(q.generated) for q in seqs)
    rounds = sum(r.rounds for r in reports)
    st = loop.rt.stats()
    slices = sum(st.graph_replays.values()) + sum(st.eager_calls.values()) + sum(st.dynamic_calls.values())
    launches = loop.runner.launches - before + slices  # the host's launches: the loop's, the prompts' slices
    dev = [r.device_seconds for r in reports]
    if dev and None not in dev and loop.prefill_device_seconds is not None:
        device_seconds = sum(dev) + loop.prefill_device_seconds - (prefill_dev or 0.0)
    else:
        device_seconds = None
    served = {q.uid: q.generated for q in seqs}
    return {
        "graphs": graphs, "dispatch": "device", "drafter": "coin", "steps": rounds, "tokens": tokens,
        "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
        "steps_per_s": rounds / seconds if seconds else 0.0, "capture_s": capture_s, "finished": len(seqs),
        **acceptance(seqs, args.k), "rows_consumed": sum(len(q.rows) for q in seqs),
        "host_phases_us_per_step": {}, "host_phases_s": {}, "device_seconds": device_seconds,
        "gpu_busy": device_seconds / seconds if device_seconds is not None and seconds else None,
        "drafter_label": serve.drafter_label("coin", args.accept_prob),
        # the prompts' prefill steps go through the runtime's step(); the rounds replay its
        # width graphs from the loop's plan
        "widths": {"graph_replays": dict(sorted(st.graph_replays.items())),
                   "eager_calls": dict(sorted(st.eager_calls.items())),
                   "dynamic_calls": dict(sorted(st.dynamic_calls.items())),
                   "padding_rows": st.padding_rows, "slices": st.slices},
        "loop": {"rounds_ran": loop.runner.name, "note": loop.note, "launches": launches,
                 "prefill_steps": loop.prefills - prefilled, "prefill_slices": slices, "loop_launches": len(reports),
                 "rounds": rounds, "launches_per_64_tokens": 64 * launches / tokens if tokens else None,
                 "stops": [r.stop.name for r in reports]},
        "check": serve.check(model, seqs, sampled=not sampling.greedy),
        "generated": [served.get(u, []) for u in uids],
        "replans": 0, "replan_seconds": 0.0, "finished_seqs": seqs,
    }
