"""``cgrt demo --tp N``: the speculative-decoding demo on the tensor-parallel toy.

Rank 0 is the driver: it runs the host runner (cudagraph_rt.speculative.runner.SpecRunner) over a
DistributedRuntime whose inputs are broadcast (``inputs_from=0``) and whose host rows come
from rank 0 only; the other ranks ``follow()``. Every generated token is checked on rank 0
against greedy decoding of the ONE-device ToyDecoder with the same weights, and every
committed hidden row against its hidden rows (the same check as ``cgrt demo``).
"""
from __future__ import annotations

import sys

import torch

from cudagraph_rt.distributed import DistributedRuntime
from cudagraph_rt.errors import CgrtError, expected
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.models.tp import TPToyDecoder
from cudagraph_rt.speculative.runner import Request, RunReport, SpecRunner, ToyDrafter
from .. import options, tp_launch
from .report import publish
from .serve import check, make_requests, served_sequences, timing


def _runtime(model: TPToyDecoder, runner: SpecRunner, graphs: bool) -> DistributedRuntime:
    """The runner's runtime rebuilt over the ranks: same step, inputs and host rows."""
    hr, specs = runner.rt.host_rows_config, dict(runner.rt.input_specs)  # the sampling inputs included
    runner.rt.close()  # never captured: only its arena and staging to free
    return DistributedRuntime(model.verify_step, specs, graphs=graphs, device=model.device,
                              host_rows=hr, inputs_from=0, rows_rank=0)


def serve_tp(model: TPToyDecoder, ref: ToyDecoder, requests: list[Request], graphs: bool, args) -> dict | None:
    """One graph mode on every rank: capture, then rank 0 drives (warm-up on two short
    requests, then ``requests`` timed) while the others follow. Returns rank 0's report
    (None on the other ranks)."""
    model.reset_cache()
    runner = SpecRunner(model, ToyDrafter(ref, args.accept_prob, args.seed), k=args.k, slots=args.slots,
                        lanes=args.lanes, chunk=args.chunk, graphs=graphs, record_rows=True, seed=args.seed)
    rt = runner.rt = _runtime(model, runner, graphs)
    sampling = options.sampling_params(args)  # every request's (replicated: every rank draws the same)
    requests = [Request(r.prompt, r.max_new, sampling) for r in requests]
    try:
        cap = rt.capture()
        captures = tp_launch.gather(cap.seconds)
        if rt.rank != 0:
            rt.follow()
            return None
        try:
            runner.submit([Request(r.prompt, min(4, r.max_new), sampling) for r in requests[:2]])
            runner.run()
            runner.reset_stats()
            rt.reset_stats()
            runner.submit(requests)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            rep: RunReport = runner.run(max_steps=args.rounds or None)
        except BaseException as e:
            rt.stop_followers(f"{type(e).__name__}: {e}")
            raise
        rt.stop_followers()
        st = rt.stats()
        return {
            "graphs": graphs, "steps": rep.steps, "tokens": rep.tokens, "seconds": rep.seconds,
            "tokens_per_s": rep.tokens_per_s, "steps_per_s": rep.steps_per_s, "capture_s": max(captures),
            "capture_s_per_rank": captures, "finished": len(runner.finished), "accept_hist": list(rep.accept_hist),
            "proposed": rep.proposed, "accepted": rep.accepted, "rows_consumed": rep.rows, **timing(rep),
            "widths": {"graph_replays": dict(sorted(st.graph_replays.items())),
                       "eager_calls": dict(sorted(st.eager_calls.items())),
                       "dynamic_calls": dict(sorted(st.dynamic_calls.items())),
                       "padding_rows": st.padding_rows, "slices": st.slices},
            "check": check(ref, served_sequences(runner)),
        }
    finally:
        rt.close()


def run_tp(args) -> int:
    """``cgrt demo --tp N`` on every rank of a torchrun launch; exit code agreed by all."""
    choice = options.model_choice(args)
    if choice.kind != "toy":
        raise options.UsageError(expected("--model", "toy with --tp (the tensor-parallel toy)", repr(args.model)))
    options.graph_modes(args.graphs, options.device(args))  # refused before the ranks start, as without --tp

    def body(device: torch.device) -> int:
        modes, notes = options.graph_modes(args.graphs, device)
        size = ToyConfig.bench if choice.size == "bench" else ToyConfig.tiny
        cfg = size(seed=args.seed)
        try:
            model = TPToyDecoder(cfg, device, table_from=0)  # rank 0 drives: its block table every step
            ref = ToyDecoder(cfg, device)  # the one-device toy, same weights: the check's reference
            requests = make_requests(cfg, args.sequences, args.max_new, args.seed)
            runs = [serve_tp(model, ref, requests, g, args) for g in modes]
        except ValueError as e:  # a bad argument (InputError is a ValueError)
            print(f"cgrt demo: {e}", file=sys.stderr)
            return 2
        except (RuntimeError, CgrtError) as e:
            print(f"cgrt demo (rank {tp_launch.rank()}): failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        if tp_launch.rank() != 0:
            return 0
        notes.append(f"tensor-parallel over {args.tp} ranks ({'NCCL' if device.type == 'cuda' else 'gloo'}); "
                     f"tokens and rows checked against the one-device toy with the same weights")
        report = {"config": {"size": choice.size, "dtype": str(cfg.dtype).replace("torch.", ""),
                             "hidden": cfg.hidden, "layers": cfg.layers, "device": f"{device} x {args.tp} ranks",
                             "tp": args.tp, "sequences": args.sequences, "slots": args.slots or cfg.max_seqs,
                             "lanes": args.lanes, "k": args.k, "accept_prob": args.accept_prob,
                             "max_new": args.max_new, "chunk": args.chunk, "rounds": args.rounds, "seed": args.seed},
                  "notes": notes, "runs": runs, "ok": all(r["check"]["ok"] for r in runs)}
        return publish(report, args.json)

    return tp_launch.run_ranks(args.tp, args.device, "demo", body)
