"""``DraftModelDrafter``: a small causal LM of the target's vocabulary (any Decoder: the
toy, or a transformers model built by ``models.hf``) drafting ``k`` tokens per sequence
through its own GraphRuntime and paged KV pool.

Per sequence it remembers which tokens its pool holds K/V for (``fed``: positions 0 ..
len - 1). ``propose`` first catches up: the longest common prefix of ``fed`` and the
sequence's tokens stays, everything after it is fed again in one step (the rejected
drafts' cells are simply rewritten: a row reads positions up to its own only, and every
row of a step writes its cell before any reads), the last row asking for the first draft;
then ``k - 1`` one-row steps feed each draft to get the next. Greedy (``Proposal.q`` is
None), or with ``sampling=True`` sampled with each sequence's settings (its ``sampling``
attribute: temperature, top_k, top_p, min_p, seed; none = greedy) by
``kernels.sampling.sample_with_probs`` on the draft stream, the drawn token named by its
own position (the verify draws the target's token of that position with the same
(seed, position)), and q kept and returned.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..checks import as_bool, as_int
from ..errors import InputError, expected
from ..models.protocol import Decoder
from ..runtime import GraphRuntime
from ..inputs.spec import InputSpec
from .proposal import Proposal

__all__ = ["DraftModelDrafter"]

_SETTINGS = {"temperature": (torch.float32, 0.0), "top_k": (torch.int64, 0), "top_p": (torch.float32, 1.0),
             "min_p": (torch.float32, 0.0), "seed": (torch.int64, 0)}


def _lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DraftModelDrafter:
    """Drafts with ``draft`` (a Decoder of ``target``'s vocabulary, ``max_len`` and
    ``max_seqs`` at least the target's). Lifetime: owns ``self.rt`` and the draft model's
    pool use (one sequence id per live sequence, freed by ``forget``; ``close()`` frees
    the runtime). InputError naming ``draft`` (not a Decoder, another vocabulary, too few
    positions or sequences), ``k`` or ``sampling`` before anything is built.
    """

    name = "model"

    def __init__(self, target, draft, *, k: int = 4, graphs: bool | str = False, sampling: bool = False):
        if not isinstance(draft, Decoder):
            raise InputError(expected("draft", "a Decoder (cudagraph_rt.models)", type(draft).__name__))
        t, d = target.config, draft.config
        if d.vocab != t.vocab:
            raise InputError(expected("draft", f"a model of the target's vocabulary ({t.vocab})", f"vocab {d.vocab}"))
        if d.max_len < t.max_len or d.max_seqs < t.max_seqs:
            raise InputError(expected("draft", f"max_len >= {t.max_len} and max_seqs >= {t.max_seqs} (the target's)",
                                      (d.max_len, d.max_seqs)))
        self.k = as_int("k", k, 1)
        self.sampling = as_bool("sampling", sampling)
        self.target, self.draft = target, draft
        specs = dict(draft.inputs())
        if self.sampling:
            from .target_parts import target_parts
            self._readout = target_parts(draft).readout_weight
            specs.update({n: InputSpec(dtype=dt, pad=pad) for n, (dt, pad) in _SETTINGS.items()})
        self.rt = GraphRuntime(self._step, specs, graphs=graphs, device=draft.device)
        self._fed: dict[int, list[int]] = {}  # uid -> tokens whose K/V the draft pool holds, from position 0
        self._slot: dict[int, int] = {}
        self._free = list(range(d.max_seqs))

    @classmethod
    def from_path(cls, target, path: str, **kw) -> "DraftModelDrafter":
        """A transformers checkpoint folder as the draft model (target's device, dtype and
        sizes). InputError naming ``draft`` for a folder that is not one."""
        import os

        from ..models import hf
        if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
            raise InputError(expected("draft", "a transformers checkpoint folder", repr(path)))
        t = target.config
        model = hf.build("llama", "tiny", path=path, device=target.device, dtype=t.dtype, max_seqs=t.max_seqs,
                         max_len=t.max_len)
        return cls(target, model, **kw)

    def _step(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        out = self.draft.step({n: inputs[n] for n in ("tokens", "positions", "seq_ids", "cells", "want")})
        if not self.sampling:
            return {"tokens": out["tokens"]}
        from ..kernels.sampling import SamplingSettings, sample_with_probs
        logits = (out["hidden"] @ self._readout.T).float()
        s = SamplingSettings(inputs["temperature"], inputs["top_k"], inputs["top_p"], inputs["min_p"],
                             inputs["seed"], inputs["positions"] + 1)  # the drawn token's own position
        tokens, probs = sample_with_probs(logits, s, validate=False)
        return {"tokens": tokens, "probs": probs}

    def capture(self):
        return self.rt.capture()

    def observe(self, c) -> None:
        """Nothing to do now: ``propose`` catches up from the sequences' tokens."""

    def _rows(self, seq, toks: list[int], p0: int, want_last: bool, cols: dict) -> None:
        slot = self._slot[seq.uid]
        n = len(toks)
        cols["tokens"] += toks
        cols["positions"] += range(p0, p0 + n)
        cols["seq_ids"] += [slot] * n
        cols["cells"] += self.draft.cell_range(slot, p0, n)
        cols["want"] += [0] * (n - 1) + [int(want_last)]
        if self.sampling:
            sp = getattr(seq, "sampling", None)
            for name, (_, pad) in _SETTINGS.items():
                cols[name] += [getattr(sp, name, pad) if sp is not None else pad] * n

    def _run(self, cols: dict) -> dict:
        inputs = {n: torch.tensor(v, dtype=_SETTINGS[n][0] if n in _SETTINGS else torch.int64)
                  for n, v in cols.items()}
        return self.rt.step(**inputs).outputs

    def propose(self, seqs, k: int) -> Proposal:
        k = as_int("k", k, 0, self.k, f"an int in [0, {self.k}] (the drafter's k)")
        n = len(seqs)
        if n == 0 or k == 0:
            return Proposal(np.zeros((n, k), np.int64))
        names = ["tokens", "positions", "seq_ids", "cells", "want"] + (list(_SETTINGS) if self.sampling else [])
        cols = {name: [] for name in names}
        last = []
        for s in seqs:
            if s.uid not in self._slot:
                if not self._free:
                    raise RuntimeError(f"sequence {s.uid}: the draft model has no free sequence id")
                self._slot[s.uid] = slot = self._free.pop(0)
                self.draft.free_seq(slot)
                self._fed[s.uid] = []
            toks = list(s.tokens)
            m = min(_lcp(self._fed[s.uid], toks), len(toks) - 1)  # K/V kept for positions < m
            self._rows(s, toks[m:], m, True, cols)
            last.append(len(cols["tokens"]) - 1)
            self._fed[s.uid] = toks
        drafts, qs = [], []
        out = self._run(cols)
        idx = torch.tensor(last)
        cur = out["tokens"].cpu()[idx]  # an index: a copy
        drafts.append(cur)
        if self.sampling:
            qs.append(out["probs"][idx.to(out["probs"].device)].clone())
        for j in range(1, k):
            cols = {name: [] for name in names}
            for i, s in enumerate(seqs):
                p = len(s.tokens) + j - 1
                self._rows(s, [int(cur[i])], p, True, cols)
                self._fed[s.uid].append(int(cur[i]))
            out = self._run(cols)
            cur = out["tokens"][:n].to("cpu", copy=True)  # outputs die at the next step
            drafts.append(cur)
            if self.sampling:
                qs.append(out["probs"][:n].clone())
        q = torch.stack(qs, 1).to(self.target.device) if self.sampling else None
        return Proposal(torch.stack(drafts, 1).numpy().astype(np.int64), q)

    def forget(self, seq) -> None:
        slot = self._slot.pop(seq.uid, None)
        self._fed.pop(seq.uid, None)
        if slot is not None:
            self.draft.free_seq(slot)
            self._free.append(slot)

    def close(self) -> None:
        self.rt.close()
