"""Checking one step's inputs before anything is written (`Validator.check`), and what
the check hands on (`Prepared`). The casting rules themselves are in ``specs``."""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import torch

from ..errors import InputError, expected
from .casting import as_input_tensor, cast_input
from .spec import InputSpec

_STRIDED = torch.strided
_OVERLAP = ("memory apart from the runtime's static buffers (or the rows device_inputs() gave, or the "
            "unchanged views host_inputs() gave for this step)")


class Prepared(NamedTuple):
    """Validated inputs of one step: ``T`` rows each; nothing has been written yet.
    (A NamedTuple, not a dataclass: it is built on every step's path.)"""

    T: int
    tensors: Mapping[str, torch.Tensor]
    zero_copy: frozenset  # names whose rows already sit in the arena (device_inputs() views)
    host_ptrs: Mapping[str, int]  # contiguous host tensors of the declared dtype: data_ptr()


def _shape_error(name: str, shape: torch.Size, got) -> InputError:
    return InputError(expected(name, f"shape (T, {', '.join(map(str, shape))})".replace(", )", ")"), tuple(got)))


class Validator:
    """Names, rows, per-row shapes, dtypes, devices and overlaps of one step's inputs.

    ``host_ranges`` / ``device_ranges``: the runtime's own buffers, as (start, end)
    addresses; a tensor inside one is taken only when ``check``'s ``owned(name, t)`` says
    it is a handed view or the arena's own rows ("zero copy"), else refused."""

    def __init__(self, specs: Mapping[str, InputSpec], device: torch.device, host_ranges: list,
                 device_ranges: list):
        self.specs, self.device = dict(specs), device
        self._host_ranges, self._device_ranges = host_ranges, device_ranges
        self._checks = [(n, s, s.ndim1, torch.Size(s.shape), s.dtype) for n, s in self.specs.items()]
        self._first = next(iter(self.specs))
        self._host_checks = [(n, nd, sh, dt) for n, _, nd, sh, dt in self._checks]
        # one span around our host buffers: most tensors fall outside it in one comparison
        self._host_span = (min(lo for lo, _ in host_ranges), max(hi for _, hi in host_ranges)) if host_ranges \
            else (0, 0)

    def names(self, inputs: Mapping[str, Any]) -> None:
        if inputs.keys() != self.specs.keys():
            missing = [n for n in self.specs if n not in inputs]
            extra = [n for n in inputs if n not in self.specs]
            raise InputError(expected("step inputs", f"exactly {sorted(self.specs)}",
                                      f"missing {missing}, unexpected {extra}"))

    def check(self, inputs: Mapping[str, Any], owned: Callable[[str, torch.Tensor], bool | None]) -> Prepared:
        """Raises InputError naming the input; writes nothing. On every step's path, so the
        common case (tensors of the declared dtype) takes few Python operations. ``owned``
        tells, for a tensor inside our buffers, zero copy (True), a handed view (False) or
        neither (None: refused)."""
        tensors, host_ptrs, zero_copy, T = {}, {}, (), -1
        for name, spec, ndim, shape, dtype in self._checks:
            t = inputs[name]
            if type(t) is not torch.Tensor:
                t = as_input_tensor(name, t, spec)
            if t.layout is not _STRIDED:
                raise InputError(expected(name, "a dense (strided) tensor", f"layout {t.layout}"))
            if t.is_neg():  # a lazy negation (conj().imag): its bytes hold the other sign
                t = t.resolve_neg()
            sh = _shape(name, t)
            if len(sh) != ndim or (ndim > 1 and sh[1:] != shape):
                raise _shape_error(name, shape, sh)
            if T < 0:
                T = sh[0]
            elif sh[0] != T:
                raise InputError(expected(name, f"{T} rows like {self._first!r}", f"{sh[0]} rows"))
            cast = t.dtype is not dtype
            if cast:
                if t.dtype.is_complex or t.is_quantized:
                    raise InputError(expected(name, f"dtype {dtype}", t.dtype))
                t = cast_input(name, t, spec)
            t, ranges = self._place(name, t)
            p = t.data_ptr()
            if self._inside(p, ranges) and self._overlap(name, t, owned):
                zero_copy += (name,)
            if ranges is self._host_ranges and not cast and t.is_contiguous():
                host_ptrs[name] = p  # written with one memmove, no tensor op
            tensors[name] = t
        if T <= 0:
            raise InputError(expected("step inputs", "at least one row", "0 rows"))
        return Prepared(T, tensors, frozenset(zero_copy), host_ptrs)

    def host_rows(self, inputs: Mapping[str, Any]) -> tuple[int, list[int]] | None:
        """``check``'s common case in few operations: every input a contiguous CPU tensor
        of its declared dtype and per-row shape, outside our buffers, one T for all.
        ``(T, data pointers in spec order)``, or None for anything else (``check`` then
        decides, and raises where it must). Writes nothing."""
        if len(inputs) != len(self._host_checks):
            return None
        T, ptrs, ranges = -1, [], self._host_ranges
        span_lo, span_hi = self._host_span
        try:
            for name, ndim, shape, dtype in self._host_checks:
                t = inputs[name]
                # is_neg: a lazy negation's bytes hold the other sign (check resolves it)
                if type(t) is not torch.Tensor or t.dtype is not dtype or not t.is_cpu or t.is_neg() \
                        or not t.is_contiguous():
                    return None
                sh = t.shape
                if len(sh) != ndim or (ndim > 1 and sh[1:] != shape):
                    return None
                if sh[0] != T:
                    if T >= 0:
                        return None
                    T = sh[0]
                p = t.data_ptr()
                if span_lo <= p < span_hi:
                    for lo, hi in ranges:
                        if lo <= p < hi:
                            return None
                ptrs.append(p)
        except (KeyError, RuntimeError):  # a missing name; a tensor without sizes or storage
            return None
        return T, ptrs

    def _place(self, name: str, t: torch.Tensor) -> tuple[torch.Tensor, list]:
        """The tensor (detached on the device) and the ranges of our buffers on its side."""
        if t.is_cuda:
            if t.device != self.device:
                raise InputError(expected(name, f"a tensor on {self.device} or the host", f"one on {t.device}"))
            return (t.detach() if t.requires_grad else t), self._device_ranges
        if not t.is_cpu:
            raise InputError(expected(name, f"a tensor on {self.device} or the host", f"one on {t.device}"))
        return t, self._host_ranges

    @staticmethod
    def _inside(p: int, ranges: list) -> bool:
        # Only a view of one of our own buffers can overlap them, and such a view starts
        # inside the buffer: one range test per buffer is exact.
        for lo, hi in ranges:
            if lo <= p < hi:
                return True
        return False

    @staticmethod
    def _overlap(name: str, t: torch.Tensor, owned) -> bool:
        """A tensor inside our buffers: True when it is the arena's own rows (zero copy),
        False for a handed view (its rows are taken from where they lie), else refused."""
        kind = owned(name, t)
        if kind is None:
            raise InputError(expected(name, _OVERLAP, "a tensor overlapping them"))
        return kind


def _shape(name: str, t: torch.Tensor) -> torch.Size:
    try:
        return t.shape
    except RuntimeError:  # a nested tensor has no sizes
        raise InputError(expected(name, "a dense (strided) tensor", "a nested tensor")) from None
