"""Attention over the live cells of a paged KV pool, beside its torch reference.

Contract (shared by :func:`cell_attention` and :func:`cell_attention_reference`):

* ``q``: ``[N, Hq, D]``, the step's rows by query heads. ``k_cache`` / ``v_cache``: one
  layer of the pool, ``[cells, Hkv, D]``, last dimension contiguous. ``Hq = G * Hkv``:
  query head ``h`` reads KV head ``h // G``.
* ``block_table``: int32 ``[S, MB]``; ``seq_ids``: ``[N]`` integer, -1 for a padding row
  (its output is 0 and it reads nothing); ``positions``: ``[N]`` int64.
* Row r of sequence s at position p attends to the positions j in ``[lo, p]``, where
  ``lo = max(0, p - window + 1)`` with a ``window`` and 0 without; the cell of position j
  is ``block_table[s, j // block_size] * block_size + j % block_size``.
* ``score = scale * q.k - slopes[h] * |p - bias_shift - j|`` (no bias when ``slopes`` is
  None; ALiBi is ``bias_shift=0``, the toy decoder's previous-token head ``1``); softmax
  in fp32; the probabilities are rounded to the cache dtype for the product with V, as a
  flash kernel does; the output is in ``q``'s dtype (written into ``out`` when given).

``write_cells`` puts a step's K/V rows into their cells: ``k``/``v`` ``[N, Hkv, D]`` into
rows ``cells`` ``[N]`` of the caches. Only padding rows share a cell (the scratch cell),
so which of them wins does not matter.
"""
from __future__ import annotations

import torch
from torch import Tensor


def write_cells_reference(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cells: Tensor) -> None:
    """``k_cache[cells] = k``, ``v_cache[cells] = v`` (in the caches' dtype)."""
    k_cache.index_copy_(0, cells, k.to(k_cache.dtype))
    v_cache.index_copy_(0, cells, v.to(v_cache.dtype))


def cell_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_ids: Tensor,
                             positions: Tensor, *, block_size: int, scale: float, window: int | None = None,
                             slopes: Tensor | None = None, bias_shift: int = 0, out: Tensor | None = None,
                             splits: int | None = None) -> Tensor:
    """The contract above in plain torch, on any device. No host read of a device value
    and no data-dependent shape (it runs inside captured step functions and under the
    hazard finder): every row gathers the static bound of ``MB * block_size`` positions
    and masks what it may not see. ``splits`` is accepted and ignored."""
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
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a padding row sees nothing: all -inf -> 0
    o = torch.einsum("nhs,nshd->nhd", p.to(v.dtype).float(), v.float()).to(q.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out


# Until the Triton kernels land, every device runs the reference.
cell_attention = cell_attention_reference
write_cells = write_cells_reference

__all__ = ["cell_attention", "cell_attention_reference", "write_cells", "write_cells_reference"]
