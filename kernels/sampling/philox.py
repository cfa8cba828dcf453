"""The sampler's randomness: Philox4x32-10, counter-based, the same bits in torch and in Triton.

A draw is a pure function of ``(seed, position, stream, index)``:

* key ``(k0, k1)`` = the low and high 32 bits of the request's int64 ``seed``;
* counter ``(c0, c1, c2, c3)`` = ``(index // 4, position & 0xffffffff, position >> 32, stream)``;
* the draw for ``index`` is output word ``index % 4`` of Philox4x32 with 10 rounds
  (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the Random123
  known-answer vectors are in the tests), so one Philox evaluation serves four
  consecutive vocabulary entries.

Nothing else goes in: not the row of the step, the step's width, the batch-mates, the graph
mode nor the device, so a request's tokens depend only on its own logits and settings.

Streams. Each decision that must be independent of another draws from its own stream
(:class:`Stream`). Speculative verification is lossless (the emitted token is distributed
exactly as plain sampling from p) only if the acceptance uniform is independent of the
draft token it judges and of the residual sample drawn after a rejection: were the draft
model's sample and the acceptance test to read the same uniform, drafts the draft model
was likely to draw would also be likely to pass (or fail) for that reason alone, and the
accepted tokens would follow a mixture of p and q instead of p. Separate streams make
the four uses (the target's sample, the acceptance uniform, the residual sample, the draft
model's sample) independent for the same ``(seed, position)``.

Uniforms are Random123's open-open fixed-point conversion for float32 (u01fixedpt,
B = 24): ``u = (x >> 9) * 2**-23 + 2**-24``, one of the 2**23 odd multiples of 2**-24 in
(0, 1), never 0 nor 1, computed exactly in float32 (so torch and Triton agree bit for
bit). Gumbel noise is ``-log(-log(u))``; there the two paths may differ by a rounding of
``log`` (a different library), which changes a sample only when two candidates' keys
are within float32 rounding of each other.

The torch functions use int64 tensors holding 32-bit values; the 32x32-bit products are
split into 16-bit limbs so that no intermediate value reaches 2**63 (CPU and CUDA alike).
"""
from __future__ import annotations

import enum

import torch
from torch import Tensor

try:  # Triton is optional: the torch functions below need none of it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

__all__ = ["ROUNDS", "Stream", "gumbel", "philox4x32", "random_words", "uniform", "uniforms", "words_to_uniform"]

ROUNDS = 10
_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox4x32 round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_MASK32 = 0xFFFFFFFF


class Stream(enum.IntEnum):
    """The counter's fourth word: one independent sequence per use of a (seed, position)."""

    SAMPLE = 0  # the target model's token (plain sampling, the bonus row of a verify)
    ACCEPT = 1  # the acceptance uniform of a verify row
    RESIDUAL = 2  # the token drawn from norm(max(0, p - q)) after a rejection
    DRAFT = 3  # a draft model's own sample of the same position


def _mulhilo(a: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """The high and low 32-bit words of ``a * b`` for ``a`` in [0, 2**32) (int64) and a
    32-bit constant ``b``; ``a`` is split into 16-bit limbs so nothing exceeds 2**49."""
    low = (a & 0xFFFF) * b  # < 2**48
    high = (a >> 16) * b  # < 2**48
    w = low + ((high & 0xFFFF) << 16)  # < 2**49
    return (high >> 16) + (w >> 32), w & _MASK32


def philox4x32(c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: Tensor, k1: Tensor,
               rounds: int = ROUNDS) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-``rounds`` of counter ``(c0, c1, c2, c3)`` under key ``(k0, k1)``: int64
    tensors (broadcast together) holding values in [0, 2**32); returns the four output
    words, int64 in [0, 2**32). Pure torch ops: any device, capturable."""
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _W0) & _MASK32, (k1 + _W1) & _MASK32
    return c0, c1, c2, c3


def _key_and_position(seed: Tensor, position: Tensor) -> tuple[Tensor, ...]:
    """[N, 1] int64 columns: the key words of ``seed`` and the counter words of ``position``."""
    seed, position = seed.to(torch.int64)[:, None], position.to(torch.int64)[:, None]
    return seed & _MASK32, (seed >> 32) & _MASK32, position & _MASK32, (position >> 32) & _MASK32


def random_words(seed: Tensor, position: Tensor, stream: int, count: int) -> Tensor:
    """[N, count] int64: the 32-bit draws for indices ``0 .. count - 1`` of each row's
    ``(seed[i], position[i], stream)`` (see the module doc for the layout)."""
    k0, k1, p_lo, p_hi = _key_and_position(seed, position)
    groups = torch.arange((count + 3) // 4, dtype=torch.int64, device=seed.device)[None, :]
    words = philox4x32(groups, p_lo, p_hi, torch.full_like(p_lo, int(stream)), k0, k1)
    return torch.stack(words, -1).reshape(seed.shape[0], -1)[:, :count]


def words_to_uniform(words: Tensor) -> Tensor:
    """float32 uniforms in (0, 1) from 32-bit words (int64 tensor): the odd multiples of
    2**-24 (Random123's u01fixedpt open-open, 24 bits), exact in float32."""
    return (words >> 9).to(torch.float32) * 2.0**-23 + 2.0**-24


def uniforms(seed: Tensor, position: Tensor, stream: int, count: int) -> Tensor:
    """[N, count] float32 uniforms in (0, 1) of each row's (seed, position, stream)."""
    return words_to_uniform(random_words(seed, position, stream, count))


def uniform(seed: Tensor, position: Tensor, stream: int) -> Tensor:
    """[N] float32: index 0 of each row's stream (the acceptance uniform)."""
    return uniforms(seed, position, stream, 1)[:, 0]


def gumbel(seed: Tensor, position: Tensor, stream: int, count: int) -> Tensor:
    """[N, count] float32 standard Gumbel noise ``-log(-log(u))`` of the uniforms above."""
    return -torch.log(-torch.log(uniforms(seed, position, stream, count)))


if triton is not None:
    _ROUNDS = tl.constexpr(ROUNDS)

    @triton.jit
    def tl_uniforms(seed, position, stream, base, BLOCK: tl.constexpr):
        """[BLOCK] float32 uniforms of vocabulary indices ``base .. base + BLOCK - 1``
        (``base`` a multiple of 4) of one row's (seed, position, stream): the torch
        :func:`uniforms`, bit for bit. The rounds are :func:`philox4x32`'s in uint32 (as
        ``tl.philox``, written out: one call fewer per tile under the interpreter); the
        four words of each counter are interleaved so that word j of counter c serves
        index 4c + j."""
        c0 = (base // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)
        zero = c0 * 0
        c1 = zero + (position & 0xFFFFFFFF).to(tl.uint32)
        c2 = zero + ((position >> 32) & 0xFFFFFFFF).to(tl.uint32)
        c3 = zero + stream.to(tl.uint32)
        k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
        k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        for _ in tl.static_range(_ROUNDS):
            a0, a2 = c0, c2
            c0 = tl.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
            c2 = tl.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
            c1 = a2 * 0xCD9E8D57
            c3 = a0 * 0xD2511F53
            k0 = k0 + 0x9E3779B9
            k1 = k1 + 0xBB67AE85
        words = tl.reshape(tl.join(tl.join(c0, c2), tl.join(c1, c3)), [BLOCK])
        return (words >> 9).to(tl.float32) * 1.1920928955078125e-07 + 5.9604644775390625e-08

    @triton.jit
    def tl_gumbel(seed, position, stream, base, BLOCK: tl.constexpr):
        """[BLOCK] float32 Gumbel noise ``-log(-log(u))`` of :func:`tl_uniforms`' uniforms."""
        u = tl_uniforms(seed, position, stream, base, BLOCK)
        return -tl.log(-tl.log(u))
