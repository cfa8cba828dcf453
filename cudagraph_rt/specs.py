"""What a step function's input is declared as (`InputSpec`), and the rules for what a
step may pass for it: which Python and numpy values become tensors, and which dtypes cast
into the declared one without changing a value."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import InputError, expected


@dataclass(frozen=True)
class InputSpec:
    """One input of a step function, declared once.

    ``shape`` is the per-row shape (rows are the leading dimension and are not part of it),
    ``dtype`` the dtype of the static buffer, ``pad`` the value written into padding rows.
    A padding row must be a valid input whose outputs nothing reads back: for anything
    that writes state (a KV cache), point it at a reserved scratch slot.
    """

    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.int64
    pad: int | float | bool = 0

    def __post_init__(self):
        shape = (self.shape,) if isinstance(self.shape, int) else tuple(self.shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
            raise InputError(expected("InputSpec.shape", "a tuple of positive ints", self.shape))
        object.__setattr__(self, "shape", shape)
        if not isinstance(self.dtype, torch.dtype):
            raise InputError(expected("InputSpec.dtype", "a torch.dtype", self.dtype))
        if self.dtype.is_complex:
            raise InputError(expected("InputSpec.dtype", "a real (bool, integer or floating) dtype", self.dtype))
        pad = self.pad
        if isinstance(pad, (np.integer, np.floating, np.bool_)):
            pad = pad.item()
            object.__setattr__(self, "pad", pad)
        if not isinstance(pad, (int, float, bool)):
            raise InputError(expected("InputSpec.pad", "an int, float or bool", repr(pad)))
        if self.dtype.is_floating_point:
            return
        if isinstance(pad, float) and not (math.isfinite(pad) and pad.is_integer()):
            raise InputError(expected("InputSpec.pad", f"a finite integer for {self.dtype}", pad))
        if self.dtype != torch.bool:
            info = torch.iinfo(self.dtype)
            if not info.min <= int(pad) <= info.max:
                raise InputError(expected("InputSpec.pad", f"a value in [{info.min}, {info.max}]", pad))

    @property
    def ndim1(self) -> int:
        """Dimensions of a step's tensor for this input: rows plus the per-row shape."""
        return 1 + len(self.shape)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


NUMPY_DTYPES = {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
              torch.float16, torch.float32, torch.float64}


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def as_input_tensor(name: str, value: Any, spec: InputSpec) -> torch.Tensor:
    """Turn a tensor, numpy array or (nested) list into a tensor, without casting yet."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype == object or value.dtype.kind not in "biuf":
            raise InputError(expected(name, "a numeric array", f"numpy dtype {value.dtype}"))
        if not value.dtype.isnative:  # big-endian: torch takes native byte order only
            value = value.astype(value.dtype.newbyteorder("="))  # exact: same values
        return torch.from_numpy(np.ascontiguousarray(value) if value.ndim else value.copy())
    if isinstance(value, (list, tuple)):
        try:
            t = torch.as_tensor(value)
            if t.dtype.is_floating_point and spec.dtype.is_floating_point and t.dtype != spec.dtype:
                # Python floats are doubles: round each once, into the declared dtype (as
                # written into a buffer of that dtype), never through torch's float32 default.
                t = torch.as_tensor(value, dtype=spec.dtype)
            return t
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputError(expected(name, "a list of numbers with one row per token", f"{e}")) from None
    raise InputError(
        expected(name, "a torch.Tensor, numpy array or list", type(value).__name__)
    )


_MANTISSA = {torch.float16: 11, torch.bfloat16: 8, torch.float32: 24, torch.float64: 53}


def cast_input(name: str, t: torch.Tensor, spec: InputSpec) -> torch.Tensor:
    """Cast only where no value can change; host integers may narrow after a range check."""
    if t.dtype == spec.dtype:
        return t
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
