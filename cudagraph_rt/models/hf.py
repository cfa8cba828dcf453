"""transformers decoder-only causal LMs on a cell KV pool: one packed step of many sequences.

:class:`HFDecoder` wraps a ``*ForCausalLM`` (Llama, Qwen2, Qwen3, Mistral and anything
built the same way) and gives it the toy decoder's surfaces (``inputs``, ``step``,
``verify_step``, ``reference``, ``cell_for``, ...), so every tool and the sweep harness take
either. It plugs in through transformers' own extension points only, never by patching
model source:

* an attention function registered with ``AttentionInterface.register`` (name
  :data:`ATTENTION`). It is selected for the duration of a step only (the config's
  attention implementation is switched around the call and restored), so ``reference``,
  ``generate`` and anything else the user runs see the model exactly as it was. The step
  passes its per-step state through the model call's keyword arguments, which the model
  forwards to every attention call; the function reads ``module.layer_idx``, writes the
  rows' K/V (after RoPE, which the model applied from ``position_ids``) into the pool by
  cell index and attends over the whole pool under an explicit mask;
* that mask is built on the device from the cells' owners and positions and passed as a
  4-D ``attention_mask``, which transformers' masking code returns as is (so none of it
  runs, and nothing syncs with the host). Sliding-window layers (Mistral, Qwen2/3 with
  ``layer_types``) get the window applied to the same mask inside the function.

transformers' own ``StaticCache`` is not used: it advances a device counter on every call,
so warm-up runs, captures and padding rows would shift it.

The cell pool is the toy's: cell ``seq * max_len + pos`` for ``max_seqs`` sequences, plus
one scratch cell (the last) that padding rows write and only they see.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InputError, expected
from .cells import ROW_INPUTS as _INPUTS, CellPoolModel
from .accept import greedy_accept

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

    ``vocab``/``hidden``/``layers`` come from the transformers config; ``max_seqs`` x
    ``max_len`` cells form the pool; ``family``/``size`` name how it was built ("custom"
    for a model passed in)."""

    vocab: int
    hidden: int
    layers: int
    max_seqs: int
    max_len: int
    dtype: torch.dtype
    family: str = "custom"
    size: str = "custom"


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
          max_seqs: int | None = None, max_len: int | None = None, path: str | None = None) -> HFDecoder:
    """An :class:`HFDecoder` for the CLI: random weights from ``hf_config(family, size)``
    (seeded), or ``from_pretrained(path)`` of a local directory (never a download).
    Defaults: tiny fp32 with 8 x 128 cells; 1b bf16 with 16 x 256 cells."""
    dtype = dtype or (torch.float32 if size == "tiny" else torch.bfloat16)
    dev = _device(device)
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
    defaults = (8, 128) if size == "tiny" else (16, 256)
    return HFDecoder(model, max_seqs=max_seqs or defaults[0], max_len=max_len or defaults[1],
                     family=family, size=size if path is None else "local")


def _device(device) -> torch.device:
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:  # "cuda" != "cuda:0" in the input checks
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


# ------------------------------------------------------------------------------ attention
class _CellStep:
    """The state one step hands every attention call (through the model's kwargs): the
    pool, the rows' cells and positions, and the mask per window size (built once, on the
    device). Lives for one model call."""

    def __init__(self, pool: HFDecoder, cells: Tensor, positions: Tensor, visible: Tensor):
        self.pool, self.cells, self.positions = pool, cells, positions
        self._masks = {None: visible}

    def mask(self, window: int | None) -> Tensor:
        """[N, cells] bool. A sliding layer also hides cells ``window`` or more positions back
        (transformers' rule: key visible iff ``q_pos - k_pos < window``)."""
        if window is not None and window >= self.pool.config.max_len:
            window = None  # no position in the pool is that far back
        if window not in self._masks:
            near = self.pool.cell_pos[None, :] > self.positions[:, None] - window
            self._masks[window] = self._masks[None] & near
        return self._masks[window]


def cell_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling: float | None = None,
                   dropout: float = 0.0, cgrt_cells: _CellStep | None = None, sliding_window: int | None = None,
                   **kwargs):
    """The registered attention function (``ATTENTION``): q [1, heads, N, d], k/v
    [1, kv_heads, N, d] after RoPE. Writes k/v into layer ``module.layer_idx`` of the pool
    at the step's cells, then attends over every cell of that layer under the step's mask.
    Returns ``([1, N, heads, d], None)`` like transformers' sdpa function.

    Grouped-query attention without copying K/V: the query heads that share a KV head are
    stacked along the query axis, so each KV head is read once."""
    if cgrt_cells is None:
        raise RuntimeError(f"attention {ATTENTION!r} runs only inside HFDecoder.step (no cell state was passed)")
    st, layer = cgrt_cells, module.layer_idx
    k_pool, v_pool = st.pool.k_cache[layer], st.pool.v_cache[layer]  # [kv_heads, cells, d]
    k_pool.index_copy_(1, st.cells, key[0].to(k_pool.dtype))  # duplicate cells only from padding rows
    v_pool.index_copy_(1, st.cells, value[0].to(v_pool.dtype))
    _, heads, n, d = query.shape
    kvh = k_pool.shape[0]
    g = heads // kvh
    mask = st.mask(sliding_window)  # [N, cells]
    q = query.reshape(kvh, g * n, d)  # head h = kv * g + j: rows (j, i) of kv head kv
    m = mask[None].expand(g, n, mask.shape[1]).reshape(g * n, mask.shape[1])
    out = split_pool_attention(q, k_pool, v_pool, m, d ** -0.5 if scaling is None else scaling)
    return out.reshape(1, heads, n, d).transpose(1, 2), None


CELL_CHUNK = 64  # cells per chunk of the split attention (the pool is allocated in whole chunks)


def split_pool_attention(q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale over the visible cells) v: q [kvh, R, d], k/v [kvh, cells, d]
    with ``cells`` a multiple of ``CELL_CHUNK``, visible [R, cells] -> [kvh, R, d].

    Split over chunks of cells (flash-decoding's shape): a step has few query rows and only
    ``kvh`` heads of them, so a kernel parallel over (batch x heads) leaves most of the GPU
    idle while it walks the whole pool (every SDPA backend did, about 125 us a layer for a
    4,097-cell pool on the H200, BENCHMARKS.md). Here each (head, chunk) is its own small
    matmul, the softmax runs over all cells at once in fp32, and the chunks' outputs are
    summed. Scores and probabilities are rounded to the pool's dtype for the matmuls, as a
    flash kernel does for its second one."""
    kvh, R, d = q.shape
    C = k.shape[1] // CELL_CHUNK
    kc = k.view(kvh, C, CELL_CHUNK, d)
    s = torch.matmul(q.unsqueeze(1), kc.transpose(-1, -2))  # [kvh, C, R, CHUNK]
    s = s.float().transpose(1, 2).reshape(kvh, R, C * CELL_CHUNK) * scale
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1).to(v.dtype)
    p = p.view(kvh, R, C, CELL_CHUNK).transpose(1, 2)  # [kvh, C, R, CHUNK]
    return torch.matmul(p, v.view(kvh, C, CELL_CHUNK, d)).sum(1, dtype=torch.float32).to(q.dtype)


_REGISTERED = False


def _register() -> None:
    global _REGISTERED
    if not _REGISTERED:
        _transformers().AttentionInterface.register(ATTENTION, cell_attention)
        _REGISTERED = True


# ------------------------------------------------------------------------------ the decoder
class HFDecoder(CellPoolModel):
    """A transformers causal LM stepped on a multi-sequence cell KV pool.

    Lifetime: the wrapped ``model`` is shared, not copied (put it in eval mode, on one
    device, in its dtype before wrapping); the KV pool (``k_cache``, ``v_cache`` [layers,
    kv_heads, cells + 1 rounded up to whole CELL_CHUNKs, head_dim], ``cell_owner``, ``cell_pos``;
    the cells past the scratch cell are never owned) lives as long as the object
    and is MUTATED BY EVERY :meth:`step` / :meth:`verify_step`, padding rows included (they
    write only :attr:`scratch_cell`). :meth:`reset_cache` frees every cell. Outputs are fresh
    tensors (graph-owned memory when replayed from a CUDA graph).

    Visibility (as the toy's): a row attends to the cells whose owner equals its ``seq_id``
    and whose position is ``<=`` its own (and, on a sliding layer, within the window), after
    every row of the step has written its cell in that layer. Cells of rejected positions
    stay invisible until overwritten, so a sequence id may be reused without freeing as
    long as each sequence feeds its positions from 0 in order.

    Failure modes: the step checks names, shapes, dtypes and devices on the host
    (:class:`InputError`); values are NOT checked (that would need a host sync inside a
    captured graph): out-of-range tokens, positions or cells fail on the device. A model
    whose attention modules lack ``layer_idx``, or that does not forward keyword arguments
    to its attention function, is refused at construction (InputError naming it).
    """

    def __init__(self, model, *, max_seqs: int = 8, max_len: int = 128, family: str = "custom",
                 size: str = "custom"):
        _register()
        for name, v in (("max_seqs", max_seqs), ("max_len", max_len)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(expected(name, "a positive int", repr(v)))
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(model, "get_output_embeddings") or not hasattr(model, "get_decoder"):
            raise InputError(expected("model", "a transformers *ForCausalLM", type(model).__name__))
        if max_len > getattr(cfg, "max_position_embeddings", max_len):
            raise InputError(expected("max_len", f"<= max_position_embeddings {cfg.max_position_embeddings}", max_len))
        self.model = model.eval()
        self.decoder, self.head = model.get_decoder(), model.get_output_embeddings()
        self._decoder = self.decoder  # what step() calls: see compile_decoder
        p = next(model.parameters())
        self.device, dtype = _device(p.device), p.dtype
        attn = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "head_dim")]
        if not attn:
            raise InputError(expected("model", "attention modules with layer_idx and head_dim",
                                      type(model).__name__))
        layers = cfg.num_hidden_layers
        kvh = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = attn[0].head_dim
        self.config = HFSpec(cfg.vocab_size, cfg.hidden_size, layers, max_seqs, max_len, dtype, family, size)
        self.num_cells = max_seqs * max_len
        self.scratch_cell = self.num_cells
        # Whole chunks of cells for the split attention (the cells past the scratch cell are
        # never owned, so never visible).
        shape = (layers, kvh, -(-(self.num_cells + 1) // CELL_CHUNK) * CELL_CHUNK, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.cell_owner = torch.empty(shape[2], dtype=torch.int64, device=self.device)
        self.cell_pos = torch.empty(shape[2], dtype=torch.int64, device=self.device)
        self.reset_cache()

    # ----------------------------------------------------------------- public surface
    @property
    def hidden_width(self) -> int:
        """Width of the "hidden" output: the model's hidden size (its last, normed layer)."""
        return self.config.hidden

    def step(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """One packed step of N rows from any sequences (capturable: no host sync, static
        shapes). Returns ``tokens`` [N] int64 (greedy argmax of the model's logits where
        ``want == 1``, else -1) and ``hidden`` [N, hidden] (the model's last hidden state,
        after its final norm: what the LM head reads). Logits of all N rows, masked."""
        t, pos, seq, cells, want = self._take(inputs, _INPUTS)
        h = self.forward_cells(t, pos, seq, cells)
        greedy = self.head(h).argmax(-1).masked_fill(want != 1, -1)
        return {"tokens": greedy, "hidden": h}

    def forward_cells(self, tokens: Tensor, positions: Tensor, seq_ids: Tensor, cells: Tensor) -> Tensor:
        """The model's decoder over N packed rows on the pool: [N, hidden]. Owners and
        positions are written first, so every layer's mask sees all rows of this step."""
        self.cell_owner.index_copy_(0, cells, seq_ids)
        self.cell_pos.index_copy_(0, cells, positions)
        visible = (self.cell_owner[None, :] == seq_ids[:, None]) & (self.cell_pos[None, :] <= positions[:, None])
        state = _CellStep(self, cells, positions, visible)
        with self._cell_attention():
            out = self._decoder(input_ids=tokens[None], position_ids=positions[None],
                                attention_mask=visible[None, None], use_cache=False, cgrt_cells=state)
        return out.last_hidden_state[0]

    def compile_decoder(self, mode: str | None = "default", **kwargs) -> None:
        """Run the decoder of :meth:`step` through ``torch.compile(mode=mode, **kwargs)`` from
        now on (``mode=None``: back to eager). Inductor fuses the kernels; the runtime still
        owns the graphs, so use a mode without CUDA graphs ("default" or
        "max-autotune-no-cudagraphs"). Compilation happens at the first step of each new
        width (the runtime's warm-up), not here. :meth:`reference` stays eager."""
        self._decoder = self.decoder if mode is None else torch.compile(self.decoder, mode=mode, **kwargs)

    def verify_step(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """:meth:`step` plus greedy speculative acceptance on the device (no host sync), by
        :func:`~cudagraph_rt.models.accept.greedy_accept`, exactly as the toy's
        ``verify_step`` (see it for ``next_tokens`` and the outputs ``committed``,
        ``accept_rows``, ``accept_count``)."""
        (nxt,) = self._take(inputs, ("next_tokens",))
        out = self.step(inputs)
        return {**out, **greedy_accept(out["tokens"], nxt, inputs["positions"], inputs["seq_ids"], inputs["want"])}

    # ----------------------------------------------------------------- eager reference
    @torch.no_grad()
    def reference_logits(self, tokens: list[int]) -> tuple[Tensor, Tensor]:
        """Logits [L, vocab] (fp32 copies of the model's) and last hidden [L, hidden] of one
        sequence at positions 0..L-1: the model's own forward (its own attention and mask),
        no cache, no padding. Reads and writes no cell. InputError for an empty or too long
        sequence or a bad token."""
        n, vocab = len(tokens), self.config.vocab
        if not 1 <= n <= self.config.max_len:
            raise InputError(expected("tokens", f"1..{self.config.max_len} tokens", n))
        if any(not 0 <= int(t) < vocab for t in tokens):
            raise InputError(expected("tokens", f"ids in [0, {vocab})", list(tokens)))
        ids = torch.tensor([[int(v) for v in tokens]], dtype=torch.int64, device=self.device)
        h = self.decoder(input_ids=ids, use_cache=False).last_hidden_state[0]
        return self.head(h).float(), h

    def reference(self, tokens: list[int]) -> tuple[Tensor, Tensor]:
        """``(greedy [L] int64, hidden [L, hidden])``: greedy[p] is the next token after
        tokens[:p+1], hidden[p] the last hidden row at p."""
        logits, hidden = self.reference_logits(tokens)
        return logits.argmax(-1), hidden

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
        if len(prompt) + max(n, 1) - 1 > self.config.max_len:
            raise InputError(expected("prompt + n", f"<= {self.config.max_len + 1} tokens", len(prompt) + n))
        if n < 1:
            return []
        ids = torch.tensor([[int(t) for t in prompt]], dtype=torch.int64, device=self.device)
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
