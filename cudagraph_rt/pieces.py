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
* its outputs at capture are the static tensors the next piece reads. At a replay each
  output the call returns is copied into them (one device copy per output tensor), unless
  the call wrote it in place (it returned the very tensor, e.g. an ``out=`` argument it
  was given): then nothing is copied;
* a marked call costs what it costs eagerly (its launches, its host work) plus one graph
  launch per piece; everything between marked calls replays from the graphs.

Where no width is captured in pieces (graphs off, a whole graph, the dynamic path) a
marked call is a plain call, captured inline in a whole graph. :func:`step_values` refuses
(CaptureError) to be read while a whole graph or a piece captures, outside a marked call:
a value read there would be frozen into the graph.

Lifetime: the recorded calls, their arguments and their static outputs live as long as
their width's graphs (until ``recapture()`` or ``close()``).
"""
from __future__ import annotations

import functools
import threading
import types
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils._pytree import tree_flatten

from .errors import CaptureError, CgrtError, InputError, expected

__all__ = ["eager", "step_values", "is_marked", "EagerCall", "PiecewiseGraph", "PieceLaunch", "EmulatedPieces",
           "StepValues"]


class _Now(threading.local):
    """What this thread's marked calls do and see now (set by the runtime, never by users)."""

    handler: Callable | None = None  # how a marked call runs: None = a plain call
    values: Any = None  # the running slice's step values
    has_values: bool = False
    frozen: int = 0  # > 0: the code that runs now is being recorded into a graph (emulated)
    marked: int = 0  # > 0: inside a marked call that runs outside the graphs


_NOW = _Now()
_PLAIN = nullcontext()


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
        h = _NOW.handler
        if h is None or _NOW.marked:  # inside another marked call: part of that one
            return fn(*args, **kwargs)
        _NOW.marked += 1
        try:
            return h(recorded, args, kwargs)
        finally:
            _NOW.marked -= 1

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
    call.__name__ = call.__qualname__ = _name(fn)
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
    now = _NOW
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
    before, _NOW.handler = _NOW.handler, handler
    try:
        yield
    finally:
        _NOW.handler = before


@contextmanager
def frozen() -> Iterator[None]:
    """The code in this block is being recorded into a graph (an emulated capture or
    replay): :func:`step_values` refuses to be read here outside a marked call."""
    _NOW.frozen += 1
    try:
        yield
    finally:
        _NOW.frozen -= 1


@contextmanager
def _values(value: Any) -> Iterator[None]:
    before = (_NOW.values, _NOW.has_values)
    _NOW.values, _NOW.has_values = value, True
    try:
        yield
    finally:
        _NOW.values, _NOW.has_values = before


class StepValues:
    """The runtime's ``step_values`` function, called once per slice before its step
    function (or its pieces) run: ``fn(rows, width)`` with ``rows`` the slice's real rows
    of every input as the step got them (``[length, *shape]`` tensors, CPU or CUDA: reading
    a CUDA one syncs) and ``width`` the rows the step function runs (the rows past
    ``length`` are padding, each input's ``pad``). At capture and in the hazard finder
    every row is padding (``length`` 0). Without a function, nothing is called."""

    def __init__(self, fn: Callable[[Mapping[str, torch.Tensor], int], Any] | None, specs: Mapping):
        self.fn, self._specs = fn, specs
        self.none = fn is None

    def scope(self, prep, start: int, length: int, width: int):
        """A context in which :func:`step_values` gives this slice's values (``prep`` None:
        padding rows only)."""
        if self.fn is None:
            return _PLAIN
        if prep is None:
            rows = {n: torch.empty((0, *s.shape), dtype=s.dtype) for n, s in self._specs.items()}
        else:
            rows = {n: t[start:start + length] for n, t in prep.tensors.items()}
        return _values(self.fn(rows, width))

    def on_pads(self, fn: Callable) -> Callable:
        """``fn(views)`` with this runtime's values of padding rows (the probe, the hazard finder)."""
        if self.fn is None:
            return fn

        def padded(views):
            n = next(iter(views.values())).shape[0] if views else 0
            with self.scope(None, 0, 0, n):
                return fn(views)
        return padded


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


class EagerCall:
    """One marked call recorded at capture: the function, its arguments (the capture's
    tensors and constants) and its outputs there (the static tensors the next piece
    reads). ``replay()`` runs it again on the same arguments and puts what it returns into
    those outputs (a copy per output tensor it did not write in place); CgrtError when
    it returns another structure or an output tensor of another shape. A ``bind`` that
    raises or returns no callable fails here, at record."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, out: Any):
        self.fn, self.args, self.kwargs, self.out = fn, args, kwargs, out
        self.name = _name(fn)
        self._static = [t for t in tree_flatten(out)[0]]
        self._arg_leaves, self._arg_spec = tree_flatten((args, kwargs))
        bind = getattr(fn, "_cgrt_bind", None) if isinstance(fn, types.FunctionType) else None
        self.bound = bind is not None  # replays run what eager(bind=) made of these arguments
        self._run = bind(*args, **kwargs) if bind is not None else functools.partial(fn, *args, **kwargs)
        if not callable(self._run):  # refused at capture, not at the first replay's call
                raise InputError(expected(f"eager(bind=) of {self.name}", "a zero-argument callable as its result",
                                      type(self._run).__name__))

    def replay(self) -> Any:
        now = _NOW
        now.marked += 1  # (not in_marked_call(): a generator's context costs microseconds a call)
        try:
            new = self._run()
        finally:
            now.marked -= 1
        static = self._static
        if new is self.out:
            return new
        leaves = tree_flatten(new)[0]
        if len(leaves) != len(static):
            raise CgrtError(f"marked call {self.name}: returned {len(leaves)} leaves at replay, "
                            f"{len(static)} at capture (its output structure must not change)")
        for i, (dst, src) in enumerate(zip(static, leaves)):
            if isinstance(dst, torch.Tensor) and src is not dst and not _same_memory(dst, src):
                if not isinstance(src, torch.Tensor) or src.shape != dst.shape:  # copy_ would broadcast
                    raise CgrtError(f"marked call {self.name}: output {i} is "
                                    f"{tuple(src.shape) if isinstance(src, torch.Tensor) else type(src).__name__} "
                                    f"at replay, {tuple(dst.shape)} at capture (its outputs must not change)")
                dst.copy_(src)
        return self.out

    def absorb(self, index: int, args: tuple, kwargs: dict) -> None:
        """Emulated replays: the arguments the re-run step passed (fresh tensors) are what
        its piece wrote into the capture's tensors: copied there. A constant that differs
        from the capture's is refused (a CUDA graph would replay the capture's value)."""
        leaves, spec = tree_flatten((args, kwargs))
        if spec != self._arg_spec:
            raise CgrtError(f"marked call {index} ({self.name}): called with other arguments at replay than at "
                            f"capture ({spec} vs {self._arg_spec})")
        for i, (rec, now) in enumerate(zip(self._arg_leaves, leaves)):
            if isinstance(rec, torch.Tensor):
                if now is not rec and not _same_memory(rec, now):
                    with torch.no_grad():
                        rec.copy_(now)
            elif not _equal(rec, now):
                raise CgrtError(
                    f"marked call {index} ({self.name}): argument {i} is {now!r} at this replay, {rec!r} at "
                    "capture: a CUDA graph replays the capture's value; pass per-step host values through "
                    "step_values() (GraphRuntime(step_values=...)), not as arguments")


def _same_memory(a: torch.Tensor, b: Any) -> bool:
    return (isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a is b or a == b)
    except Exception:  # noqa: BLE001 - an object without a plain ==: identity decides
        return False


class PiecewiseGraph:
    """One width captured in pieces (CUDA): ``pieces`` (CUDA graphs, in order) and
    ``calls`` (the marked calls between them, one fewer). It is what
    ``graphs_captured[w]`` holds for such a width: ``replay()`` launches piece 1, runs call
    1, and so on, with the step values of the last ``values`` given (None: no values).
    ``reset()`` is refused (``recapture()`` instead). Lifetime: the runtime's graphs."""

    def __init__(self, width: int, pieces: tuple, calls: tuple[EagerCall, ...]):
        self.width, self.pieces, self.calls = width, tuple(pieces), tuple(calls)

    @property
    def layout(self) -> tuple[str, ...]:
        return layout(len(self.pieces), self.calls)

    def replay(self, values: Any = None) -> None:
        # The marked calls in inference mode, as at capture: their static tensors are
        # inference tensors, which nothing may write in place outside it.
        with torch.inference_mode(), (_values(values) if values is not None else _PLAIN):
            for g, call in zip(self.pieces, self.calls):
                g.replay()
                call.replay()
            self.pieces[-1].replay()

    def launcher(self, device: torch.device, before_last: Callable[[], None]) -> "PieceLaunch":
        from .launch import GraphLaunch
        return PieceLaunch([GraphLaunch(g, device) for g in self.pieces], self.calls, before_last)

    def reset(self) -> None:
        raise CgrtError("a piecewise graph cannot be reset (steps replay it): call recapture() instead")


class PieceLaunch:
    """A step's launch of a piecewise width: each piece's graph launched in turn (on the
    caller's stream), the marked calls between them run eagerly, ``before_last`` (the
    host-row mode's bookkeeping) just before the last piece, which holds the gather."""

    __slots__ = ("_steps", "_last", "_before_last")

    def __init__(self, launches: list, calls: tuple[EagerCall, ...], before_last: Callable[[], None]):
        self._steps = tuple(zip(launches[:-1], [c.replay for c in calls]))
        self._last, self._before_last = launches[-1], before_last

    def __call__(self) -> None:
        with torch.inference_mode():  # as PiecewiseGraph.replay
            for launch, call in self._steps:
                launch()
                call()
        self._before_last()
        self._last()


def layout(pieces: int, calls) -> tuple[str, ...]:
    """``("piece 1", "eager attend", "piece 2", ...)``: what a piecewise width runs, in order."""
    out = []
    for i in range(pieces):
        out.append(f"piece {i + 1}")
        if i < len(calls):
            out.append(f"eager {calls[i].name}")
    return tuple(out)


class EmulatedPieces:
    """One width captured in pieces under ``graphs="emulate"``: a replay runs the width's
    body again; at each marked call the fresh arguments are copied into the capture's
    tensors (what the piece before it writes at a CUDA replay), the recorded call runs on
    those (as at a CUDA replay) and the capture's outputs go on to the code after it (what
    the next piece reads). A call that differs from the capture's (another function, a
    constant that changed, one call more or fewer) raises CgrtError: a CUDA graph would
    silently replay the capture's. The width's outputs are copied into its static
    outputs, as an emulated whole graph's. Lifetime: the runtime's graphs."""

    def __init__(self, width: int, body: Callable[[], Any], static_out: Any, calls: tuple[EagerCall, ...]):
        self.width, self._body, self.calls = width, body, tuple(calls)
        self.pieces = tuple(f"piece {i + 1}" for i in range(len(calls) + 1))
        self._static = tree_flatten(static_out)[0]
        self._next = 0

    @property
    def layout(self) -> tuple[str, ...]:
        return layout(len(self.pieces), self.calls)

    def launcher(self, device: torch.device, before_last: Callable[[], None]) -> Callable[[], None]:
        return self.replay  # the body's gather does the host-row bookkeeping itself

    def _marked(self, fn, args, kwargs):
        i = self._next
        if i >= len(self.calls) or self.calls[i].fn is not fn:
            got = "one more marked call" if i >= len(self.calls) else f"{_name(fn)}"
            raise CgrtError(f"width {self.width}: marked call {i + 1} at this replay is {got}, not what the capture "
                            "recorded: the step took another path than at capture")
        self._next = i + 1
        call = self.calls[i]
        call.absorb(i + 1, args, kwargs)
        return call.replay()

    def replay(self, values: Any = None) -> None:
        self._next = 0
        with torch.inference_mode(), frozen(), marked_calls(self._marked), \
                (_values(values) if values is not None else _PLAIN):
            new = tree_flatten(self._body())[0]
        if self._next != len(self.calls):
            raise CgrtError(f"width {self.width}: {self._next} marked calls at this replay, {len(self.calls)} at "
                            "capture: the step took another path than at capture")
        with torch.inference_mode():
            for dst, src in zip(self._static, new):
                if dst is not src:
                    dst.copy_(src)

    def reset(self) -> None:
        raise CgrtError("an emulated graph cannot be reset (steps replay it): call recapture() instead")
