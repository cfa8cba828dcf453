"""What every model on the paged KV pool (``pool.py``) shares: its per-row inputs and their
pads, the checks of a step's rows and of a reference's tokens (devices and token lists
are checked by :mod:`cudagraph_rt.checks`), the pool's cells by (sequence, position), ``verify_step`` and ``reference``.

A model mixes in :class:`CellPoolModel` and provides ``config`` (``vocab``, ``max_seqs``,
``max_len``), ``device``, ``pool`` (a :class:`~cudagraph_rt.models.pool.KVPool`),
``step`` and ``reference_logits``; the surface the tools see is
:class:`~cudagraph_rt.models.protocol.Decoder`."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from ..checks import as_bool, as_int, token_ids
from ..errors import InputError, expected
from ..pieces import eager
from ..inputs.spec import InputSpec
from . import attention_op
from .accept import greedy_accept
from .choose import DRAFT_Q, draft_q_spec, sampling_specs
from .greedy import chunk_count, greedy_tokens  # noqa: F401 - re-exported: the models' greedy token
from .pool import KVPool

ROW_INPUTS = ("tokens", "positions", "seq_ids", "cells", "want")
# How a model's attention runs: "cells" the pool's attention inside the step (captured with
# it); "eager-piece" the same attention marked cudagraph_rt.eager (a width captured in
# pieces runs it between graphs); "varlen" (transformers models only) torch's varlen_attn,
# which needs per-step host ints (models/varlen.py): it runs only in pieces or eagerly.
ATTENTIONS = ("cells", "eager-piece", "varlen")


def check_attention(attention, allowed: tuple[str, ...] = ATTENTIONS) -> str:
    if attention not in allowed:
        raise InputError(expected("attention", " | ".join(allowed), repr(attention)))
    return attention


def _bind_pool_attend(pool, layer: int, q: Tensor, k: Tensor, v: Tensor, seq_ids: Tensor, positions: Tensor,
                      cells: Tensor, out: Tensor, scale: float, window, slopes, bias_shift: int):
    return pool.bind_attend(layer, q, k, v, seq_ids, positions, cells, scale=scale, out=out, window=window,
                            slopes=slopes, bias_shift=bias_shift)


@eager(bind=_bind_pool_attend)
def eager_pool_attend(pool, layer: int, q: Tensor, k: Tensor, v: Tensor, seq_ids: Tensor, positions: Tensor,
                      cells: Tensor, out: Tensor, scale: float, window, slopes, bias_shift: int) -> Tensor:
    """:meth:`KVPool.attend` as a call marked eager (``attention="eager-piece"``), written
    into ``out`` in place: a piecewise replay copies nothing after it, and replays it
    through :meth:`KVPool.bind_attend` (two kernel launches, nothing else on the host)."""
    return pool.attend(layer, q, k, v, seq_ids, positions, cells, scale=scale, window=window, slopes=slopes,
                       bias_shift=bias_shift, out=out)


def take_rows(inputs: dict[str, Tensor], names: tuple[str, ...], device: torch.device) -> list[Tensor]:
    """``inputs[name]`` for each name, checked: present, 1-D, one N (the rows of
    ``tokens``), int64, on ``device``. Reads no device value (capturable)."""
    if not isinstance(inputs, Mapping):
        raise InputError(expected("inputs", f"a dict of tensors {list(names)}", type(inputs).__name__))
    missing = [k for k in names if k not in inputs]
    if missing:
        raise InputError(expected("inputs", f"keys {list(names)}", f"missing {missing}"))
    tokens = inputs.get("tokens")
    n = tokens.shape[0] if isinstance(tokens, Tensor) and tokens.dim() == 1 else None
    rows = "" if n is None else f" of {n} rows"
    out = []
    for k in names:
        v = inputs[k]
        if not isinstance(v, Tensor) or v.dim() != 1 or (n is not None and v.shape[0] != n):
            got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise InputError(expected(k, f"a 1-D tensor{rows}", got))
        if v.dtype != torch.int64 or v.device != device:
            raise InputError(expected(k, f"int64 on {device}", f"{v.dtype} on {v.device}"))
        out.append(v)
    return out


class CellPoolModel:
    """Mixed into every model on a :class:`KVPool` (see the module docstring). The pool's
    cells are handed out by sequence and position (:meth:`cell_for`, :meth:`cell_range`),
    which takes blocks on demand; :meth:`free_seq` gives a retired sequence's blocks back."""

    pool: KVPool
    pool_id: int  # attention_op's registry id of ``pool`` (set with it): what a compiled step fetches it by
    attention: str = "cells"  # see ATTENTIONS
    step_values = None  # a runtime's step_values function this model needs (varlen attention), or None

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, seq_ids: Tensor, positions: Tensor, cells: Tensor,
               *, scale: float, window=None, slopes=None, bias_shift: int = 0) -> Tensor:
        """The pool's attention of one layer: inside the step (``"cells"``), or marked eager
        (``"eager-piece"``: same kernels, same result). Under torch.compile one opaque op
        (:mod:`.attention_op`), so inductor neither re-generates the kernel nor holds the pool."""
        if self.attention == "cells":
            if torch.compiler.is_compiling():
                return attention_op.attend(self.pool_id, layer, q, k, v, seq_ids, positions, cells, scale=scale,
                                           window=window, slopes=slopes, bias_shift=bias_shift)
            return self.pool.attend(layer, q, k, v, seq_ids, positions, cells, scale=scale, window=window,
                                    slopes=slopes, bias_shift=bias_shift)
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        return eager_pool_attend(self.pool, layer, q, k, v, seq_ids, positions, cells, out, scale, window, slopes,
                                 bias_shift)

    @property
    def scratch_cell(self) -> int:
        """The cell padding rows write (the pool's scratch block's first cell)."""
        return self.pool.scratch_cell

    def reset_cache(self) -> None:
        """Every block free, every table entry the scratch block, K/V zeroed (outside a graph)."""
        self.pool.reset()

    def cell_for(self, seq: int, pos: int) -> int:
        """The cell a row of ``seq`` at ``pos`` writes (:meth:`KVPool.cell_for`: a block is
        taken, or copied when shared, on the way); InputError outside the model's
        sequences and positions, CapacityError when no block is free."""
        return self.pool.cell_for(seq, pos)

    def cell_range(self, seq: int, pos0: int, n: int) -> list[int]:
        """The cells of positions ``pos0 .. pos0 + n - 1`` of ``seq`` (:meth:`KVPool.cell_range`:
        one check and one table update for all of them; not consecutive across blocks)."""
        return self.pool.cell_range(seq, pos0, n)

    def free_seq(self, seq: int) -> None:
        """Give ``seq``'s blocks back (:meth:`KVPool.free`); its next sequence starts empty."""
        self.pool.free(seq)

    def fork_seq(self, src: int, dst: int, upto: int) -> None:
        """``dst`` continues ``src``'s first ``upto`` positions, sharing its whole blocks
        (:meth:`KVPool.fork`): a prefix cache's snapshot."""
        self.pool.fork(src, dst, upto)

    def inputs(self, verify: bool = False, *, sampling: bool = False, draft_q: bool = False) -> dict[str, InputSpec]:
        """Per-row inputs and their pad values: the int64 rows (``next_tokens`` only for
        the verify step); with ``sampling`` the five per-row sampling settings
        (:func:`~.choose.sampling_specs`: ``temperature``, ``top_k``, ``top_p``, ``min_p``,
        ``seed``); with ``draft_q`` (a verify step with sampling only) the drafts' q rows
        ([vocab] float32 each, :mod:`.choose`). InputError for ``draft_q`` without both.

        A padding row (token 0, position 0, seq -1, scratch cell, want 0; greedy, every
        filter off, q all zero) writes only the scratch cell and reads nothing (seq -1),
        so it cannot change any live row.
        """
        verify, sampling, draft_q = (as_bool(n, v) for n, v in (("verify", verify), ("sampling", sampling),
                                                                 ("draft_q", draft_q)))
        if draft_q and not (verify and sampling):
            raise InputError(expected("draft_q", "True only with verify=True and sampling=True",
                                      f"draft_q=True, verify={verify}, sampling={sampling}"))
        specs = dict(tokens=InputSpec(pad=0), positions=InputSpec(pad=0), seq_ids=InputSpec(pad=-1),
                     cells=InputSpec(pad=self.scratch_cell), want=InputSpec(pad=0))
        if verify:
            specs["next_tokens"] = InputSpec(pad=-1)
        if sampling:
            specs.update(sampling_specs())
        if draft_q:
            specs[DRAFT_Q] = draft_q_spec(self.config.vocab)
        return specs

    def verify_step(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """``step`` plus speculative acceptance on the device (no host sync), by
        :func:`~cudagraph_rt.models.accept.greedy_accept`.

        ``next_tokens[i]`` is the token fed at ``positions[i] + 1`` of the same sequence in
        this step (the draft the next row checks), -1 if none. Row i's token is its argmax
        (no sampling inputs, or a greedy row) or, with the sampling inputs, the outcome of
        rejection sampling of that draft (``kernels.sampling.verify``, q from ``draft_q``:
        see :mod:`.choose`), which equals the draft exactly when it was accepted. Row i
        MISMATCHES when ``want[i] == 1`` and its token != ``next_tokens[i]`` (so -1 always
        mismatches). Row i is COMMITTED when ``want[i] == 1`` and no row of the same
        sequence at a smaller position mismatches: per sequence the longest matching prefix
        plus the first mismatching row (the bonus / correction). Rows with ``want == 0``
        (prefill rows, padding) are never committed and never block. Extra outputs:
        ``committed`` [N] bool; ``accept_rows`` [N] int32: committed row indices, increasing,
        packed at the front, zeros after; ``accept_count`` [1] int32.

        A host runner appends ``tokens[committed]`` (in row order) to each row's sequence;
        the last of them per sequence is not yet fed (its K/V is not written), and the cells
        of rejected positions are read by no row until they are written again (a row reads
        positions up to its own only). Rows of one sequence need not be consecutive; equal
        positions never block each other.
        """
        (nxt,) = self._take(inputs, ("next_tokens",))
        out = self._step(inputs, verify=True)  # checks the other inputs
        return {**out, **greedy_accept(out["tokens"], nxt, inputs["positions"], inputs["seq_ids"], inputs["want"])}

    def _step(self, inputs: dict[str, Tensor], verify: bool) -> dict[str, Tensor]:
        """The step of ``inputs``; ``verify``: its tokens are verify's (drafts in
        ``next_tokens``). A model's own ``step`` is ``_step(inputs, verify=False)``."""
        return self.step(inputs)

    def reference(self, tokens: list[int]) -> tuple[Tensor, Tensor]:
        """``(greedy [L] int64, hidden [L, hidden_width])`` of ``reference_logits``: greedy[p]
        is the next token after tokens[:p+1], hidden[p] the hidden row at p."""
        logits, hidden = self.reference_logits(tokens)
        return logits.argmax(-1), hidden

    # ------------------------------------------------------------------ checks
    def _take(self, inputs: dict[str, Tensor], names: tuple[str, ...]) -> list[Tensor]:
        return take_rows(inputs, names, self.device)

    def _reference_tokens(self, tokens) -> list[int]:
        """``tokens`` as ints, checked: 1..max_len token ids in ``[0, vocab)`` (a list of
        ints or a 1-D integer array or tensor: :func:`~cudagraph_rt.checks.token_ids`),
        else InputError naming ``tokens``."""
        ids = token_ids("tokens", tokens, self.config.vocab)
        if not 1 <= len(ids) <= self.config.max_len:
            raise InputError(expected("tokens", f"1..{self.config.max_len} tokens", len(ids)))
        return list(ids)

    def _check_generate(self, prompt, n) -> tuple[tuple[int, ...], int]:
        """``prompt`` (token ids, as :meth:`_reference_tokens`) and ``n`` (an int >= 0),
        checked: InputError when either is not one, or when they do not fit ``max_len``
        positions (the last new token is not fed)."""
        prompt, n = token_ids("prompt", prompt, self.config.vocab), as_int("n", n, 0)
        if not prompt:
            raise InputError(expected("prompt", "at least one token", "none"))
        if len(prompt) + max(n, 1) - 1 > self.config.max_len:
            raise InputError(expected("prompt + n", f"<= {self.config.max_len + 1} tokens", len(prompt) + n))
        return prompt, n
