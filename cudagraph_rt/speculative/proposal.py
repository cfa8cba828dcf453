"""What a drafter hands the runner: k draft tokens per sequence, and what they were drawn from."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

__all__ = ["Proposal"]


@dataclass(frozen=True)
class Proposal:
    """A drafter's answer to ``propose(seqs, k)``.

    ``tokens``: int64 array ``(n, k)``, row i the drafts for ``seqs[i]``.
    ``q``: ``None`` for a deterministic drafter (prompt lookup, a greedy draft model or
    head: each draft's q is one-hot at it), else a float32 tensor ``(n, k, vocab)`` on the
    target model's device, ``q[i, j]`` the distribution draft ``j`` of sequence ``i`` was
    sampled from (the verify's rejection sampling reads it). Lifetime: ``q`` is valid until
    the drafter's next ``propose``; the runner copies it into the verify step's inputs.
    A drafter may still return a bare ``tokens`` array: the runner reads it as ``q=None``.
    """

    tokens: np.ndarray
    q: Tensor | None = None
