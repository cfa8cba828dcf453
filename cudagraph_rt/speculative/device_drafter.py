"""A drafter that runs on the device in its own GraphRuntime (``cgrt demo --drafter gpu``).

The shape of a real draft model (EAGLE, Medusa): it reads the target's committed hidden
rows (all taps of every committed row, from the target's host rows), runs a small model
over them and proposes ``k`` tokens per sequence. Its weights are random, so which drafts
are right is still decided by the controlled coin of ``drafting.controlled_drafts`` (the
same drafts as ``ToyDrafter``), but its device work and data movement are real: the rows go
to the device, a two-layer head (rows -> ``hidden`` -> vocab logits) runs, and the toy's
row check (each row encodes its fed token) runs on the device beside it; a row that fails
it, or non-finite logits, is reported when its drafts are read.

Overlap: ``observe`` stages the rows and launches the drafter's step on the drafter's own
CUDA stream (so it does not queue behind the target's step of another lane), then queues
the copy of its drafts and flags into a pinned buffer; ``propose`` waits for that copy
only. Pinned outputs rotate over ``depth`` buffers: a batch's drafts stay readable until
``depth`` later ``observe`` calls (``SpecRunner`` requires ``depth >= lanes + 1``).
"""
from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from .drafting import CommittedRows, DraftRule, _Seen, check_drafter, controlled_drafts
from ..checks import as_int
from ..errors import InputError, expected
from ..runtime import GraphRuntime
from ..inputs.spec import InputSpec


class _Batch:
    """One observe's drafts on the host: pinned ``drafts [n, k]`` and ``ok [n]`` (valid once
    ``done`` completed), and which row is each uid's last."""

    def __init__(self, rows: int, k: int, pin: bool):
        self.drafts = torch.empty(rows, k, dtype=torch.int64, pin_memory=pin)
        self.ok = torch.empty(rows, dtype=torch.bool, pin_memory=pin)
        self.done: torch.cuda.Event | None = None
        self.n, self.last, self.checked, self.c = 0, {}, False, None


class DeviceDrafter:
    """Drafts ``k`` tokens per sequence on the device (see the module doc).

    ``model``: the target toy (its greedy rule, token codes and row width); ``hidden``:
    the head's width; ``graphs``: capture the drafter's widths (CUDA only); ``depth``: pinned
    output buffers (a runner refuses fewer than its lanes + 1). The drafter owns ``self.rt`` and its
    stream; ``close()`` frees them. Raises InputError naming a bad ``model`` (a toy),
    ``accept_prob`` (a number in [0, 1]), ``seed`` (any integer), ``k`` (>= 1), ``hidden``
    (>= 1), ``depth`` (>= 2) or ``graphs`` (GraphRuntime's): numpy integers are taken as
    ints, bools and floats are not; ``propose`` raises RuntimeError when a sequence's rows failed the device check
    or were not observed since its tokens changed.
    """

    def __init__(self, model, accept_prob: float, seed: int = 0, *, k: int = 4, hidden: int = 512,
                 graphs: bool = False, depth: int = 3):
        accept_prob, seed = check_drafter(model, accept_prob, seed, toy=True)
        k, hidden, depth = as_int("k", k, 1), as_int("hidden", hidden, 1), as_int("depth", depth, 2)
        self.model, self.p, self.seed, self.k, self.depth = model, accept_prob, seed, k, depth
        dev, cfg = model.device, model.config
        self.rule = DraftRule.for_toy(model, accept_prob, seed, device=dev)
        g = torch.Generator().manual_seed((seed + 1) & (2**64 - 1))  # any int seed, as the host drafter
        width = model.hidden_width
        self._w1 = (torch.randn(width, hidden, generator=g) / width ** 0.5).to(dev, cfg.dtype)
        self._w2 = (torch.randn(hidden, cfg.vocab, generator=g) / hidden ** 0.5).to(dev, cfg.dtype)
        self._emb = model.emb.float()
        self._norm2 = (self._emb * self._emb).sum(1)
        specs = {"hidden": InputSpec(shape=(width,), dtype=cfg.dtype, pad=0.0), "fed": InputSpec(),
                 "cur": InputSpec(), "uid": InputSpec(), "pos": InputSpec()}
        self.rt = GraphRuntime(self._step, specs, graphs=graphs, device=dev)
        self.stream = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        self._pin = dev.type == "cuda"
        self._batches: list[_Batch] = []
        self._next = 0
        self._where: dict[int, _Batch] = {}  # uid -> the batch holding its latest drafts
        self._seen = _Seen()

    def _step(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """Per committed row: ``k`` drafts after its committed token and the row check."""
        rows, fed = inputs["hidden"], inputs["fed"]
        logits = F.gelu(rows @ self._w1) @ self._w2  # the head a real drafter would argmax
        code = self._emb[fed]
        score = (rows[:, :code.shape[1]].float() * code).sum(1)
        ok = (score > 0.75 * self._norm2[fed]) & torch.isfinite(logits.float()).all(1)
        drafts = controlled_drafts(torch, self.rule, inputs["uid"], inputs["pos"] + 2, fed, inputs["cur"], self.k)
        return {"drafts": drafts, "ok": ok}

    def capture(self):
        """Capture the drafter's widths now (else its first step does)."""
        return self.rt.capture()

    def observe(self, c: CommittedRows) -> None:
        """Stage ``c``'s rows and launch the drafter's step (asynchronous on CUDA)."""
        c.check_counts()
        n = c.rows.shape[0]
        if n == 0:
            self._seen.mark(c.seqs)
            return
        batch = self._take(n)
        uids = np.fromiter((s.uid for s in c.seqs), np.int64, len(c.seqs))
        stream = torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()
        with stream:
            inputs = self.rt.host_inputs(n, numpy=True) if len(self.rt.plan(n)) == 1 else None
            if inputs is None:  # a sliced step: the runtime packs each slice
                inputs = {"hidden": torch.empty_like(c.rows), **{k: np.empty(n, np.int64) for k in
                                                    ("fed", "cur", "uid", "pos")}}
            hidden = inputs["hidden"]  # an array for float32 rows, a tensor for bfloat16
            (torch.from_numpy(hidden) if isinstance(hidden, np.ndarray) else hidden).copy_(c.rows)
            for name, v in (("fed", c.fed), ("cur", c.tokens), ("uid", uids[c.group]), ("pos", c.positions)):
                inputs[name][:] = v
            out = self.rt.step(**inputs).outputs
            batch.drafts[:n].copy_(out["drafts"], non_blocking=True)
            batch.ok[:n].copy_(out["ok"], non_blocking=True)
            if self.stream is not None:
                batch.done = torch.cuda.Event()
                batch.done.record(self.stream)
        batch.n, batch.checked = n, False
        batch.c = (c.seqs, c.group, c.positions)  # for the error message only (not the rows view)
        batch.last = dict(zip(uids.tolist(), c.last_rows().tolist()))
        for uid in batch.last:
            self._where[uid] = batch
        self._seen.mark(c.seqs)

    def _take(self, n: int) -> _Batch:
        """The next pinned output buffer, grown (once) when ``n`` rows do not fit."""
        i = self._next
        self._next = (i + 1) % self.depth
        if i == len(self._batches):
            self._batches.append(_Batch(max(n, 64), self.k, self._pin))
        b = self._batches[i]
        old = b
        if b.drafts.shape[0] < n:
            b = self._batches[i] = _Batch(max(n, 2 * b.drafts.shape[0]), self.k, self._pin)
        if old.done is not None:
            old.done.synchronize()  # a batch `depth` observes old: long finished in a runner
        for uid, owner in list(self._where.items()):
            if owner is b or owner is old:
                del self._where[uid]  # its drafts are about to be overwritten (or dropped)
        return b

    def propose(self, seqs, k: int) -> np.ndarray:
        if not 0 <= k <= self.k:
            raise InputError(expected("k", f"in [0, {self.k}] (the drafter's k)", k))
        self._seen.require(seqs)
        out = np.empty((len(seqs), k), np.int64)
        for i, s in enumerate(seqs):
            b = self._where.get(s.uid)
            if b is None:
                raise RuntimeError(f"sequence {s.uid}: its drafts were overwritten (DeviceDrafter depth {self.depth})")
            if not b.checked:
                if b.done is not None:
                    b.done.synchronize()
                ok = b.ok[:b.n].numpy()
                if not ok.all():
                    r = int(np.flatnonzero(~ok)[0])
                    c_seqs, group, positions = b.c
                    raise RuntimeError(f"sequence {c_seqs[int(group[r])].uid}: host rows do not encode the fed "
                                       f"tokens (device check) at position {int(positions[r])}")
                b.checked, b.c = True, None
            out[i] = b.drafts[b.last[s.uid], :k].numpy()
        return out

    def forget(self, seq) -> None:
        self._seen.at.pop(seq.uid, None)
        self._where.pop(seq.uid, None)

    def close(self) -> None:
        """Free the drafter's graphs and pinned buffers (waits for its stream)."""
        if self.stream is not None:
            self.stream.synchronize()
        self._batches, self._where = [], {}
        self.rt.close()

