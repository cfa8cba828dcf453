"""Greedy speculative acceptance on the device: one function every model's ``verify_step`` uses.

Pure tensor code with static shapes (no host sync, no ``nonzero``), so it runs inside a
captured CUDA graph; the outputs feed ``HostRows(mode="device")`` directly.
"""
from __future__ import annotations

import torch
from torch import Tensor


def greedy_accept(tokens: Tensor, next_tokens: Tensor, positions: Tensor, seq_ids: Tensor,
                  want: Tensor) -> dict[str, Tensor]:
    """Which rows of one packed verify step are committed, all [N] int64 inputs.

    ``tokens[i]`` is row i's greedy token, ``next_tokens[i]`` the token fed at
    ``positions[i] + 1`` of the same sequence in this step (the draft the next row checks),
    -1 if none. Row i MISMATCHES when ``want[i] == 1`` and ``tokens[i] != next_tokens[i]`` (so
    -1 always mismatches). Row i is COMMITTED when ``want[i] == 1`` and no row of the same
    sequence at a smaller position mismatches: per sequence the longest matching prefix
    plus the first mismatching row (the bonus / correction). Rows with ``want == 0``
    (prefill rows, padding) are never committed and never block. Rows of one sequence need
    not be consecutive; equal positions never block each other.

    Returns ``committed`` [N] bool; ``accept_rows`` [N] int32: committed row indices,
    increasing, packed at the front, zeros after; ``accept_count`` [1] int32. Memory: O(N^2)
    booleans for the pairwise "earlier row of the same sequence" test (N is a step width).
    """
    want = want == 1
    mismatch = want & (tokens != next_tokens)
    earlier = (seq_ids[None, :] == seq_ids[:, None]) & (positions[None, :] < positions[:, None])  # [i, j]: j before i
    committed = want & ~(earlier & mismatch[None, :]).any(1)
    n = committed.shape[0]
    rows = torch.arange(n, device=committed.device)
    # Pack without nonzero(): committed rows go to their rank, others to distinct dump slots.
    dest = torch.where(committed, torch.cumsum(committed, 0) - 1, n + rows)
    packed = torch.zeros(2 * n, dtype=torch.int32, device=committed.device)
    packed.scatter_(0, dest, rows.to(torch.int32))
    count = committed.sum().to(torch.int32).reshape(1)
    return {"accept_rows": packed[:n], "accept_count": count, "committed": committed}
