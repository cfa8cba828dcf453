"""What every model on a cell KV pool shares: its per-row inputs and their pads, the cell of
a (sequence, position), the pool's reset, and the host-side checks of a step's rows.

The pool has ``max_seqs * max_len`` cells plus one scratch cell (the last) that padding
rows write; every cell has an owner sequence (``cell_owner``, -2 free) and a position
(``cell_pos``); ``k_cache``/``v_cache`` hold the cells' keys and values."""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError, expected
from ..specs import InputSpec

ROW_INPUTS = ("tokens", "positions", "seq_ids", "cells", "want")


def take_rows(inputs: dict[str, Tensor], names: tuple[str, ...], device: torch.device) -> list[Tensor]:
    """``inputs[name]`` for each name, checked: present, 1-D, one N (the rows of
    ``tokens``), int64, on ``device``. Reads no device value (capturable)."""
    missing = [k for k in names if k not in inputs]
    if missing:
        raise InputError(expected("inputs", f"keys {list(names)}", f"missing {missing}"))
    n = inputs["tokens"].shape[0] if "tokens" in inputs else None
    out = []
    for k in names:
        v = inputs[k]
        if not isinstance(v, Tensor) or v.dim() != 1 or (n is not None and v.shape[0] != n):
            raise InputError(expected(k, f"a 1-D tensor of {n} rows", getattr(v, "shape", type(v))))
        if v.dtype != torch.int64 or v.device != device:
            raise InputError(expected(k, f"int64 on {device}", f"{v.dtype} on {v.device}"))
        out.append(v)
    return out


class CellPoolModel:
    """Mixed into a model that has ``config.max_seqs``, ``config.max_len``, ``device``,
    ``scratch_cell``, ``k_cache``, ``v_cache``, ``cell_owner`` and ``cell_pos``."""

    def reset_cache(self) -> None:
        """Free every cell (owner -2) and zero K/V. Zeroed K/V matter: masked cells get
        probability exactly 0, and 0 * garbage could be NaN."""
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.cell_owner.fill_(-2)
        self.cell_pos.zero_()

    def cell_for(self, seq: int, pos: int) -> int:
        """The cell of ``(seq, pos)``; :class:`InputError` outside the pool."""
        if not 0 <= seq < self.config.max_seqs:
            raise InputError(expected("seq", f"in [0, {self.config.max_seqs})", seq))
        if not 0 <= pos < self.config.max_len:
            raise InputError(expected("pos", f"in [0, {self.config.max_len})", pos))
        return seq * self.config.max_len + pos

    def cell_range(self, seq: int, pos0: int, n: int) -> range:
        """The cells of positions ``pos0 .. pos0 + n - 1`` of ``seq`` (consecutive in this
        layout); one :class:`InputError` check for all of them."""
        first = self.cell_for(seq, pos0)
        if n > 1:
            self.cell_for(seq, pos0 + n - 1)
        return range(first, first + n)

    def inputs(self, verify: bool = False) -> dict[str, InputSpec]:
        """Per-row int64 inputs and their pad values (``next_tokens`` only for the verify step).

        A padding row (token 0, position 0, seq -1, scratch cell, want 0) writes only the
        scratch cell and attends only to it, so it cannot change any live row.
        """
        specs = dict(tokens=InputSpec(pad=0), positions=InputSpec(pad=0), seq_ids=InputSpec(pad=-1),
                     cells=InputSpec(pad=self.scratch_cell), want=InputSpec(pad=0))
        if verify:
            specs["next_tokens"] = InputSpec(pad=-1)
        return specs

    def _take(self, inputs: dict[str, Tensor], names: tuple[str, ...]) -> list[Tensor]:
        return take_rows(inputs, names, self.device)
