"""`cgrt demo`: speculative decoding on the toy decoder (or ``--model hf:<family>``, a
transformers model with random weights) through cudagraph_rt.speculative.runner.

Serves ``--sequences`` random prompts (at most ``--slots`` at once, so sequences retire
and join), with graphs on and/or off, and reports tokens/s, steps/s, the acceptance
histogram and the widths that ran. Every generated token is checked against plain greedy
decoding of the same prompt (the eager reference, teacher-forced on the output) and
every committed hidden row the host received against the reference's hidden row at that
position; any mismatch exits 1.

The command's rooms: ``arguments`` (its options), ``serve`` (one served run and its
check), ``report`` (tables, JSON, exit code), ``tp`` (``--tp N`` under torchrun; it uses
``serve`` and ``report``, never this module). torch is imported when it runs, not when
its arguments are parsed.
"""
from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING

from cudagraph_rt.errors import CgrtError, expected
from cudagraph_rt.sweep.graph_modes import mode_name

from .. import options
from ..progress import Activity
from .arguments import CHUNK, LANES, add_arguments

if TYPE_CHECKING:
    import torch

__all__ = ["add_arguments", "run"]


def _model(args, choice: options.ModelChoice, device: "torch.device"):
    """The model ``--model``/``--size`` name, built on ``device``."""
    from cudagraph_rt.models import ToyConfig, ToyDecoder
    from cudagraph_rt.models.hf import build

    if choice.kind == "toy":
        size = ToyConfig.bench if choice.size == "bench" else ToyConfig.tiny
        return ToyDecoder(size(seed=args.seed), device)
    if choice.kind == "path":
        return build(choice.family, "tiny", device=device, seed=args.seed, path=choice.path)
    return build(choice.family, choice.size, device=device, seed=args.seed)


def _check_together(args, choice: options.ModelChoice) -> None:
    """Flags that each parse but conflict: a usage error before anything is built."""
    if getattr(args, "tp", 1) > 1 and args.drafter not in ("coin", "host"):
        raise options.UsageError(expected("--drafter", "coin with --tp (the other drafters run on one GPU)",
                                          args.drafter))
    if getattr(args, "dispatch", "host") == "device" and args.drafter != "coin":
        raise options.UsageError(expected("--drafter", f"with --dispatch device: {options.DISPATCH_DEVICE_WANTS}",
                                          args.drafter))
    options.check_dispatch(args, {"--tp": getattr(args, "tp", 1) > 1, "--rounds": args.rounds > 0,
                                  "--lanes": args.lanes != LANES, "--chunk": args.chunk != CHUNK},
                           "the host runner's options")
    if args.drafter == "gpu" and choice.kind != "toy":
        raise options.UsageError(expected("--drafter", "coin for transformers models (gpu drafts the toy)", "gpu"))


def _loop_modes(modes: list, notes: list[str]) -> tuple[list, list[str]]:
    """The graph modes the device loop runs: it replays captured widths, so graphs off
    runs its rounds emulated (``graphs="emulate"``, the same code, eagerly)."""
    if False not in modes:
        return modes, notes
    note = "--dispatch device with graphs off: the loop's rounds run emulated (graphs='emulate')"
    return list(dict.fromkeys("emulate" if g is False else g for g in modes)), notes + [note]


def _serve(model, requests, graphs, args) -> dict:
    from . import serve, serve_loop

    if args.dispatch == "device":
        return serve_loop.serve_loop(model, requests, graphs, args)
    return serve.serve(model, requests, graphs, args)


def _sampling_text(args) -> str:
    sp = options.sampling_params(args)
    if sp.greedy:
        return "greedy"
    return f"temperature {sp.temperature}, top-k {sp.top_k}, top-p {sp.top_p}, min-p {sp.min_p}, seed {args.seed}"


def run(args) -> int:
    from . import report, serve

    choice = options.model_choice(args)
    _check_together(args, choice)
    if getattr(args, "tp", 1) > 1:  # one process per rank, under torchrun
        from .tp import run_tp
        return run_tp(args)
    device = options.device(args)
    modes, notes = options.graph_modes(args.graphs, device)
    if args.dispatch == "device":
        modes, notes = _loop_modes(modes, notes)
    with options.threads(options.thread_count(args, device, choice.tiny)), Activity.of("cgrt demo", args) as activity:
        # the toy builds in a moment; a transformers model may take minutes
        building = activity.phase(f"building {choice.label} on {device.type}") if choice.kind != "toy" else None
        try:
            with building or contextlib.nullcontext():
                model = _model(args, choice, device)
        except (ValueError, ImportError) as e:  # ImportError: hf models without the hf extra
            print(f"cgrt demo: {e}", file=sys.stderr)
            return 2
        try:
            requests = serve.make_requests(model.config, args.sequences, args.max_new, args.seed)
            runs = []
            for g in modes:
                with activity.phase(f"serving {args.sequences} sequences, {mode_name(g)}"):
                    runs.append(_serve(model, requests, g, args))
            for r in runs:
                r.pop("finished_seqs")
        except ValueError as e:  # a bad argument (InputError is a ValueError)
            print(f"cgrt demo: {e}", file=sys.stderr)
            return 2
        except (RuntimeError, CgrtError) as e:  # the runner's own checks, capture, device rows
            print(f"cgrt demo: failed: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    cfg, device_loop = model.config, args.dispatch == "device"
    doc = {"config": {"model": args.model, "size": choice.size, "dtype": str(cfg.dtype).replace("torch.", ""),
                      "hidden": cfg.hidden, "layers": cfg.layers, "device": str(device),
                      "sequences": args.sequences, "slots": args.slots or cfg.max_seqs,
                      "lanes": None if device_loop else args.lanes, "k": args.k, "accept_prob": args.accept_prob,
                      "max_new": args.max_new, "chunk": None if device_loop else args.chunk, "rounds": args.rounds,
                      "launch_rounds": args.launch_rounds, "seed": args.seed,
                      "drafter": args.drafter, "dispatch": args.dispatch,
                      "drafter_label": serve.drafter_label(args.drafter, args.accept_prob),
                      "sampling": _sampling_text(args)},
              "notes": notes, "runs": runs, "ok": all(r["check"]["ok"] for r in runs),
              # every request's generated tokens, in submission order (the first run's; the
              # same seed serves the same tokens in every graph mode: tokens_agree says so)
              "tokens": runs[0]["generated"] if runs else [],
              "tokens_agree": all(r["generated"] == runs[0]["generated"] for r in runs)}
    return report.publish(doc, args.json)
