"""What the sections of ``cgrt bench`` share, built lazily: the toy model, its input sets,
the runtime under test, the hand-written baselines and the mixed trace. A section that
is not asked for builds nothing it alone needs."""
from __future__ import annotations

import contextlib
import shutil
import tempfile
from functools import cached_property
from typing import Any

import torch

from cudagraph_rt import GraphRuntime, default_widths
from cudagraph_rt.models.toy import ToyConfig, ToyDecoder

from . import compile_setups
from .common import N_SETS, Feed, ToyRows, Trace, build_trace, capture_bare, sync_fn, trace_widths
from .compile_setups import SETUPS, CompileRuns


class Context:
    """Settings from the command line plus the shared objects, each made on first use."""

    def __init__(self, args: Any, progress: Any = None):
        self.quick = bool(args.quick)
        dev = args.device or ("cpu" if self.quick or not torch.cuda.is_available() else "cuda")
        if dev == "cuda":
            if not torch.cuda.is_available():
                raise SystemExit("cgrt bench: --device cuda but torch sees no CUDA device")
            # An indexed device: tensors report cuda:N, and torch.device("cuda") != "cuda:0".
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.graphs = self.device.type == "cuda"
        self.pin = self.graphs
        light = self.quick or not self.graphs  # a CPU's defaults: about a minute in all
        self.size = getattr(args, "size", None) or ("tiny" if light else "bench")
        self.config = ToyConfig.bench() if self.size == "bench" else ToyConfig.tiny()
        self.repeats = args.repeats or (5 if light else 200)
        self.warmup = args.warmup if args.warmup is not None else (2 if light else 20)
        self.trace_steps = args.trace_steps or (200 if light else 2000)
        self.trace_passes = 1 if light else 3
        self.seed = args.seed
        self.all_widths = bool(args.all_widths)
        self.use_compile = not args.no_compile
        self.sections = tuple(getattr(args, "sections", None) or (1, 2))
        self.compile_setups = tuple(getattr(args, "compile_setups", None) or compile_setups.DEFAULT_SETUPS)
        self.compile_timeout = float(getattr(args, "compile_timeout", None) or 240)
        self.cgrt_compile_mode = getattr(args, "cgrt_compile_mode", None) or "default"
        self.widths = default_widths(64)
        self.sync = sync_fn(self.device)
        self.progress = progress
        self.first_capture = None
        self.stack = contextlib.ExitStack()  # what close() undoes (the compile children's files)

    def close(self) -> None:
        """Undo process-wide settings; remove the compile children's files."""
        self.stack.close()

    def note(self, text: str, always: bool = False) -> None:
        """Progress: a status line on a terminal; ``always`` notes also in a log."""
        if self.progress is not None:
            self.progress(text, always)

    # -- shared objects ----------------------------------------------------------------
    @cached_property
    def model(self) -> ToyDecoder:
        self.note("building the toy decoder")
        return ToyDecoder(self.config, self.device)

    @cached_property
    def rows(self) -> ToyRows:
        return ToyRows(self.model, self.seed)

    @cached_property
    def feed(self) -> Feed:
        return Feed(self.rows.names, self.device)

    @cached_property
    def step_widths(self) -> list[int]:
        """The T of section 1."""
        return list(range(1, self.widths[-1] + 1)) if self.all_widths else list(self.widths)

    @cached_property
    def width_sets(self) -> dict[int, list[torch.Tensor]]:
        """Section 1's input sets: N_SETS packed [n, T] rows per T (CPU int64), shared by
        every variant, the compile children included."""
        rows = self._rows_stream(1)
        return {T: [rows.rows(T) for _ in range(N_SETS)] for T in self.step_widths}

    def _rows_stream(self, k: int) -> ToyRows:
        """A ToyRows of its own for one purpose: its draws do not depend on which sections ran."""
        return ToyRows(self.model, self.seed * 1_000_003 + k)

    def make_runtime(self, widths=None, step_fn=None, inputs=None, **kw) -> GraphRuntime:
        m = self.model
        return GraphRuntime(step_fn or m.step, inputs or m.inputs(), widths=widths or self.widths,
                            graphs=self.graphs, device=self.device, **kw)

    @cached_property
    def runtime(self) -> GraphRuntime:
        """The runtime under test (default widths); its capture is the first in the process."""
        self.note("capturing the runtime's graphs")
        rt = self.make_runtime()
        self.first_capture = rt.capture()
        return rt

    @cached_property
    def bare(self) -> tuple[dict, float] | None:
        """Hand-captured graphs per default width and their capture seconds (None on CPU)."""
        if not self.graphs:
            return None
        self.note("capturing the bare graphs")
        return capture_bare(self.model.step, self.rows, self.widths, self.device)

    @cached_property
    def compiled(self) -> CompileRuns:
        """The torch.compile setups, each run in a child process (compile_setups) over this
        process's inputs: section 1's sets if section 1 is asked for, the trace if section 2
        is. Never raises for a child's failure: it is in the setup's record."""
        names = self.compile_setups
        if not self.graphs:
            return CompileRuns([compile_setups.skipped(SETUPS[n], "needs CUDA") for n in names])
        if not self.use_compile:
            return CompileRuns([compile_setups.skipped(SETUPS[n], "--no-compile") for n in names])
        sets = self.width_sets if 1 in self.sections else None
        raw = self.trace_raw if 2 in self.sections else None
        payload = compile_setups.make_payload(self.config, self.device, self.widths, seed=self.seed,
                                             repeats=self.repeats, warmup=self.warmup,
                                             trace_passes=self.trace_passes, sets=sets, trace=raw)
        folder = tempfile.mkdtemp(prefix="cgrt-bench-")
        self.stack.callback(shutil.rmtree, folder, ignore_errors=True)
        self.note(f"torch.compile setups {','.join(names)}: one child process each (minutes)", always=True)
        return compile_setups.run_setups(names, payload, folder, timeout=self.compile_timeout,
                                        cgrt_mode=self.cgrt_compile_mode, note=self.note)

    @cached_property
    def trace_raw(self) -> list[torch.Tensor]:
        """The mixed trace's steps as packed [n, T] CPU rows (the compile children get these)."""
        rows = self._rows_stream(2)
        return [rows.rows(T) for T in trace_widths(self.trace_steps, self.seed)]

    @cached_property
    def trace(self) -> Trace:
        self.note("generating the mixed trace")
        return build_trace(self.trace_raw, self.rows, self.widths, self.pin)
