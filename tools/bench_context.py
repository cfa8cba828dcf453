"""What the sections of ``cgrt bench`` share, built lazily: the toy model, its input sets,
the runtime under test, the hand-written baselines and the mixed trace. A section that
is not asked for builds nothing it alone needs."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from cudagraph_rt import GraphRuntime, default_widths
from cudagraph_rt.models.toy import ToyConfig, ToyDecoder

from .bench_common import Compiled, Feed, ToyRows, capture_bare, compile_step, pack, padded_width, sync_fn, trace_widths


@dataclass
class Trace:
    """The mixed trace: ``Ts[i]`` rows at step i, as the runtime gets them (``host``:
    pageable per-input tensors) and as the hand-written runners get them (``packed``:
    pinned [n, T]; ``padded``: pinned [n, N] at the default width set)."""

    Ts: list[int]
    host: list[dict[str, torch.Tensor]]
    packed: list[torch.Tensor]
    padded: list[torch.Tensor]

    def first_of_each_width(self) -> list[int]:
        seen: dict[int, int] = {}
        for i, T in enumerate(self.Ts):
            seen.setdefault(T, i)
        return sorted(seen.values())


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
        self.config = ToyConfig.tiny() if self.quick else ToyConfig.bench()
        self.repeats = args.repeats or (5 if self.quick else 200)
        self.warmup = args.warmup if args.warmup is not None else (2 if self.quick else 20)
        self.trace_steps = args.trace_steps or (200 if self.quick else 2000)
        self.trace_passes = 1 if self.quick else 3
        self.seed = args.seed
        self.all_widths = bool(args.all_widths)
        self.use_compile = not args.no_compile
        self.widths = default_widths(64)
        self.sync = sync_fn(self.device)
        self.progress = progress
        self.first_capture = None
        self.stack = contextlib.ExitStack()  # process-wide settings the bench changed; see close()

    def close(self) -> None:
        """Undo process-wide settings (torch.compile's recompile limit)."""
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
    def compile_feed(self) -> Feed:
        return Feed(self.rows.names, self.device)

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
    def compiled(self) -> Compiled:
        if not self.graphs:
            return Compiled(None, "needs CUDA (reduce-overhead is CUDA graphs)")
        if not self.use_compile:
            return Compiled(None, "--no-compile")
        self.note("torch.compile(mode='reduce-overhead') at each width (minutes)", always=True)
        return compile_step(self.model, self.rows, self.compile_feed, self.widths, self.stack)

    @cached_property
    def trace(self) -> Trace:
        self.note("generating the mixed trace")
        Ts = trace_widths(self.trace_steps, self.seed)
        raw = [self.rows.rows(T) for T in Ts]
        return Trace(Ts, [self.rows.host(p) for p in raw], pack(raw, self.pin),
                     pack([self.rows.padded(p, padded_width(p.shape[1], self.widths)) for p in raw], self.pin))
