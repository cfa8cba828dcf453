"""Prompt lookup (vLLM's ``ngram`` speculative method): draft what followed the last
occurrence of the sequence's own trailing n-gram.

No model, no device work: per sequence one numpy scan of its tokens. Deterministic
(``Proposal.q`` is None: each draft's q is one-hot at it).
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ..checks import as_int
from ..errors import InputError, expected
from .proposal import Proposal

__all__ = ["NgramDrafter", "ngram_drafts"]


def ngram_drafts(tokens, k: int, n_max: int, n_min: int) -> list[int]:
    """``k`` drafts continuing ``tokens`` (a list or 1-D int array): for ``n`` from
    ``n_max`` down to ``n_min``, the latest earlier start ``i`` with
    ``tokens[i:i+n] == tokens[-n:]`` (the trailing n-gram itself excluded) gives draft
    ``j = ext[i + n + j]``, where ``ext`` is ``tokens`` followed by the drafts already made:
    a continuation that reaches the end of the sequence goes on copying what it drafted,
    so a repeating sequence is continued period by period. No match at any ``n``: the last
    token ``k`` times (the fallback)."""
    arr = np.asarray(tokens, dtype=np.int64)
    L = arr.shape[0]
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # starts 0 .. L-n-1: every n-gram that ends before the last token
        hit = np.flatnonzero((sliding_window_view(arr[:-1], n) == arr[L - n:]).all(1))
        if hit.size:
            ext, src = arr.tolist(), int(hit[-1]) + n
            for j in range(k):
                ext.append(ext[src + j])
            return ext[L:]
    return [int(arr[-1])] * k


class NgramDrafter:
    """Prompt-lookup drafter: ``propose`` matches each sequence's trailing n-gram
    (``n_max`` .. ``n_min`` tokens, longest first) against its own earlier tokens
    (prompt and generated) and proposes what followed (:func:`ngram_drafts`).

    Stateless between calls: ``observe`` and ``forget`` do nothing (it reads
    ``seq.tokens`` when drafting). InputError naming ``n_max`` / ``n_min`` unless
    ``1 <= n_min <= n_max``.
    """

    def __init__(self, n_max: int = 4, n_min: int = 1):
        self.n_max = as_int("n_max", n_max, 1)
        self.n_min = as_int("n_min", n_min, 1)
        if self.n_min > self.n_max:
            raise InputError(expected("n_min", f"<= n_max = {self.n_max}", self.n_min))

    name = "ngram"

    def observe(self, c) -> None:
        """Nothing to keep: drafts read the sequences' tokens."""

    def propose(self, seqs, k: int) -> Proposal:
        k = as_int("k", k, 0)
        out = np.array([ngram_drafts(s.tokens, k, self.n_max, self.n_min) for s in seqs], np.int64)
        return Proposal(out.reshape(len(seqs), k))

    def forget(self, seq) -> None:
        """Nothing to free."""
