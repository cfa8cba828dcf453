"""Attention that cannot be captured once for every step: torch's ``varlen_attn`` (flash
attention over packed variable-length sequences), whose ``max_q`` / ``max_k`` are Python
ints, over the rows' contexts gathered from the paged KV pool into packed buffers whose
length is a per-step host int too.

It is what the piecewise mode is for: the call is marked ``cudagraph_rt.eager``, so a width
captured in pieces replays everything around it from graphs and runs it eagerly between
them, with this step's host ints, which :func:`varlen_plan` (the runtime's
``step_values`` function) computes on the host from the slice's own rows and the call
reads with ``cudagraph_rt.step_values()``. A whole-graph capture of it fails (CaptureError:
``step_values()`` read while capturing), as it would freeze the capture's ints.

Each row is its own varlen "sequence" (``cu_seq_q = 0, 1, .., N``, ``max_q = 1``) whose keys
are its own sequence's positions ``[lo, p]`` (``lo = p - window + 1`` on a sliding layer,
else 0): every row sees exactly what the cell attention's contract gives it, whatever the
order of the step's rows. A padding row (seq -1) gets one key, the scratch cell; its
output is never read. On CUDA in fp16/bf16 the packed keys go to ``varlen_attn`` where
torch has it; elsewhere (a CPU, fp32, an older torch) a torch reference pads every row's
keys to ``max_k`` (a per-step host int used as a shape: a stale one truncates contexts).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import Tensor

from ..errors import CgrtError
from ..pieces import eager, step_values
from .attention_op import pool_by_id

try:
    from torch.nn.attention.varlen import varlen_attn as _VARLEN
except ImportError:  # torch without it: the reference runs everywhere
    _VARLEN = None
_VARLEN_ARGS = set(inspect.signature(_VARLEN).parameters) if _VARLEN is not None else set()


@dataclass
class VarlenPlan:
    """One slice's host plan: per window (None: full attention) the keys of all rows
    (``total``) and the most keys of one row (``max_k``), from the host's copy of the rows'
    positions and sequence ids. The device index tensors built from it are kept here for
    the slice's other layers (``keys``). Lives for one slice."""

    width: int
    totals: dict[Any, int]
    max_ks: dict[Any, int]
    _keys: dict = field(default_factory=dict, repr=False)

    def keys(self, window, pool, seq_ids: Tensor, positions: Tensor, packed: bool) -> tuple[Tensor, Tensor]:
        """``(cells, where)``: packed (``cells`` [total] and ``cu_k`` [N + 1] int32) or padded
        (``cells`` [N, max_k] and a [N, max_k] mask of the keys each row sees)."""
        got = self._keys.get((window, packed))
        if got is None:
            got = self._keys[(window, packed)] = _key_cells(self, window, pool, seq_ids, positions, packed)
        return got


def _lengths(pos: list[int], seq: list[int], width: int, window) -> list[int]:
    lens = [(min(p + 1, window) if window else p + 1) if s >= 0 else 1 for p, s in zip(pos, seq)]
    return lens + [1] * (width - len(lens))  # padding rows: one key (the scratch cell)


def varlen_plan(windows: tuple) -> Any:
    """The ``step_values`` function of a model on varlen attention with these layer windows."""
    def plan(rows: Mapping[str, Tensor], width: int) -> VarlenPlan:
        pos, seq = rows["positions"].tolist(), rows["seq_ids"].tolist()  # the slice's real rows, on the host
        per = {w: _lengths(pos, seq, width, w) for w in windows}
        return VarlenPlan(width, {w: sum(v) for w, v in per.items()}, {w: max(v) for w, v in per.items()})
    return plan


def _key_cells(plan: VarlenPlan, window, pool, seq_ids: Tensor, positions: Tensor, packed: bool):
    live = seq_ids >= 0
    pos = positions.long()
    full = pos + 1 if window is None else torch.clamp(pos + 1, max=window)
    lens = torch.where(live, full, 1)
    lo = torch.where(live, pos - lens + 1, 0)
    seq = torch.where(live, seq_ids, 0).long()
    if packed:
        cu = torch.zeros(lens.shape[0] + 1, dtype=torch.int64, device=pos.device)
        cu[1:] = torch.cumsum(lens, 0)
        idx = torch.arange(plan.totals[window], device=pos.device)
        row = torch.searchsorted(cu[1:], idx, right=True)
        j = lo[row] + idx - cu[row]
        cells = _cells(pool, seq[row], j, live[row])
        return cells, cu.to(torch.int32)
    k = torch.arange(plan.max_ks[window], device=pos.device)
    j = lo[:, None] + k[None, :]
    sees = k[None, :] < lens[:, None]
    return _cells(pool, seq[:, None].expand_as(j), j.clamp(min=0), live[:, None] & sees), sees


def _cells(pool, seq: Tensor, j: Tensor, live: Tensor) -> Tensor:
    bs = pool.block_size
    blk = pool.block_table[seq, (j // bs).clamp(max=pool.block_table.shape[1] - 1)].long()
    return torch.where(live, blk * bs + j % bs, pool.scratch_cell)


@eager
def varlen_attend(pool_id: int, layer: int, q: Tensor, k: Tensor, v: Tensor, seq_ids: Tensor, positions: Tensor,
                  cells: Tensor, out: Tensor, scale: float, window: int | None) -> Tensor:
    """Write the rows' K/V into their cells of ``layer``, then every row's attention over its
    own context by this slice's :class:`VarlenPlan` (``step_values()``), into ``out``
    ([N, Hq, D]). Marked eager: it runs outside the graphs (CaptureError in a whole graph)."""
    from ..kernels.attention import write_cells, write_cells_reference

    plan = step_values()
    if not isinstance(plan, VarlenPlan) or plan.width != q.shape[0]:
        raise CgrtError(f"varlen attention: step_values() is {plan!r}, not the plan of {q.shape[0]} rows "
                        "(build the runtime with step_values=model.step_values)")
    pool = pool_by_id(pool_id)
    kc, vc = pool.k[layer], pool.v[layer]
    (write_cells if q.is_cuda else write_cells_reference)(k, v, kc, vc, cells)
    packed = _VARLEN is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
    where, extra = plan.keys(window, pool, seq_ids, positions, packed)
    if packed:
        res = _flash(q, kc[where], vc[where], extra, plan.max_ks[window], scale)
    else:
        res = _padded(q, kc[where], vc[where], extra, scale)
    out.copy_(res)
    return out


def _flash(q: Tensor, k: Tensor, v: Tensor, cu_k: Tensor, max_k: int, scale: float) -> Tensor:
    N, Hq, _ = q.shape
    if Hq != k.shape[1] and "enable_gqa" not in _VARLEN_ARGS:
        g = Hq // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    kw = {"scale": scale} if "scale" in _VARLEN_ARGS else {}
    if Hq != k.shape[1]:
        kw["enable_gqa"] = True
    cu_q = torch.arange(N + 1, dtype=torch.int32, device=q.device)
    return _VARLEN(q.contiguous(), k, v, cu_q, cu_k, 1, max_k, **kw)


def _padded(q: Tensor, k: Tensor, v: Tensor, sees: Tensor, scale: float) -> Tensor:
    """k / v [N, max_k, Hkv, D]; each row's softmax over the keys it sees, in fp32."""
    N, Hq, D = q.shape
    g = Hq // k.shape[2]
    k = k.repeat_interleave(g, 2).float()
    v = v.repeat_interleave(g, 2)
    s = torch.einsum("nhd,nkhd->nhk", q.float(), k) * scale
    p = torch.softmax(s.masked_fill(~sees[:, None, :], float("-inf")), -1)
    return torch.einsum("nhk,nkhd->nhd", p.to(v.dtype).float(), v.float()).to(q.dtype)


__all__ = ["VarlenPlan", "varlen_attend", "varlen_plan"]
