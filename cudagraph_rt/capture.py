"""Capture one width: warm-up on a side stream, capture into the shared pool, and turn
any failure into a CaptureError that leaves the CUDA context usable."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .errors import CaptureError, CgrtError


@dataclass(frozen=True)
class WidthCapture:
    """How one width's capture went: seconds of warm-up and capture, pool bytes reserved
    after it (all widths share one pool, so this grows only where a width needs more),
    and ``error`` (a message) when the width fell back to eager execution."""

    width: int
    warmup_s: float
    capture_s: float
    pool_bytes: int
    error: str | None = None


@dataclass(frozen=True)
class CaptureReport:
    """Every width's capture, largest first, and the shared pool's size after all."""

    widths: tuple[WidthCapture, ...]
    seconds: float
    pool_bytes: int

    def to_json(self) -> dict:
        return {
            "seconds": self.seconds,
            "pool_bytes": self.pool_bytes,
            "widths": [vars(w) for w in self.widths],
        }


def _reset_after_failure(stream: torch.cuda.Stream) -> None:
    """End a capture left open by an exception, and clear the (non-sticky) error state."""
    try:
        if stream.is_capturing() if hasattr(stream, "is_capturing") else torch.cuda.is_current_stream_capturing():
            torch.cuda.cudart().cudaStreamEndCapture(stream.cuda_stream)
    except Exception:  # noqa: BLE001 - best effort; the checks below tell if it worked
        pass
    try:
        torch.cuda.cudart().cudaGetLastError()
    except Exception:  # noqa: BLE001
        pass
    torch.cuda.synchronize()


def capture_width(
    width: int,
    run: Callable[[], Any],
    *,
    pool,
    warmup: int,
    keep_graph: bool,
    explain: Callable[[], tuple] = lambda: (),
) -> tuple[torch.cuda.CUDAGraph, Any, float, float]:
    """Warm ``run`` up on a side stream, then capture it at ``width`` into ``pool``.

    Returns ``(graph, outputs, warmup_s, capture_s)``; ``outputs`` are the static tensors
    the graph writes. Raises CaptureError naming the width, the failing operation and,
    through ``explain`` (the hazard finder), the user's source line; afterwards no stream
    is capturing and graphs captured before still replay.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    t0 = time.perf_counter()
    try:
        with torch.cuda.stream(side):
            for _ in range(warmup):
                run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    except CgrtError:
        raise
    except Exception as e:  # the step function fails even eagerly: not a capture problem
        raise CaptureError(
            f"width {width}: the step function raised during warm-up: {type(e).__name__}: {e}",
            width=width, cause=e,
        ) from e
    t1 = time.perf_counter()
    graph = torch.cuda.CUDAGraph(keep_graph=True) if keep_graph else torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            outputs = run()
        if keep_graph:
            graph.instantiate()
    except Exception as e:  # noqa: BLE001 - every capture failure becomes a CaptureError
        _reset_after_failure(side)
        hazards = explain()
        where = "".join(f"\n  {h}" for h in hazards) or "\n  (the hazard finder saw no known hazard)"
        raise CaptureError(
            f"width {width}: capture failed: {type(e).__name__}: {str(e).strip().splitlines()[0]}"
            f"\nwhat cannot be captured:{where}",
            width=width, hazards=hazards, cause=e,
        ) from e
    torch.cuda.synchronize()
    return graph, outputs, t1 - t0, time.perf_counter() - t1
