"""The child process of ``cgrt bench``'s torch.compile setups: builds one setup, then
compiles (or warms up), checks its tokens against the eager step, times each width and
the mixed trace, rewriting its result file after every stage.

Run by the bench process (``compile_setups.run_setups``) as

    python -m cudagraph_rt.tools.bench.compile_child --setup NAME --payload FILE --out FILE

and only through that command: it is a separate module so that the bench process never
imports what can only run here (the setups' compile and capture code). Lifetime: one
setup per process; the process ends after the last stage. Failure modes: an exception is
written to the result file (``error``, ``traceback``) and the exit code is 1; a crash that
takes the process down (inductor's CUDA graphs can) leaves the stages written before it,
which the bench reports as "partial" (see ``compile_setups.summarize_run``).

Without ``--payload`` the child makes its own inputs from ``--seed`` (a standalone run for
diagnosis, e.g. under CUDA_LAUNCH_BLOCKING=1 or compute-sanitizer); the results go to
stdout when there is no ``--out``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from cudagraph_rt.models.toy import ToyConfig, ToyDecoder

from .common import (
    N_SETS,
    Feed,
    ToyRows,
    Trace,
    build_trace,
    measure,
    measure_trace,
    pack,
    padded_width,
    sync_fn,
    trace_widths,
)
from .compile_setups import CGRT_MODES, NOTE, SETUPS, make_payload

WARM_CALLS = 3  # reduce-overhead records its graph on the 2nd-3rd call of a shape


def note(text: str) -> None:
    print(NOTE + text, file=sys.stderr, flush=True)


class Results:
    """The child's result file, rewritten atomically after every stage."""

    def __init__(self, path: str | None, **head):
        self.path, self.data = path, dict(head)

    def write(self) -> None:
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, default=str)
        os.replace(tmp, self.path)


class _SkipLog(logging.Handler):
    """Collects inductor's "skipping cudagraphs due to ..." messages."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            msg = " ".join(record.getMessage().split())
            if "skipping cudagraph" in msg and msg not in self.messages and len(self.messages) < 8:
                self.messages.append(msg[:400])


@contextlib.contextmanager
def _dynamo_limits(n: int):
    """Room for one compiled shape per width (the default limit of 8 would fall back to eager)."""
    import torch._dynamo

    cfg, old = torch._dynamo.config, {}
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        try:
            old[name] = getattr(cfg, name)
            setattr(cfg, name, max(old[name], n))
        except (AttributeError, TypeError):
            old.pop(name, None)
    try:
        yield
    finally:
        for name, v in old.items():
            setattr(cfg, name, v)


class _Variant:
    """One setup in the child: ``prepare`` builds (compiles, captures) it; ``width_call``
    and ``trace_run`` are the bodies the bench process uses for the same kind of variant."""

    inference = False  # timed under torch.inference_mode(inference), as in the bench process

    def __init__(self, model: ToyDecoder, rows: ToyRows, widths: tuple[int, ...], pin: bool, opts: dict):
        self.m, self.rows, self.widths, self.pin, self.opts = model, rows, widths, pin, opts
        self.feed = Feed(rows.names, model.device)
        self.sync = sync_fn(model.device)

    def prepare(self) -> dict:
        return {}

    def tokens(self, raw: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def width_call(self, raw: list[torch.Tensor], T: int) -> Callable[[int], Any]:
        raise NotImplementedError

    def trace_run(self, tr: Trace) -> Callable[[Any], None]:
        raise NotImplementedError


class _Eager(_Variant):
    inference = True

    def tokens(self, raw):
        with torch.inference_mode():
            return self.m.step(self.feed(pack([raw], self.pin)[0]))["tokens"].clone()

    def width_call(self, raw, T):
        m, feed, packed = self.m, self.feed, pack(raw, self.pin)
        return lambda i: m.step(feed(packed[i % N_SETS]))

    def trace_run(self, tr):
        m, feed = self.m, self.feed

        def run(idx):
            with torch.inference_mode():
                for i in idx:
                    m.step(feed(tr.packed[i]))["tokens"].cpu()
        return run


class _ReduceOverhead(_Variant):
    static = True

    def prepare(self):
        import torch._dynamo
        from torch._dynamo.utils import counters

        if self.static:
            for v in vars(self.m).values():  # weights and KV pool: static, mutated in place
                if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                    torch._dynamo.mark_static_address(v)
        skips0 = counters["inductor"]["cudagraph_skips"]
        self.fn = torch.compile(self.m.step, mode="reduce-overhead", dynamic=False)
        per = {}
        for w in self.widths:
            note(f"compiling width {w}")
            tw = time.perf_counter()
            packed = pack([self.rows.padded(self.rows.rows(w), w)], pin=self.pin)[0]
            for _ in range(WARM_CALLS):
                self.call(self.feed(packed))
            self.sync()
            per[w] = time.perf_counter() - tw
        return {"mode": "reduce-overhead", "per_width_s": per,
                "cudagraph_skips": counters["inductor"]["cudagraph_skips"] - skips0}

    def call(self, views):  # the bench's former Compiled.call
        torch.compiler.cudagraph_mark_step_begin()  # earlier outputs may be overwritten
        with torch.no_grad():
            return self.fn(views)

    def tokens(self, raw):
        T = raw.shape[1]
        padded = pack([self.rows.padded(raw, padded_width(T, self.widths))], self.pin)[0]
        return self.call(self.feed(padded))["tokens"][:T].clone()

    def width_call(self, raw, T):
        N = padded_width(T, self.widths)
        padded, feed, call = pack([self.rows.padded(p, N) for p in raw], self.pin), self.feed, self.call
        return lambda i: call(feed(padded[i % N_SETS]))

    def trace_run(self, tr):
        feed, call = self.feed, self.call

        def run(idx):
            for i in idx:
                call(feed(tr.padded[i]))["tokens"][:tr.Ts[i]].cpu()
        return run


class _ReduceOverheadDefault(_ReduceOverhead):
    static = False


class _CgrtCompile(_Variant):
    def prepare(self):
        from cudagraph_rt import GraphRuntime

        mode = self.opts["cgrt_mode"]
        self.fn = torch.compile(self.m.step, mode=mode, dynamic=False)
        self.rt = GraphRuntime(self.fn, self.m.inputs(), widths=self.widths, graphs=self.m.device.type == "cuda",
                               device=self.m.device)  # graphs off only in a standalone CPU smoke run
        per = {}
        for w in self.widths:  # compile each width outside capture, as capture() will call it
            note(f"compiling width {w}")
            tw = time.perf_counter()
            with torch.inference_mode():
                for _ in range(WARM_CALLS):
                    self.fn(self.rt.static_inputs(w))
            self.sync()
            per[w] = time.perf_counter() - tw
        note("capturing the compiled step at every width")
        rep = self.rt.capture()
        return {"mode": mode, "per_width_s": per, "capture_s": rep.seconds, "pool_bytes": rep.pool_bytes}

    def tokens(self, raw):
        return self.rt.step(**self.rows.host(raw)).outputs["tokens"].clone()

    def width_call(self, raw, T):
        rt, host = self.rt, [self.rows.host(p) for p in raw]
        return lambda i: rt.step(**host[i % N_SETS])

    def trace_run(self, tr):
        rt = self.rt

        def run(idx):
            for i in idx:
                rt.step(**tr.host[i]).outputs["tokens"].cpu()
        return run


KINDS = {"static": _ReduceOverhead, "default": _ReduceOverheadDefault, "cgrt": _CgrtCompile, "eager": _Eager}


def _standalone_payload(model: ToyDecoder, rows: ToyRows, args) -> dict:
    from cudagraph_rt import default_widths

    widths = default_widths(64)
    sets = {T: [rows.rows(T) for _ in range(N_SETS)] for T in widths}
    trace = [rows.rows(T) for T in trace_widths(args.trace_steps, args.seed)]
    return make_payload(model.config, model.device, widths, seed=args.seed, repeats=args.repeats, warmup=args.warmup,
                        trace_passes=args.trace_passes, sets=sets, trace=trace)


def _token_check(var: _Variant, eager: _Eager, raws: list[torch.Tensor]) -> dict:
    """Tokens of the variant against the eager step on the same rows (both write the same
    cells with the same values, so the order does not matter); margins are ~8 logits."""
    rows = bad = 0
    for raw in raws:
        got, want = var.tokens(raw).cpu(), eager.tokens(raw).cpu()
        rows += want.numel()
        bad += int((got != want).sum())
    return {"rows": rows, "mismatched": bad, "widths": [int(r.shape[1]) for r in raws]}


def child_main(args) -> tuple[int, dict]:
    """Build the setup, then compile / warm up, check tokens, time each width, time the
    trace; the result file is rewritten after each stage. Returns (exit code, results)."""
    res = Results(args.out, setup=args.setup, variant=SETUPS[args.setup].variant, pid=os.getpid(),
                  torch=torch.__version__, stage="start")
    skip_log = _SkipLog()
    logging.getLogger("torch._inductor.cudagraph_utils.__cudagraphs").addHandler(skip_log)
    with contextlib.suppress(Exception):  # an abort here must not spend the timeout writing a core file
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    try:
        payload = torch.load(args.payload, weights_only=True) if args.payload else None
        if payload is not None:
            fields = dict(payload["config"])
            fields["dtype"] = getattr(torch, fields["dtype"])
            config, device = ToyConfig(**fields), torch.device(payload["device"])
        else:
            config = ToyConfig.tiny() if args.config == "tiny" else ToyConfig.bench()
            device = torch.device(args.device)
        if device.type == "cuda":
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(1)  # as the bench process does without graphs
        res.data["stage"] = "building the model"
        note(f"building the toy decoder on {device}")
        model = ToyDecoder(config, device)
        rows = ToyRows(model, payload["seed"] if payload else args.seed)  # warm-up rows (and standalone inputs)
        if payload is None:
            payload = _standalone_payload(model, rows, args)
        widths, pin, sync = tuple(payload["widths"]), device.type == "cuda", sync_fn(device)
        kw = {"repeats": payload["repeats"], "warmup": payload["warmup"], "sync": sync}
        sets = {int(T): list(t.unbind(0)) for T, t in (payload["sets"] or {}).items()}
        trace = None
        if payload["trace"] is not None:
            trace = build_trace(list(payload["trace"].split(payload["trace_Ts"], 1)), rows, widths, pin)
        opts = {"cgrt_mode": args.cgrt_compile_mode}
        var = KINDS[args.setup](model, rows, widths, pin, opts)

        res.data["stage"] = "compile" if args.setup != "eager" else "warm-up"
        res.write()
        t0 = time.perf_counter()
        with _dynamo_limits(4 * len(widths) + 8) if args.setup != "eager" else contextlib.nullcontext():
            info = var.prepare()
            sync()
            info["seconds"] = time.perf_counter() - t0
            info["per_width_s"] = {str(k): v for k, v in info.get("per_width_s", {}).items()}
            info["skip_reasons"] = list(skip_log.messages)
            res.data["compile"] = info
            res.write()

            res.data["stage"] = "token check"
            checks = [ps[0] for ps in sets.values()]
            if not checks and trace is not None:
                checks = [trace.packed[i] for i in trace.first_of_each_width()]
            eager = var if isinstance(var, _Eager) else _Eager(model, rows, widths, pin, opts)
            res.data["check"] = _token_check(var, eager, [c.clone() for c in checks])
            sync()
            res.write()

            res.data["step_time"] = {}
            for T, raw in sets.items():
                res.data["stage"] = f"step time at T={T}"
                note(f"step time: width {T}")
                lat, pipe = measure(var.width_call(raw, T), inference=var.inference, **kw)
                sync()
                res.data["step_time"][str(T)] = {"latency": lat, "pipelined_us": pipe}
                res.write()

            if trace is not None:
                res.data["stage"] = "mixed trace"
                note("mixed trace")
                res.data["trace"] = measure_trace(var.trace_run(trace), trace, payload["trace_passes"], sync)
                sync()
            res.data["compile"]["skip_reasons"] = list(skip_log.messages)
        res.data["stage"] = None
        res.data["done"] = True
        res.write()
        return 0, res.data
    except BaseException as e:  # noqa: BLE001 - reported to the bench through the result file
        first = (str(e).strip().splitlines() or [""])[0]
        res.data["error"] = f"{type(e).__name__}: {first}"[:400]
        res.data["traceback"] = traceback.format_exc()[-4000:]
        with contextlib.suppress(Exception):
            res.write()
        traceback.print_exc()
        return 1, res.data


def add_child_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--setup", choices=tuple(SETUPS), required=True)
    p.add_argument("--payload", help="inputs and settings written by cgrt bench (default: make them here)")
    p.add_argument("--out", help="JSON result file, rewritten after every stage")
    p.add_argument("--cgrt-compile-mode", choices=CGRT_MODES, default="default")
    g = p.add_argument_group("standalone (no --payload)")
    g.add_argument("--config", choices=("bench", "tiny"), default="bench")
    g.add_argument("--device", default="cuda")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--repeats", type=int, default=200)
    g.add_argument("--warmup", type=int, default=20)
    g.add_argument("--trace-steps", type=int, default=2000)
    g.add_argument("--trace-passes", type=int, default=3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cudagraph_rt.tools.bench.compile_child",
                                description=__doc__.splitlines()[0])
    add_child_arguments(p)
    args = p.parse_args(argv)
    rc, data = child_main(args)
    if args.out is None:  # standalone: the results on stdout
        print(json.dumps({k: v for k, v in data.items() if k != "traceback"}, indent=1, default=str))
    return rc


if __name__ == "__main__":
    sys.exit(main())
