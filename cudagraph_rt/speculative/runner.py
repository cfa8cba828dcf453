"""A speculative-decoding host runner on the toy decoder or a transformers model
(``models/hf.py``): the loop an engine wraps around a GraphRuntime. Copy it and swap in
your model, drafter and scheduler.

One *step* of a lane serves every sequence of that lane at once:

* a decoding sequence feeds ``k + 1`` rows: its last committed token (not fed yet) and
  ``k`` draft tokens, each row asking for a token (``want=1``) and naming the draft that
  follows it (``next_tokens``);
* a joining sequence feeds a chunk of its prompt (``want=0``); the chunk that ends the
  prompt asks for a token on its last row only (``want=1``, ``next_tokens=-1``), so the
  prefill step itself returns the first generated token and ships that row's hidden state
  -- the feature the drafter starts from.

The runtime pads the step to the narrowest graph (wide prefill steps run the dynamic path
or are sliced), the step function decides acceptance on the device (per sequence the
longest matching draft prefix plus the bonus/correction row) and the captured gather
copies only the committed rows' hidden states into a pinned host ring slot, all in one
replay. The host waits once per step, reads the tokens and the rows, and retires
sequences that reached their length while new prompts join.

What overlaps (CUDA; on the CPU every call is synchronous and nothing does): a lane's
next drafts need that lane's last result -- the first verify row is the last committed
token and the drafter reads the committed rows -- so they cannot overlap its own step.
Sequences are therefore split into ``lanes`` (default 2) that take turns: while the GPU
verifies lane A, the host reads lane B's finished step, drafts for B, admits prompts and
writes B's next inputs straight into the pinned staging of ``rt.host_inputs``. That needs
``lanes`` host-row slots held at once (``HostRows.depth >= lanes``) and one pinned token
buffer per lane, because a step's outputs die at the next step. The host work is per
sequence, never per row in Python (list slices and ranges into six int columns, one
batched drafter call each way), so it stays short beside a step: at 4 sequences a lane,
plain lists beat numpy's per-call cost.

Lifetimes: ``StepResult.outputs`` are valid until the next ``rt.step`` (the runner copies
``tokens`` to pinned memory right behind the step); host rows (``handle.rows()``) are
valid until ``handle.release()``, which the runner calls once the drafter has read them
(the drafter copies what it keeps).
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import torch

from .drafting import CommittedRows, ReferenceDrafter, ToyDrafter
from .intake import (Request, Sequence, blocks_for, check_request, check_runner_args, check_sampling_args,
                     read_proposal)
from ..errors import InputError, expected
from ..host_rows import HostRows, HostRowsHandle
from ..models.protocol import Decoder
from .run_timing import PHASES, DeviceTimer, PhaseClock, RunReport
from ..runtime import GraphRuntime

__all__ = ["CommittedRows", "DeviceTimer", "PHASES", "PhaseClock", "ReferenceDrafter", "Request", "RunReport",
           "Sequence", "SpecRunner", "ToyDrafter", "make_runtime"]

COLUMNS = ("tokens", "positions", "seq_ids", "cells", "want", "next_tokens")
# The per-row sampling columns (models/choose.py), each a SamplingParams field of the row's sequence.
SAMPLING_COLUMNS = ("temperature", "top_k", "top_p", "min_p", "seed")


@dataclass(frozen=True)
class _Group:
    """The rows one sequence has in a step: ``[row0, row0 + n)`` at positions ``pos0 ..``;
    ``verify`` for a decoding sequence's verify rows, else a prompt chunk (``ends``: it
    ends the prompt, so its last row asks for a token)."""

    seq: Sequence
    row0: int
    n: int
    pos0: int
    verify: bool
    ends: bool = False
    q: torch.Tensor | None = None  # [n - 1, vocab]: the drafts' q (a sampling drafter's), else None


@dataclass
class _InFlight:
    """A launched step: what the host needs after its one wait."""

    groups: list[_Group]
    cols: list[list[int]]  # the step's columns (COLUMNS order): the fed tokens are read back
    handle: HostRowsHandle
    tokens: torch.Tensor  # pinned copy of outputs["tokens"], valid after `done`
    done: torch.cuda.Event | None


@dataclass
class _Lane:
    """Sequences that share steps. Its own pinned token buffer: a lane's tokens are read
    after the next lane has stepped."""

    cap: int
    tokens_host: torch.Tensor
    seqs: list[Sequence] = field(default_factory=list)
    inflight: _InFlight | None = None


def make_runtime(model: Decoder, *, graphs: bool, rows_per_step: int, depth: int = 3, sampling: bool = False,
                 draft_q: bool = False) -> GraphRuntime:
    """The runtime a runner steps: ``model.verify_step`` with device-chosen host rows (the
    committed rows, ``accept_rows[:accept_count]``, gathered inside the replay); with
    ``sampling`` its per-row sampling inputs, with ``draft_q`` the drafts' q rows too."""
    hr = HostRows(source="hidden", mode="device", rows_output="accept_rows", count_output="accept_count",
                  capacity=rows_per_step, depth=depth)
    specs = model.inputs(verify=True, sampling=True, draft_q=draft_q) if sampling else model.inputs(verify=True)
    return GraphRuntime(model.verify_step, specs, graphs=graphs, device=model.device, host_rows=hr)


def _sampling_columns(groups: list[_Group]) -> list[list]:
    """The step's sampling columns (``SAMPLING_COLUMNS`` order): each row its sequence's
    settings. Work per group (list repetition), none per row in Python."""
    cols: list[list] = [[] for _ in SAMPLING_COLUMNS]
    for g in groups:
        sp = g.seq.sampling
        for col, v in zip(cols, (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seed)):
            col += [v] * g.n
    return cols


def _unbuild(groups: list[_Group]) -> None:
    """Undo what building a step changed in its sequences (the prompt chunks it placed), for
    a step that failed before it ran: a later ``run`` builds the same rows again."""
    for g in groups:
        if not g.verify:
            g.seq.prefilled = g.pos0


class SpecRunner:
    """Serves requests with speculative decoding through one GraphRuntime.

    ``k`` drafts per sequence and step; at most ``slots`` sequences at once (default the
    model's ``max_seqs``), split over ``lanes``; ``chunk`` prompt rows per lane step (more
    than the runtime's dynamic limit, 96 by default, makes a sliced step).
    ``record_rows`` keeps a copy of every committed hidden row per sequence (for checks).
    The drafter has ``observe(CommittedRows)``, ``propose(seqs, k) -> [len(seqs), k]`` (or a
    :class:`~cudagraph_rt.speculative.proposal.Proposal`) and ``forget(seq)``; see
    :mod:`cudagraph_rt.speculative.drafting`.

    Sampling (``sampling=True``, the default): every step samples each row with its
    request's :class:`~cudagraph_rt.SamplingParams` (written into the step's static
    sampling inputs, no recapture), and a verify step accepts drafts by rejection sampling,
    so the tokens follow the target's own sampled distribution whatever the drafter
    proposes (greedy requests get exactly the greedy tokens). ``seed`` (an int in [0,
    2**63 - 1]) seeds the requests that give none (see ``sampling_params.py``).
    ``draft_q``: the verify step takes the drafts' q ([T, vocab] float32 rows written on
    the device each step; ``None``: the drafter's ``draft_q`` attribute, default False); a
    drafter whose ``Proposal.q`` is not None needs it. ``sampling=False``: the greedy step
    without the sampler (requests must be greedy). The runner owns ``self.rt`` (its
    graphs and pinned buffers live as long as the runner); one host thread drives it.

    KV cells come from the model's pool (``model.cell_range`` per sequence and step). A
    request is admitted only when the pool's free blocks cover every admitted sequence's
    remaining worst case (prompt + max_new - 1 positions) and its own, so no step runs out
    of blocks; a retired sequence's blocks go back at once (``model.free_seq``), and a
    slot's leftover blocks (from an earlier user of the model) are freed when it is handed
    to a new sequence.

    Raises InputError naming the argument, before the model's pool is touched: ``k``,
    ``slots``, ``lanes`` and ``chunk`` are ints (numpy integers taken as ints, bools and
    floats refused), ``record_rows`` a bool, ``model`` a Decoder and ``drafter`` one with
    the three calls; and for a configuration whose verify rows would not fit the first
    slice of a step (acceptance is decided per slice, so a sequence's rows must share one).
    ``submit`` raises it for a request that does not fit the model (its positions or the
    whole pool) or whose prompt is not a list of token ids.
    """

    def __init__(self, model: Decoder, drafter, *, k: int = 4, slots: int | None = None, lanes: int = 2,
                 chunk: int = 128, graphs: bool = False, record_rows: bool = False, seed: int = 0,
                 sampling: bool = True, draft_q: bool | None = None):
        k, slots, lanes, chunk, record_rows = check_runner_args(model, drafter, k, slots, lanes, chunk, record_rows)
        self.seed, self.sampling, self.draft_q = check_sampling_args(drafter, seed, sampling, draft_q)
        self.model, self.drafter, self.k, self.chunk, self.record_rows = model, drafter, k, chunk, record_rows
        caps = [slots // lanes + (i < slots % lanes) for i in range(lanes)]
        # A step commits at most k + 1 rows per sequence; while one lane steps, every other
        # lane holds its in-flight step's ring slot, so the ring needs >= lanes slots.
        self.rt = make_runtime(model, graphs=graphs, rows_per_step=max(caps) * (k + 1), depth=max(3, lanes),
                               sampling=self.sampling, draft_q=self.draft_q)
        if max(caps) * (k + 1) > self.rt.dynamic_limit:  # verify rows go first: they must fit slice 0
            raise InputError(expected("k", f"(k + 1) * {max(caps)} sequences per lane <= {self.rt.dynamic_limit}", k))
        pin = model.device.type == "cuda"
        # A lane step's rows: its verify rows and at most chunk prompt rows, which its
        # sequences' prompts bound too (a chunk past them is no chunking, not a bigger buffer).
        rows = [c * (k + 1) + min(chunk, c * model.config.max_len) for c in caps]
        self.lanes = [_Lane(c, torch.empty(n, dtype=torch.int64, pin_memory=pin)) for c, n in zip(caps, rows)]
        self.waiting: deque[tuple[int, Request]] = deque()
        self.finished: list[Sequence] = []
        self._free_slots = list(range(slots))
        self._next_uid = 0
        self._turn = 0  # the lane after the last one launched: a later run() starts there
        self.phase_clock = PhaseClock()  # replace it (PhaseClock(clock=...)) to time on another clock
        self._device_timer = DeviceTimer() if model.device.type == "cuda" else None
        self.reset_stats()

    # -- public --------------------------------------------------------------------------
    def submit(self, requests) -> list[int]:
        """Queue requests; returns their uids. All or none: InputError (naming the request)
        if one does not fit the model, its ``max_new`` is not an int >= 1 or its prompt is
        not a list of token ids, and then none of them is queued (a retry serves each once).
        A prompt may be a list or tuple of ints or a 1-D integer numpy array or torch tensor;
        it is queued (and served, as ``Sequence.prompt``) as a tuple of ints. ``sampling``
        must be a SamplingParams (a greedy one when the runner has ``sampling=False``); its
        seed is resolved here (``Sequence.sampling``)."""
        requests = [check_request(i, r, self.model, self.sampling, "runner") for i, r in enumerate(list(requests))]
        uids = list(range(self._next_uid, self._next_uid + len(requests)))
        requests = [Request(r.prompt, r.max_new, r.sampling.seeded(self.seed, uid)) for uid, r in zip(uids, requests)]
        self.waiting.extend(zip(uids, requests))
        self._next_uid += len(requests)
        return uids

    def run(self, max_steps: int | None = None) -> RunReport:
        """Serve until every request is done (or ``max_steps`` more steps were launched;
        unfinished sequences then stay in their lanes and a later ``run`` continues them).
        Lanes take turns: finish a lane's step (the one wait), then build and launch its
        next one while the other lanes' steps run on the GPU. Counters in the report are
        since ``reset_stats``; ``seconds`` is this call's wall time, split into host
        ``phases`` (``self.phase_clock``); on CUDA ``gpu_busy`` from events around each
        step (read here, after the last wait)."""
        clk, dev = self.phase_clock, self._device_timer
        t0, steps0, tokens0 = clk.start(), self.steps, self.tokens
        if dev is not None:
            dev.reset()
        L = len(self.lanes)
        while True:
            busy = False
            for i in [(self._turn + j) % L for j in range(L)]:  # turns continue across runs
                lane = self.lanes[i]
                if lane.inflight is not None:
                    self._finish(lane, lane.inflight)
                    lane.inflight = None
                if max_steps is not None and self.steps - steps0 >= max_steps:
                    continue
                clk.mark("loop")
                self._admit(lane)
                clk.mark("admit")
                groups, cols = self._build(lane)
                clk.mark("build")
                if groups:
                    try:
                        lane.inflight = self._launch(lane, groups, cols)
                    except BaseException:
                        _unbuild(groups)  # the step never ran: its prompt chunks are fed again next time
                        raise
                    self._turn = (i + 1) % L
                    busy = True
            if not busy and all(lane.inflight is None for lane in self.lanes):
                break
        return self._report(t0, self.steps - steps0, self.tokens - tokens0)

    def _report(self, t0: float, run_steps: int, run_tokens: int) -> RunReport:
        """The report of a run that started at ``t0`` (phase clock) and launched
        ``run_steps``; its last lap (this) is charged to ``loop``. Reading the device
        timer waits for the last step, which the run already waited for."""
        hist = tuple(self.hist[a] for a in range(self.k + 1))
        dev = self._device_timer.seconds() if self._device_timer is not None else None
        seconds = self.phase_clock.mark("loop") - t0
        busy = dev / seconds if dev is not None and seconds > 0 else None
        return RunReport(self.steps, self.tokens, seconds, hist, self.proposed, self.accepted, self.rows,
                         run_steps, dict(self.phase_clock.totals), dev, busy, run_tokens,
                         tuple(self.proposed_at.tolist()), tuple(self.accepted_at.tolist()),
                         getattr(self.drafter, "name", type(self.drafter).__name__))

    def reset_stats(self) -> None:
        """Zero the counters and forget finished sequences (e.g. after a warm-up)."""
        self.steps = self.tokens = self.proposed = self.accepted = self.rows = 0
        self.hist: Counter[int] = Counter()
        self.proposed_at = np.zeros(self.k, np.int64)  # per draft position j: verify groups that proposed it
        self.accepted_at = np.zeros(self.k, np.int64)  # ... and that accepted it
        self.finished = []

    # -- one step --------------------------------------------------------------------------
    def _admit(self, lane: _Lane) -> None:
        """Waiting prompts join while the lane has room and the pool's free blocks cover the
        admitted sequences' remaining worst case plus the newcomer's (a slot's leftover
        blocks are freed first: the new sequence starts at position 0)."""
        pool = self.model.pool
        while len(lane.seqs) < lane.cap and self.waiting and self._free_slots:
            uid, r = self.waiting[0]
            slot = self._free_slots[0]
            self.model.free_seq(slot)
            owed = sum(blocks_for(self.model, len(s.prompt), s.max_new)
                       - sum(b is not None for b in pool.blocks(s.slot)) for ln in self.lanes for s in ln.seqs)
            if owed + blocks_for(self.model, len(r.prompt), r.max_new) > pool.free_blocks:
                return
            self.waiting.popleft()
            lane.seqs.append(Sequence(uid, self._free_slots.pop(0), r.prompt, r.max_new, list(r.prompt),
                                      sampling=r.sampling))

    def _build(self, lane: _Lane) -> tuple[list[_Group], list[list[int]]]:
        """The lane's next step as columns (``COLUMNS`` order): verify rows first (so every
        sequence's verify rows sit in the first slice even when a wide prefill gets
        sliced), then prefill chunks up to ``chunk`` rows. Work per sequence, not per row:
        list slices and ranges, one batched drafter call."""
        cols: list[list[int]] = [[] for _ in COLUMNS]
        groups: list[_Group] = []
        dec = [s for s in lane.seqs if s.decoding]
        if dec:
            self._verify_rows(cols, groups, dec)
        budget = self.chunk
        for seq in lane.seqs:
            n = min(budget, len(seq.prompt) - seq.prefilled)
            if n > 0 and not seq.decoding:
                self._prompt_rows(cols, groups, seq, n)
                budget -= n
        return groups, cols

    def _verify_rows(self, cols: list[list[int]], groups: list[_Group], dec: list[Sequence]) -> None:
        """Every decoding sequence's last committed token then its drafts, each row asking
        for a token and naming the draft after it."""
        ks = [min(self.k, s.max_new - (len(s.tokens) - len(s.prompt)) - 1) for s in dec]  # never past the limit
        kmax = max(ks)
        clk = self.phase_clock
        clk.mark("build")
        drafts, q = [[]] * len(dec), None
        if kmax > 0:
            drafts, q = read_proposal(self.drafter.propose(dec, kmax), len(dec), kmax, self.model.config.vocab,
                                  self.model.device, self.draft_q)
        clk.mark("draft")
        toks, pos, sid, cells, want, nxt = cols
        for i, (s, k, d) in enumerate(zip(dec, ks, drafts)):
            p0, row0 = len(s.tokens) - 1, len(toks)
            t = [s.tokens[-1], *d[:k]]
            toks += t
            nxt += t[1:]
            nxt.append(-1)
            pos += range(p0, p0 + k + 1)
            sid += [s.slot] * (k + 1)
            cells += self.model.cell_range(s.slot, p0, k + 1)
            want += [1] * (k + 1)
            groups.append(_Group(s, row0, k + 1, p0, True, q=None if q is None else q[i, :k]))

    def _prompt_rows(self, cols: list[list[int]], groups: list[_Group], seq: Sequence, n: int) -> None:
        """A prompt chunk of ``n`` rows; the chunk that ends the prompt asks for a token on
        its last row (that row then ships the hidden state drafting starts from)."""
        toks, pos, sid, cells, want, nxt = cols
        p0, row0 = seq.prefilled, len(toks)
        ends = p0 + n == len(seq.prompt)
        toks += seq.prompt[p0:p0 + n]
        pos += range(p0, p0 + n)
        sid += [seq.slot] * n
        cells += self.model.cell_range(seq.slot, p0, n)
        want += [0] * (n - 1)
        want.append(int(ends))
        nxt += [-1] * n
        seq.prefilled += n
        groups.append(_Group(seq, row0, n, p0, False, ends))

    def _launch(self, lane: _Lane, groups: list[_Group], cols: list[list[int]]) -> _InFlight:
        """Stage, step (asynchronous on CUDA), and queue the copy of the tokens to pinned
        memory behind it: ``outputs`` die at the next step, which another lane launches
        before this one is read. Phases stage, step, queue; on CUDA the device timer's
        events bracket ``rt.step``."""
        clk, dev = self.phase_clock, self._device_timer
        T = len(cols[0])
        columns = list(zip(COLUMNS, cols))
        if self.sampling:
            columns += zip(SAMPLING_COLUMNS, _sampling_columns(groups))
        if self.draft_q:
            inputs = self._device_step_inputs(T, columns, groups)
        elif len(self.rt.plan(T)) == 1:
            inputs = self.rt.host_inputs(T, numpy=True)  # pinned staging of this step: fill in place
            for name, col in columns:
                inputs[name][:] = col
        else:  # a sliced step cannot use one staging view; the runtime packs each slice
            inputs = {name: torch.tensor(col, dtype=self.rt.input_specs[name].dtype) for name, col in columns}
        if dev is not None:
            dev.begin()
        clk.mark("stage")
        res = self.rt.step(**inputs)
        clk.mark("step")
        if dev is not None:
            dev.end()
        tokens = lane.tokens_host[:T]
        tokens.copy_(res.outputs["tokens"], non_blocking=True)
        done = None
        if self.model.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self.steps += 1
        clk.mark("queue")
        return _InFlight(groups, cols, res.host_rows, tokens, done)

    def _device_step_inputs(self, T: int, columns, groups: list[_Group]) -> dict[str, torch.Tensor]:
        """A step's inputs with the drafts' q: the q rows stay on the device (copied into
        the arena's ``draft_q`` rows, zeros where no q: a one-hot q), the columns follow
        them in (one copy each). A sliced step gets tensors the runtime packs instead."""
        single = len(self.rt.plan(T)) == 1
        if single:
            inputs = self.rt.device_inputs(T)
            for name, col in columns:
                inputs[name].copy_(torch.tensor(col, dtype=inputs[name].dtype))
            dq = inputs["draft_q"]
            dq.zero_()
        else:
            inputs = {name: torch.tensor(col, dtype=self.rt.input_specs[name].dtype) for name, col in columns}
            dq = inputs["draft_q"] = torch.zeros(T, self.model.config.vocab, dtype=torch.float32)
        for g in groups:
            if g.q is not None and g.n > 1:
                dq[g.row0:g.row0 + g.n - 1].copy_(g.q)
        return inputs

    def _finish(self, lane: _Lane, fl: _InFlight) -> None:
        """The one wait of a step, then: committed tokens and rows per sequence, drafter
        feedback, retirement. Releases the host-row slot at the end. Phases wait, read,
        observe, retire (what ran before this call is charged to loop)."""
        clk = self.phase_clock
        clk.mark("loop")
        if fl.done is not None:
            fl.done.synchronize()  # covers the gather too: it ran earlier on the same stream
        clk.mark("wait")
        c = self._committed(fl)
        clk.mark("read")
        if c is not None:
            self.drafter.observe(c)
        clk.mark("observe")
        fl.handle.release()
        for seq in [s for s in lane.seqs if s.done]:
            lane.seqs.remove(seq)
            self.model.free_seq(seq.slot)  # its blocks serve the next sequences
            self._free_slots.append(seq.slot)
            self.drafter.forget(seq)
            self.finished.append(seq)
        clk.mark("retire")

    def _committed(self, fl: _InFlight) -> CommittedRows | None:
        """Match the step's committed rows to its groups (RuntimeError when they do not
        fit: a verify group commits a prefix of 1 .. n rows, a prompt chunk its last row
        iff it ends the prompt), append the tokens, count, and record rows if asked.
        Work per group (list slices), none per row in Python."""
        idx = fl.handle.indices().tolist()
        rows, out = fl.handle.rows(), fl.tokens.numpy()
        committed = out[idx].tolist()
        toks_in = fl.cols[0]
        seqs, first, counts, group, fed, positions, j = [], [], [], [], [], [], 0
        for g in fl.groups:
            j0, end = j, g.row0 + g.n
            while j < len(idx) and idx[j] < end:
                j += 1
            c = j - j0
            if g.verify:  # the longest matching draft prefix plus one row: row0 .. row0 + c - 1
                ok = 1 <= c <= g.n and idx[j0:j] == list(range(g.row0, g.row0 + c))
            else:  # a prompt chunk: only the last row of the whole prompt asks for a token
                ok = idx[j0:j] == ([end - 1] if g.ends else [])
            if not ok:
                raise RuntimeError(f"sequence {g.seq.uid}: committed rows {idx[j0:j]} do not fit its rows "
                                   f"[{g.row0}, {end})")
            if not c:
                continue  # a prompt chunk that does not end the prompt commits nothing
            g.seq.tokens += committed[j0:j]
            if self.record_rows:  # the slot is reused after release
                g.seq.rows.append(rows[j0:j].clone())
            if g.verify:
                self.hist[c - 1] += 1
                self.proposed += g.n - 1
                self.accepted += c - 1
                self.proposed_at[:g.n - 1] += 1  # draft j (0-based) was proposed ...
                self.accepted_at[:c - 1] += 1  # ... and accepted (the drafts before it were too)
            r0 = idx[j0]  # the committed rows are consecutive: r0 .. r0 + c - 1 (checked above)
            group += [len(seqs)] * c
            fed += toks_in[r0:r0 + c]
            positions += range(g.pos0 + r0 - g.row0, g.pos0 + r0 - g.row0 + c)
            seqs.append(g.seq)
            first.append(g.pos0 + r0 - g.row0)
            counts.append(c)
        if j != len(idx):
            raise RuntimeError(f"committed rows {idx[j:]} lie past the step's {len(fl.cols[0])} rows")
        self.tokens += len(idx)
        self.rows += len(idx)
        if not idx:
            return None
        arr = lambda v: np.array(v, np.int64)  # noqa: E731
        return CommittedRows(seqs, arr(first), arr(counts), rows, arr(fed), arr(committed), arr(positions), arr(group))
