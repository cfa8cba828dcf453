"""``cgrt sweep``: the width-sweep harness on the embedded toy decoder or, with ``--model
hf:<family>``, a transformers causal LM with random weights (``models/hf.py``).

Every step width 1..max+1 plus extras, R times each, shuffled, through the runtime with
graphs on and off (off only where there is no CUDA, and it says so), each step checked
against the eager reference. A progress display while it runs (tools/progress.py), then a
per-width table (or ``--json``), an optional ``--plot``; exit 1 on any mismatch, 2 on a bad
argument. torch is imported when it runs, not when its arguments are parsed.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

from cudagraph_rt.errors import CgrtError, InputError, expected
from cudagraph_rt.sweep.plans import SweepOptions

from .. import options
from ..console import make_console
from ..progress import Activity

if TYPE_CHECKING:
    from cudagraph_rt.sweep import HFAdapter, ToyAdapter

_DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SweepOptions()
    options.add_seed(p, None, "the step plan")
    p.add_argument("--only-step", type=options.int_at_least(0), metavar="K",
                   help="replay steps before K unchecked, check step K only")
    options.add_graphs(p)
    options.add_device(p)
    options.add_model(p)
    p.add_argument("--dtype", type=options.one_of(*_DTYPES), metavar="DT",
                   help="override the config dtype: " + " | ".join(_DTYPES))
    options.add_widths(p, "captured width set (default 1,2,4,..,64)")
    p.add_argument("--attention", type=options.one_of("cells", "eager-piece", "varlen"), default="cells", metavar="A",
                   help="the model's attention: cells (captured with the step; default) | eager-piece (the same, "
                        "marked cudagraph_rt.eager) | varlen (hf models: torch's varlen_attn, per-step host ints)")
    options.add_compile(p, "run", " (graphs on and off both run the compiled step; the reference stays eager)")
    p.add_argument("--pieces", action="store_true",
                   help="capture every width in pieces, split at the calls marked eager (GraphRuntime(pieces=True))")
    p.add_argument("--repeats", type=options.int_at_least(1), default=d.repeats, metavar="R",
                   help=f"steps per width (default {d.repeats})")
    p.add_argument("--extras", type=_extras, default=d.extras, metavar="T,T,..",
                   help=f"widths past max+1 to sweep too (default {','.join(map(str, d.extras))}; 'none' for none; "
                        "each past the widest captured width + 1)")
    p.add_argument("--no-pad-check", action="store_true",
                   help="skip the direct check of the static padding rows (outputs are still compared)")
    options.add_json(p)
    options.add_plot(p, "sweep.png (per-width step time and padding waste)")
    options.add_threads(p)
    p.add_argument("--details", type=options.int_at_least(0), default=5, metavar="N",
                   help="failed steps printed per mode (default 5)")
    options.add_tp(p)
    options.add_verbosity(p)


def _extras(text: str) -> tuple[int, ...]:
    return () if text.strip().lower() in ("", "none") else options.positive_ints(text)


def _adapter(args, choice: options.ModelChoice) -> "ToyAdapter | HFAdapter":
    import torch

    from cudagraph_rt.models.toy import ToyConfig
    from cudagraph_rt.sweep import HFAdapter, ToyAdapter

    dtype = getattr(torch, args.dtype) if args.dtype is not None else None
    if choice.kind != "toy":
        return HFAdapter(choice.family, "tiny" if choice.kind == "path" else choice.size, dtype, args.device,
                         args.widths, path=choice.path, attention=args.attention, pieces=args.pieces,
                         compile=args.compile)
    make = ToyConfig.bench if choice.size == "bench" else ToyConfig.tiny
    config = make(dtype=dtype) if dtype is not None else make()
    if getattr(args, "tp", 1) > 1:
        from .tp import TPAdapter
        return TPAdapter(config, args.device, args.widths)
    return ToyAdapter(config, args.device, args.widths, attention=args.attention, pieces=args.pieces)


def _check_together(args, choice: options.ModelChoice, modes: list) -> None:
    """Flags that each parse but conflict: a usage error before anything is built."""
    from cudagraph_rt.widths import default_widths

    if choice.kind == "toy" and args.compile:
        raise options.UsageError(expected("--compile", options.COMPILE_WANTS, repr(args.model)))
    if choice.kind == "toy" and args.attention == "varlen":
        raise options.UsageError(expected("--attention", "cells | eager-piece for the toy (varlen: hf models)",
                                          "varlen"))
    top = max(args.widths) if args.widths else default_widths()[-1]
    inside = [t for t in args.extras if t <= top + 1]
    if inside:
        raise options.UsageError(expected("--extras", f"widths past the widest captured width + 1 ({top + 1}; "
                                                      "the sweep runs every width up to it anyway), or none",
                                          ",".join(map(str, args.extras))))
    if args.attention == "varlen" and not args.pieces and any(m is not False for m in modes):
        raise options.UsageError(expected("--attention", "cells | eager-piece when graphs are captured whole (varlen "
                                                         "needs --pieces: a whole graph would freeze its per-step host "
                                                         "ints), or --graphs off",
                                          f"varlen with --graphs {args.graphs}"))


def run(args) -> int:
    from cudagraph_rt.sweep import run_sweep

    if getattr(args, "tp", 1) > 1 and not getattr(args, "tp_inner", False):  # one process per rank
        from .tp import run_tp
        return run_tp(args, run)
    # With --json on stdout, stdout carries only the JSON; people's text goes to stderr.
    console, err = make_console(stderr=options.json_to_stdout(args)), make_console(stderr=True)
    try:
        choice = options.model_choice(args)
        dev = options.device(args)
        modes, _ = options.graph_modes(args.graphs, dev)  # refuses what cannot run here
        _check_together(args, choice, modes)
        with options.threads(options.thread_count(args, dev, choice.tiny)), Activity.of("cgrt sweep", args, err) as activity:
            if choice.kind != "toy":
                with activity.phase(f"building {choice.label} on {dev.type}"):
                    adapter = _adapter(args, choice)
            else:
                adapter = _adapter(args, choice)
            bars = {}

            def progress(mode: str, done: int, total: int) -> None:
                if mode not in bars:
                    bars[mode] = activity.counter(mode, total)
                bars[mode](done)

            with activity.phase("sweeping"):
                report = run_sweep(adapter, graphs=args.graphs, seed=args.seed, repeats=args.repeats,
                                   extras=args.extras, only_step=args.only_step,
                                   check_pad_rows=not args.no_pad_check, progress=progress,
                                   log=lambda m: console.print(m, markup=False, soft_wrap=True))
    except (InputError, ImportError) as e:  # ImportError: --model hf:... without the hf extra
        err.print(f"cgrt sweep: {e}", markup=False, soft_wrap=True)
        return 2
    except CgrtError as e:  # a capture failure, a busy runtime: the sweep could not run
        err.print(f"cgrt sweep: {type(e).__name__}: {e}", markup=False, soft_wrap=True)
        return 1
    _publish(args, report, console)
    return 0 if report.ok else 1


def _publish(args, report, console) -> None:
    """The plot, the JSON, the tables and the summary (the seed and notes were logged)."""
    from cudagraph_rt.sweep.report import plot, rich_tables

    png = os.path.join(args.plot, "sweep.png") if args.plot else None
    if png:
        plot(report, png)
    if args.json:
        options.write_json(args.json, json.loads(report.to_json()))
    if not options.json_to_stdout(args):
        for t in rich_tables(report):
            console.print(t)
    # The notes were logged at the start; print the rest of the summary. soft_wrap: long
    # lines stay whole, so a reproduction command can be copied from a terminal or a log.
    for line in report.summary(args.details).splitlines()[len(report.notes):]:
        bad = not report.ok and line.startswith(("sweep", "FAIL"))
        console.print(line, markup=False, soft_wrap=True, style="bold red" if bad else None)
    if png:
        console.print(f"plot: {png}", markup=False, soft_wrap=True)
    if args.json and not options.json_to_stdout(args):
        console.print(f"json: {args.json}", markup=False, soft_wrap=True)
