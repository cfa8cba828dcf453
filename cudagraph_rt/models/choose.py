"""How a step turns its logits into tokens: greedy, sampled, or rejection-sampled against drafts.

A model's step takes the sampling inputs when its ``inputs(sampling=True)`` declared them:
five per-row static inputs (:data:`SAMPLING_INPUTS`, pads in :func:`sampling_specs`) that
a runner rewrites in place for each request (no recapture), and a verify step may take
``draft_q`` too (``inputs(verify=True, draft_q=True)``: row i the distribution q the draft
``next_tokens[i]`` was drawn from; an all-zero row means a deterministic drafter, q one-hot
at the draft). The position of a row's drawn token is its position + 1: the randomness
key (``kernels/sampling/philox.py``) is (seed, that position), nothing of the step.

:class:`TokenChoice` is what a step builds from its inputs before any computing (it checks
them: InputError before the pool is written) and applies to its logits:

* without sampling inputs: ``greedy_tokens``, exactly the step it always was;
* with them, a step: ``kernels.sampling.sample`` (temperature 0 rows give the same token
  as ``greedy_tokens``, bit for bit);
* with them, a verify step: ``kernels.sampling.verify`` with ``draft = next_tokens``
  (accept a draft with probability min(1, p/q), else draw from norm(max(0, p - q)); rows
  without a draft draw from p), so a token equals its draft exactly when it was accepted
  and ``greedy_accept`` decides the committed rows unchanged.

Padding rows hold the pads: temperature 0 (greedy), every filter off, seed 0: they sample
nothing and cost the greedy path. Rows with ``want == 0`` get -1 either way.

The sampler runs outside torch.compile (a compiled step returns logits; see
``models/hf.py``); it is capturable (static shapes, no host sync). Setting values are
checked on the host only when the tensors live there (CPU: graphs off or emulated); on
CUDA a bad value in a static row samples something unspecified, never out of bounds
(``kernels/sampling/settings.py``): runners check :class:`~cudagraph_rt.SamplingParams`
before writing rows.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from ..errors import InputError, expected
from ..kernels.sampling import SamplingSettings, check_setting_values, sample, verify
from ..inputs.spec import InputSpec
from .greedy import greedy_tokens

__all__ = ["DRAFT_Q", "SAMPLING_INPUTS", "TokenChoice", "draft_q_spec", "sampling_specs"]

SAMPLING_INPUTS = ("temperature", "top_k", "top_p", "min_p", "seed")
DRAFT_Q = "draft_q"


def sampling_specs() -> dict[str, InputSpec]:
    """The five per-row sampling inputs and their pads (a greedy row with every filter off)."""
    f32 = torch.float32
    return dict(temperature=InputSpec(dtype=f32, pad=0.0), top_k=InputSpec(pad=0), top_p=InputSpec(dtype=f32, pad=1.0),
                min_p=InputSpec(dtype=f32, pad=0.0), seed=InputSpec(pad=0))


def draft_q_spec(vocab: int) -> InputSpec:
    """``draft_q``: a [vocab] float32 row per step row; the pad (all zero) is a deterministic draft."""
    return InputSpec(shape=(vocab,), dtype=torch.float32, pad=0.0)


class TokenChoice:
    """The token rule of one step, built from its inputs (checked here, metadata only on
    CUDA, values too on the CPU) before the step computes anything. ``settings`` is None
    for a greedy step without sampling inputs. Call it with the step's logits."""

    __slots__ = ("settings", "draft", "q", "want")

    def __init__(self, settings: SamplingSettings | None, draft: Tensor | None, q: Tensor | None, want: Tensor):
        self.settings, self.draft, self.q, self.want = settings, draft, q, want

    @classmethod
    def of(cls, inputs: Mapping[str, Tensor], positions: Tensor, want: Tensor, vocab: int, *,
           verify: bool = False) -> "TokenChoice":
        """The rule ``inputs`` ask for. ``verify``: a verify step (``next_tokens`` are the
        drafts). InputError for a partial set of sampling inputs, one of the wrong
        dtype or rows, ``draft_q`` without them or of the wrong shape, or (CPU tensors) a
        setting value out of range."""
        given = [k for k in SAMPLING_INPUTS if k in inputs]
        q = inputs.get(DRAFT_Q)
        if not given:
            if q is not None:
                raise InputError(expected(DRAFT_Q, f"given with the sampling inputs {list(SAMPLING_INPUTS)}",
                                          "draft_q alone"))
            return cls(None, None, None, want)
        if len(given) != len(SAMPLING_INPUTS):
            missing = [k for k in SAMPLING_INPUTS if k not in inputs]
            raise InputError(expected("inputs", f"all of the sampling inputs {list(SAMPLING_INPUTS)} or none",
                                      f"missing {missing}"))
        if q is not None and not verify:
            raise InputError(expected(DRAFT_Q, "only in a verify step's inputs", "draft_q in a step's"))
        n, dev, specs = positions.shape[0], positions.device, sampling_specs()
        for k in SAMPLING_INPUTS:
            t, dtype = inputs[k], specs[k].dtype
            if not isinstance(t, Tensor) or tuple(t.shape) != (n,) or t.dtype != dtype or t.device != dev:
                raise InputError(expected(k, f"a [{n}] {dtype} tensor on {dev}", _desc(t)))
        if q is not None and (not isinstance(q, Tensor) or tuple(q.shape) != (n, vocab) or q.dtype != torch.float32
                              or q.device != dev):
            raise InputError(expected(DRAFT_Q, f"a [{n}, {vocab}] float32 tensor on {dev}", _desc(q)))
        values = {k: inputs[k] for k in SAMPLING_INPUTS}
        settings = SamplingSettings(position=positions + 1, **values)
        draft = inputs["next_tokens"] if verify else None
        if dev.type == "cpu":
            check_setting_values(settings)
        return cls(settings, draft, q, want)

    @property
    def greedy(self) -> bool:
        """No sampling inputs: the step is the greedy one (``greedy_tokens``)."""
        return self.settings is None

    def __call__(self, logits: Tensor, greedy=None) -> Tensor:
        """[N] int64 tokens of ``logits`` [N, vocab] under this rule (-1 where ``want != 1``);
        ``greedy``: the model's greedy rule for a step without sampling inputs (any that
        picks the first maximal logit; default ``greedy_tokens``)."""
        if self.settings is None:
            tokens = (greedy or greedy_tokens)(logits)
        elif self.draft is None:
            tokens = sample(logits, self.settings, validate=False)
        else:
            tokens, _ = verify(logits, self.settings, self.draft, q=_one_hot_where_empty(self.q, self.draft),
                               validate=False)
        return tokens.masked_fill(self.want != 1, -1)


def _one_hot_where_empty(q: Tensor | None, draft: Tensor) -> Tensor | None:
    """``q`` with each all-zero row made one-hot at its draft (a deterministic drafter's q);
    rows without a valid draft are left as they are (verify reads no q there)."""
    if q is None:
        return None
    empty = ~(q != 0).any(-1)
    at = draft.clamp(0, q.shape[1] - 1)[:, None]
    return q.scatter_add(1, at, empty.to(q.dtype)[:, None])


def _desc(t) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, Tensor) else type(t).__name__
