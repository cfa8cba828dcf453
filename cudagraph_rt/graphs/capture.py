"""Capture one width: warm-up on a side stream, capture into the shared pool, and turn
any failure into a CaptureError that leaves the CUDA context usable."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from .hygiene import no_collection, release_blas_workspaces, reset_after_failure
from ..errors import CaptureError, CgrtError, StaleCaptureError


@dataclass(frozen=True)
class WidthCapture:
    """How one width's capture went: seconds of warm-up and capture, pool bytes reserved
    after it (all widths share one pool, so this grows only where a width needs more),
    ``mode`` what the width runs as (``"graph"``: one whole graph, ``"pieces"``: graphs
    split at the calls marked ``cudagraph_rt.eager``, ``"eager"``: no graph), ``pieces``
    (graphs of the width: 1 whole, 0 eager) and ``eager_calls`` (the marked calls between
    the pieces, in order), and ``error`` (a message) when the width fell back from a
    failed capture (to pieces, or to eager execution). ``pool``: which pool of this
    capture the width's graphs went into, 0 the first; a failed capture attempt may leave
    its stream and pool unusable, so what is captured after it goes into a fresh pool on a
    fresh stream (1, then 2, ...: no memory shared with the widths before); None for a
    width without graphs. Emulated graphs count their pools the same way (no memory)."""

    width: int
    warmup_s: float
    capture_s: float
    pool_bytes: int
    error: str | None = None
    mode: str = "graph"
    pieces: int = 1
    eager_calls: tuple[str, ...] = ()
    pool: int | None = 0


@dataclass(frozen=True)
class CaptureReport:
    """Every width's capture, largest first, and the shared pool's size after all.

    ``step_fn_calls``: how many times capture ran the step function (the first-use probe
    at the widest width when HostRows is set, then ``warmup`` eager runs and one captured
    run per width). Every one of them ran on padding rows only (each input's ``pad``), so
    a step function that keeps state of its own, beyond what its inputs index (a counter
    it advances per call, as transformers' StaticCache does), was advanced that many
    times before the first real step. ``graph_mode``: what the widths were captured as
    (``"emulated"``: eager re-runs standing in for CUDA graphs, no pool)."""

    widths: tuple[WidthCapture, ...]
    seconds: float
    pool_bytes: int
    step_fn_calls: int = 0
    graph_mode: str = "cuda"  # "cuda", "emulated" (graphs="emulate") or "off"

    def to_json(self) -> dict:
        return {
            "graph_mode": self.graph_mode,
            "seconds": self.seconds,
            "pool_bytes": self.pool_bytes,
            "step_fn_calls": self.step_fn_calls,
            "rows_of_those_calls": "padding rows only",
            "widths": [vars(w) for w in self.widths],
        }


class WatchedTensors:
    """The addresses and shapes of the tensors ``watch()`` lists, remembered at capture:
    ``check`` raises StaleCaptureError (before anything is written) once one moved."""

    def __init__(self, watch: Callable[[], Iterable[torch.Tensor]] | None):
        self._watch, self._seen = watch, None

    def _now(self):
        return None if self._watch is None else [(t.data_ptr(), tuple(t.shape)) for t in self._watch()]

    @property
    def watching(self) -> bool:
        """Whether any tensors are watched (else ``check`` never raises)."""
        return self._watch is not None

    def remember(self) -> None:
        self._seen = self._now()

    def forget(self) -> None:
        self._seen = None

    def check(self) -> None:
        if self._seen is not None and self._now() != self._seen:
            raise StaleCaptureError(
                "a tensor listed by watch() moved or changed shape since capture; replaying would "
                "use the old memory: call recapture()"
            )


@dataclass(frozen=True)
class CaptureSettings:
    """How widths are captured: on which device, how many eager warm-up runs first, and
    whether each graph stays readable (``keep_graph``). What a failed width does next is
    the capture policy's (``policy.CapturePolicy``)."""

    device: torch.device
    warmup: int
    keep_graph: bool


class WidthCapturer:
    """Captures widths one by one into one shared pool on one side stream (cuBLAS keeps a
    workspace per stream, so one stream keeps one workspace in the pool). After a failed
    attempt the stream and pool may be spoiled: the capture loop calls ``renew``, so later
    widths get fresh ones (and no longer share memory with the widths before; ``pool``
    counts them for the report). Lifetime: the pool lives while its graphs do."""

    def __init__(self, settings: CaptureSettings):
        self.settings = settings
        self.stream: torch.cuda.Stream | None = None
        self.pool = None
        self.pool_index = 0  # which pool of this capture ``pool`` is (WidthCapture.pool)
        self._base = 0

    def begin(self) -> None:
        """A fresh pool (the previous one's graphs were dropped or are kept alive by their
        own references); memory reserved from here on is the pool's."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self._base = torch.cuda.memory_reserved(self.settings.device)
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = self.stream or torch.cuda.Stream(self.settings.device)
        self.pool_index = 0

    def renew(self) -> None:
        """A fresh stream and pool for what is captured next: a failed capture may have
        left its own unusable (graphs captured into them before keep them)."""
        self.stream, self.pool = torch.cuda.Stream(self.settings.device), torch.cuda.graph_pool_handle()
        self.pool_index += 1

    def pool_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.settings.device) - self._base

    def width(self, w: int, run: Callable[[], Any], replay: Callable[[], Any], explain: Callable[[], tuple]):
        """``(graph, outputs, WidthCapture)`` of one whole graph, or CaptureError (then
        ``renew`` before capturing anything else). ``run`` is warmed up and captured;
        ``replay`` (the same work, uncounted) is for emulated graphs, which re-run it."""
        st = self.settings
        return self._guarded(w, lambda: capture_width(w, run, pool=self.pool, stream=self.stream, warmup=st.warmup,
                                                      keep_graph=st.keep_graph, explain=explain))

    def pieces(self, w: int, run: Callable[[], Any], replay: Callable[[], Any], explain: Callable[[], tuple]):
        """``(PiecewiseGraph, outputs, WidthCapture)``: the width in pieces (see
        ``piece_capture``), or CaptureError as ``width``."""
        from .piece_capture import capture_pieces
        st = self.settings
        return self._guarded(w, lambda: capture_pieces(w, run, pool=self.pool, stream=self.stream, warmup=st.warmup,
                                                       keep_graph=st.keep_graph, explain=explain))

    def _guarded(self, w: int, capture: Callable[[], tuple]):
        g, out, tw, tc = capture()
        torch.cuda.empty_cache()
        return g, out, WidthCapture(w, tw, tc, self.pool_bytes(), pool=self.pool_index)

    def body(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """A graph of ``fn`` in the pool (a host-row choice's own, e.g. commit's gather):
        one eager run on the capture stream, then the capture."""
        g, stream = torch.cuda.CUDAGraph(), self.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(g, pool=self.pool, stream=stream):
            fn()
        return g

    def drop(self) -> None:
        self.pool = None


def _warm_up(width: int, run: Callable[[], Any], side: torch.cuda.Stream, warmup: int) -> None:
    """``warmup`` eager runs on the capture stream (compiles kernels, creates cuBLAS
    handles); a step function that fails even eagerly is no capture problem."""
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(warmup):
                run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    except CgrtError:
        raise
    except Exception as e:
        raise CaptureError(
            f"width {width}: the step function raised during warm-up: {type(e).__name__}: {e}",
            width=width, cause=e,
        ) from e


def capture_width(
    width: int,
    run: Callable[[], Any],
    *,
    pool,
    stream: torch.cuda.Stream,
    warmup: int,
    keep_graph: bool,
    explain: Callable[[], tuple] = lambda: (),
) -> tuple[torch.cuda.CUDAGraph, Any, float, float]:
    """Warm ``run`` up on a side stream, then capture it at ``width`` into ``pool``.

    Returns ``(graph, outputs, warmup_s, capture_s)``; ``outputs`` are the static tensors
    the graph writes. Raises CaptureError naming the width, the failing operation and,
    through ``explain`` (the hazard finder), the user's source line; afterwards no stream
    is capturing and graphs captured before still replay; the caller should capture later
    widths on a fresh stream and pool (``stream`` and ``pool`` may be left unusable).
    """
    side, caller = stream, torch.cuda.current_stream()
    t0 = time.perf_counter()
    _warm_up(width, run, side, warmup)
    t1 = time.perf_counter()
    graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
    release_blas_workspaces()  # the capture allocates its own, inside the pool
    try:
        with no_collection(), torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            outputs = run()
        if keep_graph:
            graph.instantiate()
    except Exception as e:  # noqa: BLE001 - every capture failure becomes a CaptureError
        release_blas_workspaces()
        reset_after_failure(side, caller, pool)
        hazards = explain()
        where = "".join(f"\n  {h}" for h in hazards) or "\n  (the hazard finder saw no known hazard)"
        raise CaptureError(
            f"width {width}: capture failed: {type(e).__name__}: {str(e).strip().splitlines()[0]}"
            f"\nwhat cannot be captured:{where}",
            width=width, hazards=hazards, cause=e,
        ) from e
    torch.cuda.synchronize()
    release_blas_workspaces()  # no cache keeps the pool's workspace: only the graph uses it
    return graph, outputs, t1 - t0, time.perf_counter() - t1
