"""The toy decoder split tensor-parallel over the ranks of a torch.distributed group.

Megatron-style, with the weights of the single-GPU :class:`ToyDecoder` (same config, same
seed): every rank builds the full weights the way ``ToyDecoder`` does and keeps its slice.

* Attention: rank ``r`` of ``tp`` owns heads ``[r * heads/tp, (r + 1) * heads/tp)``: their
  q/k/v columns of ``wqkv``, their rows of ``wo``, their slopes and their part of the KV
  pool (a :class:`~cudagraph_rt.models.pool.KVPool` of those heads, over which the rank
  runs the cell attention). Every rank hands out the same cells: the same calls to
  ``cell_for`` / ``cell_range`` / ``free_seq`` on every rank, in the same order, give the
  same blocks. ``attn_local @ wo_local`` is a partial sum of the residual update.
* MLP: rank ``r`` owns columns ``[r * 4H/tp, (r + 1) * 4H/tp)`` of ``w1`` and those rows of
  ``w2``; ``silu(x @ w1_local) @ w2_local`` is again a partial sum.
* Each partial sum is summed over the ranks by one ``torch.distributed.all_reduce`` (two per
  layer, as in Megatron); embedding, positions, the output head and the greedy argmax (or the
  sampler) are replicated, so every rank returns the same tokens and hidden rows.

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
from .cells import ROW_INPUTS
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
    other until the process group's timeout. The KV pool holds this rank's heads only; its
    allocator is deterministic, so ranks that make the same cell calls hold the same cells.
    ``comm=False`` skips the all-reduces (wrong outputs; for timing the step without
    communication only).

    Cells: every rank's pool must map each (sequence, position) to the same cell. Either
    every rank makes the same ``cell_for`` / ``cell_range`` / ``free_seq`` calls (the
    sweep, lockstep loops), or only the rank ``table_from`` does (a driver whose followers
    take its inputs, ``DistributedRuntime(inputs_from=...)``): then every step starts with
    one broadcast of the block table from that rank (part of the captured graph; a few
    hundred bytes). Block copies (``fork_seq``, copy-on-write of a shared block) are not
    broadcast: with ``table_from`` they need the same calls on every rank.

    Raises :class:`InputError` when ``heads`` or ``4 * hidden`` is not divisible by the
    group size, or when torch.distributed is not initialised.
    """

    def __init__(self, config: ToyConfig | None = None, device: str | torch.device | None = None, *,
                 group: dist.ProcessGroup | None = None, comm: bool = True, table_from: int | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise InputError(expected("torch.distributed", "an initialised process group (init_process_group)",
                                      "none"))
        cfg = config or ToyConfig.tiny()
        self.group, self.comm = group, comm
        self.tp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        if table_from is not None and (isinstance(table_from, bool) or not isinstance(table_from, int)
                                       or not 0 <= table_from < self.tp):
            raise InputError(expected("table_from", f"None or a rank of the group in [0, {self.tp})", repr(table_from)))
        self.table_from = table_from
        if cfg.heads % self.tp or (4 * cfg.hidden) % self.tp:
            raise InputError(expected("ToyConfig.heads", f"heads and 4 * hidden divisible by the group size {self.tp}",
                                      f"heads {cfg.heads}, hidden {cfg.hidden}"))
        super().__init__(cfg, device)  # builds the full weights, keeps this rank's (_shard), then its pool

    def _shard(self) -> None:
        """This rank's heads (q/k/v columns, ``wo`` rows, slopes; the pool gets their K/V
        only) and MLP columns."""
        H, d = self.config.hidden, self.head_dim
        self.local_heads = hl = self.config.heads // self.tp
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

    def _step(self, inputs: dict[str, Tensor], verify: bool) -> dict[str, Tensor]:
        """:meth:`ToyDecoder.step` (``verify``: its verify tokens) on this rank's heads
        (collective); with ``table_from``, the block table of that rank first. Sampling is
        replicated: every rank has the same logits, settings and seeds, so draws the same."""
        if self.table_from is not None:
            self._take(inputs, ROW_INPUTS)  # a bad input is refused before any collective
            src = self.table_from if self.group is None else dist.get_global_rank(self.group, self.table_from)
            dist.broadcast(self.pool.block_table, src=src, group=self.group)
        return super()._step(inputs, verify)

    def _reduce(self, partial: Tensor) -> Tensor:
        """Sum a partial residual update over the ranks, in place (capturable with NCCL)."""
        if self.comm:
            dist.all_reduce(partial, group=self.group)
        return partial

    def _block_out(self, x: Tensor, attn: Tensor, layer: int) -> Tensor:
        x = x + self._reduce(attn @ self.wo[layer])
        return x + self._reduce(F.silu(x @ self.w1[layer]) @ self.w2[layer])
