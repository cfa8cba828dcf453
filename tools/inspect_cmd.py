"""`cgrt inspect`: what each width's CUDA graph holds, and what in the step breaks capture.

On a GPU, per width: capture time, replay time, pool bytes, node counts, kernels, copies,
capture hazards, graphs on vs off per output; between neighbouring widths: kernels added
or removed and grids that change. ``--dot DIR`` writes ``DIR/width_<N>.dot`` per width.
On a CPU only the hazard finder runs (graph introspection needs CUDA; the report says so).

Target: ``--target module:factory``. ``factory(graphs: bool)`` returns a GraphRuntime
(built with ``keep_graphs=True`` when ``graphs`` is True; graphs off otherwise, same
weights and state) or ``(runtime, inputs)`` where ``inputs(T)`` gives step inputs of T
rows, used to compare graphs on against graphs off.
Exit code: 0 all clear; 1 a hazard, a graph hazard (pageable copy, host callback), an
on/off mismatch, a failed width or a factory that raised; 2 a usage error (bad flags, a
target that cannot be loaded, is no factory taking ``graphs=`` or does not return a
runtime). On a CPU the exit code reflects the hazard finder alone, so a CPU CI job can tell
"hazard" (1) from "clean" (0). torch is imported when it runs, not when its arguments are
parsed.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import os
import sys
import weakref
from typing import TYPE_CHECKING, Any, Callable

from cudagraph_rt.errors import CgrtError, expected
from cudagraph_rt.tools import options
from cudagraph_rt.tools.progress import Activity

if TYPE_CHECKING:
    import torch

    from cudagraph_rt.debug.inspect import InspectReport
    from cudagraph_rt.models import Decoder

DEFAULT_TARGET = "cudagraph_rt.tools.inspect_cmd:toy_target"   # the embedded toy decoder
REPLAYS = 20


# The model last built per graph mode: the on/off comparison steps the graphs-off model
# with the graphs-on target's inputs, so their cells are reserved in both pools (the
# allocator is deterministic: the same calls hand out the same cells).
_LAST: dict[bool, weakref.ref] = {}


def _target(model: "Decoder", graphs: bool, pieces: bool = False):
    """A runtime over ``model``'s step (graphs kept when on; every width in pieces with
    ``pieces``) and ``inputs(T)``: one
    sequence, a fresh id each call (its blocks freed and taken again, in this model's pool
    and in that of the last model built for the other graph mode), positions 0..T-1,
    random tokens (seed 0)."""
    import torch

    from cudagraph_rt import GraphRuntime

    rt = GraphRuntime(model.step, model.inputs(), graphs=graphs, keep_graphs=graphs, device=model.device,
                      pieces=pieces and graphs, step_values=model.step_values)
    gen, calls = torch.Generator().manual_seed(0), iter(range(1 << 30))
    _LAST[graphs] = weakref.ref(model)

    def inputs(T: int) -> "dict[str, torch.Tensor]":
        seq, cfg = next(calls) % model.config.max_seqs, model.config
        twin = _LAST.get(not graphs, lambda: None)()
        reserved = []
        for m in (model,) if twin is None else (model, twin):
            m.free_seq(seq)
            reserved.append(m.cell_range(seq, 0, T))
        if reserved[-1] != reserved[0]:
            raise RuntimeError("cgrt inspect: the graphs-on and graphs-off models hold different cells")
        cells = torch.tensor(reserved[0], dtype=torch.int64)
        return dict(tokens=torch.randint(0, cfg.vocab, (T,), generator=gen), positions=torch.arange(T),
                    seq_ids=torch.full((T,), seq), cells=cells, want=torch.ones(T, dtype=torch.int64))

    return rt, inputs


def toy_target(graphs: bool):
    """The default target: the embedded toy decoder (same seed, so graphs on and off have
    the same weights); ``inputs(T)`` as :func:`_target`'s."""
    from cudagraph_rt.models.toy import ToyDecoder

    return _target(ToyDecoder(), graphs)


def toy_pieces_target(graphs: bool):
    """The toy decoder with its attention marked eager, every width captured in pieces
    (``--target cudagraph_rt.tools.inspect_cmd:toy_pieces_target``): the report lists each
    width's pieces and the attention calls between them."""
    from cudagraph_rt.models.toy import ToyDecoder

    return _target(ToyDecoder(attention="eager-piece"), graphs, pieces=True)


@functools.lru_cache(maxsize=2)
def _hf_model(family: str, size: str, path: str | None = None):
    from cudagraph_rt.models.hf import build

    return build(family, size, path=path)


def hf_target(graphs: bool, family: str = "llama", size: str = "tiny", compile_mode: str | None = None,
              path: str | None = None):
    """``--model hf:<family>``: a transformers model with random weights (built once: the
    graphs-on and graphs-off runtimes share its weights, each with its own KV pool).
    ``compile_mode``: the graphs-on runtime captures ``compile_decoder(compile_mode)``
    (the graphs-off reference stays eager). ``inputs(T)`` as :func:`_target`'s."""
    from cudagraph_rt.models.hf import HFDecoder

    base = _hf_model(family, size, path)
    model = HFDecoder(base.model, max_seqs=base.config.max_seqs, max_len=base.config.max_len, family=family,
                      size=size)
    if compile_mode and graphs:
        model.compile_decoder(compile_mode)
    return _target(model, graphs)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("exit codes: 0 clean; 1 a capture hazard, a graph hazard, a graphs on/off mismatch "
                "or a failed width (on a CPU: the hazard finder alone); 2 a usage error")
    p.add_argument("--target", default=None, metavar="MODULE:FACTORY",
                   help=f"runtime factory (default: {DEFAULT_TARGET}); see the module docstring")
    options.add_model(p, model_note="; not toy: instead of --target")
    options.add_compile(p, "capture", " (inductor kernels in the graphs; the graphs-off reference stays eager)")
    options.add_widths(p, "inspect only these of the widths the target captures (default: all)")
    p.add_argument("--replays", type=options.int_at_least(1), default=REPLAYS, metavar="N",
                   help=f"event-timed replays per width (median; default {REPLAYS})")
    p.add_argument("--no-compare", action="store_true", help="skip graphs on vs off")
    p.add_argument("--dot", type=options.output_folder, metavar="DIR",
                   help="write one Graphviz file per width into DIR, an existing folder")
    options.add_dispatch(p, "; here device shows that loop's outer graph (its conditional nodes, branches and "
                            "bodies; k=4, the model's coin drafter) instead of each width's graph")
    options.add_json(p)
    options.add_threads(p)
    options.add_verbosity(p)


class FactoryFailed(Exception):
    """The target's factory raised: the target exists and takes ``graphs=``, but could not
    build a runtime (exit 1, the error named; never a traceback)."""


def _load(target: str | Callable) -> Callable:
    """The factory ``MODULE:FACTORY`` names (or ``target`` itself when it is callable);
    ValueError saying why it is none: not ``MODULE:FACTORY``, not callable, or a callable
    that cannot be called as ``factory(graphs=...)``."""
    if callable(target):
        return target
    module, sep, attr = str(target).partition(":")
    if not sep or not module or not attr:
        raise ValueError("MODULE:FACTORY")
    factory = getattr(importlib.import_module(module), attr)
    if not callable(factory):
        raise ValueError(f"a callable factory ({attr} is a {type(factory).__name__})")
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call will say
        return factory
    try:
        signature.bind(graphs=True)
    except TypeError:
        raise ValueError(f"a factory taking graphs= (factory(graphs: bool); {attr}{signature} does not)") from None
    return factory


def _build(factory: Callable, graphs: bool, widths: tuple[int, ...] | None = None) -> tuple[Any, Callable | None]:
    """The factory's runtime (and ``inputs``), not captured yet. FactoryFailed when the
    factory raises; UsageError when it returns no runtime or ``widths`` it does not have."""
    try:
        made = factory(graphs=graphs)
    except (CgrtError, options.UsageError):
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code: named, never a traceback
        raise FactoryFailed(f"the target's factory raised {type(exc).__name__}: {exc}") from exc
    rt, inputs = made if isinstance(made, tuple) and len(made) == 2 else (made, None)
    if not callable(getattr(rt, "capture", None)) or (inputs is not None and not callable(inputs)):
        raise options.UsageError(expected("--target", "a factory returning a GraphRuntime or (runtime, inputs)",
                                          f"{type(made).__name__} from {getattr(factory, '__name__', factory)}"))
    _check_widths(rt, widths)
    return rt, inputs


def _factory(args: argparse.Namespace, choice: options.ModelChoice) -> Callable:
    """The runtime factory ``--model`` / ``--target`` name (UsageError when both are given)."""
    if choice.kind != "toy" and args.target is not None:
        raise options.UsageError(expected("--model", f"toy (the default) with --target {args.target}", repr(args.model)))
    if choice.kind == "toy" and choice.size != "tiny":
        raise options.UsageError(expected("--size", "tiny for the toy target", repr(choice.size)))
    if choice.kind == "toy" and args.compile:
        raise options.UsageError(expected("--compile", options.COMPILE_WANTS, repr(args.model)))
    if choice.kind != "toy":
        size = "tiny" if choice.kind == "path" else choice.size
        return functools.partial(hf_target, family=choice.family, size=size, compile_mode=args.compile,
                                 path=choice.path)
    target = DEFAULT_TARGET if args.target is None else args.target
    try:
        return _load(target)
    except ValueError as exc:  # what the target is not
        raise options.UsageError(expected("--target", str(exc), repr(target))) from None
    except (ImportError, AttributeError) as exc:
        raise options.UsageError(expected("--target", "MODULE:FACTORY of an importable module",
                                          f"{target!r} ({type(exc).__name__}: {exc})")) from None


def _check_widths(rt, asked: tuple[int, ...] | None) -> None:
    """``--widths`` must name widths the target captures (before anything is captured)."""
    have = tuple(getattr(rt, "widths", ()) or ())
    missing = [w for w in asked or () if have and w not in have]
    if missing:
        raise options.UsageError(expected("--widths", f"widths the target captures ({','.join(map(str, have))})",
                                          ",".join(map(str, asked))))


def run(args: argparse.Namespace) -> int:
    options.check_dispatch(args, {"--target": args.target is not None, "--compile": bool(args.compile),
                                  "--widths": args.widths is not None, "--dot": args.dot is not None,
                                  "--replays": args.replays != REPLAYS, "--no-compare": args.no_compare},
                           "the widths' own inspection; the loop captures the widths its rows need")
    if args.dispatch == "device":
        return _run_loop(args)
    try:
        choice = options.model_choice(args)
        factory = _factory(args, choice)
    except options.UsageError as exc:
        print(f"cgrt inspect: {exc}", file=sys.stderr)
        return 2
    cuda, dev = _here()
    try:
        with options.threads(options.thread_count(args, dev, choice.tiny)), Activity.of("cgrt inspect", args) as activity:
            if choice.kind != "toy":
                with activity.phase(f"building {choice.label}"):
                    _hf_model(choice.family, factory.keywords["size"], choice.path)
            rt, inputs = _build(factory, graphs=cuda, widths=args.widths)
            ref = _build(factory, graphs=False)[0] if cuda and inputs and not args.no_compare else None
            with activity.phase("capturing the target's widths"):
                for r in (rt, ref) if ref is not None else (rt,):
                    r.capture()
            report = _inspect(rt, ref, inputs, args, activity)
    except (options.UsageError, ImportError) as exc:  # ImportError: an hf model without the hf extra
        print(f"cgrt inspect: {exc}", file=sys.stderr)
        return 2
    except FactoryFailed as exc:
        print(f"cgrt inspect: --target {args.target or DEFAULT_TARGET}: {exc}", file=sys.stderr)
        return 1
    except CgrtError as exc:   # a capture that failed names the width and the source line
        print(f"cgrt inspect: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    _publish(report, args)
    return report.exit_code


LOOP_K = 4  # drafts per sequence and round in the loop `--dispatch device` shows


def _here() -> "tuple[bool, torch.device]":
    """Whether CUDA is here, and the device the inspected runtime goes on."""
    import torch

    cuda = torch.cuda.is_available()
    return cuda, torch.device("cuda" if cuda else "cpu")


def _run_loop(args: argparse.Namespace) -> int:
    """``--dispatch device``: the device loop over ``--model`` (the toy by default), built
    as ``cgrt demo --dispatch device`` builds it, and its structure; exit 0 once built."""
    choice = options.model_choice(args)
    from cudagraph_rt.dispatch.loop import DeviceLoop
    from cudagraph_rt.tools.demo.serve_loop import loop_drafter

    cuda, dev = _here()
    try:
        with options.threads(options.thread_count(args, dev, choice.tiny)), Activity.of("cgrt inspect", args) as activity:
            with activity.phase(f"building {choice.label} and its device loop"):
                if choice.kind == "toy":
                    from cudagraph_rt.models import ToyConfig, ToyDecoder
                    model = ToyDecoder(ToyConfig.bench() if choice.size == "bench" else ToyConfig.tiny(), dev)
                else:
                    model = _hf_model(choice.family, "tiny" if choice.kind == "path" else choice.size, choice.path)
                loop = DeviceLoop(model, loop_drafter(model, 0.7, 0), k=LOOP_K, graphs=True if cuda else "emulate",
                                  rounds=args.launch_rounds)
    except ImportError as exc:  # an hf model without the hf extra
        print(f"cgrt inspect: {exc}", file=sys.stderr)
        return 2
    except CgrtError as exc:
        print(f"cgrt inspect: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    shape = loop.shape
    doc = {"ok": True, "dispatch": "device", "model": choice.label, "device": str(dev),
           "rounds_ran": loop.runner.name, "note": loop.note, "k": shape.k, "slots": shape.slots,
           "widths": list(shape.widths), "rounds_per_launch": loop.rounds, "outline": list(loop.runner.description)}
    if args.json:
        options.write_json(args.json, doc)
    if args.json != options.STDOUT:
        print(f"device loop over {choice.label} on {dev}: k={shape.k}, {shape.slots} slots, widths "
              f"{list(shape.widths)}, up to {loop.rounds} rounds per launch\nrounds run by: {loop.note}")
        print("\n".join(doc["outline"]))
    return 0


def _publish(report: "InspectReport", args: argparse.Namespace) -> None:
    from cudagraph_rt.debug.inspect import to_dot

    if args.dot and report.available:
        for w in report.widths:
            if w.nodes:
                with open(os.path.join(args.dot, f"width_{w.width}.dot"), "w") as f:
                    f.write(to_dot(w.nodes, f"width {w.width}"))
    if args.json:
        options.write_json(args.json, report.to_json())
    if args.json != options.STDOUT:
        _print(report)


def _inspect(rt, ref, inputs, args, activity: Activity) -> "InspectReport":
    from cudagraph_rt.debug.inspect import inspect_runtime

    done = activity.counter("inspecting widths", len(args.widths or getattr(rt, "widths", ())))
    seen: list[int] = []

    def step(w: int) -> None:
        seen.append(w)
        done(len(seen))

    kw = dict(widths=args.widths, replays=args.replays, reference=ref, inputs=inputs if ref else None)
    return inspect_runtime(rt, **kw, on_width=step)


def _on_off(diffs) -> str:
    if not diffs:
        return "-"
    bad = [d for d in diffs if not d.equal]
    if not bad:
        return "[green]identical[/]"
    worst = max(bad, key=lambda d: d.max_abs)
    return f"[red]{len(bad)} differ[/] ({worst.path}: max|d| {worst.max_abs:.3g}, row {worst.first_row})"


def _print(report: "InspectReport") -> None:
    from cudagraph_rt.debug.inspect import short_kernel_name
    from cudagraph_rt.tools.console import fit, make_console
    from rich.markup import escape
    from rich.table import Table

    con = make_console()
    if not report.available:
        con.print(f"[yellow]graph introspection skipped:[/] {report.reason}")
    else:
        t = Table(title=f"cgrt inspect ({report.device})", caption="nodes: kernels / memcpy / memset / other",
                  caption_justify="left")
        for col in ("width", "capture ms", "replay us", "pool MiB", "nodes", "hazards", "graphs on vs off"):
            t.add_column(col, justify="right" if col not in ("graphs on vs off",) else "left")
        fmt = lambda v, k: "-" if v is None else f"{v * k:.1f}"  # noqa: E731
        for w in report.widths:
            c = dict(w.counts)
            kern, cp, ms = c.pop("kernel", 0), c.pop("memcpy", 0), c.pop("memset", 0)
            if w.error:
                t.add_row(str(w.width), fmt(w.capture_s, 1e3), "", "", "", "", f"[red]{escape(w.error)}[/]")
                continue
            flagged = len(w.hazards) + len(w.node_hazards)
            t.add_row(str(w.width), fmt(w.capture_s, 1e3), fmt(w.replay_s, 1e6),
                      fmt(w.pool_bytes, 1 / 2**20), f"{kern}/{cp}/{ms}/{sum(c.values())}",
                      f"[red]{flagged}[/]" if flagged else "0", _on_off(w.diffs))
        con.print(fit(t))
        for a, b, d in report.width_diffs:
            parts = [f"+{short_kernel_name(k)} x{n}" for k, n in d.added]
            parts += [f"-{short_kernel_name(k)} x{n}" for k, n in d.removed]
            if d.grid_changes:
                parts.append(f"{len(d.grid_changes)} launch shapes change")
            con.print(f"width {a} -> {b}: " + escape(", ".join(parts) or "same kernels, same launch shapes"))
        for w in report.widths:
            for n in w.node_hazards:
                con.print(f"[red]width {w.width} node #{n.index} {n.type}[/] "
                          f"{escape(n.direction or '')} {n.bytes or ''} B: {escape(n.hazard)}")
    for w in report.widths:
        if w.layout:
            con.print(f"width {w.width} in pieces: " + escape(" -> ".join(w.layout)))
    seen: dict[tuple, list[int]] = {}
    for w in report.widths:
        for h in w.hazards:
            seen.setdefault((h.kind, h.op, h.filename, h.lineno, h.line, h.message), []).append(w.width)
    if not seen:
        con.print("[green]capture hazards: none found[/]")
    for (kind, op, filename, lineno, line, message), widths in seen.items():
        con.print(f"[red]{kind}[/] {escape(op)} at {escape(filename)}:{lineno}: {escape(line)}  "
                  f"(widths {','.join(map(str, widths))})\n    {escape(message)}")
