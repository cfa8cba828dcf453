"""Capture one width in pieces: CUDA graphs split at the calls marked ``eager`` (see
``pieces``), or their emulation on any device. A failure becomes a CaptureError naming the
width and the piece (1-based: piece 1 runs up to the first marked call) or the marked call,
and leaves the CUDA context as ``capture.capture_width`` leaves it after a failed width."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from .hygiene import no_collection, release_blas_workspaces, reset_after_failure
from ..errors import CaptureError, CgrtError
from ..pieces import frozen, marked_calls
from .pieces import ArgumentsSeen, EagerCall, PiecewiseGraph


class _MarkedCallFailed(Exception):
    """A marked call raised while a width was captured in pieces (not a capture problem
    of the piece before it: the call ran outside any capture), or did what no replay can
    honour (``refused``: a CaptureError of ``EagerCall``, saying what)."""

    def __init__(self, index: int, name: str, cause: BaseException, refused: bool = False):
        what = str(cause) if refused else f"raised: {type(cause).__name__}: {cause}"
        super().__init__(f"marked call {index} ({name}) {what}")
        self.index, self.cause, self.refused = index, cause, refused


class _Counter:
    """Warm-up: marked calls run as plain calls, counted, so a failure names its piece."""

    def __init__(self):
        self.calls = 0

    def restart(self) -> None:
        self.calls = 0

    @property
    def piece(self) -> int:
        return self.calls + 1

    def __call__(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        self.calls += 1
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - named by call, not by piece
            raise _MarkedCallFailed(self.calls, getattr(fn, "__qualname__", repr(fn)), e) from e

    def record(self, fn: Callable, args: tuple, kwargs: dict, out: Any, before: ArgumentsSeen) -> EagerCall:
        """The call just made, recorded (its ``eager(bind=)`` runs here: a failure there is
        this call's, as one of the call itself; so is what no replay can honour, refused
        by ``EagerCall``: an output that is no tensor, an argument replaced or reshaped)."""
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            return EagerCall(fn, args, kwargs, out, before)
        except CaptureError as e:
            raise _MarkedCallFailed(self.calls, name, e, refused=True) from e
        except Exception as e:  # noqa: BLE001 - named by call, not by piece
            raise _MarkedCallFailed(self.calls, name, e) from e


class _CudaRecorder(_Counter):
    """The capture run: each marked call ends the piece being captured, replays it (so the
    call reads what the pieces before it really wrote, not uninitialised pool memory),
    runs the call outside any capture and begins the next piece in the same pool."""

    def __init__(self, pool, keep_graph: bool):
        super().__init__()
        self.pool, self.keep_graph = pool, keep_graph
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.recorded: list[EagerCall] = []
        self._open: torch.cuda.CUDAGraph | None = None

    def begin(self) -> None:
        release_blas_workspaces()  # each piece's matmuls get a workspace inside the pool
        g = torch.cuda.CUDAGraph(keep_graph=True) if self.keep_graph else torch.cuda.CUDAGraph()
        g.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        self._open = g

    def end(self) -> torch.cuda.CUDAGraph:
        g, self._open = self._open, None
        g.capture_end()
        if self.keep_graph:
            g.instantiate()
        self.graphs.append(g)
        return g

    def __call__(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        self.end().replay()
        before = ArgumentsSeen(args, kwargs)
        out = super().__call__(fn, args, kwargs)
        self.recorded.append(self.record(fn, args, kwargs, out, before))
        self.begin()
        return out


def _warm_up(width: int, run: Callable[[], Any], side: torch.cuda.Stream, warmup: int) -> None:
    """``warmup`` eager runs on the capture stream; a failure names the piece or the call."""
    count = _Counter()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side), marked_calls(count):
            for _ in range(warmup):
                count.restart()
                run()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
    except _MarkedCallFailed as e:
        raise CaptureError(f"width {width}: {e} during warm-up", width=width, cause=e.cause) from e.cause
    except CgrtError:
        raise
    except Exception as e:
        raise CaptureError(f"width {width}, piece {count.piece}: the step function raised during warm-up: "
                           f"{type(e).__name__}: {e}", width=width, piece=count.piece, cause=e) from e


def capture_pieces(width: int, run: Callable[[], Any], *, pool, stream: torch.cuda.Stream, warmup: int,
                   keep_graph: bool, explain: Callable[[], tuple] = lambda: ()
                   ) -> tuple[PiecewiseGraph, Any, float, float]:
    """Warm ``run`` up, then capture it at ``width`` in pieces into ``pool`` (one graph per
    piece, the marked calls recorded between them). Returns ``(graph, outputs, warmup_s,
    capture_s)``. Raises CaptureError naming the width and the failing piece (``piece``)
    or marked call, with the hazard finder's explanation; afterwards no stream captures."""
    side, caller = stream, torch.cuda.current_stream()
    t0 = time.perf_counter()
    _warm_up(width, run, side, warmup)
    t1 = time.perf_counter()
    rec = _CudaRecorder(pool, keep_graph)
    try:
        with no_collection(), torch.cuda.stream(side), marked_calls(rec):
            rec.begin()
            outputs = run()
            rec.end()
    except Exception as e:  # noqa: BLE001 - every failure becomes a CaptureError
        release_blas_workspaces()
        reset_after_failure(side, caller, pool)
        raise _failure(width, rec, e, explain) from (e.cause if isinstance(e, _MarkedCallFailed) else e)
    torch.cuda.synchronize()
    release_blas_workspaces()
    return PiecewiseGraph(width, rec.graphs, rec.recorded), outputs, t1 - t0, time.perf_counter() - t1


def _failure(width: int, rec: _Counter, e: Exception, explain: Callable[[], tuple]) -> CaptureError:
    if isinstance(e, _MarkedCallFailed):
        return CaptureError(f"width {width}: {e}{'' if e.refused else ' while capturing in pieces'}", width=width,
                            cause=e.cause)
    hazards = explain()
    where = "".join(f"\n  {h}" for h in hazards) or "\n  (the hazard finder saw no known hazard)"
    first = (str(e).strip().splitlines() or [""])[0]
    return CaptureError(f"width {width}, piece {rec.piece}: capture failed: {type(e).__name__}: {first}"
                        f"\nwhat cannot be captured:{where}", width=width, piece=rec.piece, hazards=hazards, cause=e)


class _EmulatedRecorder(_Counter):
    """The emulated capture run: each marked call runs and is recorded; its outputs are
    the static tensors the code after it reads."""

    def __init__(self):
        super().__init__()
        self.recorded: list[EagerCall] = []

    def __call__(self, fn: Callable, args: tuple, kwargs: dict) -> Any:
        before = ArgumentsSeen(args, kwargs)
        out = super().__call__(fn, args, kwargs)
        self.recorded.append(self.record(fn, args, kwargs, out, before))
        return out


def emulate_pieces(width: int, run: Callable[[], Any], warmup: int
                   ) -> tuple[tuple[EagerCall, ...], Any, float, float]:
    """``warmup`` runs, then one recorded run whose outputs (and marked calls' outputs)
    become the width's static tensors. Returns ``(calls, outputs, warmup_s, capture_s)``
    (``emulation.EmulatedPieces`` replays them);
    a step function that raises is a CaptureError naming the width and the piece."""
    t0 = time.perf_counter()
    rec: _Counter = _Counter()
    try:
        with marked_calls(rec):
            for _ in range(warmup):
                rec.restart()
                run()
        t1 = time.perf_counter()
        rec = _EmulatedRecorder()
        with torch.inference_mode(), frozen(), marked_calls(rec):
            out = run()
    except _MarkedCallFailed as e:
        raise CaptureError(f"width {width}: {e}{'' if e.refused else ' during emulated capture'}", width=width,
                           cause=e.cause) from e.cause
    except CgrtError as e:
        if not isinstance(e, CaptureError):
            raise
        raise CaptureError(f"width {width}, piece {rec.piece}: {e}", width=width, piece=rec.piece, cause=e) from e
    except Exception as e:  # noqa: BLE001 - as capture_width: every failure a CaptureError
        raise CaptureError(f"width {width}, piece {rec.piece}: the step function raised during emulated capture: "
                           f"{type(e).__name__}: {e}", width=width, piece=rec.piece, cause=e) from e
    return tuple(rec.recorded), out, t1 - t0, time.perf_counter() - t1
