"""The embedded toy decoder: random weights with wide greedy margins, the paged KV pool,
batched padded steps that can be captured in a CUDA graph, and an eager reference.

How the weights are built (in a "design basis", then turned by one random orthogonal
matrix ``Q`` so every weight is dense and reduction order matters as in a real model):

* A token ``t`` is a pair ``(a, b) = (t // B, t % B)`` with ``vocab = A * B``.
* The residual stream is ``[a-code (A) | b-code (B) | ctx (B) | scratch (rest)]``.
  The embedding writes ``s * onehot(a)`` and ``s * onehot(b)`` plus a small random scratch
  vector; a random position table writes scratch only.
* Head 0 of every layer is a previous-token head: a relative-position bias
  ``-16 * |pos_q - 1 - pos_k|`` (the cell attention's ALiBi-shaped bias with slope 16 and
  ``bias_shift = 1``; the rest is causality within the row's own sequence)
  puts all but ~1e-7 of its weight on position ``p - 1`` (on itself at ``p = 0``); its value
  copies the b-code into ctx. Other heads attend softly by content and, like the MLPs,
  write scratch only, so every hidden row depends on every visible cell.
* The head reads ``a`` and ``ctx`` through two random permutations, so the greedy next
  token is ``pi_a(a(t_p)) * B + pi_b(b(t_{p-1}))`` (:meth:`ToyDecoder.design_next`): the
  winner matches both one-hots (logit ``2m``), every other token at most one (``m``), so the
  top1-top2 gap is about ``m = 8`` logits whatever the dtype, batching or padding, while
  the token still depends on context through attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checks import as_int, resolve_device
from ..errors import InputError, expected
from . import attention_op
from .cells import ROW_INPUTS as _INPUTS, CellPoolModel, check_attention
from .choose import TokenChoice
from .pool import DEFAULT_BLOCK_SIZE, KVPool, default_cells

_EMB = 4.0  # scale of the one-hot token codes
_OUT = 2.0  # readout gain: designed margin _EMB * _OUT = 8 logits
_SLOPE = 16.0  # previous-token head: each neighbour gets exp(-16) ~ 1e-7 of the weight
_NOISE = 0.1  # std of the random part of each logit (breaks ties below the top two)


@dataclass(frozen=True)
class ToyConfig:
    """Sizes of a :class:`ToyDecoder`. Immutable; the defaults are :meth:`tiny`.

    ``max_len`` is the per-sequence position limit (the position table's size), not a
    reservation: the KV pool has ``cells`` cells (default ``max_seqs * max_len``, each
    sequence's share rounded up to whole blocks, so every sequence can reach ``max_len``
    at once) in blocks of ``block_size``, taken as sequences grow. ``vocab`` must factor as ``A * B`` with ``A >= B >= 2`` (A the smallest divisor
    >= sqrt(vocab)); ``hidden`` needs room for ``A + 2B`` code dimensions plus 8 scratch
    dimensions and ``hidden // heads >= B``; ``taps`` are layer indices whose output hidden
    states the step returns, in that order. Raises :class:`InputError` when violated.
    """

    vocab: int = 128
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    taps: tuple[int, ...] = (0, 1)
    max_seqs: int = 8
    max_len: int = 128
    dtype: torch.dtype = torch.float32
    seed: int = 0
    cells: int | None = None  # None: max_seqs * max_len (whole blocks per sequence); resolved on construction
    block_size: int = DEFAULT_BLOCK_SIZE

    @classmethod
    def tiny(cls, **overrides) -> ToyConfig:
        """CPU default: fp32, 64 hidden, 2 layers, vocab 128, 8 sequences x 128 positions."""
        return cls(**overrides)

    @classmethod
    def bench(cls, **overrides) -> ToyConfig:
        """GPU benchmark: bf16, 1024 hidden, 6 layers, vocab 8192, 8 sequences x 128 positions
        on a KV pool of serving size: 262,144 cells (64 x 4096), 24 KiB a cell (6 layers x
        K and V x 8 heads x 128 dims x 2 bytes), 6.0 GiB in all. A row reads only its own
        sequence's cells, so the step costs what it did on a pool of 1,024 cells."""
        base = dict(vocab=8192, hidden=1024, layers=6, heads=8, taps=(1, 3, 5),
                    max_seqs=8, max_len=128, dtype=torch.bfloat16, cells=64 * 4096)
        return cls(**{**base, **overrides})

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "layers", "heads", "max_seqs", "max_len", "seed", "block_size", "cells"):
            if name == "cells" and self.cells is None:
                object.__setattr__(self, "cells", default_cells(self.max_seqs, self.max_len, self.block_size))
            lo, hi = (0, 2**64 - 1) if name == "seed" else (1, None)  # a seed is a torch.Generator's
            v = as_int(f"ToyConfig.{name}", getattr(self, name), lo, hi)
            object.__setattr__(self, name, v)  # numpy integers kept as the plain int
        taps = self.taps if isinstance(self.taps, (tuple, list)) else None
        if not taps:
            raise InputError(expected("ToyConfig.taps", f"layer indices in [0, {self.layers})", repr(self.taps)))
        object.__setattr__(self, "taps", tuple(as_int("ToyConfig.taps", t, 0, self.layers - 1) for t in taps))
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise InputError(expected("ToyConfig.dtype", "float32, float16 or bfloat16", self.dtype))
        a, b = self.factors
        if b < 2:
            raise InputError(expected("ToyConfig.vocab", "a product A*B with A >= B >= 2", self.vocab))
        if self.hidden % self.heads or self.hidden // self.heads < b:
            raise InputError(expected("ToyConfig.heads", f"a divisor of hidden with head dim >= {b}", self.heads))
        if self.hidden < a + 2 * b + 8:
            raise InputError(expected("ToyConfig.hidden", f">= {a + 2 * b + 8} for vocab {self.vocab}", self.hidden))

    @property
    def factors(self) -> tuple[int, int]:
        """``(A, B)``: token ``t`` is ``(t // B, t % B)``."""
        a = next(d for d in range(math.isqrt(self.vocab - 1) + 1, self.vocab + 1) if self.vocab % d == 0)
        return a, self.vocab // a


def _design_weights(cfg: ToyConfig) -> tuple[dict[str, Tensor], Tensor, list[int], list[int]]:
    """Weights in the design basis (fp32, CPU, from ``cfg.seed`` only), the rotation Q, and
    the permutations (pi_a, pi_b) the readout implements."""
    g = torch.Generator().manual_seed(cfg.seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g)

    (A, B), H, L, nh, V = cfg.factors, cfg.hidden, cfg.layers, cfg.heads, cfg.vocab
    d, Fd, S, c0 = H // nh, 4 * H, H - A - 2 * B, A + B  # c0: first ctx dim
    zn = math.sqrt(3 * _EMB**2 + 2 + 2 * L)  # rough |residual|: codes, ctx, O(1) scratch per block
    tok = torch.arange(V)
    emb = torch.zeros(V, H)
    emb[tok, tok // B] = _EMB
    emb[tok, A + tok % B] = _EMB
    emb[:, c0 + B:] = randn(V, S) / math.sqrt(S)
    pos = torch.zeros(cfg.max_len, H)
    pos[:, c0 + B:] = randn(cfg.max_len, S) / math.sqrt(S)
    # q.k / sqrt(d) has std ~1.4: soft, content-dependent attention. Head 0 is steered by
    # the position bias alone (its q.k is 100x smaller, far below the slope of 16).
    wq, wk = randn(L, H, H) * (1.2 / zn), randn(L, H, H) * (1.2 / zn)
    wq[:, :, :d] *= 0.1
    wk[:, :, :d] *= 0.1
    wv = randn(L, H, H) / (zn * math.sqrt(d))  # |value of a head| ~ 1
    wv[:, :, :d] = 0
    wv[:, A + torch.arange(B), torch.arange(B)] = 1.0  # head 0 copies the b-code...
    # ...and a strong read of scratch (position and token features), so a stolen or
    # missing predecessor cell changes every hidden row that reads it by O(1).
    wv[:, c0 + B:, B:d] = randn(L, S, d - B) * (1.5 / math.sqrt((2 + L) * (d - B)))
    wo = torch.zeros(L, H, H)
    wo[:, :, c0 + B:] = randn(L, H, S) / math.sqrt(S * nh)  # heads write scratch only
    wo[:, :d, c0 + B:] *= math.sqrt(nh)
    wo[:, :B, :] = 0
    wo[:, torch.arange(B), c0 + torch.arange(B)] = 1.0 / L  # b-code into ctx, 1/L per layer
    w1 = randn(L, H, Fd) / zn
    w2 = torch.zeros(L, Fd, H)
    w2[:, :, c0 + B:] = randn(L, Fd, S) * math.sqrt(2.0 / (Fd * S))  # MLP writes scratch only
    pi_a, pi_b = torch.randperm(A, generator=g), torch.randperm(B, generator=g)
    wout = randn(H, V) * (_NOISE / zn)
    wout[torch.argsort(pi_a)[tok // B], tok] += _OUT  # logit(a', b') reads a = pi_a^-1(a')
    wout[c0 + torch.argsort(pi_b)[tok % B], tok] += _OUT  # and ctx b = pi_b^-1(b')
    q, r = torch.linalg.qr(torch.randn(H, H, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))
    w = dict(emb=emb, pos=pos, wqkv=torch.cat([wq, wk, wv], -1), wo=wo, w1=w1, w2=w2, wout=wout)
    return w, q, pi_a.tolist(), pi_b.tolist()


def _argmax(logits: Tensor) -> Tensor:
    return logits.argmax(-1)


class ToyDecoder(CellPoolModel):
    """A small decoder that every command can run with no weights to fetch.

    Lifetime: weights are fixed at construction (from ``config.seed``); the KV pool
    (:attr:`pool`, a :class:`~cudagraph_rt.models.pool.KVPool` of ``config.cells`` cells
    in blocks of ``config.block_size``) lives as long as the object and is MUTATED BY EVERY
    :meth:`step` / :meth:`verify_step`, including padding rows (which write only
    :attr:`scratch_cell`). :meth:`reset_cache` frees every block. Outputs are fresh tensors
    (graph-owned memory when the step is replayed from a CUDA graph).

    Cells: a row's ``cells`` entry is what :meth:`cell_for` / :meth:`cell_range` handed out
    for its (sequence, position), which takes a block when the sequence first reaches it.
    A row attends to its own sequence's positions ``<=`` its own through the pool's block
    table, after every row of the step has written its cell in that layer; its work
    follows the table's width (``max_len`` positions), never the pool's size. Cells beyond
    a sequence's current position (rejected drafts) are read by no row until rewritten, so
    a sequence id may be reused without freeing as long as each sequence feeds its
    positions from 0 in order (:meth:`free_seq` gives the blocks back).

    Failure modes: the step checks names, shapes, dtypes and devices on the host and
    raises :class:`InputError`; values are NOT checked (that would need a host sync inside
    a captured graph): out-of-range tokens or cells fail on the device (an index error on
    the CPU, a device assert on CUDA), a row whose cell is not the one its (sequence,
    position) maps to silently corrupts attention, and a padding row pointing at a live
    cell overwrites it.

    ``attention="eager-piece"``: the pool's attention marked ``cudagraph_rt.eager`` (a
    runtime with ``pieces=True`` runs it between graphs; same kernels, same results).
    """

    def __init__(self, config: ToyConfig | None = None, device: str | torch.device | None = None, *,
                 attention: str = "cells"):
        self.attention = check_attention(attention, ("cells", "eager-piece"))
        if config is not None and not isinstance(config, ToyConfig):
            raise InputError(expected("config", "a ToyConfig or None", type(config).__name__))
        self.config = cfg = config or ToyConfig.tiny()
        self.device = resolve_device(device)
        w, q, self._pi_a, self._pi_b = _design_weights(cfg)
        # Rotate on the target device (fast there); fp64 on CUDA so TF32 settings cannot
        # change the weights. Weights that read the residual get Q @ W, weights that write
        # it get W @ Q^T, so the design holds in any basis.
        exact = torch.float64 if self.device.type == "cuda" else torch.float32
        q = q.to(self.device, exact)
        reads, writes = ("wqkv", "w1", "wout"), ("emb", "pos", "wo", "w2")
        for k, v in w.items():
            v = v.to(self.device, exact)
            v = q @ v if k in reads else v @ q.T if k in writes else v
            setattr(self, k, v.to(cfg.dtype).contiguous())
        self.slopes = torch.zeros(cfg.heads, device=self.device)
        self.slopes[0] = _SLOPE
        self.head_dim = cfg.hidden // cfg.heads
        self.local_heads = cfg.heads
        self._shard()
        self.pool = KVPool(layers=cfg.layers, kv_heads=self.local_heads, head_dim=self.head_dim, dtype=cfg.dtype,
                           device=self.device, cells=cfg.cells, max_seqs=cfg.max_seqs, max_seq_len=cfg.max_len,
                           block_size=cfg.block_size)
        self.pool_id = attention_op.pool_id(self.pool)

    def _shard(self) -> None:
        """Keep this process's part of the weights (all of them here; see ``tp.py``)."""

    # ----------------------------------------------------------------- public surface
    @property
    def hidden_width(self) -> int:
        """Width of the "hidden" output: ``len(taps) * hidden``."""
        return len(self.config.taps) * self.config.hidden

    @property
    def design_margin(self) -> float:
        """Nominal top1-top2 logit gap the weights are built for (measure: :meth:`logit_margin`)."""
        return _EMB * _OUT

    def step(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """One batched step of N rows (N = any width; capturable: no host sync, static shapes).

        Returns ``tokens`` [N] int64 (where ``want == 1``: the greedy argmax, or with the
        sampling inputs (``inputs(sampling=True)``) the token drawn by ``kernels.sampling``;
        else -1) and ``hidden`` [N, len(taps) * hidden] (the tapped layers' outputs, model
        dtype). Logits are computed for all N rows (static shapes) and masked.
        """
        return self._step(inputs, verify=False)

    def _step(self, inputs: dict[str, Tensor], verify: bool) -> dict[str, Tensor]:
        t, pos, seq, cells, want = self._take(inputs, _INPUTS)
        choose = TokenChoice.of(inputs, pos, want, self.config.vocab, verify=verify)
        x, taps = self._embed(t, pos), []
        for layer in range(self.config.layers):
            q, k, v = self._qkv(x, layer)
            attn = self.attend(layer, q, k, v, seq, pos, cells, scale=self.head_dim**-0.5, slopes=self.slopes,
                               bias_shift=1)
            x = self._block_out(x, attn.reshape(x.shape[0], self.local_heads * self.head_dim), layer)
            taps.append(x)
        tokens = choose(x @ self.wout, greedy=_argmax)
        return {"tokens": tokens, "hidden": torch.cat([taps[i] for i in self.config.taps], -1)}

    # ----------------------------------------------------------------- eager reference
    @torch.no_grad()
    def reference_logits(self, tokens: list[int]) -> tuple[Tensor, Tensor]:
        """Logits [L, vocab] and tapped hidden [L, len(taps) * hidden] of one sequence at
        positions 0..L-1: full causal attention, no cache, no padding, no batching. Reads and
        writes no KV cell. :class:`InputError` for an empty/too long sequence or a bad token."""
        t = torch.tensor(self._reference_tokens(tokens), dtype=torch.int64, device=self.device)
        pos = torch.arange(t.shape[0], device=self.device)
        bias = self._bias(pos, pos, pos[None, :] <= pos[:, None])
        x, taps = self._embed(t, pos), []
        for layer in range(self.config.layers):
            x = self._block_out(x, self._attend(*self._qkv(x, layer), bias), layer)
            taps.append(x)
        return (x @ self.wout).float(), torch.cat([taps[i] for i in self.config.taps], -1)

    def greedy_generate(self, prompt: list[int], n: int) -> list[int]:
        """The ``n`` tokens plain greedy decoding appends to ``prompt`` (through :meth:`reference`)."""
        prompt, n = self._check_generate(prompt, n)
        seq = list(prompt)
        for _ in range(n):
            seq.append(int(self.reference(seq)[0][-1]))
        return seq[len(prompt):]

    def design_next(self, prev: int, token: int) -> int:
        """The rule the weights implement: greedy next after ``token`` whose predecessor is
        ``prev`` (pass ``prev = token`` at position 0)."""
        b = self.config.factors[1]
        return self._pi_a[token // b] * b + self._pi_b[prev % b]

    def logit_margin(self, contexts: int = 64, length: int | None = None, seed: int = 0) -> float:
        """Measured minimum top1-top2 logit gap over ``contexts`` random sequences of
        ``length`` tokens (default max_len), every position."""
        g = torch.Generator().manual_seed(seed)
        length = length or self.config.max_len
        gaps = []
        for _ in range(contexts):
            toks = torch.randint(0, self.config.vocab, (length,), generator=g).tolist()
            top2 = self.reference_logits(toks)[0].topk(2, -1).values
            gaps.append((top2[:, 0] - top2[:, 1]).min())
        return float(torch.stack(gaps).min())

    # ----------------------------------------------------------------- shared math
    def _embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        return self.emb.index_select(0, tokens) + self.pos.index_select(0, positions)

    def _bias(self, pos_q: Tensor, pos_k: Tensor, visible: Tensor) -> Tensor:
        """[heads, Nq, Nk] fp32 for the eager reference: previous-token bias per head, -inf
        where not visible (the step's attention applies the same bias in the pool's kernel)."""
        rel = (pos_q[:, None] - 1 - pos_k[None, :]).abs().float()
        return (rel[None] * -self.slopes[:, None, None]).masked_fill(~visible[None], float("-inf"))

    def _qkv(self, x: Tensor, layer: int) -> tuple[Tensor, Tensor, Tensor]:
        """Three [N, local_heads, head_dim] projections of x [N, hidden] (views; last dim contiguous)."""
        qkv = (x @ self.wqkv[layer]).view(x.shape[0], 3, self.local_heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        return q, k, v

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor) -> Tensor:
        """The eager reference's softmax attention in fp32 of one sequence: q/k/v
        [L, local_heads, head_dim], bias [local_heads, L, L]; returns [L, local_heads * head_dim]."""
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        scores = (q @ k.transpose(-1, -2)).float() * self.head_dim**-0.5 + bias
        out = torch.softmax(scores, -1).to(v.dtype) @ v
        return out.transpose(0, 1).reshape(q.shape[1], self.local_heads * self.head_dim)

    def _block_out(self, x: Tensor, attn: Tensor, layer: int) -> Tensor:
        x = x + attn @ self.wo[layer]
        return x + F.silu(x @ self.w1[layer]) @ self.w2[layer]
