"""Width sets and the step plan: which graph (or dynamic call) runs which rows.

`plan_step` is a pure function of the step width and the runtime's limits; it is the
only source of truth for what replays, and is tested on its own.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Literal

from .errors import CapacityError, InputError, expected

Path = Literal["graph", "dynamic"]


@dataclass(frozen=True)
class Slice:
    """One piece of a step: rows ``[start, start + length)`` run on ``path`` at ``width``.

    For ``path == "graph"`` ``width`` is the captured width (``>= length``; the rows past
    ``length`` are padding). For ``path == "dynamic"`` ``width == length`` (no padding).
    """

    path: Path
    width: int
    start: int
    length: int

    @property
    def padding(self) -> int:
        return self.width - self.length


def default_widths(max_width: int = 64) -> tuple[int, ...]:
    """Powers of two from 1 up to ``max_width`` (``max_width`` itself included)."""
    if isinstance(max_width, bool) or not isinstance(max_width, int) or max_width < 1:
        raise InputError(expected("max_width", "a positive int", repr(max_width)))
    out, w = [], 1
    while w < max_width:
        out.append(w)
        w *= 2
    out.append(max_width)
    return tuple(out)


def check_widths(widths: Iterable[int]) -> tuple[int, ...]:
    """Validate a user width set: positive ints, strictly increasing, not empty."""
    try:
        ws = tuple(widths)
    except TypeError:
        raise InputError(expected("widths", "a sequence of positive ints", repr(widths))) from None
    if not ws:
        raise InputError(expected("widths", "at least one width", "an empty sequence"))
    for w in ws:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise InputError(expected("widths", "positive ints", f"{w!r} in {ws}"))
    if any(a >= b for a, b in zip(ws, ws[1:])):
        raise InputError(expected("widths", "strictly increasing widths", ws))
    return ws


def default_dynamic_limit(widths: tuple[int, ...]) -> int:
    """Half again the widest graph: wide enough for a verification burst, small enough
    that an eager call of that width stays cheap next to slicing."""
    return widths[-1] * 3 // 2


def _check_T(T: int, limit: int, slicing: bool) -> None:
    if isinstance(T, bool) or not isinstance(T, int) or T < 1:
        raise InputError(expected("T (rows in the step)", "a positive int", repr(T)))
    if T > limit and not slicing:
        raise CapacityError(expected("T (rows in the step)", f"at most {limit} with slicing off", T))


def _slice_at(start: int, T: int, widths: tuple[int, ...], limit: int) -> Slice:
    """The slice that runs rows ``[start, ...)`` of a step of T rows (the rule below)."""
    left, widest = T - start, widths[-1]
    if left <= widest:
        return Slice("graph", widths[bisect.bisect_left(widths, left)], start, left)
    n = min(left, limit)
    if n <= widest:  # only when dynamic_limit == widest: slice at the widest graph
        return Slice("graph", widest, start, n)
    return Slice("dynamic", n, start, n)


def plan_step(
    T: int, widths: tuple[int, ...], dynamic_limit: int, slicing: bool = True
) -> tuple[Slice, ...]:
    """The slices that run a step of ``T`` rows.

    - ``T <= widths[-1]``: one graph slice on the narrowest width ``>= T``.
    - ``widths[-1] < T <= dynamic_limit``: one unpadded dynamic slice of ``T`` rows.
    - ``T > dynamic_limit``: consecutive slices, each planned by the same rule on what is
      left (so the head runs at ``dynamic_limit`` and the tail on a graph or dynamically).

    One Slice per slice: O(T / max(widths[-1], dynamic_limit)), what a step of T rows runs
    (:func:`first_slice` is the first alone, in O(1)). Raises InputError for a
    non-positive T, CapacityError for T over every limit with ``slicing`` off, both
    before any slice is built.
    """
    limit = max(dynamic_limit, widths[-1])
    _check_T(T, limit, slicing)
    out, start = [], 0
    while start < T:
        out.append(_slice_at(start, T, widths, limit))
        start += out[-1].length
    return tuple(out)


def first_slice(T: int, widths: tuple[int, ...], dynamic_limit: int, slicing: bool = True) -> Slice:
    """``plan_step(T, ...)[0]`` in O(1), whatever T: the same slice and the same errors."""
    limit = max(dynamic_limit, widths[-1])
    _check_T(T, limit, slicing)
    return _slice_at(0, T, widths, limit)


class Planner:
    """``plan_step`` for one runtime's widths and limits, with a bounded cache (a step's
    plan is looked up, not recomputed, on the hot path)."""

    def __init__(self, widths: tuple[int, ...], dynamic_limit: int, slicing: bool):
        self.widths, self.dynamic_limit, self.slicing = widths, dynamic_limit, slicing
        self._cache: dict[int, tuple[Slice, ...]] = {}
        self._bound = 4 * max(widths[-1], dynamic_limit)  # never more than a few hundred entries

    def first(self, T: int) -> Slice:
        """The first slice of T's plan (:func:`first_slice`): O(1), nothing cached."""
        return first_slice(T, self.widths, self.dynamic_limit, self.slicing)

    def __call__(self, T: int) -> tuple[Slice, ...]:
        plan = self._cache.get(T) if type(T) is int else None
        if plan is None:
            plan = plan_step(T, self.widths, self.dynamic_limit, self.slicing)
            if T <= self._bound:
                self._cache[T] = plan
        return plan
