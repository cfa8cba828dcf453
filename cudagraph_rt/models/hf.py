"""transformers decoder-only causal LMs on a cell KV pool: one packed step of many sequences.

:class:`HFDecoder` wraps a ``*ForCausalLM`` (Llama, Qwen2, Qwen3, Mistral and anything
built the same way) and gives it the toy decoder's surfaces (``inputs``, ``step``,
``verify_step``, ``reference``, ``cell_for``, ...), so every tool and the sweep harness take
either. It plugs in through transformers' own extension points, never by patching model
source: an attention function registered as :data:`ATTENTION`, selected for the duration
of a step only (``reference``, ``generate`` and the user's own calls see the model as it
was), which is one call of :meth:`KVPool.attend` per layer; no mask tensor is built and
transformers' ``StaticCache`` is not used (why: ARCHITECTURE.md, "transformers models
through their extension points").
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ..checks import resolve_device
from ..errors import InputError, expected
from . import attention_op, hf_rotary
from .cells import ROW_INPUTS as _INPUTS, CellPoolModel, check_attention, eager_pool_attend, greedy_tokens
from .choose import TokenChoice
from .compiled import CompiledRows
from .pool import DEFAULT_BLOCK_SIZE, KVPool, default_cells

log = logging.getLogger(__name__)

ATTENTION = "cgrt_cells"  # the registered attention function's name
FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
SIZES = ("tiny", "1b")
# A greedy token is "clear" when the reference's top-1 logit beats its top-2 by more than
# MARGIN_ULPS * eps(dtype) * max|logit| of that row (see HFDecoder.clear_positions).
# Measured on the CPU (packed, padded steps against the one-sequence forward): bf16 logits
# differ by up to ~1 ulp of max|logit| on the tiny configs and ~3.3 on the 1b shape (16
# layers), so two logits' errors stay below 8; fp32 by far less than 256.
MARGIN_ULPS = {torch.float32: 256.0, torch.float16: 8.0, torch.bfloat16: 8.0}


def _transformers():
    from ..extras import require

    return require("hf", "cudagraph_rt.models.hf")


# ------------------------------------------------------------------------------ configs
@dataclass(frozen=True)
class HFSpec:
    """What the tools read off a model (the toy's ``ToyConfig`` fields they use). Immutable.

    ``vocab``/``hidden``/``layers`` come from the transformers config; ``max_seqs`` sequence
    ids of up to ``max_len`` positions each (a limit, not a reservation) share a pool of
    ``cells`` cells in blocks of ``block_size``; ``family``/``size`` name how it was built
    ("custom" for a model passed in)."""

    vocab: int
    hidden: int
    layers: int
    max_seqs: int
    max_len: int
    dtype: torch.dtype
    family: str = "custom"
    size: str = "custom"
    cells: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE


def hf_config(family: str, size: str = "tiny", **overrides):
    """A transformers config of ``family`` (llama | qwen2 | qwen3 | mistral) and ``size``.

    ``tiny``: 2 layers, 64 hidden, 4 heads over 2 KV heads, vocab 512: a CPU forward takes
    about a millisecond. Mistral's tiny config has a sliding window of 16 and Qwen2's a
    sliding second layer, so the window path is exercised. ``1b``: Llama-3.2-1B's shape
    (16 layers, 2048 hidden, 32 heads over 8 KV heads, vocab 128256, tied embeddings, llama3
    RoPE) in the family's own config class. ``overrides`` go to the config constructor.
    InputError for an unknown family or size."""
    if family not in FAMILIES:
        raise InputError(expected("family", " | ".join(FAMILIES), repr(family)))
    if size not in SIZES:
        raise InputError(expected("size", " | ".join(SIZES), repr(size)))
    tf = _transformers()
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config,
           "mistral": tf.MistralConfig}[family]
    if size == "tiny":
        kw = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
        if family == "mistral":
            kw["sliding_window"] = 16
        if family == "qwen2":  # layer 1 slides, layer 0 is full: both paths in one model
            kw.update(use_sliding_window=True, sliding_window=16, max_window_layers=1)
    else:
        kw = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                  rms_norm_eps=1e-5, tie_word_embeddings=True,
                  rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=8192))
        if family in ("mistral", "qwen2", "qwen3"):
            kw["sliding_window"] = None
    kw.update(overrides)
    return cls(**kw)


def build(family: str, size: str = "tiny", *, dtype: torch.dtype | None = None, device=None, seed: int = 0,
          max_seqs: int | None = None, max_len: int | None = None, cells: int | None = None,
          path: str | None = None, fuse: bool = False, attention: str = "cells",
          rotary_in_pool: bool = True) -> HFDecoder:
    """An :class:`HFDecoder` for the CLI: random weights from ``hf_config(family, size)``
    (seeded), or ``from_pretrained(path)`` of a local directory (never a download).
    Defaults: tiny fp32 with 8 sequences x 128 positions; 1b bf16 with 16 x 256; the pool
    ``cells`` defaults to ``max_seqs * max_len`` (whole blocks per sequence). ``fuse``:
    merge q/k/v and gate/up first (:func:`~.fused.fuse_projections`, same weights).
    ``attention``, ``rotary_in_pool``: HFDecoder's."""
    dtype = dtype or (torch.float32 if size == "tiny" else torch.bfloat16)
    dev = resolve_device(device)
    log.info("building %s on %s", f"{path} (local checkpoint)" if path is not None else f"{family} {size}", dev)
    if path is not None:
        if not os.path.isdir(path):
            raise InputError(expected("path", "a local model directory", repr(path)))
        tf = _transformers()
        model = tf.AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).to(dev)
    else:
        tf = _transformers()
        cfg = hf_config(family, size)
        torch.manual_seed(seed)
        with torch.device(dev):  # initialise on the device: a 1b model inits in seconds there
            model = tf.AutoModelForCausalLM.from_config(cfg)
        model = model.to(dtype)
    if fuse:
        from .fused import fuse_projections
        fuse_projections(model)
    defaults = (8, 128) if size == "tiny" else (16, 256)
    return HFDecoder(model, max_seqs=max_seqs or defaults[0], max_len=max_len or defaults[1], cells=cells,
                     family=family, size=size if path is None else "local", attention=attention,
                     rotary_in_pool=rotary_in_pool)


# ------------------------------------------------------------------------------ attention
@dataclass(frozen=True)
class _CellStep:
    """What one step hands every attention call (through the model's kwargs): the pool's
    registry id, the rows' sequence ids, positions and cells ([N] int64 each) and how the
    model attends (``attend``, one of the functions below). Lives for one model call."""

    pool_id: int  # attention_op's registry id of the model's KVPool
    seq_ids: Tensor
    positions: Tensor
    cells: Tensor
    attend: object = None  # _captured_attend, _eager_piece_attend or _varlen_attend
    rotary: bool = False  # the attention modules hand the pool q and k unrotated (hf_rotary)


def _captured_attend(pool_id, layer, q, k, v, seq_ids, positions, cells, scale, window) -> Tensor:
    """``attention="cells"``: one opaque op under torch.compile, captured with the step."""
    return attention_op.attend(pool_id, layer, q, k, v, seq_ids, positions, cells, scale=scale, window=window)


def _eager_piece_attend(pool_id, layer, q, k, v, seq_ids, positions, cells, scale, window) -> Tensor:
    """``attention="eager-piece"``: the same attention, marked eager, into an ``out`` the
    piece before it allocates (written in place: nothing copied at a replay)."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    return eager_pool_attend(attention_op.pool_by_id(pool_id), layer, q, k, v, seq_ids, positions, cells, out,
                             scale, window, None, 0)


def _varlen_attend(pool_id, layer, q, k, v, seq_ids, positions, cells, scale, window) -> Tensor:
    """``attention="varlen"``: torch's varlen attention with per-step host ints (varlen.py)."""
    from .varlen import varlen_attend
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    return varlen_attend(pool_id, layer, q, k, v, seq_ids, positions, cells, out, scale, window)


_ATTEND = {"cells": _captured_attend, "eager-piece": _eager_piece_attend, "varlen": _varlen_attend}


def cell_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling: float | None = None,
                   dropout: float = 0.0, cgrt_cells: _CellStep | None = None, sliding_window: int | None = None,
                   **kwargs):
    """The registered attention function (``ATTENTION``): q [1, heads, N, d], k/v
    [1, kv_heads, N, d] after RoPE; :meth:`KVPool.attend` of layer ``module.layer_idx``
    (writes the rows' K/V, then each row attends over its own sequence up to its
    position, within ``sliding_window`` when the layer has one; grouped-query heads read
    their KV head in the kernel, nothing copied). ``attention_mask`` is None (no mask is
    built). Returns ``([1, N, heads, d], None)`` like transformers' sdpa function."""
    if cgrt_cells is None:
        raise RuntimeError(f"attention {ATTENTION!r} runs only inside HFDecoder.step (no cell state was passed)")
    st, d = cgrt_cells, query.shape[-1]
    out = (st.attend or _captured_attend)(st.pool_id, module.layer_idx, query[0].transpose(0, 1),
                                          key[0].transpose(0, 1), value[0].transpose(0, 1), st.seq_ids, st.positions,
                                          st.cells, d ** -0.5 if scaling is None else scaling, sliding_window)
    return out[None], None


_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        _transformers().AttentionInterface.register(ATTENTION, cell_attention)
        _REGISTERED = True


# ------------------------------------------------------------------------------ the decoder
class HFDecoder(CellPoolModel):
    """A transformers causal LM stepped on the paged KV pool.

    Lifetime: the wrapped ``model`` is shared, not copied (put it in eval mode, on one
    device, in its dtype before wrapping); the KV pool (:attr:`pool`, a
    :class:`~cudagraph_rt.models.pool.KVPool` of ``cells`` cells, default ``max_seqs *
    max_len`` in whole blocks per sequence, ``kv_heads`` x ``head_dim`` per layer) lives as
    long as the object and is MUTATED BY EVERY :meth:`step` / :meth:`verify_step`, padding
    rows included (they write only :attr:`scratch_cell`). :meth:`reset_cache` frees every
    block. Outputs are fresh tensors (graph-owned memory when replayed from a CUDA graph).

    Cells and visibility (as the toy's): a row's ``cells`` entry is what :meth:`cell_for`
    / :meth:`cell_range` handed out for its (sequence, position); a row attends to its own
    sequence's positions ``<=`` its own (and, on a sliding layer, within the window)
    through the block table, after every row of the step has written its cell in that
    layer. ``max_len`` bounds a sequence's positions; the pool's size bounds them all.

    Failure modes: the step checks names, shapes, dtypes and devices on the host
    (:class:`InputError`); values are NOT checked (that would need a host sync inside a
    captured graph): out-of-range tokens or cells fail on the device. A model whose
    attention modules lack ``layer_idx``, or that does not forward keyword arguments to
    its attention function, is refused at construction (InputError naming it).

    ``rotary_in_pool`` (default True): with ``attention="cells"``, the attention modules of
    the four families hand the pool q and k unrotated and the pool's K/V write rotates them
    (:mod:`.hf_rotary`: one kernel a layer instead of three; it sets an instance ``forward``
    on those modules of the shared model, which runs the class's own outside a step).

    ``attention``: ``"cells"`` (the pool's attention, captured with the step), ``"eager-piece"``
    (the same attention marked ``cudagraph_rt.eager``: a runtime with ``pieces=True`` runs it
    between graphs) or ``"varlen"`` (torch's ``varlen_attn`` with per-step host ints,
    ``models/varlen.py``: build the runtime with ``step_values=model.step_values`` and
    ``pieces=True``; a whole graph of it fails to capture, as it would freeze those ints).
    """

    def __init__(self, model, *, max_seqs: int = 8, max_len: int = 128, cells: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, family: str = "custom", size: str = "custom",
                 attention: str = "cells", rotary_in_pool: bool = True):
        _register()
        self.attention = check_attention(attention)
        if not isinstance(rotary_in_pool, bool):
            raise InputError(expected("rotary_in_pool", "a bool", repr(rotary_in_pool)))
        for name, v in (("max_seqs", max_seqs), ("max_len", max_len), ("block_size", block_size)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(expected(name, "a positive int", repr(v)))
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(model, "get_output_embeddings") or not hasattr(model, "get_decoder"):
            raise InputError(expected("model", "a transformers *ForCausalLM", type(model).__name__))
        if max_len > getattr(cfg, "max_position_embeddings", max_len):
            raise InputError(expected("max_len", f"<= max_position_embeddings {cfg.max_position_embeddings}", max_len))
        cells = default_cells(max_seqs, max_len, block_size) if cells is None else cells
        self.model = model.eval()
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        self._rows = self._step_rows  # what step() calls: see compile_decoder
        p = next(model.parameters())
        self.device, dtype = resolve_device(p.device), p.dtype
        attn = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "head_dim")]
        if not attn:
            raise InputError(expected("model", "attention modules with layer_idx and head_dim",
                                      type(model).__name__))
        layers = cfg.num_hidden_layers
        kvh = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = attn[0].head_dim
        self.pool = KVPool(layers=layers, kv_heads=kvh, head_dim=self.head_dim, dtype=dtype, device=self.device,
                           cells=cells, max_seqs=max_seqs, max_seq_len=max_len, block_size=block_size)
        self.pool_id = attention_op.pool_id(self.pool)  # what the attention op fetches the pool by
        self.rotary_in_pool = rotary_in_pool and hf_rotary.install(model) > 0
        self.config = HFSpec(cfg.vocab_size, cfg.hidden_size, layers, max_seqs, max_len, dtype, family, size,
                             cells, block_size)
        if attention == "varlen":
            from .varlen import varlen_plan
            window = getattr(cfg, "sliding_window", None)
            self.step_values = varlen_plan((None,) + ((window,) if isinstance(window, int) else ()))

    # ----------------------------------------------------------------- public surface
    @property
    def hidden_width(self) -> int:
        """Width of the "hidden" output: the model's hidden size (its last, normed layer)."""
        return self.config.hidden

    def step(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """One packed step of N rows from any sequences (capturable: no host sync, static
        shapes). Returns ``tokens`` [N] int64 (where ``want == 1`` the greedy argmax of the
        model's logits, or with the sampling inputs (``inputs(sampling=True)``) the token
        drawn by ``kernels.sampling``; else -1) and ``hidden`` [N, hidden] (the model's last
        hidden state, after its final norm: what the LM head reads). Logits of all N rows,
        masked."""
        return self._step(inputs, verify=False)

    def _step(self, inputs: dict[str, Tensor], verify: bool) -> dict[str, Tensor]:
        t, pos, seq, cells, want = self._take(inputs, _INPUTS)
        choose = TokenChoice.of(inputs, pos, want, self.config.vocab, verify=verify)
        with self._cell_attention():
            if choose.greedy:  # the greedy step as it always was (argmax inside the compiled rows)
                return self._rows(t, pos, seq, cells, want)
            out = self._rows(t, pos, seq, cells, want, True)
        # the sampler outside the compiled rows: its Triton kernels are launched as they are
        return {"tokens": choose(out["logits"]), "hidden": out["hidden"]}

    def _step_rows(self, tokens, positions, seq_ids, cells, want, logits: bool = False):
        """The rows' greedy tokens and hidden rows; ``logits``: the logits instead of the
        tokens (a sampling step samples them outside; a compile traces each case once)."""
        h = self.forward_cells(tokens, positions, seq_ids, cells)
        if logits:
            return {"logits": self.head(h), "hidden": h}
        greedy = greedy_tokens(self.head(h)).masked_fill(want != 1, -1)
        return {"tokens": greedy, "hidden": h}

    def forward_cells(self, tokens: Tensor, positions: Tensor, seq_ids: Tensor, cells: Tensor) -> Tensor:
        """The model's decoder over N packed rows on the pool: [N, hidden]. Runs inside
        :meth:`step`, which selects the cell attention around it (outside the compiled code)."""
        state = _CellStep(self.pool_id, seq_ids, positions, cells, _ATTEND[self.attention],
                          rotary=self.rotary_in_pool and self.attention == "cells")
        out = self.decoder(input_ids=tokens[None], position_ids=positions[None], use_cache=False,
                           cgrt_cells=state)
        return out.last_hidden_state[0]

    def compile_decoder(self, mode: str | None = "default", **kwargs):
        """Run the step's rows (decoder, head, argmax) through ``torch.compile`` from now on
        (``mode=None``: back to eager) and return the :class:`~.compiled.CompiledRows`
        (``graphs``, ``compile_s``). The row dimension is dynamic: one graph serves widths 2
        and up, one width 1; both compile at the first steps of those widths (the
        runtime's warm-up), not here. The runtime owns the CUDA graphs: "reduce-overhead"
        and "max-autotune" are refused with InputError (``kwargs``: CompiledRows's).
        :meth:`reference` and ``generate()`` stay eager."""
        self._rows = self._step_rows if mode is None else CompiledRows(self._step_rows, mode=mode, **kwargs)
        return None if mode is None else self._rows

    # ----------------------------------------------------------------- eager reference
    @torch.no_grad()
    def reference_logits(self, tokens: list[int]) -> tuple[Tensor, Tensor]:
        """Logits [L, vocab] (fp32 copies of the model's) and last hidden [L, hidden] of one
        sequence at positions 0..L-1: the model's own forward (its own attention and mask),
        no cache, no padding. Reads and writes no cell. InputError for an empty or too long
        sequence or a bad token."""
        ids = torch.tensor([self._reference_tokens(tokens)], dtype=torch.int64, device=self.device)
        h = self.decoder(input_ids=ids, use_cache=False).last_hidden_state[0]
        return self.head(h).float(), h

    def clear_positions(self, logits: Tensor) -> Tensor:
        """[L] bool: where the greedy token of ``logits`` [L, vocab] is CLEAR, i.e. its top-1
        logit beats the top-2 by more than ``MARGIN_ULPS[dtype] * eps(dtype) * max|logit|``
        of that row. Random weights leave many near-ties; a packed, padded step may round
        differently from the one-sequence reference, so a token that differs where the
        margin is not clear is no evidence of a bug (the tools count such rows apart).
        256 ulps for fp32; 8 for bf16/fp16, whose logits are rounded to the model dtype
        (an ulp of the largest logit) in both computations, and whose 16-layer error reaches
        about 3 such ulps per logit (see MARGIN_ULPS)."""
        eps = torch.finfo(self.config.dtype).eps
        top2 = logits.float().topk(2, -1).values
        bound = MARGIN_ULPS.get(self.config.dtype, 8.0) * eps * logits.float().abs().amax(-1)
        return (top2[:, 0] - top2[:, 1]) > bound

    @torch.no_grad()
    def greedy_generate(self, prompt: list[int], n: int) -> list[int]:
        """The ``n`` tokens ``model.generate(do_sample=False)`` appends to ``prompt`` (its own
        dynamic cache, batch 1, no padding, no stop at EOS)."""
        prompt, n = self._check_generate(prompt, n)
        if n < 1:
            return []
        ids = torch.tensor([list(prompt)], dtype=torch.int64, device=self.device)
        # eos_token_id=None: no stop at the config's EOS (min_new_tokens would instead forbid
        # EOS, which changes the greedy tokens where EOS wins).
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                  pad_token_id=0, eos_token_id=None)
        return out[0, len(prompt):].tolist()

    # ----------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def _cell_attention(self):
        """The cell attention for one call only; the model's own implementation after."""
        cfg = self.model.config
        before = cfg._attn_implementation
        cfg._attn_implementation = ATTENTION
        try:
            yield
        finally:
            cfg._attn_implementation = before


def parse_model(text: str) -> str | None:
    """``--model`` value -> family (``hf:llama`` -> "llama"), None for ``toy``; InputError
    otherwise."""
    if text == "toy":
        return None
    fam = text[3:] if text.startswith("hf:") else None
    if fam not in FAMILIES:
        raise InputError(expected("--model", "toy | " + " | ".join(f"hf:{f}" for f in FAMILIES), repr(text)))
    return fam


__all__ = ["ATTENTION", "FAMILIES", "SIZES", "HFDecoder", "HFSpec", "build", "cell_attention", "hf_config",
           "parse_model"]
