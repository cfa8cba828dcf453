"""The greedy token of each row: the first maximal logit, reduced in two stages."""
from __future__ import annotations

from torch import Tensor

__all__ = ["chunk_count", "greedy_tokens"]


def chunk_count(vocab: int) -> int:
    """Chunks of :func:`greedy_tokens`'s first stage: the largest divisor of ``vocab`` up to
    256 that leaves chunks of at least 256 logits (1: no split)."""
    best = 1
    for c in range(2, 257):  # a plain loop: torch.compile traces it (not max() of a generator)
        if vocab % c == 0 and vocab // c >= 256:
            best = c
    return best


def greedy_tokens(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)`` for ``[N, vocab]`` logits, in two stages: the maximum of each of
    ``chunk_count(vocab)`` chunks, then of the chunks. The same token (the first maximal
    logit: both stages take the first on ties), but a reduction with N x chunks rows in
    parallel instead of N: a decode step (N = 1) over a 128k vocabulary otherwise runs one
    long reduction on one multiprocessor (30 us of a 1.2 ms step on the H200)."""
    n, vocab = logits.shape
    c = chunk_count(vocab)
    if c == 1:
        return logits.argmax(-1)
    best, where = logits.view(n, c, vocab // c).max(-1)
    chunk = best.argmax(-1, keepdim=True)
    return (chunk * (vocab // c) + where.gather(-1, chunk)).squeeze(-1)
