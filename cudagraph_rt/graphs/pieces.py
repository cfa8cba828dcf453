"""The replay side of piecewise graphs (what a marked call is, see ``cudagraph_rt.pieces``):
:class:`StepValues` (the runtime's ``step_values`` function per slice), :class:`EagerCall`
(one marked call recorded at capture), :class:`PiecewiseGraph` and :class:`PieceLaunch`
(a width captured in pieces, and a step's launch of it).

Lifetime: the recorded calls, their arguments and their static outputs live as long as
their width's graphs (until ``recapture()`` or ``close()``).
"""
from __future__ import annotations

import functools
import types
from typing import Any, Callable, Mapping

import torch
from torch.utils._pytree import tree_flatten

from ..errors import CaptureError, CgrtError, InputError, expected
from ..pieces import NOW, PLAIN, call_name, with_values

__all__ = ["StepValues", "EagerCall", "ArgumentsSeen", "PiecewiseGraph", "PieceLaunch", "layout"]


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
            return PLAIN
        if prep is None:
            rows = {n: torch.empty((0, *s.shape), dtype=s.dtype) for n, s in self._specs.items()}
        else:
            rows = {n: t[start:start + length] for n, t in prep.tensors.items()}
        return with_values(self.fn(rows, width))

    def on_pads(self, fn: Callable) -> Callable:
        """``fn(views)`` with this runtime's values of padding rows (the probe, the hazard finder)."""
        if self.fn is None:
            return fn

        def padded(views):
            n = next(iter(views.values())).shape[0] if views else 0
            with self.scope(None, 0, 0, n):
                return fn(views)
        return padded


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
        self.name = call_name(fn)
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
        now = NOW
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
        with torch.inference_mode(), (with_values(values) if values is not None else PLAIN):
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
    host-row choice's bookkeeping) just before the last piece, which holds the gather."""

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
