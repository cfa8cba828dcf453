"""The coin drafter of :class:`~cudagraph_rt.speculative.device_drafter.DeviceDrafter` as a drafter
of the device loop (:mod:`cudagraph_rt.dispatch`): the same drafts, drawn on the device from
the loop's state alone (no host rows, no host read), so the plan captures it.

A loop drafter is a callable ``drafter(state, k) -> [slots, k] int64 tensor`` of static
shape: the drafts continuing each slot's ``(prev, cur)`` (its last two tokens), the first at
position ``n_tok`` (slots not live draft anything; their rows are never laid out).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .drafting import DraftRule, controlled_drafts


class CoinRounds:
    """Right with probability ``accept_prob`` per draft by the coin of ``(seed, uid,
    position)``: the drafts ``ToyDrafter`` and ``DeviceDrafter`` propose for the same
    sequence state (``drafting.controlled_drafts``). ``model``: the toy (its greedy rule).
    Raises InputError for a model that is not the toy, a bad ``accept_prob`` or ``seed``."""

    def __init__(self, model, accept_prob: float, seed: int = 0):
        self.rule = DraftRule.for_toy(model, accept_prob, seed, device=model.device)

    def __call__(self, state, k: int) -> Tensor:
        if k == 0:
            return torch.zeros(state.uid.shape[0], 0, dtype=torch.int64, device=state.uid.device)
        return controlled_drafts(torch, self.rule, state.uid, state.n_tok, state.prev, state.cur, k)
