"""Per-row sampling settings, their checks, and what each setting means.

A step samples ``[N, V]`` logits with one setting per row, each a device tensor of N
entries (static buffers a captured graph reads; a request's settings change by writing
them in place, never by recapture):

* ``temperature`` float32 >= 0, finite. Below :data:`MIN_TEMPERATURE` (0 included) the
  row is greedy: its token is the first maximal logit, exactly
  ``cudagraph_rt.models.cells.greedy_tokens``'s (logits / T would overflow float32 there,
  and the distribution is already one token for any logits a model makes).
* ``top_k`` int64 >= 0: keep the tokens whose scaled logit is >= the k-th largest (ties
  at the boundary are all kept); 0, or k >= V, is off.
* ``top_p`` float32 in (0, 1]: then keep the smallest set of most probable tokens whose
  probability, renormalised over the top-k set, sums to >= top_p: the largest threshold
  t with mass(s >= t) >= top_p * mass(top-k set); 1 is off.
* ``min_p`` float32 in [0, 1): then keep the tokens with p >= min_p * p_max, i.e.
  ``s >= max(s) + log(min_p)`` (a ratio, so it does not depend on any renormalisation);
  0 is off.
* ``seed`` int64 and ``position`` int64: the randomness of the row (see ``philox.py``):
  the same (seed, position) and logits give the same token in any batch, width or graph
  mode. ``position`` is whatever position the caller names the drawn token by; a draft
  model's draw and the verify of that token must use the same one.

Order: temperature (``s = logits * (1 / T)`` in float32), then top-k, then top-p on the
renormalised top-k set, then min-p; the kept set is ``{s >= threshold}`` and the token is
drawn from softmax(s) over it (Gumbel-max: argmax of s + Gumbel noise).

Checks. :func:`check_sampling_args` reads only metadata (shapes, dtypes, devices), never
a device value, so it is safe during capture; every sampler entry point runs it before
launching anything. :func:`check_setting_values` reads the values (host rows: the
runtime calls it on a request's settings before staging them); the entry points run it
too when the settings are CPU tensors. On the device, values are not checked: a bad
value there samples something unspecified but never reads or writes out of bounds.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from cudagraph_rt.errors import InputError, expected

__all__ = ["LOGIT_DTYPES", "MIN_TEMPERATURE", "SamplingSettings", "check_sampling_args", "check_setting_values"]

MIN_TEMPERATURE = 1e-5
LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPES = {"temperature": torch.float32, "top_k": torch.int64, "top_p": torch.float32, "min_p": torch.float32,
           "seed": torch.int64, "position": torch.int64}


@dataclass(frozen=True)
class SamplingSettings:
    """The six per-row setting tensors of one step, each ``[N]`` on the logits' device
    (dtypes: temperature, top_p, min_p float32; top_k, seed, position int64). Holds
    references, never copies: a graph captured over them follows in-place writes."""

    temperature: Tensor
    top_k: Tensor
    top_p: Tensor
    min_p: Tensor
    seed: Tensor
    position: Tensor

    @classmethod
    def full(cls, n: int, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             seed: int = 0, position: int = 0, device="cpu") -> "SamplingSettings":
        """N rows of one setting (new tensors on ``device``)."""
        values = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "seed": seed,
                  "position": position}
        return cls(**{k: torch.full((n,), v, dtype=_DTYPES[k], device=device) for k, v in values.items()})

    def rows(self, index) -> "SamplingSettings":
        """The settings of rows ``index`` (any tensor index: a slice, a permutation)."""
        return SamplingSettings(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    def tensors(self) -> tuple[Tensor, ...]:
        """The six tensors in field order (the kernels' argument order)."""
        return tuple(getattr(self, f.name) for f in fields(self))


def _desc(t) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, Tensor) else type(t).__name__


def check_sampling_args(logits, settings, draft=None, q=None, out_tokens=None, out_p=None, out_probs=None) -> None:
    """InputError naming the first argument whose shape, dtype or device breaks the
    contract (``logits`` [N, V] float32/float16/bfloat16 with a contiguous last dimension;
    each setting [N] of its dtype; ``draft`` [N] int64; ``q`` and ``out_probs`` [N, V]
    float32; the outputs [N] int64 / [N] float32), all on the logits' device. Metadata
    only: no sync."""
    if not isinstance(logits, Tensor) or logits.dim() != 2 or logits.dtype not in LOGIT_DTYPES:
        raise InputError(expected("logits", "a [N, V] float32, float16 or bfloat16 tensor", _desc(logits)))
    n, v = logits.shape
    if v < 1 or logits.stride(1) != 1:
        raise InputError(expected("logits", "V >= 1 and a contiguous last dimension", f"{_desc(logits)} "
                                  f"stride {logits.stride()}"))
    if not isinstance(settings, SamplingSettings):
        raise InputError(expected("settings", "a SamplingSettings", type(settings).__name__))
    rows = [(f.name, getattr(settings, f.name), _DTYPES[f.name]) for f in fields(settings)]
    rows += [("draft", draft, torch.int64), ("out_tokens", out_tokens, torch.int64), ("out_p", out_p, torch.float32)]
    for name, t, dtype in rows:
        if t is None:
            continue
        if not isinstance(t, Tensor) or tuple(t.shape) != (n,) or t.dtype != dtype or t.device != logits.device:
            raise InputError(expected(name, f"a [{n}] {dtype} tensor on {logits.device}", _desc(t)))
    for name, t in (("q", q), ("out_probs", out_probs)):
        if t is not None and (not isinstance(t, Tensor) or tuple(t.shape) != (n, v) or t.dtype != torch.float32
                              or t.device != logits.device or t.stride(1) != 1):
            raise InputError(expected(name, f"a [{n}, {v}] float32 tensor on {logits.device}, last dimension "
                                      "contiguous", _desc(t)))


def _first_bad(name: str, values: Tensor, bad: Tensor, want: str) -> None:
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise InputError(expected(name, want, f"{values[row].item()} in row {row}"))


def check_setting_values(settings: SamplingSettings, vocab: int | None = None, draft: Tensor | None = None) -> None:
    """InputError naming the first setting with a value outside its range (temperature
    < 0, NaN or infinite; top_k < 0; top_p outside (0, 1]; min_p outside [0, 1); a draft
    outside [-1, vocab)). Reads the values: on CUDA tensors a sync, so call it on host
    rows, before staging them. Writes nothing."""
    t, k, p, mp = settings.temperature, settings.top_k, settings.top_p, settings.min_p
    _first_bad("temperature", t, ~torch.isfinite(t) | (t < 0), "a finite value >= 0 (0: greedy)")
    _first_bad("top_k", k, k < 0, "a value >= 0 (0: off)")
    _first_bad("top_p", p, ~((p > 0) & (p <= 1)), "a value in (0, 1] (1: off)")
    _first_bad("min_p", mp, ~((mp >= 0) & (mp < 1)), "a value in [0, 1) (0: off)")
    if draft is not None and vocab is not None:
        _first_bad("draft", draft, (draft < -1) | (draft >= vocab), f"a token in [0, {vocab}) or -1 (none)")
