"""The rules for what a step may pass for an input (an `InputSpec`): which Python and numpy
values become tensors, and which dtypes cast into the declared one without changing a value."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import InputError, expected
from .spec import InputSpec


NUMPY_DTYPES = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
              torch.float16, torch.float32, torch.float64}


def numpy_tensor(name: str, value: np.ndarray) -> torch.Tensor:
    """A numpy array as a tensor, by value (big-endian arrays too); InputError for dtypes
    torch has no tensor of (strings, objects, complex, longdouble)."""
    if value.dtype == object or value.dtype.kind not in "biuf":
        raise InputError(expected(name, "a numeric array", f"numpy dtype {value.dtype}"))
    if not value.dtype.isnative:  # big-endian: torch takes native byte order only
        value = value.astype(value.dtype.newbyteorder("="))  # exact: same values
    try:
        return torch.from_numpy(np.ascontiguousarray(value) if value.ndim else value.copy())
    except TypeError:  # longdouble and the like: no torch dtype holds them
        raise InputError(expected(name, "a numeric array of a dtype torch has", f"numpy dtype {value.dtype}")) \
            from None


def as_input_tensor(name: str, value: Any, spec: InputSpec) -> torch.Tensor:
    """Turn a tensor, numpy array or (nested) list into a tensor, without casting yet.
    A list of floats for a floating spec is rounded once, into the spec's dtype (as numpy
    writes a double into a float16 array); a finite value that rounds to inf there is
    refused. A list of numpy scalars goes through numpy (uint64 included)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        return numpy_tensor(name, value)
    if isinstance(value, (list, tuple)):
        t = _list_tensor(name, value)
        if t.dtype.is_floating_point and spec.dtype.is_floating_point and t.dtype != spec.dtype:
            t = round_once(name, t, spec.dtype)
        return t
    raise InputError(
        expected(name, "a torch.Tensor, numpy array or list", type(value).__name__)
    )


def _list_tensor(name: str, value: list | tuple) -> torch.Tensor:
    """A (nested) list as a tensor: torch's own reading; floats as float64 (Python floats
    are doubles), numpy scalars torch refuses (uint64) through numpy."""
    try:
        t = torch.as_tensor(value)
        if t.dtype.is_floating_point and t.dtype != torch.float64:
            t = torch.as_tensor(value, dtype=torch.float64)  # exact for any float: rounded later, once
        return t
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        err = e
    try:
        a = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        a = None
    if a is not None and a.dtype.kind in "biu":  # numpy integer scalars (np.uint64 ...)
        return numpy_tensor(name, a)
    raise InputError(expected(name, "a list of numbers with one row per token", f"{err}")) from None


def round_once(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floats ``t`` rounded to nearest-even into ``dtype`` in one rounding (torch's own
    float64 -> float16/bfloat16 conversion goes through float32: two roundings, 1 ulp off
    now and then). InputError when a finite value rounds to inf (beyond ``dtype``'s range)."""
    if dtype in (torch.float16, torch.bfloat16) and t.dtype == torch.float64:
        a = t.numpy()
        if dtype == torch.float16:
            with np.errstate(over="ignore"):  # overflow is refused below, by name
                out = torch.from_numpy(a.astype(np.float16))  # numpy: double -> half, one rounding
        else:  # round-to-odd into float32 keeps the one rounding float32 -> bfloat16 makes exact
            out = torch.from_numpy(_float32_round_to_odd(a)).to(torch.bfloat16)
    else:
        out = t.to(dtype)
    over = torch.isinf(out) & torch.isfinite(t)
    if bool(over.any()):
        info = torch.finfo(dtype)
        raise InputError(expected(name, f"values within {dtype}'s range (|x| <= {info.max:g})",
                                  f"{float(t[over].flatten()[0])!r}"))
    return out


def _float32_round_to_odd(a: np.ndarray) -> np.ndarray:
    """float64 -> float32, truncated toward zero with the last bit set when inexact
    ("round to odd"): a second rounding to a format of 2+ fewer bits is then exact."""
    with np.errstate(over="ignore"):
        f = a.astype(np.float32)
    back = f.astype(np.float64)
    inexact = (back != a) & ~np.isnan(a)
    bits = f.view(np.uint32).copy()
    toward_zero = inexact & (np.abs(back) > np.abs(a))  # rounded away from zero: step back
    bits[toward_zero] -= 1
    bits[inexact] |= 1
    return bits.view(np.float32)


_MANTISSA = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


_FLOAT8 = {d for d in (getattr(torch, n, None) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                          "float8_e5m2fnuz", "float8_e8m0fnu")) if d is not None}


def cast_input(name: str, t: torch.Tensor, spec: InputSpec) -> torch.Tensor:
    """Cast only where no value can change; host integers may narrow after a range check.
    Dtypes torch cannot promote (float8) are refused unless they are the spec's own."""
    if t.dtype == spec.dtype:
        return t
    if t.dtype in _FLOAT8:
        raise InputError(expected(name, f"dtype {spec.dtype} (or one that casts to it safely)", t.dtype))
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):  # no promotion rules, no min/max
        if t.device.type != "cpu":
            raise InputError(expected(name, f"dtype {spec.dtype} (or one that casts to it safely)", t.dtype))
        a = t.numpy()
        if a.size and int(a.max()) > torch.iinfo(torch.int64).max:
            raise InputError(expected(name, f"values that fit {spec.dtype}", f"values up to {int(a.max())}"))
        t = torch.from_numpy(a.astype(np.int64))
        if spec.dtype == torch.int64:
            return t
    if spec.dtype.is_floating_point and not t.dtype.is_floating_point and t.dtype != torch.bool:
        # an integer is exact in a float only up to 2**mantissa
        lim = 2 ** _MANTISSA.get(spec.dtype, 24)
        if t.device.type == "cpu":
            # min and max as Python ints: abs() of the most negative value overflows
            big = max(-int(t.min()), int(t.max())) if t.numel() else 0
            if big > lim:
                raise InputError(expected(name, f"integers of magnitude <= 2**{_MANTISSA.get(spec.dtype, 24)} "
                                          f"(exact in {spec.dtype})", f"magnitude {big}"))
            return t
        if max(abs(torch.iinfo(t.dtype).min), torch.iinfo(t.dtype).max) > lim:
            raise InputError(expected(name, f"dtype {spec.dtype} (or one that casts to it exactly)", t.dtype))
        return t
    if torch.promote_types(t.dtype, spec.dtype) == spec.dtype:
        return t  # safe: the copy into the static buffer casts
    both_int = not t.dtype.is_floating_point and not spec.dtype.is_floating_point
    if both_int and t.device.type == "cpu" and spec.dtype != torch.bool and t.dtype != torch.bool:
        info = torch.iinfo(spec.dtype)
        if t.numel() == 0 or (int(t.min()) >= info.min and int(t.max()) <= info.max):
            return t
        raise InputError(
            expected(name, f"values that fit {spec.dtype} [{info.min}, {info.max}]",
                     f"values in [{int(t.min())}, {int(t.max())}]")
        )
    raise InputError(expected(name, f"dtype {spec.dtype} (or one that casts to it safely)", t.dtype))
