"""A request's sampling settings (:class:`SamplingParams`), checked once, at construction.

The step samples with per-row device tensors (``kernels.sampling.SamplingSettings``); a
runner writes each request's :class:`SamplingParams` into those rows of every step it
feeds (``speculative/runner.py``). What each setting means, and the order they apply in, is
``kernels/sampling/settings.py``'s: temperature, then top-k, then top-p on the top-k set,
then min-p; temperature 0 is greedy (the first maximal logit, exactly the greedy step's
token), whatever the other settings say.

Seeds. Randomness is counter-based, keyed by ``(seed, position)`` (``kernels/sampling/
philox.py``), so a request's tokens depend only on its prompt, its settings and its seed:
not on its batch-mates, the step's width or the graph mode. ``seed=None`` asks the runner
for one: :func:`derived_seed` of the runner's own ``seed`` and the request's uid (its
submission index), so a run repeated with the same runner seed and the same submissions in
the same order gives the same tokens, and two requests with ``seed=None`` draw
independently. Give a seed to make one request reproducible on its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .errors import InputError, expected

__all__ = ["MAX_SEED", "SamplingParams", "derived_seed"]

MAX_SEED = 2**63 - 1  # seeds are int64 rows of the step (the Philox key is their 64 bits)
_MASK64 = 2**64 - 1


def as_int(name: str, v, lo: int, hi: int | None, what: str | None = None) -> int:
    """``checks.as_int`` without its torch import (the CLI parses these before torch loads)."""
    what = what or (f"an int in [{lo}, {hi}]" if hi is not None else f"an int >= {lo}")
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not lo <= int(v) <= (hi or int(v)):
        raise InputError(expected(name, what, repr(v)))
    return int(v)


def _real(name: str, v, lo: float, hi: float, lo_open: bool, hi_open: bool, what: str) -> float:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise InputError(expected(name, what, repr(v)))
    x = float(v)
    with np.errstate(over="ignore"):  # the step's rows are float32: the value must hold there too
        y = float(np.float32(x))
    ok = all(math.isfinite(z) and (lo < z if lo_open else lo <= z) and (z < hi if hi_open else z <= hi) for z in (x, y))
    if not ok:
        raise InputError(expected(name, what + " (as a float32 too)", repr(v)))
    return x


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are drawn. Immutable; checked at construction: an
    InputError names the first bad field (``SamplingParams.<field>``), so a bad request is
    refused before any runner, buffer or cache sees it. Numpy scalars are taken as the
    plain value; bools are refused everywhere.

    Each float must hold as a float32 too (the step's rows are float32: 1e39 is no
    temperature, 1e-46 no top_p).

    * ``temperature``: a finite float >= 0; below ``kernels.sampling.MIN_TEMPERATURE``
      (0 included) the request is greedy and the other settings do not matter.
    * ``top_k``: an int in [0, 2**63 - 1] (0: off; an int64 row of the step).
    * ``top_p``: a float in (0, 1] (1: off).
    * ``min_p``: a float in [0, 1) (0: off).
    * ``seed``: None (the runner derives one, see the module doc) or an int in
      [0, 2**63 - 1].

    The default is greedy decoding.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        f = "SamplingParams."
        values = dict(
            temperature=_real(f + "temperature", self.temperature, 0.0, math.inf, False, True,
                              "a finite number >= 0 (0: greedy)"),
            top_k=as_int(f + "top_k", self.top_k, 0, MAX_SEED, "an int in [0, 2**63 - 1] (0: off)"),
            top_p=_real(f + "top_p", self.top_p, 0.0, 1.0, True, False, "a number in (0, 1] (1: off)"),
            min_p=_real(f + "min_p", self.min_p, 0.0, 1.0, False, True, "a number in [0, 1) (0: off)"),
            seed=None if self.seed is None else as_int(f + "seed", self.seed, 0, MAX_SEED),
        )
        for name, v in values.items():
            object.__setattr__(self, name, v)

    @property
    def greedy(self) -> bool:
        """Whether the tokens are the greedy ones (temperature below the sampler's minimum)."""
        from .kernels.sampling.settings import MIN_TEMPERATURE

        return self.temperature < MIN_TEMPERATURE

    def seeded(self, runner_seed: int, uid: int) -> "SamplingParams":
        """These settings with ``seed`` resolved: kept when given, else
        :func:`derived_seed` ``(runner_seed, uid)``."""
        if self.seed is not None:
            return self
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p, derived_seed(runner_seed, uid))


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def derived_seed(runner_seed: int, uid: int) -> int:
    """The seed of request ``uid`` (its submission index) of a runner seeded with
    ``runner_seed``, for a request that gave none: SplitMix64 of the pair, in
    [0, 2**63 - 1]. A pure function: the same pair always gives the same seed."""
    runner_seed = as_int("seed", runner_seed, 0, MAX_SEED)
    uid = as_int("uid", uid, 0, None)
    return _splitmix64(_splitmix64(runner_seed) ^ uid) & MAX_SEED
