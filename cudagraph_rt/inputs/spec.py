"""What a step function's input is declared as: `InputSpec` (its per-row shape, dtype and
pad). The rules for what a step may pass for it are in casting.py."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError, expected


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


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
