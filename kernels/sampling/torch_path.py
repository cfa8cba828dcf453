"""The sampler in plain torch ops: the CPU (and emulated-graph) path, and the oracle the Triton
kernels are tested against, token for token.

Same contract as the kernels (``settings.py`` says what each setting means, ``api.py`` what
comes out), computed the direct way: the thresholds from one sort of each row's scaled
logits (this path may sort; the GPU path does not), the token by Gumbel-max over the kept
set with the noise of ``philox.py``. The same float32 formulas as the kernels wherever a
decision depends on them (``s = logits * (1 / T)``, ``s + g``, ``exp(s - m) / Z``,
``u < p(d)``), so the two disagree only where two sums of the same numbers in another
order, or two ``log``/``exp`` libraries, round to different sides of a decision: a top-p
boundary within float32 rounding of its target mass, two Gumbel keys within rounding of
each other, an acceptance uniform within rounding of p(d).

Every function is a pure function of its tensors: static shapes, no host sync, no
``.item()``, no ``nonzero``, so it runs inside a captured CUDA graph too (slowly: it
sorts and draws noise for the whole vocabulary).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from cudagraph_rt.kernels.sampling.philox import Stream, gumbel, uniform
from cudagraph_rt.kernels.sampling.settings import MIN_TEMPERATURE, SamplingSettings

__all__ = ["Processed", "process", "sample_torch", "verify_torch"]

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class Processed:
    """One step's logits after temperature, top-k, top-p and min-p (all [N] or [N, V]):
    ``s`` the scaled logits (float32), ``m`` their row maximum, ``threshold`` (keep
    ``s >= threshold``), ``kept`` the mask, ``mass`` = sum of exp(s - m) over it (so
    p = exp(s - m) / mass on the kept set), ``greedy`` the greedy rows, ``argmax`` each
    row's first maximal logit (the greedy token)."""

    s: Tensor
    m: Tensor
    threshold: Tensor
    kept: Tensor
    mass: Tensor
    greedy: Tensor
    argmax: Tensor

    def probs(self) -> Tensor:
        """[N, V] float32: p on the kept set, 0 elsewhere; a one-hot argmax for greedy rows."""
        p = torch.where(self.kept, torch.exp(self.s - self.m[:, None]) / self.mass[:, None], 0.0)
        one_hot = torch.nn.functional.one_hot(self.argmax, self.s.shape[1]).to(torch.float32)
        return torch.where(self.greedy[:, None], one_hot, p)


def _top_k_top_p(sd: Tensor, m: Tensor, settings: SamplingSettings) -> Tensor:
    """The top-k then top-p threshold of each row (-inf: nothing cut) from the scaled
    logits sorted in descending order."""
    n, v = sd.shape
    k = settings.top_k
    k = torch.where((k > 0) & (k < v), k, 0)
    t_k = torch.where(k > 0, sd.gather(1, (k - 1).clamp(min=0)[:, None])[:, 0], _NEG_INF)
    w = torch.where(sd >= t_k[:, None], torch.exp(sd - m[:, None]), 0.0)
    # the largest data value t with mass(s >= t) >= top_p * mass(top-k set): the first
    # sorted position whose running mass reaches the target (ties included by >= t)
    hit = w.cumsum(-1) >= (settings.top_p * w.sum(-1))[:, None]
    t_p = sd.gather(1, hit.to(torch.int8).argmax(-1)[:, None])[:, 0]
    t_p = torch.where((settings.top_p < 1) & hit.any(-1), t_p, _NEG_INF)
    return torch.maximum(t_k, t_p)


def process(logits: Tensor, settings: SamplingSettings) -> Processed:
    """Temperature, top-k, top-p, min-p of ``logits`` [N, V] under ``settings`` (see
    ``settings.py`` for the order and the exact thresholds)."""
    t = settings.temperature
    greedy = t < MIN_TEMPERATURE
    inv_t = torch.where(greedy, torch.ones_like(t), 1.0 / t)
    s = logits.to(torch.float32) * inv_t[:, None]
    m = s.amax(-1)
    argmax = s.argmax(-1)  # the first maximal value
    threshold = _top_k_top_p(s.sort(-1, descending=True).values, m, settings)
    min_p = settings.min_p
    t_min = torch.where(min_p > 0, m + torch.log(min_p), _NEG_INF)
    threshold = torch.maximum(threshold, t_min)
    kept = s >= threshold[:, None]
    mass = torch.where(kept, torch.exp(s - m[:, None]), 0.0).sum(-1)
    return Processed(s, m, threshold, kept, mass, greedy, argmax)


def _gumbel_argmax(pr: Processed, noise: Tensor, exclude: Tensor) -> Tensor:
    """argmax over the kept set minus ``exclude`` (-1: none) of s + ``noise``; the first
    on ties (0 when nothing is left)."""
    idx = torch.arange(pr.s.shape[1], device=pr.s.device)[None, :]
    score = torch.where(pr.kept & (idx != exclude[:, None]), pr.s + noise, _NEG_INF)
    return score.argmax(-1)


def sample_torch(logits: Tensor, settings: SamplingSettings, stream: int = Stream.SAMPLE) -> Tensor:
    """[N] int64: each row's token drawn from its processed distribution with the noise of
    ``stream`` (``Stream.SAMPLE`` for the target model, ``Stream.DRAFT`` for a draft
    model's own draw of the same position); greedy rows give their first maximal logit."""
    pr = process(logits, settings)
    noise = gumbel(settings.seed, settings.position, int(stream), logits.shape[1])
    tok = _gumbel_argmax(pr, noise, torch.full_like(settings.seed, -1))
    return torch.where(pr.greedy, pr.argmax, tok)


def verify_torch(logits: Tensor, settings: SamplingSettings, draft: Tensor, q: Tensor | None = None,
                 stream: int = Stream.SAMPLE) -> tuple[Tensor, Tensor, Processed]:
    """Rejection sampling of each row's ``draft`` token (-1, or anything outside [0, V):
    none) against its processed distribution p: accept with probability min(1, p(d)/q(d))
    (q one-hot at d when ``q`` is None, else the row of ``q``), else draw from
    norm(max(0, p - q)); a row without a draft draws from p (the bonus token, with
    ``stream``'s noise). Returns the tokens [N] int64 (== d exactly when accepted), p(d)
    [N] float32 (0 without a draft) and the processed rows."""
    pr = process(logits, settings)
    v = logits.shape[1]
    valid = (draft >= 0) & (draft < v)
    d = torch.where(valid, draft, -1)
    dc = d.clamp(min=0)[:, None]
    p_d = torch.where(valid & pr.kept.gather(1, dc)[:, 0],
                      torch.exp(pr.s.gather(1, dc)[:, 0] - pr.m) / pr.mass, 0.0)
    p_d = torch.where(pr.greedy, (valid & (d == pr.argmax)).to(torch.float32), p_d)
    u = uniform(settings.seed, settings.position, Stream.ACCEPT)
    q_d = 1.0 if q is None else q.gather(1, dc)[:, 0]
    accept = valid & (u * q_d < p_d)
    residual_noise = gumbel(settings.seed, settings.position, Stream.RESIDUAL, v)
    noise = torch.where(valid[:, None], residual_noise, gumbel(settings.seed, settings.position, int(stream), v))
    token = _gumbel_argmax(pr, noise, d)
    if q is not None:
        token = torch.where(valid, _residual(pr, residual_noise, q, d), token)
    token = torch.where(accept, d, token)
    return torch.where(pr.greedy, pr.argmax, token), p_d, pr


def _residual(pr: Processed, g: Tensor, q: Tensor, d: Tensor) -> Tensor:
    """The token drawn from norm(max(0, p - q)) with the residual stream's noise (Gumbel-max
    over log(p - q) where p > q, which never holds at a rejected draft); from p without the
    draft where p - q has no positive entry (p == q up to rounding, where a rejection can only
    come from rounding), so that a token equals its draft only when it was accepted."""
    p = torch.where(pr.kept, torch.exp(pr.s - pr.m[:, None]) / pr.mass[:, None], 0.0)
    r = p - q
    score = torch.where(r > 0, torch.log(r) + g, _NEG_INF)
    fallback = _gumbel_argmax(pr, g, d)
    return torch.where((r > 0).any(-1), score.argmax(-1), fallback)
