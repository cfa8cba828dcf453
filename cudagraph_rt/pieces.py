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

__all__ = ["eager", "step_values", "is_marked", "EagerCall", "ArgumentsSeen", "PiecewiseGraph", "PieceLaunch",
           "EmulatedPieces", "StepValues"]


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
    raises or returns no callable fails here, at record, and so does (CaptureError) what
    no replay can honour: an output that is not a tensor or None, or, given the
    arguments as they were before the call (``before``), an argument the call replaced
    (an entry of a list or dict it was given) or whose shape or memory it changed."""

    def __init__(self, fn: Callable, args: tuple, kwargs: dict, out: Any, before: "ArgumentsSeen | None" = None):
        self.fn, self.args, self.kwargs, self.out = fn, args, kwargs, out
        self.name = _name(fn)
        self._static = [t for t in tree_flatten(out)[0]]
        _check_outputs(self._static)
        self._arg_leaves, self._arg_spec = tree_flatten((args, kwargs))
        if before is not None:
            before.check_unchanged(self._arg_leaves, self._arg_spec)
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

    def absorb(self, index: int, args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Emulated replays: the arguments the re-run step passed (fresh tensors) are what
        its piece wrote into the capture's tensors: copied there. Returns the pairs
        ``(capture's, re-run's)`` copied, for :meth:`give_back`. A constant that differs
        from the capture's, or a tensor of another shape, is refused (a CUDA graph would
        replay the capture's)."""
        leaves, spec = tree_flatten((args, kwargs))
        if spec != self._arg_spec:
            raise CgrtError(f"marked call {index} ({self.name}): called with other arguments at replay than at "
                            f"capture ({spec} vs {self._arg_spec})")
        copied = []
        for i, (rec, now) in enumerate(zip(self._arg_leaves, leaves)):
            if isinstance(rec, torch.Tensor):
                if now is not rec and not _same_memory(rec, now):
                    if not isinstance(now, torch.Tensor) or now.shape != rec.shape:
                        got = tuple(now.shape) if isinstance(now, torch.Tensor) else type(now).__name__
                        raise CgrtError(f"marked call {index} ({self.name}): argument {i} is {got} at this replay, "
                                        f"{tuple(rec.shape)} at capture (a CUDA graph replays the capture's)")
                    _copy_into(rec, now, lambda: f"marked call {index} ({self.name}): argument {i}")
                    copied.append((rec, now))
            elif not _equal(rec, now):
                raise CgrtError(
                    f"marked call {index} ({self.name}): argument {i} is {now!r} at this replay, {rec!r} at "
                    "capture: a CUDA graph replays the capture's value; pass per-step host values through "
                    "step_values() (GraphRuntime(step_values=...)), not as arguments")
        return copied

    def give_back(self, copied: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Emulated replays, after the call: what it left in the capture's tensors (what it
        wrote in place) copied back into the re-run's, which the code after it reads, as
        the next piece reads the capture's at a CUDA replay."""
        for rec, now in copied:
            _copy_into(now, rec, lambda: f"marked call {self.name}: an argument")


class ArgumentsSeen:
    """A marked call's arguments just before it runs at capture: their structure, every
    leaf, and each tensor's shape, strides, dtype and address. ``check_unchanged`` (after
    the call) refuses, with CaptureError, what a replay cannot honour: the call replaced
    an entry of a list or dict it was given (or added or removed one), or changed a tensor
    argument's shape or memory in place (``resize_``, ``set_``, ``unsqueeze_``). A replay
    runs the call on the capture's arguments while the code after it (the next piece) goes
    on reading what it read at capture; writing into an argument's memory is fine."""

    def __init__(self, args: tuple, kwargs: dict):
        self.leaves, self.spec = tree_flatten((args, kwargs))
        self.layouts = [_layout(t) if isinstance(t, torch.Tensor) else None for t in self.leaves]

    def check_unchanged(self, leaves: list, spec) -> None:
        fix = (": a replay runs the call on the capture's arguments, and the code after it goes on reading what "
               "it read at capture; return the new value instead")
        if spec != self.spec:
            raise CaptureError("changed the structure of its arguments (a list or dict it was given gained or lost "
                               f"an entry: {self.spec} before the call, {spec} after it)" + fix)
        for i, (was, now, lay) in enumerate(zip(self.leaves, leaves, self.layouts)):
            if now is not was:
                raise CaptureError(f"replaced argument {i} (a {type(was).__name__}) by another object "
                                   f"(a {type(now).__name__}) in a list or dict it was given" + fix)
            if lay is not None and _layout(now) != lay:
                (shape, stride, dtype, _), (shape2, stride2, dtype2, _) = lay, _layout(now)
                what = (f"shape {shape} stride {stride} {dtype} before the call, shape {shape2} stride {stride2} "
                        f"{dtype2} after it" if (shape, stride, dtype) != (shape2, stride2, dtype2) else
                        "it points at other memory after the call (set_, resize_)")
                raise CaptureError(f"changed argument {i} in place: {what}" + fix)


def _layout(t: torch.Tensor) -> tuple:
    if t.layout is not torch.strided:  # (sparse: no strides, no one address) its shape and dtype only
        return tuple(t.shape), t.layout, t.dtype, 0
    return tuple(t.shape), t.stride(), t.dtype, t.data_ptr()


def _check_outputs(leaves: list) -> None:
    """CaptureError unless every output leaf of a marked call is a tensor or None."""
    for i, leaf in enumerate(leaves):
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            raise CaptureError(
                f"returned {type(leaf).__name__} as output {i} ({_short(leaf)}): the code after a marked call is a "
                "graph at every replay, which keeps the value the capture saw; return tensors (or None), and read a "
                "per-step host value through step_values() (GraphRuntime(step_values=...)) in the marked call that "
                "needs it")


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _copy_into(dst: torch.Tensor, src: torch.Tensor, what: Callable[[], str]) -> None:
    """``dst.copy_(src)`` (same shape) through the memory ``dst`` really has: a dim it
    repeats (stride 0, as ``expand()`` makes) is written once. Another view whose elements
    share memory (``unfold``, ``as_strided``) cannot be written: CgrtError naming it."""
    with torch.no_grad():
        if 0 in dst.stride():
            one = tuple(slice(0, 1) if st == 0 else slice(None) for st in dst.stride())
            dst, src = dst[one], src[one]
        try:
            dst.copy_(src)
        except RuntimeError as e:
            raise CgrtError(f"{what()}: the emulated replay cannot copy it between the capture's tensor and the "
                            f"re-run's ({e}); pass a tensor whose elements do not share memory (.contiguous()): a "
                            "CUDA replay runs the call on it as it is") from None


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
    those (as at a CUDA replay), what it left in them is copied back into the fresh ones
    (what it wrote in place, which the next piece reads) and the capture's outputs go on
    to the code after it (what the next piece reads). A call that differs from the capture's (another function, a
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
        copied = call.absorb(i + 1, args, kwargs)
        out = call.replay()
        call.give_back(copied)
        return out

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
