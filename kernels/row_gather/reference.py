"""The row gather's torch reference: the contract of :mod:`cudagraph_rt.kernels.row_gather`
in plain torch, the CPU path of the runtime and the oracle of the tests.
"""
from __future__ import annotations

import torch

from .launch import FLAG_CAPACITY, FLAG_COUNT, FLAG_INDEX, FLAG_SRC_SLOT, validate_gather_args

__all__ = ["gather_rows_reference"]


def gather_rows_reference(src, rows, count, dst, meta, *, src_slot=None, dst_slot=None, validate: bool = True) -> None:
    """Plain-torch implementation of the same contract as :func:`gather_rows`; the CPU
    path of the runtime and the oracle of the tests.

    Synchronous: it reads ``count`` and the slots with ``.item()`` (a device sync on
    CUDA, so it cannot be captured in a graph). Raises :class:`InputError` like
    :func:`gather_rows`; bad device values are flagged in ``meta``, never raised.
    """
    if validate:
        validate_gather_args(src, rows, count, dst, meta, src_slot, dst_slot)
    S, C, _ = dst.shape
    R = rows.shape[0]
    d = int(dst_slot.item()) if dst_slot is not None else 0
    if not 0 <= d < S:
        return  # no slot to write into: nothing at all is written (as in the kernel)
    n_rows = src.shape[-2]
    s = int(src_slot.item()) if src_slot is not None else 0
    slabs = src.shape[0] if src.dim() == 3 else 1
    src_ok = 0 <= s < slabs
    c = int(count.item())
    n = min(max(c, 0), C, R)

    idx = rows[:n].to(torch.int64)
    in_range = (idx >= 0) & (idx < n_rows)
    bad = ((FLAG_INDEX if not bool(in_range.all()) else 0) | (FLAG_CAPACITY if c > C else 0)
           | (FLAG_COUNT if (c < 0 or c > R) else 0) | (FLAG_SRC_SLOT if not src_ok else 0))

    meta[d, 0] = n
    meta[d, 1] = bad
    meta[d, 2 : 2 + n] = idx.to(torch.int32).to(meta.device)
    if src_ok and n > 0:
        slab = src[s] if src.dim() == 3 else src
        j = torch.nonzero(in_range).flatten()
        dst[d, j.to(dst.device)] = slab[idx[j]].to(dst.device)
