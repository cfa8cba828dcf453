"""Piecewise graphs: a call marked :func:`eager` runs outside the graphs, between pieces.

A step function whose attention (or any other call) cannot live in a CUDA graph marks
that call with ``cudagraph_rt.eager``. A width captured in pieces (``GraphRuntime(...,
pieces=True)``, or ``on_capture_error="pieces"`` for widths whose whole capture failed)
ends the current piece before each marked call, records the call with its arguments (the
static tensors the piece before it wrote), runs it outside any capture, and captures the
next piece into the same pool. A replay launches piece 1, runs the recorded calls on the
same static tensors, launches piece 2, and so on (:class:`PieceLaunch`).

What a marked call may rely on, and what it costs:

* its tensor arguments are the capture's own tensors (the static buffers the pieces write
  at each replay); every other argument (ints, floats, None) is frozen at capture. Per-step
  host values (an int ``max_seqlen``, a list of lengths) reach it through
  :func:`step_values`, which reads what the runtime's ``step_values`` function made from
  this slice's own rows, never a capture-time value; or the call reads them from its
  static tensors itself (a host sync: allowed there, the call runs outside the graphs);
* it may write its tensor arguments in place (an ``out=`` buffer, a cache, a tensor of a
  list it was given): the code after it reads what it wrote. At a CUDA replay the call
  writes the capture's tensors, which the next piece reads; an emulated replay copies
  what it left in them back into the re-run's tensors. What no replay can honour is
  refused at capture (CaptureError naming the width and the call): replacing an entry
  of a list or dict argument (or adding or removing one), or changing a tensor
  argument's shape or memory in place (``resize_``, ``set_``, ``unsqueeze_``): the code
  after the call would go on reading what it read at capture. Return the new value;
* its outputs at capture are the static tensors the next piece reads. At a replay each
  output the call returns is copied into them (one device copy per output tensor), unless
  the call wrote it in place (it returned the very tensor, e.g. an ``out=`` argument it
  was given): then nothing is copied;
* its outputs are tensors (or None): any other value (an int read from
  :func:`step_values`, a float read from a tensor) is refused at capture (CaptureError
  naming the width, the call and the output). The code after the call is a graph at
  every replay: the capture's value is baked into it (a shape, a kernel argument, a
  branch taken) and no replay can hand it a new one, so a live value cannot be had and a
  stale one would be silent. A per-step host value is read through :func:`step_values`
  inside the marked call that needs it;
* a marked call costs what it costs eagerly (its launches, its host work) plus one graph
  launch per piece; everything between marked calls replays from the graphs.

Where no width is captured in pieces (graphs off, a whole graph, the dynamic path) a
marked call is a plain call, captured inline in a whole graph (nothing of it is recorded
or checked there). :func:`step_values` refuses
(CaptureError) to be read while a whole graph or a piece captures, outside a marked call:
a value read there would be frozen into the graph.

Lifetime: the recorded calls, their arguments and their static outputs live as long as
their width's graphs (until ``recapture()`` or ``close()``).

This module holds what a step function marks and reads (:func:`eager`, :func:`step_values`)
and the thread-local state they need; the replay side (recorded calls, piecewise graphs,
their launch) is ``cudagraph_rt.graphs.pieces``, the emulated one ``graphs.emulation``.
"""
from __future__ import annotations

import functools
import threading
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator

import torch

from .errors import CaptureError, CgrtError, InputError, expected

__all__ = ["eager", "step_values", "is_marked"]


class _Now(threading.local):
    """What this thread's marked calls do and see now (set by the runtime, never by users)."""

    handler: Callable | None = None  # how a marked call runs: None = a plain call
    values: Any = None  # the running slice's step values
    has_values: bool = False
    frozen: int = 0  # > 0: the code that runs now is being recorded into a graph (emulated)
    marked: int = 0  # > 0: inside a marked call that runs outside the graphs


NOW = _Now()
PLAIN = nullcontext()


_DECORATE: Any = object()  # eager() / eager(bind=...): a decorator (eager(None) is refused)


def eager(fn: Callable = _DECORATE, *, bind: Callable[..., Callable[[], Any]] | None = None) -> Callable:
    """Mark ``fn`` as a call that runs outside the graphs (a decorator, ``@eager(bind=...)``,
    or ``eager(fn)``).

    In a width captured in pieces, each call of the marked function ends a piece: it runs
    eagerly between two graphs at every replay, on the tensors it was given at capture
    (see the module docstring for what it may rely on and what it costs). Everywhere else
    it is a plain call, and so is a marked call made inside another (``eager(eager(f),
    bind=b)`` adds a bind to a marked ``f``). The hazard finder skips what runs inside it
    (it may sync: that is why it is marked). torch.compile does not trace into it (a
    graph break).

    ``bind`` (optional): ``bind(*args, **kwargs)`` returns a zero-argument callable that
    does what ``fn(*args, **kwargs)`` does on those very arguments and returns the same
    outputs. It is called once, when the call is recorded at capture, and the replays run
    what it returned instead of ``fn``: the host work that depends only on the arguments'
    shapes and addresses (checks, planning, scratch, packing a kernel's arguments) is done
    once, not at every step. An exception from it fails the capture of that piece. The
    bind belongs to this marking: marking the same ``fn`` again (with another bind or
    none) leaves it alone; ``fn`` may be any callable."""
    if bind is not None and not callable(bind):
        raise InputError(expected("eager(bind=)", "None or a callable", type(bind).__name__))
    if fn is _DECORATE:
        return lambda f: eager(f, bind=bind)
    if not callable(fn):
        raise InputError(expected("eager(fn)", "a callable", type(fn).__name__))
    recorded = fn if bind is None else _with_bind(fn, bind)

    @functools.wraps(fn)
    def marked(*args, **kwargs):
        h = NOW.handler
        if h is None or NOW.marked:  # inside another marked call: part of that one
            return fn(*args, **kwargs)
        NOW.marked += 1
        try:
            return h(recorded, args, kwargs)
        finally:
            NOW.marked -= 1

    out = torch.compiler.disable(marked)  # dynamo runs it as it is (about 0.5 us a call)
    out._cgrt_eager = fn  # type: ignore[attr-defined]
    return out


def _with_bind(fn: Callable, bind: Callable) -> Callable:
    """What a marking with ``bind`` records: its own function calling ``fn``, named as
    ``fn``, carrying ``bind`` (never stored on or keyed by ``fn``: the same function
    marked twice keeps each marking's bind, and callables that cannot be weakly
    referenced or hashed work)."""
    def call(*args, **kwargs):
        return fn(*args, **kwargs)
    call.__name__ = call.__qualname__ = call_name(fn)
    call._cgrt_bind = bind  # type: ignore[attr-defined]
    return call


def is_marked(fn: Any) -> bool:
    """Whether ``fn`` was made by :func:`eager`."""
    return getattr(fn, "_cgrt_eager", None) is not None


def step_values() -> Any:
    """The step values of the slice that runs now: what the runtime's ``step_values``
    function returned for this slice's rows (``GraphRuntime(..., step_values=fn)``).

    Valid inside the step function while a step, a capture or the hazard finder runs it.
    Raises CgrtError outside a step or when the runtime has no ``step_values`` function,
    and CaptureError when read while a graph captures outside a marked call (the value
    would be frozen into the graph: read it inside a call marked ``eager`` and capture
    that width in pieces)."""
    now = NOW
    if not now.has_values:
        raise CgrtError("step_values(): no step of a runtime built with step_values=... is running")
    if not now.marked and (now.frozen or _capturing()):
        raise CaptureError("step_values() was read while a graph captures (a whole graph captures even a call "
                           "marked cudagraph_rt.eager inline): the graph would replay the capture's value at every "
                           "step; read it inside a marked call and capture this width in pieces (pieces=True, or "
                           "on_capture_error='pieces')")
    return now.values


_REAL_CAPTURING = torch.cuda.is_current_stream_capturing
_CUDA: list[bool] = []


def _capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing()``, False without CUDA (where torch's own
    raises); the hazard finder's stand-in (which answers True) is asked as well."""
    ask = torch.cuda.is_current_stream_capturing
    if ask is _REAL_CAPTURING:
        if not _CUDA:
            _CUDA.append(torch.cuda.is_available())
        if not _CUDA[0]:
            return False
    return ask()


@contextmanager
def marked_calls(handler: Callable[[Callable, tuple, dict], Any]) -> Iterator[None]:
    """Marked calls run through ``handler(fn, args, kwargs)`` in this block (this thread)."""
    before, NOW.handler = NOW.handler, handler
    try:
        yield
    finally:
        NOW.handler = before


@contextmanager
def frozen() -> Iterator[None]:
    """The code in this block is being recorded into a graph (an emulated capture or
    replay): :func:`step_values` refuses to be read here outside a marked call."""
    NOW.frozen += 1
    try:
        yield
    finally:
        NOW.frozen -= 1


@contextmanager
def with_values(value: Any) -> Iterator[None]:
    before = (NOW.values, NOW.has_values)
    NOW.values, NOW.has_values = value, True
    try:
        yield
    finally:
        NOW.values, NOW.has_values = before


def call_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
