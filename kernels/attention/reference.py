"""The cell attention's torch references: the contract of :mod:`cudagraph_rt.kernels.attention`
in plain torch, on any device: the models' CPU path and the oracle of the kernel's tests.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .checks import check_attention_args

__all__ = ["cell_attention_reference", "write_cells_reference"]


def write_cells_reference(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cells: Tensor) -> None:
    """``k_cache[cells] = k``, ``v_cache[cells] = v`` (in the caches' dtype)."""
    k_cache.index_copy_(0, cells.long(), k.to(k_cache.dtype))  # (index_copy_ takes int64 indices only)
    v_cache.index_copy_(0, cells.long(), v.to(v_cache.dtype))


def cell_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_ids: Tensor,
                             positions: Tensor, *, block_size: int, scale: float, window: int | None = None,
                             slopes: Tensor | None = None, bias_shift: int = 0, out: Tensor | None = None,
                             splits: int | None = None, counters: Tensor | None = None,
                             dependent: bool = False) -> Tensor:
    """The contract in plain torch, on any device. No host read of a device value
    and no data-dependent shape (it runs inside captured step functions and under the
    hazard finder): every row gathers the static bound of ``MB * block_size`` positions
    and masks what it may not see. ``splits``, ``counters`` and ``dependent`` are checked
    as the kernel's, and ignored. Raises InputError before anything is read or written
    when an argument breaks the contract (the kernel's checks: metadata only)."""
    check_attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, block_size, window, slopes,
                         out, splits, counters, dependent, scale, bias_shift)
    scale = float(scale)  # an int scale past torch's scalar range multiplies as its float
    N, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    span = block_table.shape[1] * block_size
    j = torch.arange(span, device=q.device)
    live = seq_ids >= 0
    seq = torch.where(live, seq_ids, 0).long()
    pos = positions.long()
    cells = block_table[seq].long().repeat_interleave(block_size, 1) * block_size + j % block_size  # [N, span]
    lo = (pos - window + 1).clamp(min=0) if window is not None else torch.zeros_like(pos)
    visible = live[:, None] & (j[None, :] <= pos[:, None]) & (j[None, :] >= lo[:, None])
    k = k_cache[cells].view(N, span, Hkv, 1, D).expand(N, span, Hkv, G, D).reshape(N, span, Hq, D)
    v = v_cache[cells].view(N, span, Hkv, 1, D).expand(N, span, Hkv, G, D).reshape(N, span, Hq, D)
    s = torch.einsum("nhd,nshd->nhs", q.float(), k.float()) * scale
    if slopes is not None:
        dist = (pos[:, None] - bias_shift - j[None, :]).abs().float()  # [N, span]
        s = s - slopes.float()[None, :, None] * dist[:, None, :]
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    # A row that sees nothing (padding) is 0; a NaN or inf the row sees stays in its output,
    # one it does not see (probability 0) is no part of it, V's included: 0 x NaN is NaN.
    p = torch.where(visible.any(-1)[:, None, None], torch.softmax(s, -1), 0.0)
    v = torch.where(visible[:, :, None, None], v, 0)
    o = torch.einsum("nhs,nshd->nhd", p.to(v.dtype).float(), v.float()).to(q.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out
