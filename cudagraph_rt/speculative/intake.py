"""What a runner takes in, checked before anything is built: the requests, the sequences
they become while served, the runner's own arguments, and a drafter's proposals."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..checks import as_bool, as_int, token_ids
from ..errors import InputError, expected
from ..models.pool import cdiv
from ..models.protocol import Decoder
from ..sampling_params import MAX_SEED, SamplingParams
from .proposal import Proposal

__all__ = ["Request", "Sequence", "blocks_for", "check_request", "check_runner_args", "check_sampling_args",
           "read_proposal"]


@dataclass(frozen=True)
class Request:
    """A prompt, how many tokens to generate for it, and how to draw them (``sampling``:
    a :class:`~cudagraph_rt.SamplingParams`, greedy by default; ``seed=None`` there means
    the runner derives one from its own seed and the request's uid)."""

    prompt: tuple[int, ...]
    max_new: int
    sampling: SamplingParams = SamplingParams()


@dataclass
class Sequence:
    """One request while it is served. ``tokens`` = prompt + generated; the last token is
    committed but not fed yet (its K/V is written by the next step). ``slot`` is the
    model's sequence id (its KV blocks), free again once the sequence retires."""

    uid: int
    slot: int
    prompt: tuple[int, ...]
    max_new: int
    tokens: list[int]
    prefilled: int = 0  # prompt tokens already placed in a step
    rows: list[torch.Tensor] = field(default_factory=list)  # committed hidden rows, if recorded
    # the request's settings, seed resolved (an int: a draft model draws with it, Stream.DRAFT)
    sampling: SamplingParams = SamplingParams(seed=0)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def decoding(self) -> bool:
        return len(self.tokens) > len(self.prompt)

    @property
    def done(self) -> bool:
        return len(self.tokens) - len(self.prompt) >= self.max_new


def blocks_for(model: Decoder, prompt: int, max_new: int) -> int:
    """KV blocks a request may hold at most: its fed positions (the last generated token is
    never fed; drafts never pass the limit)."""
    return cdiv(prompt + max_new - 1, model.pool.block_size)


def check_request(i: int, r, model: Decoder, sampling: bool, owner: str) -> Request:
    """``requests[i]`` of a runner or loop (``owner`` names it in the messages) checked, as a
    Request of a tuple of ints, an int and a SamplingParams (greedy unless ``sampling``).
    InputError naming ``requests[i]`` (or its field) otherwise, e.g. a request that does not
    fit the model's positions or its whole KV pool."""
    cfg, pool = model.config, model.pool
    if not hasattr(r, "prompt") or not hasattr(r, "max_new"):
        raise InputError(expected(f"requests[{i}]", "a Request(prompt, max_new)", type(r).__name__))
    n = as_int(f"requests[{i}].max_new", r.max_new, 1)
    prompt = token_ids(f"requests[{i}].prompt", r.prompt, cfg.vocab)
    if not prompt or len(prompt) + n - 1 > cfg.max_len:
        raise InputError(expected(f"requests[{i}]", f"a prompt and max_new >= 1 within {cfg.max_len} positions",
                                  (len(prompt), n)))
    if blocks_for(model, len(prompt), n) > pool.num_blocks:
        raise InputError(expected(f"requests[{i}]", f"at most {pool.num_blocks * pool.block_size} positions "
                                  "(the model's whole KV pool)", (len(prompt), n)))
    sp = getattr(r, "sampling", SamplingParams())
    if not isinstance(sp, SamplingParams):
        raise InputError(expected(f"requests[{i}].sampling", "a SamplingParams", type(sp).__name__))
    if not sampling and not sp.greedy:
        raise InputError(expected(f"requests[{i}].sampling", f"greedy settings (this {owner} has sampling=False)", sp))
    return Request(prompt, n, sp)


def read_proposal(p, n: int, k: int, vocab: int, device: torch.device, takes_q: bool) -> tuple[list, torch.Tensor | None]:
    """A drafter's answer (a :class:`Proposal` or a bare ``(n, k)`` array: q None) as its
    draft lists and its q (None, or ``(n, k, vocab)`` float32 on ``device``), checked:
    InputError naming ``drafter.propose`` for a q this runner cannot take or of the wrong
    shape (before anything of the step is built)."""
    q = None
    if isinstance(p, Proposal):
        p, q = p.tokens, p.q
    if q is not None:
        if not takes_q:
            raise InputError(expected("drafter.propose(...).q", "None: this runner's verify step takes no q "
                                      "(SpecRunner(draft_q=True), or a drafter with draft_q = True)", "a q"))
        if not isinstance(q, torch.Tensor) or tuple(q.shape[:1]) != (n,) or q.dim() != 3 or q.shape[1] < k \
                or q.shape[2] != vocab or q.dtype != torch.float32 or q.device != device:
            got = f"{q.dtype} {tuple(q.shape)} on {q.device}" if isinstance(q, torch.Tensor) else type(q).__name__
            raise InputError(expected("drafter.propose(...).q", f"a ({n}, >= {k}, {vocab}) float32 tensor on {device}",
                                      got))
    tokens = _draft_tokens(p, n, k, vocab)
    if q is not None and q.device.type == "cpu":
        _check_q_values(q[:, :k], tokens)
    return tokens.tolist(), q


def _draft_tokens(p, n: int, k: int, vocab: int) -> np.ndarray:
    """The drafts as an int64 ``(n, >= k)`` array of token ids in [0, vocab), or InputError
    naming ``drafter.propose(...)``: a short answer would leave a sequence without drafts,
    a token out of range would reach the embedding."""
    name = "drafter.propose(...).tokens"
    try:
        a = np.asarray(p)
    except (TypeError, ValueError):
        a = None
    if a is None or a.dtype.kind not in "iu" or a.ndim != 2 or a.shape[0] != n or a.shape[1] < k:
        got = f"{a.dtype} {a.shape}" if a is not None else type(p).__name__
        raise InputError(expected(name, f"ints of shape ({n}, >= {k}): k drafts for each sequence", got))
    d = a[:, :k]
    if d.size and (d.min() < 0 or d.max() >= vocab):
        raise InputError(expected(name, f"token ids in [0, {vocab})", f"{int(d.min())} .. {int(d.max())}"))
    return d.astype(np.int64, copy=False)


def _check_q_values(q: torch.Tensor, tokens: np.ndarray) -> None:
    """A q on the CPU checked as a distribution each draft was drawn from: finite, >= 0, rows
    summing to 1, positive at the draft (acceptance divides by it). On CUDA the values
    are not read (a host read would wait for the GPU): a bad q there gives wrong odds."""
    name = "drafter.propose(...).q"
    at = q.gather(2, torch.as_tensor(tokens, dtype=torch.int64)[..., None])
    if not (torch.isfinite(q).all() and (q >= 0).all() and torch.allclose(q.sum(-1), torch.ones(()), atol=1e-3)
            and (at > 0).all()):
        raise InputError(expected(name, "rows of probabilities (finite, >= 0, summing to 1, > 0 at the draft)",
                                  "other values"))


def check_sampling_args(drafter, seed, sampling, draft_q) -> tuple[int, bool, bool]:
    """SpecRunner's ``seed``, ``sampling`` and ``draft_q`` checked (InputError naming the first
    bad one); ``draft_q=None`` asks the drafter (its ``draft_q``, default False)."""
    seed = as_int("seed", seed, 0, MAX_SEED)
    sampling = as_bool("sampling", sampling)
    draft_q = as_bool("draft_q", bool(getattr(drafter, "draft_q", False)) if draft_q is None else draft_q)
    if draft_q and not sampling:
        raise InputError(expected("draft_q", "False when sampling=False (a greedy step takes no q)", True))
    return seed, sampling, draft_q


def check_runner_args(model, drafter, k, slots, lanes, chunk, record_rows) -> tuple[int, int, int, int, bool]:
    """SpecRunner's arguments checked (InputError naming the first bad one), as plain values."""
    if not isinstance(model, Decoder):
        raise InputError(expected("model", "a Decoder (cudagraph_rt.models.Decoder)", type(model).__name__))
    if not all(callable(getattr(drafter, call, None)) for call in ("observe", "propose", "forget")):
        raise InputError(expected("drafter", "an object with observe, propose and forget", type(drafter).__name__))
    max_seqs = model.config.max_seqs
    k = as_int("k", k, 0)
    slots = max_seqs if slots is None else as_int("slots", slots, 1, max_seqs)
    lanes = as_int("lanes", lanes, 1, slots, f"an int in [1, slots = {slots}]")
    chunk = as_int("chunk", chunk, 1)
    record_rows = as_bool("record_rows", record_rows)
    depth = getattr(drafter, "depth", None)  # a drafter that holds results per observe
    if depth is not None and depth < lanes + 1:
        raise InputError(expected("drafter.depth", f">= lanes + 1 = {lanes + 1} (a lane's drafts must outlive "
                                  "the other lanes' observes)", depth))
    drafts = getattr(drafter, "k", None)  # a drafter that drafts at most k per sequence
    if drafts is not None and drafts < k:
        raise InputError(expected("drafter.k", f">= the runner's k = {k} (it proposes k drafts per sequence)",
                                  drafts))
    return k, slots, lanes, chunk, record_rows
