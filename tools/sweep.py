"""``cgrt sweep``: the width-sweep harness on the embedded toy decoder or, with ``--model
hf:<family>``, a transformers causal LM with random weights (``models/hf.py``).

Every step width 1..max+1 plus extras, R times each, shuffled, through the runtime with
graphs on and off (off only where there is no CUDA, and it says so), each step checked
against the eager reference. A progress bar while it runs, then a per-width table (or
``--json``), an optional ``--plot``; exit 1 on any mismatch, 2 on a bad argument.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

from cudagraph_rt.errors import CgrtError, InputError, expected
from cudagraph_rt.models.hf import SIZES, parse_model
from cudagraph_rt.models.toy import ToyConfig
from cudagraph_rt.testing import HFAdapter, SweepOptions, ToyAdapter, run_sweep
from cudagraph_rt.testing.report import plot, rich_tables
from cudagraph_rt.tools.console import make_console

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PLOT_EXT = (".png", ".svg", ".pdf")


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = SweepOptions()
    # Values arrive as strings and are checked in run(): a bad one gets an InputError that
    # says what was expected (argparse's own message would not), and exit code 2.
    p.add_argument("--seed", metavar="N", help="seed of the step plan (default: a fresh one, printed)")
    p.add_argument("--only-step", metavar="K", help="replay steps before K unchecked, check step K only")
    p.add_argument("--graphs", metavar="MODE", default="auto",
                   help="on | off | both | auto (default: both where CUDA exists, else off) | emulate "
                        "(the graph path run eagerly, any device: GraphRuntime(graphs='emulate'))")
    p.add_argument("--device", metavar="DEV", help="cuda or cpu (default: cuda if available)")
    p.add_argument("--model", metavar="M", default="toy",
                   help="toy (default) | hf:llama | hf:qwen2 | hf:qwen3 | hf:mistral (transformers, random weights)")
    p.add_argument("--size", metavar="S", default="tiny",
                   help="hf models: tiny (default: 2 layers, fp32, seconds on a CPU) | 1b (Llama-3.2-1B shape, bf16)")
    p.add_argument("--bench-size", action="store_true", help="the bf16 bench config of the toy (default: tiny fp32)")
    p.add_argument("--dtype", metavar="DT", help="override the config dtype: " + " | ".join(_DTYPES))
    p.add_argument("--widths", metavar="W,W,..", help="captured width set (default 1,2,4,..,64)")
    p.add_argument("--repeats", metavar="R", default=str(d.repeats), help=f"steps per width (default {d.repeats})")
    p.add_argument("--extras", metavar="T,T,..", default=",".join(map(str, d.extras)),
                   help="widths past max+1 to sweep too (default %(default)s; 'none' for none)")
    p.add_argument("--no-pad-check", action="store_true",
                   help="skip the direct check of the static padding rows (outputs are still compared)")
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    p.add_argument("--plot", metavar="FILE.png", help="write per-width step time and padding waste")
    p.add_argument("--threads", metavar="N",
                   help="CPU intra-op threads while sweeping (default: 1 for the tiny config on the CPU, "
                        "whose tiny ops only lose time to thread hand-offs, most of all on shared CPUs)")
    p.add_argument("--details", metavar="N", default="5", help="failed steps printed per mode (default 5)")
    p.add_argument("--tp", metavar="N", type=int, default=1,
                   help="tensor-parallel ranks (launch with torchrun --nproc-per-node N; default 1)")


def _int(flag: str, v: str | None, lo: int = 0) -> int | None:
    if v is None:
        return None
    try:
        n = int(v)
    except ValueError:
        n = None
    if n is None or n < lo:
        raise InputError(expected(flag, f"an int >= {lo}", repr(v)))
    return n


def _ints(flag: str, v: str | None) -> tuple[int, ...] | None:
    if v is None:
        return None
    if v.strip().lower() in ("", "none"):
        return ()
    try:
        out = tuple(int(x) for x in v.split(","))
    except ValueError:
        out = ()
    if not out or any(x < 1 for x in out):
        raise InputError(expected(flag, "comma-separated positive ints such as 96,97", repr(v)))
    return out


@contextlib.contextmanager
def _threads(n: int | None):
    """torch's intra-op thread count for the sweep only (restored: main() may run in-process)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _adapter(args) -> ToyAdapter | HFAdapter:
    dtype = None
    if args.dtype is not None:
        if args.dtype not in _DTYPES:
            raise InputError(expected("--dtype", " | ".join(_DTYPES), repr(args.dtype)))
        dtype = _DTYPES[args.dtype]
    family = parse_model(args.model)
    if family is not None or args.size != "tiny":
        if family is None:
            raise InputError(expected("--size", "tiny for the toy (its GPU config is --bench-size)", repr(args.size)))
        if args.size not in SIZES:
            raise InputError(expected("--size", " | ".join(SIZES), repr(args.size)))
        if args.bench_size:
            raise InputError(expected("--bench-size", "the toy only (hf models take --size)", args.model))
        widths = _ints("--widths", args.widths)
        if widths == ():
            raise InputError(expected("--widths", "at least one width", repr(args.widths)))
        return HFAdapter(family, args.size, dtype, args.device, widths)
    make = ToyConfig.bench if args.bench_size else ToyConfig.tiny
    config = make(dtype=dtype) if dtype is not None else make()
    widths = _ints("--widths", args.widths)
    if widths == ():
        raise InputError(expected("--widths", "at least one width", repr(args.widths)))
    if getattr(args, "tp", 1) > 1:
        from cudagraph_rt.tools.sweep_tp import TPAdapter
        return TPAdapter(config, args.device, widths)
    return ToyAdapter(config, args.device, widths)


def run(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if getattr(args, "tp", 1) > 1 and not getattr(args, "tp_inner", False):  # one process per rank
        from cudagraph_rt.tools.sweep_tp import run_tp
        return run_tp(args, run)
    # With --json, stdout carries only the JSON; people's text goes to stderr.
    console, err = make_console(stderr=args.json), make_console(stderr=True)
    try:
        seed, only = _int("--seed", args.seed), _int("--only-step", args.only_step)
        repeats, details = _int("--repeats", args.repeats, 1), _int("--details", args.details)
        extras = _ints("--extras", args.extras)
        if args.plot is not None:
            if not args.plot.lower().endswith(_PLOT_EXT):
                raise InputError(expected("--plot", "a file name ending in " + " / ".join(_PLOT_EXT), repr(args.plot)))
            folder = os.path.dirname(os.path.abspath(args.plot))
            if not os.path.isdir(folder):
                raise InputError(expected("--plot", "a path in an existing folder", repr(args.plot)))
        adapter = _adapter(args)
        threads = _int("--threads", args.threads, 1)
        if threads is None and adapter.device.type == "cpu" and not args.bench_size and args.size == "tiny":
            threads = 1
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with _threads(threads), Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
            tasks = {}

            def progress(mode: str, done: int, total: int) -> None:
                if mode not in tasks:
                    tasks[mode] = bar.add_task(mode, total=total)
                bar.update(tasks[mode], completed=done)

            report = run_sweep(adapter, graphs=args.graphs, seed=seed, repeats=repeats, extras=extras,
                               only_step=only, check_pad_rows=not args.no_pad_check, progress=progress,
                               log=lambda m: console.print(m, markup=False, soft_wrap=True))
    except (InputError, ImportError) as e:  # ImportError: --model hf:... without the hf extra
        err.print(f"cgrt sweep: {e}", markup=False, soft_wrap=True)
        return 2
    except CgrtError as e:  # a capture failure, a busy runtime: the sweep could not run
        err.print(f"cgrt sweep: {type(e).__name__}: {e}", markup=False, soft_wrap=True)
        return 1
    if args.plot:
        plot(report, args.plot)
    if args.json:
        sys.stdout.write(report.to_json(indent=1) + "\n")
    else:
        for t in rich_tables(report):
            console.print(t)
    # The notes were logged at the start; print the rest of the summary. soft_wrap: long
    # lines stay whole, so a reproduction command can be copied from a terminal or a log.
    for line in report.summary(details).splitlines()[len(report.notes):]:
        bad = not report.ok and line.startswith(("sweep", "FAIL"))
        console.print(line, markup=False, soft_wrap=True, style="bold red" if bad else None)
    if args.plot:
        console.print(f"plot: {args.plot}", markup=False, soft_wrap=True)
    return 0 if report.ok else 1
