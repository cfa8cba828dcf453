"""Sort-based top-k / top-p / min-p sampling, the way torch users and vLLM's sampler write it:
the tests' distribution oracle and the benchmark's baseline. Not used by the sampler.

* :func:`reference_probs`: the processed distribution of each row in float64, straight
  from the textbook definitions on probabilities (softmax of logits / T; keep the k most
  probable; renormalise; keep the most probable tokens while the mass before them is
  below top_p; keep p >= min_p * p_max; renormalise). Greedy rows (T below
  ``MIN_TEMPERATURE``) are one-hot at the first maximal logit. Ties are broken by rank
  (the sampler keeps every tied token at a boundary): compare kept sets on logits without
  ties.
* :func:`reference_sample`: one token per row the way vLLM's ``TopKTopPSampler`` (torch
  path) and ``apply_top_k_top_p`` do it, in float32 on the device: sort each row, mask
  below the k-th value, softmax and cumsum of the sorted row for top-p, scatter back,
  min-p on the probabilities, then the exponential race (argmax of p / Exp(1) noise from
  torch's generator). Capturable in a CUDA graph (torch's generator advances per replay).
"""
from __future__ import annotations

import torch
from torch import Tensor

from cudagraph_rt.kernels.sampling.settings import MIN_TEMPERATURE, SamplingSettings

__all__ = ["reference_probs", "reference_sample"]


def reference_probs(logits: Tensor, settings: SamplingSettings) -> Tensor:
    """[N, V] float64: each row's distribution after temperature, top-k, top-p (on the
    renormalised top-k set) and min-p, from one descending sort of its probabilities."""
    n, v = logits.shape
    t = settings.temperature.double()
    greedy = t < MIN_TEMPERATURE
    probs = torch.softmax(logits.double() / torch.where(greedy, 1.0, t)[:, None], -1)
    sp, order = probs.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(v, device=logits.device)[None, :]
    k = settings.top_k[:, None]
    sp = torch.where((k <= 0) | (k >= v) | (rank < k), sp, 0.0)
    sp = sp / sp.sum(-1, keepdim=True)
    before = sp.cumsum(-1) - sp
    top_p = settings.top_p.double()[:, None]
    sp = torch.where((top_p >= 1) | (before < top_p), sp, 0.0)
    sp = torch.where(sp >= settings.min_p.double()[:, None] * sp[:, :1], sp, 0.0)
    sp = sp / sp.sum(-1, keepdim=True)
    out = torch.zeros_like(probs).scatter_(1, order, sp)
    one_hot = torch.nn.functional.one_hot(logits.argmax(-1), v).double()
    return torch.where(greedy[:, None], one_hot, out)


def _apply_top_k_top_p(x: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """vLLM's ``apply_top_k_top_p`` (torch path): mask logits outside the top-k, then
    outside the top-p of the renormalised rest, with -inf (one ascending sort)."""
    v = x.shape[1]
    sx, idx = x.sort(-1, descending=False)
    k = torch.where((top_k > 0) & (top_k < v), top_k, v)
    kth = sx.gather(1, (v - k)[:, None])
    sx = sx.masked_fill(sx < kth, float("-inf"))
    cum = sx.softmax(-1).cumsum(-1)
    cut = cum <= (1 - top_p)[:, None]
    cut[:, -1] = False  # keep at least one
    sx = sx.masked_fill(cut & (top_p < 1)[:, None], float("-inf"))
    return sx.scatter(-1, idx, sx)


def reference_sample(logits: Tensor, settings: SamplingSettings, generator: torch.Generator | None = None) -> Tensor:
    """[N] int64 tokens by sort-based top-k / top-p, min-p and the exponential race (the
    baseline the benchmark times; its randomness is torch's, not the sampler's)."""
    t = settings.temperature
    greedy = t < MIN_TEMPERATURE
    x = logits.to(torch.float32) / torch.where(greedy, torch.ones_like(t), t)[:, None]
    x = _apply_top_k_top_p(x, settings.top_k, settings.top_p)
    probs = x.softmax(-1)
    probs = probs.masked_fill(probs < settings.min_p[:, None] * probs.amax(-1, keepdim=True), 0.0)
    race = torch.empty_like(probs).exponential_(generator=generator)
    token = probs.div(race).argmax(-1)
    return torch.where(greedy, logits.argmax(-1), token)
