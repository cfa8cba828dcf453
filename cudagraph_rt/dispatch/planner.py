"""The device-side planner: the next round's rows and width, from the loop's state alone.

Pure tensor code with static shapes (no host read, no ``nonzero``, no ``.item()``), so it
is captured once and replayed at every round. It lays a round out exactly as the host
runner does (``spec.runner.SpecRunner._verify_rows``): per live sequence, in slot order,
``k_s + 1`` rows (``k_s = min(k, remaining - 1)``): its last committed token, then its
drafts; each row at the next position, asking for a token (``want = 1``) and naming the
draft after it (``next_tokens``, -1 on the last), with its slot's sampling settings when
the step samples. Cells come from the pool's block table
(``KVPool.device_cells``' rule). Rows past the round's ``T`` get each input's pad. The
width is the one ``widths.plan_step(T)`` picks: the narrowest captured width ``>= T``.

Before anything runs it decides whether the round may run at all (``Stop``): a bad token
id, a position without a KV block, a full ring, N rounds done, or nothing live stop the
loop with the round's step never launched, so the committed rows stay as they were.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .state import SAMPLING, LoopRing, LoopShape, LoopState, RoundRows, Stop


def round_layout(st: LoopState, shape: LoopShape) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(ks, slot, j, T)``: each slot's drafts this round (``[slots]``, 0 for a slot not
    live), each row's slot (``slots`` past the round's rows) and index in its slot's rows,
    and the round's row count (``[1]``)."""
    S, W = shape.slots, shape.rows
    ks = torch.clamp(torch.minimum(st.remaining - 1, torch.full_like(st.remaining, shape.k)), min=0)
    n = torch.where(st.live, ks + 1, torch.zeros_like(ks))
    end = torch.cumsum(n, 0)
    r = torch.arange(W, device=end.device)
    slot = torch.searchsorted(end, r, right=True)  # rows past T land on S
    row0 = torch.cat([end - n, end[-1:]])[slot]  # each row's slot's first row (T for padding)
    j = torch.where(slot < S, r - row0, torch.zeros_like(r))
    return ks, slot, j, end[-1:]


def plan_round(st: LoopState, rows: RoundRows, arena: dict[str, Tensor], block_table: Tensor,
               ring: LoopRing, shape: LoopShape, widths: Tensor) -> None:
    """Write the next round into ``arena`` (the width graphs' static inputs, ``shape.rows``
    rows of each), ``rows`` (layout, width index, go) and, when the round may not run,
    ``st.status`` / ``st.error``. ``rows.drafts`` holds the round's drafts already;
    ``widths`` is the captured widths as an int64 tensor."""
    S, k = shape.slots, shape.k
    ks, slot, j, T = round_layout(st, shape)
    real = slot < S
    s = slot.clamp(max=S - 1)
    fed = torch.cat([st.cur[:, None], rows.drafts], 1)  # [S, k + 1]: the token at j
    tok = fed[s, j.clamp(max=k)]
    nxt = torch.where(j < ks[s], fed[s, (j + 1).clamp(max=k)], torch.full_like(tok, -1))
    pos = torch.where(real, st.n_tok[s] - 1 + j, torch.zeros_like(j))
    bad = real & ((tok < 0) | (tok >= shape.vocab))
    blk = block_table[s, pos // shape.block_size].long()
    cells = torch.where(real, blk * shape.block_size + pos % shape.block_size,
                        torch.full_like(pos, shape.scratch_cell))
    arena["tokens"].copy_(torch.where(real & ~bad, tok, torch.zeros_like(tok)))
    arena["positions"].copy_(pos)
    arena["seq_ids"].copy_(torch.where(real, s, torch.full_like(s, -1)))
    arena["cells"].copy_(cells)
    arena["want"].copy_(real.long())
    arena["next_tokens"].copy_(torch.where(real & ~bad, nxt, torch.full_like(nxt, -1)))
    for name, (_, pad) in SAMPLING.items():  # a sampling verify step: each row its slot's settings
        if name in arena:
            arena[name].copy_(torch.where(real, st.settings[name][s], torch.full_like(arena[name], pad)))
    rows.slot.copy_(slot)
    rows.j.copy_(j)
    rows.pos.copy_(pos)
    _decide(st, rows, ring, shape, widths, T, bad, real & (pos >= st.reserved[s]), tok, pos, s)


def _decide(st: LoopState, rows: RoundRows, ring: LoopRing, shape: LoopShape, widths: Tensor, T: Tensor,
            bad: Tensor, unreserved: Tensor, tok: Tensor, pos: Tensor, s: Tensor) -> None:
    """The round's verdict: the first stop that holds (in the order of the checks below),
    unless a commit already stopped the loop; the SWITCH value and the WHILE value."""
    one = lambda v: torch.full_like(st.status, int(v))  # noqa: E731
    verdict = one(Stop.RUNNING)
    for stop, holds in ((Stop.BAD_TOKEN, bad.any()), (Stop.POOL, unreserved.any()),
                        (Stop.RING_FULL, ring.head >= ring.depth), (Stop.ROUNDS, st.round >= st.max_rounds),
                        (Stop.FINISHED, T == 0)):  # reversed priority: the last that holds wins
        verdict = torch.where(holds.reshape(1), one(stop), verdict)
    status = torch.where(st.status == int(Stop.RUNNING), verdict, st.status)
    first = torch.argmax(bad.to(torch.int64)).reshape(1)
    error = torch.cat([s[first], tok[first], pos[first]])
    st.error.copy_(torch.where((status == int(Stop.BAD_TOKEN)) & (st.status == int(Stop.RUNNING)), error, st.error))
    st.status.copy_(status)
    go = status == int(Stop.RUNNING)
    index = torch.searchsorted(widths, T)  # the narrowest width >= T (T <= widths[-1] by construction)
    rows.width_index.copy_(torch.where(go, index, torch.full_like(index, len(shape.widths))).to(torch.int32))
    rows.go.copy_(go.to(torch.int32))
