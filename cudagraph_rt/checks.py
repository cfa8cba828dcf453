"""The argument checks the public constructors and entry points outside the runtime's own
configuration share (the models, the pool, the kernels, the runner and its drafters). Each
returns the plain value or raises :class:`~cudagraph_rt.errors.InputError` naming the
argument (``"<name>: expected <what>, got <value>"``), before anything is built or written.

* :func:`as_int`: an integer; numpy integers are taken as the plain int, bools are not
  integers here (``k=True`` is a mistake, not 1), nor are floats, even integral ones.
* :func:`as_real`: a finite real number (numpy scalars taken as float; bools refused).
* :func:`token_ids`: token ids as a tuple of ints: a list or tuple of integers, or a 1-D
  integer numpy array or torch tensor.
* :func:`resolve_device`: a device this machine has, ``"cuda"`` resolved to
  ``cuda:<current>`` (``"cuda" != "cuda:0"`` in a step's input checks); None picks CUDA
  when there is one, else the CPU. :class:`~cudagraph_rt.GraphRuntime` resolves its
  ``device`` through it too.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from .errors import InputError, expected


def _int_range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"an int in [{lo}, {hi}]"
    return "an int" + (f" >= {lo}" if lo is not None else f" <= {hi}" if hi is not None else "")


def as_int(name: str, v: Any, lo: int | None = None, hi: int | None = None, what: str | None = None) -> int:
    """``v`` as a plain int in ``[lo, hi]`` (either bound optional), else InputError
    (``what``: the message's own words for what was expected)."""
    what = what or _int_range(lo, hi)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise InputError(expected(name, what, repr(v)))
    i = int(v)
    if (lo is not None and i < lo) or (hi is not None and i > hi):
        raise InputError(expected(name, what, i))
    return i


def as_bool(name: str, v: Any) -> bool:
    """``v`` when it is True or False (numpy's bools taken as bool), else InputError: a
    flag given 1 or "yes" is a mistake, not a truth value."""
    if not isinstance(v, (bool, np.bool_)):
        raise InputError(expected(name, "True or False", repr(v)))
    return bool(v)


def as_real(name: str, v: Any, lo: float, hi: float) -> float:
    """``v`` as a finite float in ``[lo, hi]`` (ints and numpy reals taken), else InputError."""
    what = f"a number in [{lo}, {hi}]"
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise InputError(expected(name, what, repr(v)))
    x = float(v)
    if not (math.isfinite(x) and lo <= x <= hi):
        raise InputError(expected(name, what, repr(v)))
    return x


def token_ids(name: str, tokens: Any, vocab: int) -> tuple[int, ...]:
    """``tokens`` as a tuple of ints in ``[0, vocab)``: a list, tuple or range of integers
    (numpy integers taken), or a 1-D integer numpy array or torch tensor (read on the host).
    Floats (even integral), bools, strings and other shapes are refused: a token id that
    came as anything else is a mistake upstream."""
    what = f"token ids in [0, {vocab}) (a list of ints, or a 1-D integer array or tensor)"
    if isinstance(tokens, (np.ndarray, torch.Tensor)):
        integer = (tokens.dtype.kind in "iu" if isinstance(tokens, np.ndarray)
                   else not tokens.dtype.is_floating_point and not tokens.dtype.is_complex
                   and tokens.dtype != torch.bool)
        if tokens.ndim != 1 or not integer:
            raise InputError(expected(name, what, f"{tokens.dtype} of shape {tuple(tokens.shape)}"))
        ids = tuple(int(t) for t in tokens.tolist())
    elif isinstance(tokens, (list, tuple, range)):
        bad = [t for t in tokens if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))]
        if bad:
            raise InputError(expected(name, what, f"{bad[0]!r} in {_short(tokens)}"))
        ids = tuple(int(t) for t in tokens)
    else:
        raise InputError(expected(name, what, type(tokens).__name__))
    out = [t for t in ids if not 0 <= t < vocab]
    if out:
        raise InputError(expected(name, what, f"{out[0]} in {_short(ids)}"))
    return ids


def _short(seq) -> str:
    seq = list(seq)
    return repr(seq) if len(seq) <= 8 else f"[{', '.join(map(repr, seq[:8]))}, ... ({len(seq)} in all)]"


def resolve_device(device: Any, name: str = "device") -> torch.device:
    """The device ``device`` names on this machine, else InputError naming ``name``: an
    unknown name, a type other than 'cpu' and 'cuda', CUDA where there is none, or a CUDA
    index past the devices there are."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if isinstance(device, (int, np.integer)) and not isinstance(device, (bool, np.bool_)):
        device = f"cuda:{int(device)}"  # torch reads a bare index as one of the accelerator's
    if not isinstance(device, (str, torch.device)):
        raise InputError(expected(name, "a torch device", repr(device)))
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(expected(name, "a torch device", repr(device))) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(expected(name, "a device this machine has", f"{device} (no CUDA here)"))
        if dev.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            raise InputError(expected(name, "a device this machine has",
                                      f"{dev} ({torch.cuda.device_count()} CUDA device(s))"))
        return dev
    if dev.type != "cpu":
        raise InputError(expected(name, "'cuda' or 'cpu'", str(dev)))
    return dev


__all__ = ["as_bool", "as_int", "as_real", "resolve_device", "token_ids"]
