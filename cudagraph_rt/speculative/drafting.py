"""Drafters for the speculative-decoding runner (``runner.SpecRunner``), and what they see.

A drafter has three calls, all batched over the sequences of one lane step:

* ``observe(c: CommittedRows)``: the rows a step committed (tokens, hidden rows, positions)
  right after the runner's one wait of that step. ``c.rows`` is a view of a host-row ring
  slot, valid only during the call: copy what you keep.
* ``propose(seqs, k) -> int64 array [len(seqs), k]``: draft tokens continuing each
  sequence's ``tokens`` (the runner uses the first ``min(k, tokens left - 1)`` of a row).
  A sequence must have been observed since its tokens last changed.
* ``forget(seq)``: the sequence retired.

The stand-in drafters here are right with a chosen probability per draft token, so
acceptance stays controlled while the runner's work is real. Which drafts are right is
decided by a counter-based coin of ``(seed, uid, position)`` (:func:`mix32`), the same bits
in numpy and torch, on a CPU or a GPU: :class:`ToyDrafter` (numpy, on the host) and
:class:`DeviceDrafter` (a small model in its own GraphRuntime) draft the same tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from ..checks import as_int, as_real
from ..errors import InputError, expected

if TYPE_CHECKING:  # annotations only: the models import nothing from here
    from ..models.protocol import Decoder
    from ..models.toy import ToyDecoder

M32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a product with a 32-bit value stays below 2**63, so int64
# arithmetic (numpy or torch, any device) never overflows and every backend agrees.
_MUL1, _MUL2 = 0x7FEB352D, 0x6C8E9CF5
_SALT = 0x5BD1E995  # second stream of the same key: the wrong draft's offset


def mix32(x):
    """A 32-bit integer hash of int64 values (numpy arrays or torch tensors): the same bits
    on every backend. Values outside [0, 2**32) are reduced to their low 32 bits first."""
    x = x & M32
    x = x ^ (x >> 16)
    x = (x * _MUL1) & M32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & M32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    """:func:`mix32` of one Python int (the host drafter's path: a few sequences, no arrays)."""
    x &= M32
    x ^= x >> 16
    x = (x * _MUL1) & M32
    x ^= x >> 15
    x = (x * _MUL2) & M32
    return x ^ (x >> 16)


def draft_coins(xp, seed_key: int, threshold: int, vocab: int, uid, pos, k: int):
    """``(right, off)``, each ``[G, k]``: whether draft ``j`` of each of ``G`` sequences
    (first draft at position ``pos``) is right, by the coin of ``(seed, uid, pos + j)``
    against ``threshold`` (of 2**32), and the non-zero offset a wrong draft adds to the
    truth (mod ``vocab``). ``xp`` is numpy or torch; the same bits on either."""
    steps = np.arange(k) if xp is np else torch.arange(k, device=pos.device)
    x = mix32(mix32(uid ^ seed_key)[:, None] ^ mix32(pos[:, None] + steps))
    return mix32(x) < threshold, 1 + mix32(x ^ _SALT) % (vocab - 1)


def coin_key(accept_prob: float, seed: int) -> tuple[int, int]:
    """A coin's ``(threshold, seed_key)`` for :func:`draft_coins` (checked values)."""
    return int(round(accept_prob * 2**32)), int(mix32(np.int64(seed & M32)))


def controlled_drafts(xp, rule: "DraftRule", uid, pos, prev, cur, k: int):
    """``[G, k]`` drafts continuing ``(prev, cur)`` (the last two tokens) of ``G``
    sequences whose first draft sits at position ``pos``; ``xp`` is numpy or torch, and
    the arrays are of that kind (int64). Draft ``j`` is the model's greedy token after the
    drafts before it (``rule.truth``) when the coin of ``(seed, uid, pos + j)`` falls below
    ``accept_prob``, else that token plus a non-zero offset (always wrong). The coins of
    all drafts are drawn at once; only the truth chain goes draft by draft."""
    right, off = draft_coins(xp, rule.seed_key, rule.threshold, rule.vocab, uid, pos, k)
    out = []
    for j in range(k):
        truth = rule.truth(prev, cur)
        d = xp.where(right[:, j], truth, (truth + off[:, j]) % rule.vocab)
        out.append(d)
        prev, cur = cur, d
    if not out:
        return xp.zeros((len(uid), 0), dtype=xp.int64)
    return xp.stack(out, 1)


def controlled_drafts_py(rule: "DraftRule", seqs, k: int) -> list[list[int]]:
    """:func:`controlled_drafts` for the sequences ``seqs`` (uid, ``len(tokens)``, the last
    two tokens) in Python ints: the same drafts, faster than arrays for a few sequences."""
    pa, pb, b, V, thr = rule.pi_a, rule.pi_b, rule.b, rule.vocab, rule.threshold
    out = []
    for s in seqs:
        key, pos, p, c = _mix32_int(s.uid ^ rule.seed_key), len(s.tokens), s.tokens[-2], s.tokens[-1]
        row = []
        for j in range(k):
            t = pa[c // b] * b + pb[p % b]
            x = _mix32_int(key ^ _mix32_int(pos + j))
            d = t if _mix32_int(x) < thr else (t + 1 + _mix32_int(x ^ _SALT) % (V - 1)) % V
            row.append(d)
            p, c = c, d
        out.append(row)
    return out


def check_drafter(model, accept_prob, seed, *, toy: bool) -> tuple[float, int]:
    """A drafter's shared arguments checked (InputError naming the first bad one):
    ``model`` a Decoder (the toy for a drafter that knows its rule), ``accept_prob`` a
    real number in [0, 1], ``seed`` any integer (numpy ones too); as a float and an int."""
    from ..models.protocol import Decoder
    from ..models.toy import ToyDecoder
    want = (ToyDecoder, "a ToyDecoder (the drafter knows its greedy rule)") if toy else (Decoder, "a Decoder")
    if not isinstance(model, want[0]):
        raise InputError(expected("model", want[1], type(model).__name__))
    return as_real("accept_prob", accept_prob, 0.0, 1.0), as_int("seed", seed)


@dataclass(frozen=True)
class DraftRule:
    """What a controlled drafter needs of the toy: its greedy rule as two permutation tables
    (``truth(prev, cur) = pi_a[cur // b] * b + pi_b[prev % b]``, ``ToyDecoder.design_next``),
    and the coin's threshold and seed. ``pi_a``/``pi_b`` are numpy arrays, tensors or lists,
    of the kind the drafts are computed with."""

    pi_a: object
    pi_b: object
    b: int
    vocab: int
    threshold: int  # accept a draft when its coin (in [0, 2**32)) is below this
    seed_key: int

    @classmethod
    def for_toy(cls, model: ToyDecoder, accept_prob: float, seed: int, device=None) -> "DraftRule":
        """The toy's rule with the coin of ``accept_prob`` and ``seed`` (checked: see
        :func:`check_drafter`)."""
        accept_prob, seed = check_drafter(model, accept_prob, seed, toy=True)
        b = model.config.factors[1]
        pa, pb = np.asarray(model._pi_a, dtype=np.int64), np.asarray(model._pi_b, dtype=np.int64)
        if device is not None:
            pa, pb = torch.from_numpy(pa).to(device), torch.from_numpy(pb).to(device)
        return cls(pa, pb, b, model.config.vocab, *coin_key(accept_prob, seed))

    def truth(self, prev, cur):
        return self.pi_a[cur // self.b] * self.b + self.pi_b[prev % self.b]


@dataclass(frozen=True)
class CommittedRows:
    """The rows one lane step committed, grouped by sequence (groups in step-row order).

    ``seqs[g]`` committed ``counts[g]`` tokens (its ``tokens`` already include them), the
    first fed at position ``first_pos[g]``; per committed row ``r`` (``R = counts.sum()``):
    ``rows[r]`` its hidden row (a host-row ring view: valid during ``observe`` only),
    ``fed[r]`` the token fed there, ``tokens[r]`` the token it committed, ``positions[r]``
    the position of ``fed[r]``, ``group[r]`` its index into ``seqs``. numpy int64 arrays."""

    seqs: list
    first_pos: np.ndarray
    counts: np.ndarray
    rows: Tensor
    fed: np.ndarray
    tokens: np.ndarray
    positions: np.ndarray
    group: np.ndarray

    @classmethod
    def of(cls, seq, first_pos: int, rows: Tensor) -> "CommittedRows":
        """One sequence's committed rows ``rows`` for positions ``first_pos ..`` (the last
        ``len(rows)`` tokens of ``seq.tokens``)."""
        n = rows.shape[0]
        toks = np.asarray(seq.tokens, dtype=np.int64)
        pos = np.arange(first_pos, first_pos + n, dtype=np.int64)
        return cls([seq], np.array([first_pos], np.int64), np.array([n], np.int64), rows,
                   toks[first_pos:first_pos + n], toks[first_pos + 1:first_pos + 1 + n], pos,
                   np.zeros(n, np.int64))

    def check_counts(self) -> None:
        """RuntimeError unless there is one row per committed token of every sequence."""
        have = np.fromiter((len(s.tokens) for s in self.seqs), np.int64, len(self.seqs))
        bad = np.flatnonzero((have - 1 - self.first_pos != self.counts) | (self.counts < 1))
        if bad.size or self.rows.shape[0] != int(self.counts.sum()):
            g = int(bad[0]) if bad.size else 0
            raise RuntimeError(f"sequence {self.seqs[g].uid}: {int(self.counts[g])} host rows for "
                               f"{int(have[g] - 1 - self.first_pos[g])} committed tokens")

    def last_rows(self) -> np.ndarray:
        """Index into the rows of each sequence's last committed row."""
        return np.cumsum(self.counts) - 1


class _Seen:
    """Which sequences' latest committed rows a drafter observed: ``uid -> len(tokens)``."""

    def __init__(self):
        self.at: dict[int, int] = {}

    def mark(self, seqs) -> None:
        for s in seqs:
            self.at[s.uid] = len(s.tokens)

    def require(self, seqs) -> None:
        for s in seqs:
            if self.at.get(s.uid) != len(s.tokens):
                raise RuntimeError(f"sequence {s.uid}: drafting before its committed rows were observed")


def _row_check_failed(c: CommittedRows, ok: np.ndarray) -> None:
    r = int(np.flatnonzero(~ok)[0])
    g = int(c.group[r])
    raise RuntimeError(f"sequence {c.seqs[g].uid}: host rows do not encode the fed tokens at positions "
                       f"{int(c.first_pos[g])}..{int(c.first_pos[g] + c.counts[g] - 1)}")


class ToyDrafter:
    """A host drafter for the toy that is right with probability ``accept_prob`` per draft.

    It knows the toy's greedy rule (``DraftRule``) and proposes the true continuation or a
    wrong token by the coin of ``(seed, uid, position)``: deterministic, the same drafts as
    :class:`DeviceDrafter`. ``observe`` checks one row per committed token and that each
    row still encodes its fed token (the toy's residual keeps the token code, so
    ``row . emb[token]`` is ~32 for the right token and <= ~18 for any other), one batched
    check per step; ``propose`` refuses a sequence whose latest rows it has not seen.
    """

    def __init__(self, model: ToyDecoder, accept_prob: float, seed: int = 0):
        accept_prob, seed = check_drafter(model, accept_prob, seed, toy=True)
        self.model, self.p, self.seed = model, accept_prob, seed
        rule = DraftRule.for_toy(model, accept_prob, seed)
        # the permutation tables as lists: read per draft with Python ints
        self.rule = replace(rule, pi_a=rule.pi_a.tolist(), pi_b=rule.pi_b.tolist())
        self._emb = model.emb.float().cpu().numpy()  # host copy: the check runs on the host
        self._norm2 = (self._emb * self._emb).sum(1)
        self._seen = _Seen()

    def observe(self, c: CommittedRows) -> None:
        c.check_counts()
        code = self._emb[c.fed]
        rows = c.rows[:, :code.shape[1]]
        rows = (rows if rows.dtype == torch.float32 else rows.float()).numpy()
        ok = np.einsum("ij,ij->i", rows, code) > 0.75 * self._norm2[c.fed]
        if not ok.all():
            _row_check_failed(c, ok)
        self._seen.mark(c.seqs)

    def propose(self, seqs, k: int) -> np.ndarray:
        self._seen.require(seqs)
        return np.array(controlled_drafts_py(self.rule, seqs, k), np.int64).reshape(len(seqs), k)

    def forget(self, seq) -> None:
        self._seen.at.pop(seq.uid, None)


class ReferenceDrafter:
    """A drafter for any model (the transformers ones included) that is right with
    probability ``accept_prob`` per draft token, so acceptance stays controlled.

    Its "truth" is the model's own plain greedy decoding (``model.greedy_generate``, e.g.
    ``generate(do_sample=False)``) of each sequence, planned once per prompt (``prepare``,
    before timing) and re-planned from the sequence's tokens when the served output leaves
    the plan (a near-tie that rounded the other way: rare, and the runtime's own greedy
    token always wins, so the output stays plain greedy decoding whatever is drafted).
    Every plan made inside ``propose`` (that one, or a prompt with no plan long enough)
    counts in ``replans`` and ``replan_seconds``. A wrong draft is the truth plus a random
    non-zero offset. ``observe`` checks one finite host row per committed token;
    ``propose`` refuses to draft before they were observed.
    Deterministic: one RNG per sequence, seeded by ``(seed, uid)``.
    """

    def __init__(self, model: Decoder, accept_prob: float, seed: int = 0):
        accept_prob, seed = check_drafter(model, accept_prob, seed, toy=False)
        self.model, self.p, self.seed = model, accept_prob, seed
        self._plans: dict[tuple[int, ...], list[int]] = {}  # prompt or prefix -> full token list
        self._seen = _Seen()
        self._rng: dict[int, np.random.Generator] = {}
        self._cur: dict[int, list[int]] = {}  # uid -> the plan its drafts follow
        self.replans = 0
        self.replan_seconds = 0.0  # time spent re-planning inside propose (a stand-in's cost)
        self._made = 0  # plans made by _plan (greedy_generate calls), to count the ones propose makes

    def prepare(self, requests) -> None:
        """Plan every request's greedy continuation now (outside any timed run)."""
        for r in requests:
            self._plan(list(r.prompt), r.max_new)

    def prepare_from(self, sequences) -> None:
        """Take served sequences' tokens (e.g. a plain greedy run through the same runtime)
        as the plans of their prompts: drafts then follow the runtime's own rounding, so
        near-ties rarely send the output off the plan. A prompt served more than once keeps
        its longest plan (a shorter one would be planned again inside propose)."""
        taken: dict[tuple[int, ...], list[int]] = {}
        for s in sequences:  # one prompt served twice: the longer plan (it covers the shorter request)
            key, toks = tuple(s.prompt), list(s.tokens)
            if len(toks) >= len(taken.get(key, ())):
                taken[key] = toks
        self._plans.update(taken)

    def _plan(self, tokens: list[int], n: int) -> list[int]:
        """``tokens`` and at least ``n`` greedy tokens after them (within ``max_len``): a
        cached plan too short for ``n`` (a shorter request of the same prompt) is redone."""
        key = tuple(tokens)
        n = max(0, min(n, self.model.config.max_len + 1 - len(tokens)))
        plan = self._plans.get(key)
        if plan is None or len(plan) < len(tokens) + n:
            plan = self._plans[key] = list(tokens) + (self.model.greedy_generate(list(tokens), n) if n else [])
            self._made += 1
        return plan

    def observe(self, c: CommittedRows) -> None:
        c.check_counts()
        ok = torch.isfinite(c.rows.float()).all(1).numpy()
        if not ok.all():
            r = int(np.flatnonzero(~ok)[0])
            raise RuntimeError(f"sequence {c.seqs[int(c.group[r])].uid}: non-finite host rows at position "
                               f"{int(c.positions[r])}")
        self._seen.mark(c.seqs)

    def propose(self, seqs, k: int) -> np.ndarray:
        self._seen.require(seqs)
        return np.array([self._propose_one(s, k) for s in seqs], dtype=np.int64).reshape(len(seqs), k)

    def _propose_one(self, seq, k: int) -> list[int]:
        rng = self._rng.setdefault(seq.uid, np.random.default_rng([self.seed & (2**64 - 1), seq.uid]))
        toks = seq.tokens
        plan = self._cur.get(seq.uid)
        if plan is None:  # a plan made here (none prepared, or one too short) is a re-plan too
            made, t0 = self._made, time.perf_counter()
            plan = self._plan(list(seq.prompt), seq.max_new)
            if self._made != made:
                self.replans += 1
                self.replan_seconds += time.perf_counter() - t0
        if plan[:len(toks)] != toks or len(plan) < min(len(toks) + k, len(seq.prompt) + seq.max_new):
            # the output left the plan (or outgrew it): plan again from here
            self.replans += 1
            t0 = time.perf_counter()
            plan = self._plan(list(toks), seq.max_new - len(seq.generated))
            self.replan_seconds += time.perf_counter() - t0
        self._cur[seq.uid] = plan
        vocab, out = self.model.config.vocab, []
        for i in range(k):
            j = len(toks) + i
            truth = plan[j] if j < len(plan) else 0
            out.append(truth if rng.random() < self.p else (truth + 1 + int(rng.integers(vocab - 1))) % vocab)
        return out

    def forget(self, seq) -> None:
        self._seen.at.pop(seq.uid, None)
        self._rng.pop(seq.uid, None)
        self._cur.pop(seq.uid, None)
