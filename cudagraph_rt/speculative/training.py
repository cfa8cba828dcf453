"""Self-distillation for drafters: the target generates from random prompts through its
own runtime (``collect``), and a draft head (``train_head``) or a small draft model
(``train_draft_model``) learns to predict the target's next token. No data set, no
download: a random-weight target or a user's local checkpoint gets a drafter of its own.

Data (:class:`Corpus`): per generated sequence the hidden rows the runner's captured
gather shipped (positions ``len(prompt) - 1 ..``, one per committed token) and the tokens.
A head learns ``(row[p], token[p + 1]) -> row[p + 1]`` and ``token[p + 2]``, unrolled
``unroll`` steps on its own predicted rows (as it drafts: EAGLE's training-time test).
"""
from __future__ import annotations

import math
import random
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import as_int
from .head import DraftHead, HeadConfig
from .runner import Request, SpecRunner
from .target_parts import target_parts

__all__ = ["Corpus", "TrainReport", "collect", "estimate_acceptance", "make_head", "train_head"]


class _Keep:
    """A drafter for a k = 0 run: drafts nothing, keeps nothing (the runner records rows)."""

    name = "none"

    def observe(self, c) -> None:
        pass

    def propose(self, seqs, k):
        return np.zeros((len(seqs), k), np.int64)

    def forget(self, seq) -> None:
        pass


@dataclass
class Corpus:
    """Generated sequences, concatenated: ``rows [M, row_width]`` (on the target's device,
    its dtype), ``after [M]`` int64 the token each row committed (``rows[i]`` sits at some
    position p and ``after[i]`` is the token at p + 1), ``starts``/``lengths`` of each
    sequence's run of rows, and ``sequences`` (every sequence's full token list)."""

    rows: Tensor
    after: Tensor
    starts: np.ndarray
    lengths: np.ndarray
    sequences: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0

    def split(self, held_out: float) -> tuple["Corpus", "Corpus"]:
        """The first sequences for training, the last ``held_out`` fraction (at least one) apart."""
        n = len(self.starts)
        cut = max(1, n - max(1, int(round(n * held_out)))) if n > 1 else n
        return self._take(slice(0, cut)), self._take(slice(cut, n))

    def _take(self, sl: slice) -> "Corpus":
        st, ln = self.starts[sl], self.lengths[sl]
        if not len(st):
            return Corpus(self.rows[:0], self.after[:0], st, ln, [], 0.0)
        a, b = int(st[0]), int(st[-1] + ln[-1])
        return Corpus(self.rows[a:b], self.after[a:b], st - a, ln, self.sequences[sl], 0.0)

    def windows(self, span: int) -> Tensor:
        """Every row index ``i`` whose sequence has rows ``i .. i + span`` (int64, on the rows' device)."""
        idx = [np.arange(s, s + n - span) for s, n in zip(self.starts, self.lengths) if n > span]
        out = np.concatenate(idx) if idx else np.zeros(0, np.int64)
        return torch.from_numpy(out.astype(np.int64)).to(self.rows.device)


def random_requests(cfg, n: int, seed: int, max_new: int | None = None) -> list[Request]:
    """``n`` random prompts of 4 .. max_len // 8 tokens, each generating to ``max_len``
    (or ``max_new``) tokens."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = rng.randint(min(4, cfg.max_len // 2), max(min(4, cfg.max_len // 2), cfg.max_len // 8))
        new = cfg.max_len + 1 - p if max_new is None else min(max_new, cfg.max_len + 1 - p)
        out.append(Request(tuple(rng.randrange(cfg.vocab) for _ in range(p)), new))
    return out


def collect(model, requests: list[Request], *, graphs: bool | str = False, lanes: int = 2) -> Corpus:
    """Serve ``requests`` with plain decoding (k = 0) through a SpecRunner and keep every
    committed hidden row (``record_rows``): what the target itself generates, greedy."""
    t0 = time.perf_counter()
    model.reset_cache()
    slots = model.config.max_seqs
    runner = SpecRunner(model, _Keep(), k=0, slots=slots, lanes=min(lanes, slots), graphs=graphs,
                        record_rows=True)
    runner.submit(requests)
    runner.run()
    runner.rt.close()
    seqs = sorted(runner.finished, key=lambda s: s.uid)
    model.reset_cache()
    rows, after, lengths = [], [], []
    for s in seqs:
        r = torch.cat(s.rows)
        rows.append(r)
        after.append(torch.tensor(s.generated, dtype=torch.int64))
        lengths.append(r.shape[0])
    lengths = np.array(lengths, np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    dev = model.device
    return Corpus(torch.cat(rows).to(dev), torch.cat(after).to(dev), starts, lengths,
                  [list(s.tokens) for s in seqs], time.perf_counter() - t0)


def make_head(model, corpus: Corpus | None = None, *, hidden: int | None = None, layers: int = 1,
              draft_vocab: int | None = None, target: str = "", seed: int = 0) -> DraftHead:
    """A fresh head for ``model`` (float32, on its device). ``draft_vocab``: keep the most
    frequent tokens of ``corpus`` (ties by id), the rest of the vocabulary after them."""
    parts = target_parts(model)
    dv = parts.vocab if draft_vocab is None else min(as_int("draft_vocab", draft_vocab, 1), parts.vocab)
    torch.manual_seed(seed)
    cfg = HeadConfig(parts.row_width, parts.embed_width, hidden or min(parts.row_width, 4096), parts.vocab, layers,
                     dv, target)
    head = DraftHead(cfg).to(model.device)
    if corpus is not None and dv < parts.vocab:
        counts = torch.bincount(corpus.after.cpu(), minlength=parts.vocab)
        order = torch.argsort(-counts.double() + torch.arange(parts.vocab) * 1e-9)  # stable by id on ties
        head.draft_ids.copy_(order[:dv].to(model.device))
    return head


@dataclass(frozen=True)
class TrainReport:
    """What training did: ``losses`` per step, ``seconds`` of the loop, rows seen, the
    held-out acceptance estimates before and after (mean accepted of ``k`` and per
    position, :func:`estimate_acceptance`), how much of the held-out data's next tokens lie
    in the draft vocabulary, and the training objective on held-out windows after training
    (``held_out_loss``; None where not measured): far above the last training losses, the
    drafter memorised its windows instead of learning the target."""

    losses: tuple[float, ...]
    seconds: float
    rows: int
    k: int
    before: tuple[float, tuple[float, ...]]
    after: tuple[float, tuple[float, ...]]
    coverage: float
    held_out_loss: float | None = None


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def optimizer_step(loss, module, opt, sched, losses: list, on_step, i: int) -> None:
    """One training step's update (clipped at norm 1), the loss kept for the report and
    handed to ``on_step(i + 1, loss)`` (the progress bar)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    sched.step()
    losses.append(loss.detach())
    if on_step is not None:
        on_step(i + 1, losses[-1])


def _unrolled(head: DraftHead, parts, readout: Tensor, corpus: Corpus, idx: Tensor, steps: int,
              to_draft: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Run ``head`` ``steps`` times from rows ``idx`` on true next tokens; returns the CE
    and regression losses (means over steps) and each step's draft-vocab logits."""
    row = corpus.rows[idx].float()
    ce = reg = 0.0
    logits_all = []
    for u in range(steps):
        tok = corpus.after[idx + u]
        row = head(row, parts.embed(tok).float())
        logits = row @ readout.T
        want = to_draft[corpus.after[idx + u + 1]]
        ce = ce + F.cross_entropy(logits.float(), want, ignore_index=-1)
        reg = reg + F.smooth_l1_loss(row.float(), corpus.rows[idx + u + 1].float())
        logits_all.append(logits)
    return ce / steps, reg / steps, logits_all


@torch.no_grad()
def estimate_acceptance(head: DraftHead, model, corpus: Corpus, k: int = 4, limit: int = 4096,
                        seed: int = 0) -> tuple[float, tuple[float, ...]]:
    """Greedy acceptance of ``head`` on ``corpus`` at temperature 0: from a row and its
    committed token, ``k`` drafts each from the head's previous predicted row (as
    ``HeadDrafter`` drafts); draft j counts while drafts 1..j all equal the target's
    tokens. Returns (mean accepted of k, per-position acceptance) over up to ``limit``
    start rows (a seeded choice). Sequences shorter than ``k + 1`` rows give no start."""
    parts = target_parts(model)
    idx = corpus.windows(k)
    if idx.numel() == 0:
        return 0.0, (0.0,) * k
    if idx.numel() > limit:
        g = torch.Generator().manual_seed(seed)
        idx = idx[torch.randperm(idx.numel(), generator=g)[:limit].to(idx.device)]
    readout = parts.readout_weight.index_select(0, head.draft_ids).float()
    head_dtype = next(head.parameters()).dtype
    row = corpus.rows[idx].to(head_dtype)
    ok = torch.ones(idx.numel(), dtype=torch.bool, device=idx.device)
    per = []
    for u in range(k):
        row = head(row, parts.embed(corpus.after[idx + u]).to(head_dtype))
        draft = head.draft_ids[(row.float() @ readout.T).argmax(-1)]
        ok = ok & (draft == corpus.after[idx + u + 1])
        per.append(float(ok.float().mean()))
    return float(sum(per)), tuple(per)


def train_head(head: DraftHead, model, corpus: Corpus, *, steps: int, batch: int = 512, lr: float = 1e-3,
               unroll: int = 3, reg_weight: float = 1.0, held_out: Corpus | None = None, k: int = 4, seed: int = 0,
               on_step=None) -> TrainReport:
    """Train ``head`` (in place, float32 weights; bf16 autocast on CUDA) for ``steps`` AdamW
    steps of ``batch`` start rows, cosine-decayed ``lr``: per step the head is unrolled
    ``unroll`` times on its own rows (cross-entropy on the target's next token over the
    draft vocabulary, plus ``reg_weight`` x smooth-L1 to the target's next row).
    ``on_step(i, loss)`` after each step (a progress bar). Acceptance is estimated on
    ``held_out`` (else ``corpus``) before and after."""
    steps, batch, unroll = as_int("steps", steps, 1), as_int("batch", batch, 1), as_int("unroll", unroll, 1)
    parts = target_parts(model)
    dev = model.device
    check = held_out if held_out is not None and len(held_out.starts) else corpus
    before = estimate_acceptance(head, model, check, k)
    vocab = parts.vocab
    to_draft = torch.full((vocab,), -1, dtype=torch.int64, device=dev)
    to_draft[head.draft_ids] = torch.arange(head.draft_ids.numel(), device=dev)
    coverage = float((to_draft[check.after] >= 0).float().mean()) if check.after.numel() else 0.0
    readout = parts.readout_weight.index_select(0, head.draft_ids).detach()
    idx_all = corpus.windows(unroll)
    if idx_all.numel() == 0:
        raise ValueError(f"no training window: every generated sequence is shorter than unroll + 1 = {unroll + 1} rows")
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))
    g = torch.Generator(device=dev).manual_seed(seed)
    losses = []
    head.train()
    t0 = time.perf_counter()
    for i in range(steps):
        pick = idx_all[torch.randint(idx_all.numel(), (min(batch, idx_all.numel()),), generator=g, device=dev)]
        with _autocast(dev):
            ce, reg, _ = _unrolled(head, parts, readout, corpus, pick, unroll, to_draft)
            loss = ce + reg_weight * reg
        optimizer_step(loss, head, opt, sched, losses, on_step, i)
    losses_f = tuple(float(x) for x in torch.stack(losses).cpu())
    seconds = time.perf_counter() - t0
    head.eval()
    after = estimate_acceptance(head, model, check, k)
    held = _held_out_loss(head, parts, readout, check, unroll, to_draft, reg_weight, seed)
    return TrainReport(losses_f, seconds, int(idx_all.numel()), k, before, after, coverage, held)


@torch.no_grad()
def _held_out_loss(head: DraftHead, parts, readout: Tensor, corpus: Corpus, unroll: int, to_draft: Tensor,
                   reg_weight: float, seed: int, limit: int = 4096) -> float | None:
    """The training objective on up to ``limit`` of ``corpus``'s windows (a seeded choice)."""
    idx = corpus.windows(unroll)
    if idx.numel() == 0:
        return None
    if idx.numel() > limit:
        g = torch.Generator().manual_seed(seed)
        idx = idx[torch.randperm(idx.numel(), generator=g)[:limit].to(idx.device)]
    with _autocast(idx.device):
        ce, reg, _ = _unrolled(head, parts, readout, corpus, idx, unroll, to_draft)
    return float(ce + reg_weight * reg)
