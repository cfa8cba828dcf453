"""The round's commit on the device: what the verify accepted, cut at a stop token, into
the ring and the loop's state. It reads the widest width's rows (the round's width's
outputs copied there, the rows past it the plan's padding); static shapes, no host read,
as the plan."""
from __future__ import annotations

import torch
from torch import Tensor

from .state import Finish, LoopRing, LoopShape, LoopState, RoundRows, Stop


def commit_round(st: LoopState, rows: RoundRows, out: dict[str, Tensor], ring: LoopRing, shape: LoopShape) -> None:
    """Apply the verify's outputs of one width (``out``: ``tokens``, ``committed``,
    ``hidden``, ``N`` rows) to the loop: per slot the committed rows (the verify's longest
    matching draft prefix plus one), cut after the first committed stop token; those rows
    into ring entry ``ring.head``; ``n_tok``, ``remaining``, ``prev``/``cur``,
    ``last_accept`` and ``live``/``finish`` per slot; ``round`` and ``ring.head`` + 1.
    ``out`` may hold more rows than the round's width: rows past it belong to slot ``slots``
    (the plan's padding) and commit nothing."""
    S, N = shape.slots, out["tokens"].shape[0]
    slot, j = rows.slot[:N], rows.j[:N]
    tokens, committed = out["tokens"], out["committed"] & (slot < S)
    big = shape.k + 2
    is_stop = committed & torch.isin(tokens, st.stop_tokens)
    stop_j = torch.full((S + 1,), big, dtype=torch.int64, device=slot.device)
    stop_j.scatter_reduce_(0, slot, torch.where(is_stop, j, torch.full_like(j, big)), "amin")
    count = torch.zeros(S + 1, dtype=torch.int64, device=slot.device).scatter_add_(0, slot, committed.long())
    c = torch.minimum(count, stop_j + 1)  # [S + 1]: rows each slot keeps (the dump slot S keeps none)
    keep = committed & (j < c[slot])
    _to_ring(ring, keep, out["hidden"], tokens, slot, rows.pos[:N])
    _advance(st, c[:S], (stop_j < count)[:S], tokens, slot, j, keep)


def _to_ring(ring: LoopRing, keep: Tensor, hidden: Tensor, tokens: Tensor, slot: Tensor, pos: Tensor) -> None:
    """The kept rows, packed in row order, into entry ``ring.head`` (the rest to the dump row)."""
    rank = torch.cumsum(keep.long(), 0) - 1
    dest = torch.where(keep, ring.head * ring.rows + rank, torch.full_like(rank, ring.dump))
    ring.hidden.index_copy_(0, dest, hidden.to(ring.hidden.dtype))
    ring.tokens.index_copy_(0, dest, tokens)
    ring.slots.index_copy_(0, dest, slot)
    ring.positions.index_copy_(0, dest, pos)
    ring.counts.index_copy_(0, ring.head.clamp(max=ring.depth - 1), keep.long().sum().reshape(1))
    ring.head.add_(1)


def _advance(st: LoopState, c: Tensor, stopped: Tensor, tokens: Tensor, slot: Tensor, j: Tensor,
             keep: Tensor) -> None:
    """Each slot's state after committing ``c`` tokens (``stopped``: a stop token among them)."""
    S = c.shape[0]
    ce = torch.cat([c, c.new_zeros(1)])
    last = torch.full((S + 1,), -1, dtype=torch.int64, device=c.device)
    before = last.clone()
    last.index_copy_(0, torch.where(keep & (j == ce[slot] - 1), slot, torch.full_like(slot, S)), tokens)
    before.index_copy_(0, torch.where(keep & (j == ce[slot] - 2), slot, torch.full_like(slot, S)), tokens)
    prev = torch.where(c >= 2, before[:S], torch.where(c == 1, st.cur, st.prev))
    st.prev.copy_(prev)
    st.cur.copy_(torch.where(c >= 1, last[:S], st.cur))
    st.n_tok.add_(c)
    st.remaining.sub_(c)
    st.last_accept.copy_(c)
    done = st.live & ((st.remaining <= 0) | stopped)
    st.finish.copy_(torch.where(done, torch.where(stopped, int(Finish.STOP_TOKEN), int(Finish.MAX_TOKENS)), st.finish))
    st.live.copy_(st.live & ~done)
    st.round.add_(1)
    retired = (st.stop_on_retire > 0) & done.any() & (st.status == int(Stop.RUNNING))
    st.status.copy_(torch.where(retired, torch.full_like(st.status, int(Stop.RETIRED)), st.status))
