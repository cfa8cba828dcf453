"""The toy decoder split tensor-parallel over the ranks of a torch.distributed group.

Megatron-style, with the weights of the single-GPU :class:`ToyDecoder` (same config, same
seed): every rank builds the full weights the way ``ToyDecoder`` does and keeps its slice.

* Attention: rank ``r`` of ``tp`` owns heads ``[r * heads/tp, (r + 1) * heads/tp)``: their
  q/k/v columns of ``wqkv``, their rows of ``wo``, their slopes and their part of the KV
  pool. ``attn_local @ wo_local`` is a partial sum of the residual update.
* MLP: rank ``r`` owns columns ``[r * 4H/tp, (r + 1) * 4H/tp)`` of ``w1`` and those rows of
  ``w2``; ``silu(x @ w1_local) @ w2_local`` is again a partial sum.
* Each partial sum is summed over the ranks by one ``torch.distributed.all_reduce`` (two per
  layer, as in Megatron); embedding, positions, the output head and the greedy argmax are
  replicated, so every rank returns the same tokens and hidden rows.

So the TP decoder computes what ``ToyDecoder`` computes, in another summation order:
hidden rows agree to float tolerance and the tokens exactly (the toy's greedy margin of
about 8 logits is far above the reordering noise).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..errors import InputError, expected
from .toy import ToyConfig, ToyDecoder


class TPToyDecoder(ToyDecoder):
    """:class:`ToyDecoder` with its heads and MLP columns split over ``group``'s ranks.

    Construct it on every rank of ``group`` with the same config (the weights come from
    ``config.seed`` alone, so no weights travel). ``device`` must be this rank's device
    (``cuda:<local rank>`` with NCCL, ``cpu`` with gloo).

    Lifetime and collectives: :meth:`step`, :meth:`verify_step` and the eager references
    (:meth:`reference_logits`, :meth:`reference`, :meth:`greedy_generate`,
    :meth:`logit_margin`) each run ``2 * layers`` all-reduces: they are COLLECTIVE, every rank
    must call them in the same order with the same row count, or the ranks wait for each
    other until the process group's timeout. The KV pool holds this rank's heads only.
    ``comm=False`` skips the all-reduces (wrong outputs; for timing the step without
    communication only).

    Raises :class:`InputError` when ``heads`` or ``4 * hidden`` is not divisible by the
    group size, or when torch.distributed is not initialised.
    """

    def __init__(self, config: ToyConfig | None = None, device: str | torch.device | None = None, *,
                 group: dist.ProcessGroup | None = None, comm: bool = True):
        if not dist.is_available() or not dist.is_initialized():
            raise InputError(expected("torch.distributed", "an initialised process group (init_process_group)",
                                      "none"))
        super().__init__(config, device)
        cfg = self.config
        self.group, self.comm = group, comm
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if cfg.heads % self.tp or (4 * cfg.hidden) % self.tp:
            raise InputError(expected("ToyConfig.heads", f"heads and 4 * hidden divisible by the group size {self.tp}",
                                      f"heads {cfg.heads}, hidden {cfg.hidden}"))
        H, d = cfg.hidden, self.head_dim
        self.local_heads = hl = cfg.heads // self.tp
        cols = slice(self.rank * hl * d, (self.rank + 1) * hl * d)
        ff = 4 * H // self.tp
        fcols = slice(self.rank * ff, (self.rank + 1) * ff)
        # wqkv is [layers, H, q (H) | k (H) | v (H)]; a head's columns sit at the same offset
        # in each of the three blocks.
        self.wqkv = torch.cat([self.wqkv[:, :, i * H:(i + 1) * H][:, :, cols] for i in range(3)], -1).contiguous()
        self.wo = self.wo[:, cols, :].contiguous()
        self.w1 = self.w1[:, :, fcols].contiguous()
        self.w2 = self.w2[:, fcols, :].contiguous()
        self.slopes = self.slopes[self.rank * hl:(self.rank + 1) * hl].contiguous()
        shape = (cfg.layers, hl, self.num_cells + 1, d)
        self.k_cache = torch.zeros(shape, dtype=cfg.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=cfg.dtype, device=self.device)

    def _reduce(self, partial: Tensor) -> Tensor:
        """Sum a partial residual update over the ranks, in place (capturable with NCCL)."""
        if self.comm:
            dist.all_reduce(partial, group=self.group)
        return partial

    def _qkv(self, x: Tensor, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        qkv = (x @ self.wqkv[layer]).view(x.shape[0], 3, self.local_heads, self.head_dim)
        q, k, v = qkv.permute(1, 2, 0, 3).unbind(0)
        return q, k, v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        scores = (q @ k.transpose(-1, -2)).float() * self.head_dim**-0.5 + bias
        out = torch.softmax(scores, -1).to(v.dtype) @ v
        return out.transpose(0, 1).reshape(q.shape[1], self.local_heads * self.head_dim)

    def _block_out(self, x: Tensor, attn: Tensor, layer: int) -> Tensor:
        x = x + self._reduce(attn @ self.wo[layer])
        return x + self._reduce(F.silu(x @ self.w1[layer]) @ self.w2[layer])
