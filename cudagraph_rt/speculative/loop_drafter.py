"""Drafters of the device loop (:mod:`cudagraph_rt.dispatch`): drafts drawn on the device
from the loop's state alone (no host rows, no host read), so the round's plan captures them.

A loop drafter is a :class:`LoopDrafter`: ``drafter(state, k) -> [slots, k] int64 tensor``
of static shape, the drafts continuing each slot's sequence, the first at position
``n_tok`` (slots not live draft anything; their rows are never laid out), and
``admit(slot, uid, prompt)``, which the loop calls on the host, between launches, when a
sequence takes a slot. Its drafts must follow from the state's tensors (and tensors of its
own that ``admit`` writes in place): with CUDA graphs the round's plan is captured once,
and compiled, so Python values it reads are taken as they were then (one that changes
between rounds sends the loop's compiled rounds back to eager ones, with a log message).

Both drafters here are coins (test doubles, as ``ToyDrafter`` and ``ReferenceDrafter``):
right with a chosen probability per draft by the coin of ``(seed, uid, position)``.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from ..checks import token_ids
from ..errors import InputError, expected
from .drafting import DraftRule, check_drafter, coin_key, controlled_drafts, draft_coins


class LoopDrafter:
    """The device loop's drafter interface (see the module's docstring)."""

    def admit(self, slot: int, uid: int, prompt: tuple[int, ...]) -> None:
        """A sequence took ``slot`` (host, between launches): nothing to do by default."""

    def fits(self, model) -> bool:
        """Whether this drafter can draft for ``model`` (the loop refuses it otherwise)."""
        return True

    def __call__(self, state, k: int) -> Tensor:
        raise NotImplementedError


def _no_drafts(state) -> Tensor:
    return torch.zeros(state.uid.shape[0], 0, dtype=torch.int64, device=state.uid.device)


class CoinRounds(LoopDrafter):
    """The drafts ``ToyDrafter`` and ``DeviceDrafter`` propose for the same sequence state
    (``drafting.controlled_drafts``: the toy's greedy rule, right with probability
    ``accept_prob``). ``model``: the toy. Raises InputError for a model that is not the toy,
    a bad ``accept_prob`` or ``seed``."""

    def __init__(self, model, accept_prob: float, seed: int = 0):
        self.rule = DraftRule.for_toy(model, accept_prob, seed, device=model.device)
        self.model = model

    def fits(self, model) -> bool:
        return model is self.model

    def __call__(self, state, k: int) -> Tensor:
        if k == 0:
            return _no_drafts(state)
        return controlled_drafts(torch, self.rule, state.uid, state.n_tok, state.prev, state.cur, k)


class PlanRounds(LoopDrafter):
    """A coin over the target's own greedy decoding, for any Decoder (the transformers
    models included): draft ``j`` is the plan's token at position ``n_tok + j`` when the
    coin of ``(seed, uid, n_tok + j)`` falls below ``accept_prob``, else that token plus a
    non-zero offset (always wrong).

    The plans are the full token lists (prompt + greedy continuation) of the prompts to
    serve, given up front (``plans``: prompt tuple -> tokens, e.g. the sequences of a plain
    greedy run through the same runtime, so near-ties round as the loop's verify does).
    ``admit`` copies a sequence's plan into its slot's row of a ``[slots, max_len]`` device
    table; a position past the plan, or a prompt without one, drafts token 0. A sequence
    whose served tokens leave its plan (a near-tie) keeps drafting the plan: its drafts are
    then wrong, never its output (the verify's token always wins).
    Raises InputError for a bad ``model``, ``accept_prob``, ``seed`` or ``plans``."""

    def __init__(self, model, accept_prob: float, seed: int = 0, plans=None):
        accept_prob, seed = check_drafter(model, accept_prob, seed, toy=False)
        cfg = model.config
        self.vocab, self.max_len = cfg.vocab, cfg.max_len
        self.threshold, self.seed_key = coin_key(accept_prob, seed)
        self.model = model
        self.plans: dict[tuple[int, ...], list[int]] = {}
        self._add({} if plans is None else plans)
        self.table = torch.zeros(cfg.max_seqs, cfg.max_len + 1, dtype=torch.int64, device=model.device)

    def prepare_from(self, sequences) -> None:
        """Take served sequences' ``tokens`` (e.g. an untimed run of the same loop, whose
        verify rounds as the timed one's) as the plans of their ``prompt``s."""
        self._add({tuple(q.prompt): list(q.tokens) for q in sequences})

    def _add(self, plans) -> None:
        if not isinstance(plans, Mapping):
            raise InputError(expected("plans", "a mapping of prompt -> its tokens", type(plans).__name__))
        checked = {}
        for prompt, tokens in plans.items():
            prompt = token_ids("plans' prompts", prompt, self.vocab)
            toks = list(token_ids(f"plans[{prompt[:8]}...]", tokens, self.vocab))
            if not prompt or list(prompt) != toks[:len(prompt)]:
                raise InputError(expected(f"plans[{prompt[:8]}...]", "the prompt's tokens then its continuation",
                                          toks[:8]))
            checked[prompt] = toks[:self.max_len + 1]
        self.plans.update(checked)  # all or none

    def fits(self, model) -> bool:
        return model is self.model

    def admit(self, slot: int, uid: int, prompt: tuple[int, ...]) -> None:
        plan = self.plans.get(tuple(prompt), [])
        row = torch.zeros(self.table.shape[1], dtype=torch.int64)
        row[:len(plan)] = torch.tensor(plan, dtype=torch.int64)
        self.table[slot].copy_(row)

    def __call__(self, state, k: int) -> Tensor:
        if k == 0:
            return _no_drafts(state)
        pos = state.n_tok[:, None] + torch.arange(k, device=state.n_tok.device)
        truth = self.table.gather(1, pos.clamp(max=self.table.shape[1] - 1))
        right, off = draft_coins(torch, self.seed_key, self.threshold, self.vocab, state.uid, state.n_tok, k)
        return torch.where(right, truth, (truth + off) % self.vocab)
