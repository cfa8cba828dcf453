"""``HeadDrafter``: a trained draft head (``head.py``) drafting from the target's committed
hidden rows, its k steps captured as one graph of its own GraphRuntime.

Per sequence it keeps the last committed row (the one the runner's captured gather
shipped) and the token that row committed; ``propose`` stages them and runs one step of
the drafter's runtime: ``k`` times ``row = head(row, embed(token))`` then ``token =`` the
argmax of the target's readout over the head's draft vocabulary, each step reading the
row the head predicted before (EAGLE). Greedy drafts (``Proposal.q`` is None).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ..checks import as_int
from ..errors import InputError, expected
from ..runtime import GraphRuntime
from ..inputs.spec import InputSpec
from .drafting import CommittedRows, _Seen
from .head import DraftHead, load_head
from .proposal import Proposal
from .target_parts import target_parts

__all__ = ["HeadDrafter", "check_head_fits"]


def check_head_fits(head: DraftHead, model, name: str = "head") -> None:
    """InputError naming ``name`` unless ``head`` reads ``model``'s rows, embedding and vocabulary."""
    parts = target_parts(model)
    cfg = head.cfg
    for what, mine, theirs in (("vocab", cfg.vocab, parts.vocab), ("row_width", cfg.row_width, parts.row_width),
                               ("embed_width", cfg.embed_width, parts.embed_width)):
        if mine != theirs:
            raise InputError(expected(name, f"a head for this model ({what} {theirs})",
                                      f"{what} {mine} (trained on {cfg.target or 'another model'})"))


class HeadDrafter:
    """Drafts with a :class:`DraftHead` for ``model`` (the target: its embedding and
    readout are shared, not copied). ``head``: a DraftHead or the path of a saved one;
    ``k``: the most drafts a call proposes; ``graphs``: the drafter's runtime's (True on
    CUDA captures its widths, False / "emulate" on a CPU).

    Lifetime: owns ``self.rt`` (its graphs and pinned staging; ``close()`` frees them) and
    a copy of each live sequence's last committed row until ``forget``. ``propose`` raises
    RuntimeError for a sequence whose rows it has not observed since its tokens changed.
    InputError naming ``head`` (not a head, no such file, another model's), ``k`` or
    ``graphs`` before anything is built.
    """

    name = "head"

    def __init__(self, model, head, *, k: int = 4, graphs: bool | str = False):
        if not isinstance(head, DraftHead):
            head = load_head(head, name="head")
        check_head_fits(head, model)
        self.k = as_int("k", k, 1)
        self.model, parts = model, target_parts(model)
        dev, dtype = model.device, model.config.dtype
        self.head = head.to(dev, dtype).eval()
        ids = self.head.draft_ids
        self._ids = ids
        self._readout = parts.readout_weight.index_select(0, ids).contiguous()  # [draft_vocab, row_width]
        self._embed = parts.embed
        specs = {"row": InputSpec(shape=(parts.row_width,), dtype=dtype, pad=0.0), "token": InputSpec(pad=0)}
        self.rt = GraphRuntime(self._step, specs, graphs=graphs, device=dev)
        self._rows: dict[int, tuple[Tensor, int]] = {}  # uid -> (last committed row, its committed token)
        self._seen = _Seen()

    @torch.no_grad()
    def _step(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        row, tok = inputs["row"], inputs["token"]
        out = []
        for _ in range(self.k):
            row = self.head(row, self._embed(tok))
            tok = self._ids[(row @ self._readout.T).argmax(-1)]
            out.append(tok)
        return {"drafts": torch.stack(out, 1)}

    def capture(self):
        """Capture the drafter's widths now (else its first step does)."""
        return self.rt.capture()

    def observe(self, c: CommittedRows) -> None:
        c.check_counts()
        last = c.last_rows()
        rows = c.rows[torch.from_numpy(last)].clone()  # the ring slot is reused after the call
        for g, s in enumerate(c.seqs):
            self._rows[s.uid] = (rows[g], int(c.tokens[last[g]]))
        self._seen.mark(c.seqs)

    def propose(self, seqs, k: int) -> Proposal:
        k = as_int("k", k, 0, self.k, f"an int in [0, {self.k}] (the drafter's k)")
        self._seen.require(seqs)
        n = len(seqs)
        if n == 0 or k == 0:
            return Proposal(np.zeros((n, k), np.int64))
        rows = torch.stack([self._rows[s.uid][0] for s in seqs])
        toks = torch.tensor([self._rows[s.uid][1] for s in seqs], dtype=torch.int64)
        out = self.rt.step(row=rows, token=toks).outputs["drafts"]
        return Proposal(out[:, :k].to("cpu", copy=True).numpy())  # outputs die at the next step

    def forget(self, seq) -> None:
        self._seen.at.pop(seq.uid, None)
        self._rows.pop(seq.uid, None)

    def close(self) -> None:
        self._rows = {}
        self.rt.close()
