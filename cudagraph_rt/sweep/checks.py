"""The checks one sweep step must pass, each returning messages that name the problem.

* ``check_slices``: the step ran exactly the slices the plan rule gives (``StepResult.slices``).
* ``check_counters``: the runtime's counters moved by exactly those slices (replays on the
  graph path with graphs on, eager calls with graphs off, dynamic calls, padding rows).
* ``check_rows`` / ``check_tokens`` / ``check_hidden``: the outputs have T rows; tokens equal
  the eager greedy tokens where a row wants one and -1 elsewhere; hidden rows match the
  reference within a :class:`Tolerance`.
* ``check_pad_rows``: the static input rows the last graph read past T hold the pad values.

Each returns ``None`` (passed) or a one-paragraph message. Expected slices come from
:func:`rule_slices`, the plan rule stated here on its own: never from the runtime under
test nor from ``cudagraph_rt.widths.plan_step`` (the function under test: a plan that
picks a wider width than the rule must fail the sweep, not agree with it).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

from ..errors import InputError, expected
from ..runtime import GraphRuntime, RuntimeStats
from ..widths import Slice
from .plans import StepPlan

_SHOW = 3  # examples per message


@dataclass(frozen=True)
class Tolerance:
    """A hidden row passes when ``||out - ref||_2 <= ulps * eps * ||ref||_2``.

    Why this shape: the runtime and the eager reference compute the same math, batched and
    padded versus one sequence alone, so they differ only by rounding in another order.
    The normwise relative error of a row (the standard measure for a computed vector) is
    then a small multiple of the unit roundoff whatever the row's scale; ``eps`` is the
    dtype's machine epsilon unless given. :meth:`for_dtype` picks:

    * fp32: 256 eps (3e-5). Stored values round to 2**-24; what differs is the order of
      fp32 accumulation in dot products of K terms (~sqrt(K) eps for K in the thousands),
      over a few matmuls per layer. A stale or stolen KV cell changes a row by several %.
    * bf16 / fp16: 8 eps (6% for bf16, 0.8% for fp16). Measured on the toy, one bf16
      forward differs from the same forward in fp32 by at most ~1 eps normwise at 2 and at
      6 layers (it grows slowly with depth), so two half-precision runs differ by at most
      ~2 eps: 8 is 4x headroom. A model much deeper than the toy may set its own.
    * fp32 matmuls on CUDA with TF32 allowed: their inputs round to a 10-bit mantissa, so
      the half-precision rule at TF32's eps (2**-10).

    ``SweepReport`` records the worst row as a fraction of its bound: the headroom left.
    """

    ulps: float
    eps: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.ulps, bool) or not isinstance(self.ulps, (int, float)) or not self.ulps > 0:
            raise InputError(expected("Tolerance.ulps", "a positive number", repr(self.ulps)))
        if self.eps is not None and not (isinstance(self.eps, float) and self.eps > 0):
            raise InputError(expected("Tolerance.eps", "None or a positive float", repr(self.eps)))

    @staticmethod
    def for_dtype(dtype: torch.dtype, device: torch.device | str | None = None) -> "Tolerance":
        """The default rule for hidden rows of ``dtype`` computed on ``device``."""
        if dtype in (torch.float32, torch.float64):
            cuda = device is not None and torch.device(device).type == "cuda"
            if dtype == torch.float32 and cuda and _tf32_matmuls():
                return Tolerance(8.0, 2.0**-10)
            return Tolerance(256.0)
        # The eps of the rows' own dtype, given explicitly: a check that compares fp32
        # copies of half-precision rows must not be held to fp32's eps.
        return Tolerance(8.0, float(torch.finfo(dtype).eps))

    def errors(self, got: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row of ``[T, H]`` rows: ``(||got - ref||_2, bound)`` in fp32 on ``got``'s
        device; a non-finite error counts as infinite."""
        eps = self.eps if self.eps is not None else torch.finfo(ref.dtype).eps
        ref = ref.to(got.device).float()
        err = (got.float() - ref).norm(dim=-1)
        err = torch.where(torch.isfinite(err), err, torch.full_like(err, math.inf))
        # The floor only keeps an all-zero reference row from demanding exact zeros.
        return err, self.ulps * eps * ref.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)

    def __str__(self) -> str:
        return f"{self.ulps:g} eps" + (f" (eps {self.eps:g})" if self.eps is not None else "")


def _tf32_matmuls() -> bool:
    """Whether fp32 matmuls on CUDA may round their inputs to TF32 (10-bit mantissa)."""
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32) or torch.get_float32_matmul_precision() != "highest"
    except (AttributeError, RuntimeError):  # a future torch without these switches
        return False


def describe(slices: tuple[Slice, ...], rows: bool = True) -> str:
    """``graph 16 (13 rows)`` / ``dynamic 96 + graph 1``: what a step ran."""
    return " + ".join(f"{s.path} {s.width}" + (f" ({s.length} rows)" if rows and s.length != s.width else "")
                      for s in slices)


def rule_slices(T: int, widths: tuple[int, ...], dynamic_limit: int) -> tuple[Slice, ...]:
    """The slices a step of ``T`` rows must run, by the documented rule (README, "The API
    in one screen"), written apart from ``plan_step`` on purpose:

    * ``T`` rows that fit the widest graph: one graph slice at the NARROWEST captured
      width that holds them (the rows past ``T`` are padding);
    * up to ``dynamic_limit`` rows (when it is wider than the widest graph): one dynamic
      slice of exactly ``T`` rows, unpadded;
    * more: cut into consecutive pieces of ``max(dynamic_limit, widest)`` rows, each run
      by the rules above (a full piece is a dynamic slice, or an unpadded widest graph
      when the limit is the widest graph), then the rest by the same rules.
    """
    piece = max(dynamic_limit, widths[-1])
    heads, rest = divmod(T, piece)
    if rest == 0:
        heads, rest = heads - 1, piece
    out = [_one(piece, i * piece, widths) for i in range(heads)]
    return tuple(out + [_one(rest, heads * piece, widths)])


def _one(n: int, start: int, widths: tuple[int, ...]) -> Slice:
    """One slice of ``n`` rows: the narrowest graph that holds them, else dynamic."""
    fits = [w for w in widths if w >= n]
    return Slice("graph", min(fits), start, n) if fits else Slice("dynamic", n, start, n)


def expected_slices(rt: GraphRuntime, T: int) -> tuple[Slice, ...]:
    """What ``rt`` must run for ``T`` rows (see :func:`rule_slices`). With ``rt.slicing``
    off, a step over every limit raises in ``rt.step``: the sweep records that step's error."""
    return rule_slices(T, rt.widths, rt.dynamic_limit)


def check_slices(T: int, got: tuple[Slice, ...], want: tuple[Slice, ...]) -> str | None:
    if tuple(got) == tuple(want):
        return None
    hint = ""
    if len(got) == len(want) and all(g.path == w.path == "graph" and g.width > w.width for g, w in zip(got, want)):
        hint = (" (a wider graph than the narrowest that holds the rows: outputs may still be right, "
                "the padding is waste)")
    return (f"slices: step of T={T} ran [{describe(got)}], expected [{describe(want)}] "
            f"by the plan rule (the narrowest captured width that holds T){hint}")


def _delta(after: RuntimeStats, before: RuntimeStats) -> dict:
    def sub(a, b):
        d = Counter(a)
        d.subtract(Counter(b))
        return {k: v for k, v in sorted(d.items()) if v}
    return dict(steps=after.steps - before.steps, slices=after.slices - before.slices,
                padding_rows=after.padding_rows - before.padding_rows,
                graph_replays=sub(after.graph_replays, before.graph_replays),
                eager_calls=sub(after.eager_calls, before.eager_calls),
                dynamic_calls=sub(after.dynamic_calls, before.dynamic_calls))


def check_counters(before: RuntimeStats, after: RuntimeStats, want: tuple[Slice, ...], graphs: bool) -> str | None:
    """With graphs on every graph slice must REPLAY (an eager call there means the width
    fell back, e.g. a capture failure); with graphs off every one runs eagerly."""
    graph_w = dict(sorted(Counter(s.width for s in want if s.path == "graph").items()))
    pad = sum(s.width - s.length for s in want)  # stated here, not Slice.padding (under test)
    exp = dict(steps=1, slices=len(want), padding_rows=pad,
               graph_replays=graph_w if graphs else {}, eager_calls={} if graphs else graph_w,
               dynamic_calls=dict(sorted(Counter(s.length for s in want if s.path == "dynamic").items())))
    got = _delta(after, before)
    diff = [k for k in exp if exp[k] != got[k]]
    if not diff:
        return None
    return ("counters: the runtime's stats moved by " + ", ".join(f"{k} +{got[k]}" for k in diff)
            + "; the planned slices give " + ", ".join(f"{k} +{exp[k]}" for k in diff))


def _where(step: StepPlan, i: int) -> str:
    c, p = step.row(i)
    return f"row {i} (seq {c.seq}, pos {p}{', wants a token' if c.want[p - c.start] else ''})"


def check_rows(T: int, name: str, t: torch.Tensor | None) -> str | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != T:
        shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        return f"rows: output {name!r} has shape {shape}, expected {T} rows (exactly the step's rows, no padding)"
    return None


def check_tokens(step: StepPlan, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """``got`` and ``want`` [T] on one device; ``want`` is -1 where no token was asked for."""
    bad = (got.to(torch.int64) != want).nonzero().flatten().tolist()
    if not bad:
        return None
    g, w = got.tolist(), want.tolist()
    ex = "; ".join(f"{_where(step, i)}: got {g[i]}, expected {w[i]}" for i in bad[:_SHOW])
    return (f"tokens: {len(bad)} of {step.T} rows differ from the eager greedy tokens "
            f"(-1 where a row asks for none): {ex}{' ...' if len(bad) > _SHOW else ''}")


def check_hidden(step: StepPlan, err: torch.Tensor, bound: torch.Tensor, tol: Tolerance, dtype) -> str | None:
    bad = (err > bound).nonzero().flatten().tolist()
    if not bad:
        return None
    e, b = err.tolist(), bound.tolist()
    ex = "; ".join(f"{_where(step, i)}: |diff| {e[i]:.3g} > {b[i]:.3g}" for i in bad[:_SHOW])
    return (f"hidden: {len(bad)} of {step.T} rows differ from the reference beyond tolerance "
            f"(|diff| <= {tol} of {str(dtype).replace('torch.', '')} x |row|, 2-norms): "
            f"{ex}{' ...' if len(bad) > _SHOW else ''}")


def check_pad_rows(rt: GraphRuntime, last: Slice) -> str | None:
    """The rows past the real ones that the last graph slice read must hold the pad values
    (a stale row there re-runs an earlier step's token, position and cell)."""
    if last.path != "graph" or last.padding <= 0 or last.width not in rt.widths:
        return None  # nothing padded (or a width the runtime lacks: check_slices reports it)
    views = rt.static_inputs(last.width)
    flags = []
    for name, spec in rt.input_specs.items():
        rows = views[name][last.length:last.width]
        pad = torch.tensor(spec.pad, dtype=rows.dtype, device=rows.device)
        same = (rows == pad) | (rows.isnan() & pad.isnan()) if rows.dtype.is_floating_point else rows == pad
        flags.append((~same).any())
    stale = torch.stack(flags).tolist()  # one device read for every input
    if not any(stale):
        return None
    parts = []
    for (name, spec), bad in zip(rt.input_specs.items(), stale):
        if bad:
            vals = views[name][last.length:last.width].flatten()
            parts.append(f"{name!r} holds {vals[:6].tolist()}{' ...' if vals.numel() > 6 else ''} (pad {spec.pad})")
    return (f"pad rows: static input rows [{last.length}, {last.width}) of graph width {last.width} are not "
            f"the pad values after the step: {'; '.join(parts)}. Padding rows were not filled, so rows of an "
            f"earlier step ran again (they rewrite that step's state, e.g. KV cells of a reused sequence id)")
