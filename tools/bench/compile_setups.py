"""The torch.compile variants of ``cgrt bench``, each in a child process of its own: the
bench-process side (the child is ``compile_child``).

Why a child: inductor's CUDA graphs can take the whole process down (an illegal memory
access surfaces as ``terminate called ...`` from a destructor: no Python exception to
catch). The bench process only writes a payload, runs

    python -m cudagraph_rt.tools.bench.compile_child --setup NAME --payload FILE --out FILE

with a timeout, and reads back what the child wrote. A crash (non-zero exit, a signal)
or a timeout becomes "unavailable: <how it ended; its error; last lines of its output>";
stages the child finished before (compile, step time, trace) are still reported.

Setups (``--compile-setups``, run one child each, in this order):

  static   (a) torch.compile(model.step, mode="reduce-overhead", dynamic=False), weights
               and KV pool marked with torch._dynamo.mark_static_address: inductor's
               CUDA graphs (cudagraph trees) really replay
  default  (b) the same without marking: what a user gets by default; inductor may skip
               CUDA graphs because the step writes the KV pool in place (mutated inputs)
  cgrt     cudagraph_rt capturing torch.compile(model.step, mode=--cgrt-compile-mode,
               dynamic=False) at every width (each width compiled by warm-up calls first)
  eager    control: the eager variant of the bench, timed in a child (not by default)

Same model (ToyConfig and seed from the payload), same input sets and trace (the
bench's packed CPU tensors, in the payload), same timing helpers (``common.measure``
and ``measure_trace``: repeats, warm-up, sets rotated, clock), same call bodies as the
bench process uses for eager / compile. The bench process is idle while a child runs.

This module holds what the two sides share (the setups, the payload, the progress-line
prefix) and the bench side (run a child, read and summarize what it left). It never
imports the child module (the child imports this one).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `cgrt bench --help` reads SETUPS before it
    import torch

    from cudagraph_rt.models.toy import ToyConfig

NOTE = "cgrt-child: "  # a child's progress lines start with this; the bench shows them


@dataclass(frozen=True)
class Setup:
    name: str
    variant: str  # key of its figures in the bench JSON (rows, trace variants)
    label: str  # column / row name in the tables
    what: str


SETUPS = {s.name: s for s in (
    Setup("static", "compile_static", "ro-static",
          "(a) torch.compile(model.step, mode='reduce-overhead', dynamic=False), weights and KV pool marked "
          "with torch._dynamo.mark_static_address (inductor's CUDA graphs); warmed up at each padded width; "
          "inputs: one pinned packed host-to-device copy at the padded width; until synchronize"),
    Setup("default", "compile_default", "ro-default",
          "(b) torch.compile(model.step, mode='reduce-overhead', dynamic=False), nothing marked (the default "
          "a user gets; inductor may skip CUDA graphs for the in-place KV write: the caption says whether it did); otherwise as (a)"),
    Setup("cgrt", "cgrt_compile", "cgrt+compile",
          "GraphRuntime(torch.compile(model.step, mode=<cgrt mode>, dynamic=False)) captured by cudagraph_rt "
          "at every width (each width compiled by warm-up calls first); step(**inputs) as the cgrt variant"),
    Setup("eager", "eager_child", "eager (child)",
          "control: the eager variant timed in a child process (compare with eager: process-to-process noise)"),
)}
DEFAULT_SETUPS = ("static", "default", "cgrt")
CGRT_MODES = ("default", "max-autotune-no-cudagraphs")


# ============================================================== in the bench process
@dataclass
class ChildRun:
    """How a child ended and what it left: ``data`` is its result file (possibly partial)."""

    returncode: int | None
    timed_out: bool
    wall_s: float
    data: dict | None
    tail: list[str]
    start_error: str | None = None
    skip_lines: list[str] = field(default_factory=list)  # "skipping cudagraphs ..." lines seen

    def ended_badly(self, timeout: float) -> str | None:
        """None when the child exited 0 with every stage done, else how it ended."""
        if self.start_error:
            return f"could not start: {self.start_error}"
        if self.timed_out:
            return f"timed out after {timeout:.0f} s (killed)"
        rc = self.returncode
        if rc is not None and rc < 0:
            try:
                return f"crashed: killed by {signal.Signals(-rc).name}"
            except ValueError:
                return f"crashed: killed by signal {-rc}"
        if rc:
            return f"exit code {rc}"
        if not (self.data or {}).get("done"):
            return "exited without results"
        return None


_KEY_LINE = re.compile(r"error|terminate called|what\(\)|exception|traceback|killed|segmentation|abort",
                       re.IGNORECASE)


def key_lines(tail: list[str], keep: int = 3, last: int = 2) -> list[str]:
    """What to quote from a failed child's output: up to ``keep`` lines that name an error
    (the first ones, often the cause) and the ``last`` lines."""
    lines = [ln.strip() for ln in tail if ln.strip() and not ln.startswith(NOTE)]
    picked: list[str] = []
    for ln in lines:
        if _KEY_LINE.search(ln) and ln not in picked:
            picked.append(ln)
        if len(picked) == keep:
            break
    for ln in lines[-last:]:
        if ln not in picked:
            picked.append(ln)
    return picked


def _pump(stream, tail: deque, skips: list[str], on_note: Callable[[str], None] | None) -> None:
    for line in stream:
        line = line.rstrip("\n")
        tail.append(line)
        if "skipping cudagraph" in line and line.strip() not in skips and len(skips) < 8:
            skips.append(line.strip()[:400])
        if on_note is not None and line.startswith(NOTE):
            with contextlib.suppress(Exception):
                on_note(line[len(NOTE):])


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child and its own descendants (it leads a new session: its process group
    holds only processes it started, e.g. inductor's compile workers)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(timeout=10)


def read_result(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_child(cmd: list[str], out_path: str, *, timeout: float, env: dict | None = None,
              on_note: Callable[[str], None] | None = None, tail_lines: int = 60) -> ChildRun:
    """Run ``cmd`` (stdout and stderr merged, kept in a tail of ``tail_lines``; lines
    starting with NOTE also go to ``on_note``), wait up to ``timeout`` s, then read the
    JSON the child left at ``out_path``. Never raises for the child's sake: a crash, a
    signal or a timeout is in the returned ChildRun. KeyboardInterrupt kills the child
    first, then propagates."""
    tail: deque = deque(maxlen=tail_lines)
    skips: list[str] = []
    t0 = time.perf_counter()
    with contextlib.suppress(FileNotFoundError):
        os.remove(out_path)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, text=True, errors="replace", bufsize=1)
    except OSError as e:
        return ChildRun(None, False, 0.0, None, [], start_error=f"{type(e).__name__}: {e}")
    reader = threading.Thread(target=_pump, args=(proc.stdout, tail, skips, on_note), daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
    except BaseException:
        _kill_group(proc)
        raise
    reader.join(timeout=5)
    if reader.is_alive():
        # A descendant still holds the output pipe open, so the child's process group
        # still has members (all started by the child): end them.
        _kill_group(proc)
        reader.join(timeout=5)
    return ChildRun(proc.returncode, timed_out, time.perf_counter() - t0, read_result(out_path), list(tail),
                    skip_lines=skips)


def child_command(setup: str, payload: str, out: str, cgrt_mode: str) -> list[str]:
    return [sys.executable, "-m", "cudagraph_rt.tools.bench.compile_child", "--setup", setup, "--payload", payload,
            "--out", out, "--cgrt-compile-mode", cgrt_mode]


def child_env() -> dict:
    """The bench's environment with the package importable from its source tree too."""
    import cudagraph_rt

    root = os.path.dirname(os.path.dirname(os.path.abspath(cudagraph_rt.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def summarize_run(setup: Setup, run: ChildRun, timeout: float, cmd: list[str] | None = None) -> dict:
    """A JSON-able record of one setup: status ok / partial (some stages measured, then
    the child failed) / unavailable, the reason with the child's last lines, compile
    facts and the figures (``step_time`` {T: summary}, ``pipelined_us`` {T: µs},
    ``trace``)."""
    d = run.data or {}
    comp = d.get("compile") or {}
    st = {int(T): v for T, v in (d.get("step_time") or {}).items()}
    how = run.ended_badly(timeout)
    status, reason = "ok", None
    if how is not None:
        if d.get("done"):  # every stage done and synchronized; it died at exit
            reason = f"finished, then {how} at exit"
        else:
            status = "partial" if st or d.get("trace") else "unavailable"
            parts = [how]
            if d.get("error"):
                parts.append(d["error"])
            if d.get("stage"):
                parts.append(f"during {d['stage']}")
            quoted = key_lines(run.tail)
            if quoted:
                parts.append("last lines: " + " | ".join(quoted))
            reason = "; ".join(parts)[:900]
    return {
        "setup": setup.name, "variant": setup.variant, "label": setup.label, "what": setup.what,
        "status": status, "reason": reason,
        "seconds": comp.get("seconds"), "per_width_s": comp.get("per_width_s") or {},
        "capture_s": comp.get("capture_s"), "mode": comp.get("mode"),
        "cudagraph_skips": comp.get("cudagraph_skips"),
        "skip_reasons": comp.get("skip_reasons") or run.skip_lines,
        "tokens_check": d.get("check"),
        "step_time": {T: v["latency"] for T, v in st.items()},
        "pipelined_us": {T: v["pipelined_us"] for T, v in st.items()},
        "trace": d.get("trace"),
        "child": {"returncode": run.returncode, "timed_out": run.timed_out, "wall_s": run.wall_s,
                  "command": cmd, "output_tail": run.tail[-30:], "start_error": run.start_error},
    }


def skipped(setup: Setup, reason: str) -> dict:
    return {"setup": setup.name, "variant": setup.variant, "label": setup.label, "what": setup.what,
            "status": "skipped", "reason": reason, "step_time": {}, "pipelined_us": {}, "trace": None}


class CompileRuns:
    """The setups' records, in run order, and which one the cgrt goals compare with."""

    def __init__(self, records: list[dict]):
        self.records = records

    def __iter__(self):
        return iter(self.records)

    def get(self, name: str) -> dict | None:
        return next((r for r in self.records if r["setup"] == name), None)

    def reference(self, stage: str) -> tuple[str | None, str]:
        """(variant, note) of the compile figure the cgrt goals use for ``stage``
        ("step_time" or "trace"): (a) if it measured that stage, else (b) with a note."""
        a, b = self.get("static"), self.get("default")
        if a and a.get(stage):
            n = a.get("cudagraph_skips")
            return a["variant"], (f"(a) ro-static; NOTE: it too skipped CUDA graphs {n}x" if n else "(a) ro-static")
        if b and b.get(stage):
            why = ((a or {}).get("reason") or "not run (--compile-setups)").split(";")[0]
            n = b.get("cudagraph_skips")
            graphs = f"runs WITHOUT CUDA graphs (skipped {n}x)" if n else "cudagraph skips: none reported"
            return b["variant"], f"(b) ro-default, since (a) ro-static has no figure ({why[:160]}); (b) {graphs}"
        ro = [r for r in self.records if r["setup"] in ("static", "default")]
        if ro and all(r["status"] == "skipped" for r in ro) and len({r["reason"] for r in ro}) == 1:
            return None, f"skipped: {ro[0]['reason']}"
        reasons = "; ".join(f"{r['label']}: {r['status']}: {r.get('reason') or ''}"[:250] for r in ro)
        return None, reasons or "no reduce-overhead setup asked for (--compile-setups)"

    def to_json(self) -> list[dict]:
        """The records without their figures (those are in the section rows)."""
        return [{k: v for k, v in r.items() if k not in ("step_time", "pipelined_us", "trace")}
                for r in self.records]


def run_setups(names: tuple[str, ...], payload: dict, folder: str, *, timeout: float, cgrt_mode: str,
               note: Callable[..., None] = lambda text, always=False: None) -> CompileRuns:
    """Write ``payload`` once and run one child per setup, one after another. ``note(text,
    always)``: progress (``always`` for each child's start and end, also in a log)."""
    import torch

    path = os.path.join(folder, "payload.pt")
    try:
        torch.save(payload, path)
    except Exception as e:  # noqa: BLE001 - reported per setup, the bench goes on
        return CompileRuns([{**skipped(SETUPS[n], ""), "status": "unavailable",
                             "reason": f"could not write the payload: {type(e).__name__}: {e}"[:300]} for n in names])
    env = child_env()
    out = []
    for name in names:
        setup = SETUPS[name]
        res = os.path.join(folder, f"{name}.json")
        cmd = child_command(name, path, res, cgrt_mode)
        note(f"{setup.label}: child process started (timeout {timeout:.0f} s)", True)
        run = run_child(cmd, res, timeout=timeout, env=env, on_note=lambda s, lb=setup.label: note(f"{lb}: {s}"))
        rec = summarize_run(setup, run, timeout, cmd)
        end = f"{setup.label}: {rec['status']} after {run.wall_s:.0f} s"
        note(end + (f": {rec['reason'][:300]}" if rec["reason"] else ""), True)
        out.append(rec)
    return CompileRuns(out)


def config_fields(cfg: "ToyConfig") -> dict:
    return {f.name: (str(getattr(cfg, f.name)).removeprefix("torch.") if f.name == "dtype"
                     else list(cfg.taps) if f.name == "taps" else getattr(cfg, f.name))
            for f in dataclasses.fields(cfg)}


def make_payload(config: "ToyConfig", device: "torch.device", widths: tuple[int, ...], *, seed: int, repeats: int,
                 warmup: int, trace_passes: int, sets: "dict[int, list[torch.Tensor]] | None",
                 trace: "list[torch.Tensor] | None") -> dict:
    """What a child needs: the model's config, the measuring settings and the very input
    sets (``sets``: T -> N_SETS packed [n, T]) and trace steps the bench process uses, as
    CPU int64 tensors. Loadable with ``torch.load(weights_only=True)``."""
    import torch

    return {
        "config": config_fields(config), "device": str(device), "widths": list(widths), "seed": seed,
        "repeats": repeats, "warmup": warmup, "trace_passes": trace_passes,
        "sets": {int(T): torch.stack([p.contiguous() for p in ps]) for T, ps in sets.items()} if sets else None,
        "trace_Ts": [int(p.shape[1]) for p in trace] if trace else None,
        "trace": torch.cat(trace, 1).contiguous() if trace else None,
    }
