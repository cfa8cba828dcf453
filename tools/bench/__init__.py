"""``cgrt bench``: cudagraph_rt against eager, a bare CUDA graph and torch.compile, on the
embedded toy decoder (ToyConfig.bench()), in one run.

Sections (``--sections 1,2,...``):
  1 step time per width      eager | cgrt step() | bare CUDAGraph replay | torch.compile setups
  2 mixed trace              2,000 steps of a serving mix of widths, total time per variant
  3 host overhead            step() vs replay() of the same graph at T = 1 and 64
  4 memory                   one shared pool vs separate pools vs the widest alone; capture time
  5 padding waste            default width set vs a denser user set over the trace
  6 host rows                chosen hidden rows to the host: captured gather vs copy-all vs .item()
  7 dispatch                 speculative rounds: the device loop vs host-driven rounds vs the host runner

Every figure is a median over many timed calls after warm-up, with random inputs rotated
among several pre-generated sets; what each includes is stated in the tables and in the
JSON (``--json``). ``--quick`` is a CPU smoke run (tiny model, graphs off, few repeats);
sections that need CUDA report "skipped". Exit code: 1 if a section failed (or, with
``--strict``, a goal was missed), else 0.

torch.compile setups (sections 1-2, ``--compile-setups``) run one child process each
(``compile_setups``: same model, inputs and timing; a crash or timeout is reported as
"unavailable", never taking the bench down): (a) ``static`` reduce-overhead with weights and
KV pool marked static, (b) ``default`` reduce-overhead as a user gets it, ``cgrt`` the
runtime capturing a compiled step. Skipped with --quick / on the CPU / with --no-compile.
torch is imported when the bench runs, not when its arguments are parsed.
"""
from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable

from rich.console import Console
from rich.text import Text

from cudagraph_rt.errors import expected

from .. import options
from ..console import make_console
from ..progress import Activity
from . import compile_setups

if TYPE_CHECKING:
    from .context import Context

SECTIONS = {1: "step_time", 2: "mixed_trace", 3: "host_overhead", 4: "memory", 5: "padding", 6: "host_rows",
            7: "dispatch"}


def section_function(n: int) -> Callable[["Context"], dict]:
    """The function that runs section ``n`` (its module imports torch: loaded here)."""
    from . import dispatch, host_rows, memory, steps

    return {1: steps.step_time, 2: steps.mixed_trace, 3: steps.host_overhead, 4: memory.memory,
            5: memory.padding, 6: host_rows.host_rows, 7: dispatch.toy_section}[n]


HF_SECTIONS = ("compiled", "pool", "spec", "capture", "pieces", "sampling", "dispatch", "greedy")  # hf.py's, by name


def _sections(text: str) -> tuple:
    """Toy section numbers (``1,3``) or hf section names (``pool,compiled``)."""
    words = [s.strip() for s in text.split(",") if s.strip()]
    if words and all(w in HF_SECTIONS for w in words):
        return tuple(dict.fromkeys(words))
    try:
        picked = tuple(sorted({int(s) for s in words}))
    except ValueError:
        picked = ()
    if not picked or any(n not in SECTIONS for n in picked):
        raise argparse.ArgumentTypeError(f"expected section numbers from {sorted(SECTIONS)} like 1,3 (toy) or names "
                                         f"from {','.join(HF_SECTIONS)} (hf models), got {text!r}")
    return picked


def _count(minimum: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = minimum - 1
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected an int >= {minimum}, got {text!r}")
        return v
    return parse


def _setups(text: str) -> tuple[str, ...]:
    picked = tuple(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not picked or any(n not in compile_setups.SETUPS for n in picked):
        raise argparse.ArgumentTypeError(f"expected setups from {list(compile_setups.SETUPS)} like static,cgrt, "
                                         f"got {text!r}")
    return picked


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``cgrt bench`` (see ``cgrt bench --help``)."""
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    doc = __doc__ or ""
    p.epilog = doc[doc.find("Sections"):doc.find("Every figure")].rstrip() + "\n\nBENCHMARKS.md: commands and figures."
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny model on the CPU, graphs off, few repeats, short trace (CI); a CPU "
                        "runs these settings by default")
    options.add_json(p)
    options.add_plot(p, "step_time.png and host_rows.png")
    p.add_argument("--sections", type=_sections, default=None, metavar="1,2,...",
                   help="which sections to run (default: all): toy 1..7 (7: dispatch, by name too); hf models by name ("
                        + ",".join(HF_SECTIONS) + ")")
    p.add_argument("--all-widths", action="store_true", help="section 1 at every T in 1..64, not only 1,2,4..64")
    p.add_argument("--repeats", type=_count(1), metavar="N",
                   help="timed calls per figure (default 200; on a CPU or with --quick 5)")
    p.add_argument("--warmup", type=_count(0), metavar="N",
                   help="untimed calls before each figure (default 20; on a CPU or with --quick 2)")
    p.add_argument("--trace-steps", type=_count(1), metavar="N",
                   help="steps in the mixed trace (default 2000; on a CPU or with --quick 200)")
    options.add_seed(p, 0, "every random input and of the trace")
    options.add_sampling(p, "every request of the hf spec section")
    options.add_device(p)
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out (it takes minutes)")
    p.add_argument("--compile-setups", type=_setups, default=None, metavar="static,...",
                   help="torch.compile setups, one child process each, in this order: static (a: reduce-overhead, "
                        "weights+KV marked static), default (b: reduce-overhead unmarked), cgrt (cudagraph_rt "
                        "capturing a compiled step), eager (control: eager timed in a child); "
                        f"default {','.join(compile_setups.DEFAULT_SETUPS)}")
    p.add_argument("--compile-timeout", type=_count(1), default=None, metavar="S",
                   help="seconds each compile child may run before it is killed (default 240)")
    p.add_argument("--cgrt-compile-mode", type=options.one_of(*compile_setups.CGRT_MODES), default=None,
                   metavar="MODE", help="torch.compile mode of the step cudagraph_rt captures in the cgrt setup: "
                   + " | ".join(compile_setups.CGRT_MODES) + " (default: default)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    options.add_tp(p, "; its own table (tools/bench/tp.py; --sections does not apply)")
    options.add_model(p, size_default="bench for the toy and 1b for hf: models on CUDA, tiny on a CPU",
                      size_note="; hf models run their own sections, tools/bench/hf.py, against generate()")
    p.add_argument("--hf-prompt", type=_count(1), default=None, metavar="N",
                   help="hf models: prompt tokens (default 32)")
    p.add_argument("--hf-new", type=_count(2), default=None, metavar="N", help="hf models: new tokens (default 128)")
    options.add_drafter(p, "coin", "; hf models' spec section: speculative against plain decoding at 1 sequence")
    options.add_threads(p)
    options.add_verbosity(p)


# What the options above default to (None there: a value given is told from one left out,
# so a flag that does not apply to the run is a usage error, see _check_together).
DEFAULTS = {"compile_setups": compile_setups.DEFAULT_SETUPS, "compile_timeout": 240, "cgrt_compile_mode": "default",
            "hf_prompt": 32, "hf_new": 128}


def _check_together(args: argparse.Namespace, choice: options.ModelChoice) -> None:
    """Flags that each parse but do not apply to this run: usage errors before it starts."""
    if args.no_compile:
        for flag in ("compile_setups", "compile_timeout", "cgrt_compile_mode"):
            if getattr(args, flag) is not None:
                raise options.UsageError(expected(f"--{flag.replace('_', '-')}", "no torch.compile option with "
                                                  "--no-compile", repr(getattr(args, flag))))
    if choice.kind == "toy":
        for flag in ("hf_prompt", "hf_new"):
            if getattr(args, flag) is not None:
                raise options.UsageError(expected(f"--{flag.replace('_', '-')}", "an hf model (--model hf:... or a "
                                                  "checkpoint folder)", repr(args.model)))
        if args.drafter != "coin":
            raise options.UsageError(expected("--drafter", "an hf model (--model hf:... or a checkpoint folder; the "
                                              "toy's sections draft nothing)", repr(args.model)))
    sp = options.sampling_params(args)
    given = [(f, v) for f, v, default in (("--temperature", sp.temperature, 0.0), ("--top-k", sp.top_k, 0),
                                          ("--top-p", sp.top_p, 1.0), ("--min-p", sp.min_p, 0.0)) if v != default]
    spec = choice.kind != "toy" and (args.sections is None or "spec" in args.sections)
    if given and not spec:
        raise options.UsageError(expected(given[0][0], "the hf spec section with it (--model hf:..., --sections "
                                          "including spec; the other sections decode greedy)", given[0][1]))
    if getattr(args, "tp", 1) > 1 and args.sections is not None:
        raise options.UsageError(expected("--sections", "none with --tp (the tensor-parallel bench has one table)",
                                          ",".join(map(str, args.sections))))
    for flag, value in DEFAULTS.items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)


def _meta(ctx: "Context", args: argparse.Namespace) -> dict:
    import torch

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cfg = {f.name: str(getattr(ctx.config, f.name)) if f.name == "dtype" else getattr(ctx.config, f.name)
           for f in dataclasses.fields(ctx.config)}
    return {
        "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
        "cuda": torch.version.cuda, "device": str(ctx.device),
        "device_name": torch.cuda.get_device_name(ctx.device) if ctx.graphs else platform.processor() or "cpu",
        "graphs": ctx.graphs, "model": "ToyDecoder", "config": cfg, "widths": list(ctx.widths),
        "repeats": ctx.repeats, "warmup": ctx.warmup, "trace_steps": ctx.trace_steps, "seed": ctx.seed,
        "quick": ctx.quick, "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "compile_setups": list(ctx.compile_setups), "compile_timeout_s": ctx.compile_timeout,
        "cgrt_compile_mode": ctx.cgrt_compile_mode,
        "sections": {key: n for n, key in SECTIONS.items()},
    }


def run(args: argparse.Namespace) -> int:
    """Run the chosen sections, print a table each and the goals last; write --json and
    --plot. Returns the exit code (1: a section failed, or --strict and a goal missed)."""
    choice = options.model_choice(args, "tiny" if _light(args) else "bench", "tiny" if _light(args) else "1b")
    _check_together(args, choice)
    args.size = choice.size
    if getattr(args, "tp", 1) > 1:  # one process per rank, under torchrun
        from . import tp

        if choice.kind != "toy":
            raise options.UsageError(expected("--model", "toy with --tp (the tensor-parallel toy)", repr(args.model)))
        return tp.run_tp(args)
    import torch

    dev = torch.device("cpu") if args.quick and args.device is None else options.device(args)  # as Context does
    with options.threads(options.thread_count(args, dev, _light(args))):
        if choice.kind != "toy":
            from . import hf

            args.model_path = choice.path
            args.family = choice.family
            if any(isinstance(n, int) for n in args.sections or ()):
                raise options.UsageError(expected("--sections", f"names from {','.join(HF_SECTIONS)} for hf models",
                                                  ",".join(map(str, args.sections))))
            args.hf_sections = args.sections
            return hf.run(args)
        by_name = {key: n for n, key in SECTIONS.items()}  # a section both have, by name: "dispatch"
        args.sections = tuple(by_name.get(n, n) for n in args.sections or ()) or None
        if any(isinstance(n, str) for n in args.sections or ()):
            raise options.UsageError(expected("--sections", f"numbers from {sorted(SECTIONS)} for the toy",
                                              ",".join(map(str, args.sections))))
        args.sections = args.sections or tuple(SECTIONS)
        return _run(args)


def _light(args: argparse.Namespace) -> bool:
    """The CPU defaults (a run of about a minute): --quick, --device cpu, or no CUDA."""
    import torch

    return bool(args.quick) or args.device == "cpu" or not torch.cuda.is_available()


def _run(args: argparse.Namespace) -> int:
    from . import report
    from .context import Context

    console = make_console(stderr=options.json_to_stdout(args), markup=False)
    with Activity.of("cgrt bench", args) as activity:
        # the sections' own notes: a compile child's start and end also as a line in a log
        ctx = Context(args, progress=lambda text, always: activity.note(text) if always else activity.status(text))
        try:
            results, failed = _sections_run(ctx, args, console, activity)
        finally:
            ctx.close()
    gs = report.goals(results) if ctx.graphs else []
    results["goals"] = gs
    if args.plot:
        try:
            for path in report.write_plots(results, args.plot):
                console.print(f"plot: {path}")
        except Exception as e:  # noqa: BLE001
            failed += 1
            console.print(Text(f"plots failed: {type(e).__name__}: {e}", style="red"))
    missed = sum(g["status"] == "missed" for g in gs)
    rc = 1 if failed or (args.strict and missed) else 0
    results["ok"] = rc == 0  # what the exit code says
    if args.json:
        written = options.write_json(args.json, results)
        if written:
            console.print(f"json: {written}")
    if not ctx.graphs:
        console.print(Text(options.CPU_NOTE, style="yellow"))
        console.print(f"{failed} section(s) failed")
        return rc
    console.print(report.goals_table(gs))
    console.print(f"{sum(g['status'] == 'met' for g in gs)} met, {missed} missed, "
                  f"{sum(g['status'] == 'unclear' for g in gs)} unclear, "
                  f"{sum(g['status'] == 'n/a' for g in gs)} n/a; {failed} section(s) failed")
    return rc


def _sections_run(ctx: "Context", args: argparse.Namespace, console: Console, activity: Activity
                  ) -> tuple[dict, int]:
    """Each asked-for section in order; a failing one is recorded and the rest still run."""
    import torch

    from . import report

    results: dict[str, Any] = {"meta": _meta(ctx, args)}
    failed = 0
    c = ctx.config
    console.print(f"cgrt bench on {results['meta']['device_name']} ({ctx.device}), torch {torch.__version__}, "
                  f"toy {ctx.size} config ({str(c.dtype).removeprefix('torch.')}, hidden "
                  f"{c.hidden}, {c.layers} layers, {c.max_seqs} sequences x {c.max_len} positions on a KV pool of "
                  f"{c.cells:,} cells), {ctx.repeats} repeats")
    for n, key in SECTIONS.items():
        if n not in args.sections:
            results[key] = {"status": "not run"}
            continue
        t0 = time.perf_counter()
        try:
            with activity.phase(f"{n}. {key}"):
                res = section_function(n)(ctx)
        except Exception as e:  # noqa: BLE001 - one failed section must not lose the others
            failed += 1
            res = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        res["seconds"] = time.perf_counter() - t0
        results[key] = res
        if res["status"] == "ok":
            for t in report.tables(key, res):
                console.print(t)
        elif res["status"] == "skipped":
            console.print(Text(f"{n}. {key}: skipped: {res['reason']}", style="yellow"))
        else:
            console.print(Text(f"{n}. {key}: ERROR {res['error']}", style="red"))
            console.print(Text(res["traceback"]))
    return results, failed
