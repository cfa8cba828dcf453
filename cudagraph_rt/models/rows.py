"""The host-side checks every model's step makes of its per-row inputs."""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError, expected


def take_rows(inputs: dict[str, Tensor], names: tuple[str, ...], device: torch.device) -> list[Tensor]:
    """``inputs[name]`` for each name, checked: present, 1-D, one N (the rows of
    ``tokens``), int64, on ``device``. Reads no device value (capturable)."""
    missing = [k for k in names if k not in inputs]
    if missing:
        raise InputError(expected("inputs", f"keys {list(names)}", f"missing {missing}"))
    n = inputs["tokens"].shape[0] if "tokens" in inputs else None
    out = []
    for k in names:
        v = inputs[k]
        if not isinstance(v, Tensor) or v.dim() != 1 or (n is not None and v.shape[0] != n):
            raise InputError(expected(k, f"a 1-D tensor of {n} rows", getattr(v, "shape", type(v))))
        if v.dtype != torch.int64 or v.device != device:
            raise InputError(expected(k, f"int64 on {device}", f"{v.dtype} on {v.device}"))
        out.append(v)
    return out
