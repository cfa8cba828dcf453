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
buffer per lane, because a step's outputs die at the next step.

Lifetimes: ``StepResult.outputs`` are valid until the next ``rt.step`` (the runner copies
``tokens`` to pinned memory right behind the step); host rows (``handle.rows()``) are
valid until ``handle.release()``, which the runner calls once the drafter has read them
(the drafter copies what it keeps).
"""
from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np
import torch

from .errors import InputError, expected
from .host_rows import HostRows, HostRowsHandle
from .models.toy import ToyDecoder
from .runtime import GraphRuntime


@dataclass(frozen=True)
class Request:
    """A prompt and how many tokens to generate for it."""

    prompt: tuple[int, ...]
    max_new: int


@dataclass
class Sequence:
    """One request while it is served. ``tokens`` = prompt + generated; the last token is
    committed but not fed yet (its K/V is written by the next step). ``slot`` is the
    model's sequence id (KV cells), free again once the sequence retires."""

    uid: int
    slot: int
    prompt: tuple[int, ...]
    max_new: int
    tokens: list[int]
    prefilled: int = 0  # prompt tokens already placed in a step
    rows: list[torch.Tensor] = field(default_factory=list)  # committed hidden rows, if recorded

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def decoding(self) -> bool:
        return len(self.tokens) > len(self.prompt)

    @property
    def done(self) -> bool:
        return len(self.tokens) - len(self.prompt) >= self.max_new


class ToyDrafter:
    """A drafter that is right with probability ``accept_prob`` per draft token.

    It knows the toy's greedy rule (``model.design_next``) and, per draft, proposes the
    true continuation or (with probability ``1 - p``) a wrong token, so acceptance varies
    from step to step. It consumes the committed hidden rows the previous step shipped:
    ``observe`` checks there is one row per committed token and that each row still
    encodes its input token (the toy's residual keeps the token code, so
    ``row . emb[token]`` is ~32 for the right token and <= ~18 for any other), and
    ``propose`` refuses to draft for a sequence whose latest rows it has not seen.
    Deterministic: one RNG per sequence, seeded by ``(seed, uid)``.
    """

    def __init__(self, model: ToyDecoder, accept_prob: float, seed: int = 0):
        if not 0.0 <= accept_prob <= 1.0:
            raise InputError(expected("accept_prob", "a probability in [0, 1]", accept_prob))
        self.model, self.p, self.seed = model, accept_prob, seed
        self._emb = model.emb.float().cpu()  # host copy: the check runs on the host
        self._seen: dict[int, int] = {}  # uid -> len(tokens) when its rows were observed
        self._rng: dict[int, np.random.Generator] = {}

    def observe(self, seq: Sequence, first_pos: int, rows: torch.Tensor) -> None:
        """Rows ``[n, n_taps * H]`` of positions ``first_pos ..`` (a view of a ring slot,
        valid only during this call: copy what you keep)."""
        n = len(seq.tokens) - 1 - first_pos
        if rows.shape[0] != n:
            raise RuntimeError(f"sequence {seq.uid}: {rows.shape[0]} host rows for {n} committed tokens")
        fed = torch.tensor(seq.tokens[first_pos:first_pos + n])
        code = self._emb[fed]  # [n, H]: what the first tap's rows must encode
        score = (rows[:, :code.shape[1]].float() * code).sum(1)
        if not bool((score > 0.75 * (code * code).sum(1)).all()):
            raise RuntimeError(f"sequence {seq.uid}: host rows do not encode the fed tokens at "
                               f"positions {first_pos}..{first_pos + n - 1}")
        self._seen[seq.uid] = len(seq.tokens)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """``k`` draft tokens continuing ``seq.tokens``."""
        if self._seen.get(seq.uid) != len(seq.tokens):
            raise RuntimeError(f"sequence {seq.uid}: drafting before its committed rows were observed")
        rng = self._rng.setdefault(seq.uid, np.random.default_rng([self.seed, seq.uid]))
        vocab, out = self.model.config.vocab, []
        prev, cur = seq.tokens[-2], seq.tokens[-1]  # a decoding sequence has >= 2 tokens
        for _ in range(k):
            truth = self.model.design_next(prev, cur)
            draft = truth if rng.random() < self.p else (truth + 1 + int(rng.integers(vocab - 1))) % vocab
            out.append(draft)
            prev, cur = cur, draft
        return out

    def forget(self, seq: Sequence) -> None:
        self._seen.pop(seq.uid, None)
        self._rng.pop(seq.uid, None)


class ReferenceDrafter:
    """A drafter for any model (the transformers ones included) that is right with
    probability ``accept_prob`` per draft token, so acceptance stays controlled.

    Its "truth" is the model's own plain greedy decoding (``model.greedy_generate``, e.g.
    ``generate(do_sample=False)``) of each sequence, planned once per prompt (``prepare``,
    before timing) and re-planned from the sequence's tokens when the served output leaves
    the plan (a near-tie that rounded the other way: rare, and the runtime's own greedy
    token always wins, so the output stays plain greedy decoding whatever is drafted).
    A wrong draft is the truth plus a random non-zero offset. ``observe`` checks one finite
    host row per committed token; ``propose`` refuses to draft before they were observed.
    Deterministic: one RNG per sequence, seeded by ``(seed, uid)``.
    """

    def __init__(self, model, accept_prob: float, seed: int = 0):
        if not 0.0 <= accept_prob <= 1.0:
            raise InputError(expected("accept_prob", "a probability in [0, 1]", accept_prob))
        self.model, self.p, self.seed = model, accept_prob, seed
        self._plans: dict[tuple[int, ...], list[int]] = {}  # prompt or prefix -> full token list
        self._seen: dict[int, int] = {}
        self._rng: dict[int, np.random.Generator] = {}
        self._cur: dict[int, list[int]] = {}  # uid -> the plan its drafts follow
        self.replans = 0

    def prepare(self, requests) -> None:
        """Plan every request's greedy continuation now (outside any timed run)."""
        for r in requests:
            self._plan(list(r.prompt), r.max_new)

    def _plan(self, tokens: list[int], n: int) -> list[int]:
        key = tuple(tokens)
        if key not in self._plans:
            n = max(0, min(n, self.model.config.max_len + 1 - len(tokens)))
            self._plans[key] = list(tokens) + (self.model.greedy_generate(list(tokens), n) if n else [])
        return self._plans[key]

    def observe(self, seq: Sequence, first_pos: int, rows: torch.Tensor) -> None:
        n = len(seq.tokens) - 1 - first_pos
        if rows.shape[0] != n:
            raise RuntimeError(f"sequence {seq.uid}: {rows.shape[0]} host rows for {n} committed tokens")
        if not bool(torch.isfinite(rows.float()).all()):
            raise RuntimeError(f"sequence {seq.uid}: non-finite host rows at positions {first_pos}..{first_pos + n - 1}")
        self._seen[seq.uid] = len(seq.tokens)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        if self._seen.get(seq.uid) != len(seq.tokens):
            raise RuntimeError(f"sequence {seq.uid}: drafting before its committed rows were observed")
        if k == 0:
            return []
        rng = self._rng.setdefault(seq.uid, np.random.default_rng([self.seed, seq.uid]))
        toks = seq.tokens
        plan = self._cur.get(seq.uid) or self._plan(list(seq.prompt), seq.max_new)
        if plan[:len(toks)] != toks:  # the output left the plan: plan again from here
            self.replans += 1
            plan = self._plan(list(toks), seq.max_new - len(seq.generated))
        self._cur[seq.uid] = plan
        vocab, out = self.model.config.vocab, []
        for i in range(k):
            j = len(toks) + i
            truth = plan[j] if j < len(plan) else 0
            out.append(truth if rng.random() < self.p else (truth + 1 + int(rng.integers(vocab - 1))) % vocab)
        return out

    def forget(self, seq: Sequence) -> None:
        self._seen.pop(seq.uid, None)
        self._rng.pop(seq.uid, None)
        self._cur.pop(seq.uid, None)


@dataclass(frozen=True)
class _Group:
    """The rows one sequence has in a step: ``[row0, row0 + n)`` at positions ``pos0 ..``."""

    seq: Sequence
    row0: int
    n: int
    pos0: int
    verify: bool


@dataclass
class _InFlight:
    """A launched step: what the host needs after its one wait."""

    groups: list[_Group]
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


# Host phases of a run, in the order one lane's turn goes through them (names are the
# runner's own methods and calls): admit = _admit; draft = drafter.propose; build = the
# rows' columns (_build minus drafting); stage = host_inputs + fill, or packing the
# tensors of a sliced step; step = rt.step; queue = the tokens' copy to pinned memory and
# the event behind it; wait = the one wait of a step; read = indices, rows and tokens to
# Python, matching rows to sequences, appending tokens, record_rows copies; observe =
# drafter.observe; retire = handle.release and retiring finished sequences; loop = the
# rest of run() (the lane loop, the report).
PHASES = ("admit", "draft", "build", "stage", "step", "queue", "wait", "read", "observe", "retire", "loop")


class PhaseClock:
    """A stopwatch whose laps are charged to named phases: ``mark(name)`` charges the time
    since the previous mark (or ``start``) to ``name``. Every moment between ``start`` and
    the last mark is charged to exactly one phase, so the phases sum to that span (up to
    float rounding). Costs one ``time.perf_counter`` call and a dict update per mark.
    ``clock`` is injectable (tests use a fake one). One host thread; not reentrant."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._last = 0.0

    def start(self) -> float:
        """Zero every phase and start the first lap now; returns the start time."""
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._last = self.clock()
        return self._last

    def mark(self, name: str) -> float:
        """Charge the lap since the previous mark to ``name``; returns now."""
        now = self.clock()
        self.totals[name] += now - self._last
        self._last = now
        return now


class DeviceTimer:
    """Device time of the steps of one run: a pair of timing CUDA events recorded around
    each ``rt.step`` on the current stream (the runtime's), read once after the run, never
    per step. Event pairs are pooled and reused by later runs (no allocation once the pool
    is as long as a run). A start event recorded on an idle stream also counts step()'s
    host work before its launch, so the figure is an upper bound of the device's busy
    time by at most that much per step. CUDA only (the runner makes none on a CPU)."""

    def __init__(self):
        self._pool: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._n = 0

    def reset(self) -> None:
        self._n = 0

    def begin(self) -> None:
        if self._n == len(self._pool):
            self._pool.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        self._pool[self._n][0].record()

    def end(self) -> None:
        self._pool[self._n][1].record()
        self._n += 1

    def seconds(self) -> float | None:
        """Sum of the recorded steps' device time (waits for the last one); None if none."""
        if not self._n:
            return None
        self._pool[self._n - 1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self._pool[:self._n]) / 1e3


@dataclass(frozen=True)
class RunReport:
    """Counters since ``reset_stats`` (``seconds``: the ``run`` call): steps launched,
    tokens generated, accepted
    drafts per verify group (``accept_hist[a]`` groups accepted ``a`` drafts), drafts
    proposed and accepted, committed host rows the drafter consumed.

    Of this ``run`` call only: ``run_steps`` launched; ``phases`` = host seconds per
    phase (:data:`PHASES`; they sum to ``seconds`` up to float rounding, see
    :class:`PhaseClock`); ``device_seconds`` = the steps' device time from CUDA events and
    ``gpu_busy`` = ``device_seconds / seconds`` (both None on a CPU, or when the run
    launched no step)."""

    steps: int
    tokens: int
    seconds: float
    accept_hist: tuple[int, ...]
    proposed: int
    accepted: int
    rows: int
    run_steps: int = 0
    phases: dict[str, float] = field(default_factory=dict, hash=False)
    device_seconds: float | None = None
    gpu_busy: float | None = None

    def phase_us_per_step(self) -> dict[str, float]:
        """Host µs per launched step of this call, per phase (empty when none launched)."""
        if not self.run_steps:
            return {}
        return {name: s * 1e6 / self.run_steps for name, s in self.phases.items()}

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0


def make_runtime(model: ToyDecoder, *, graphs: bool, rows_per_step: int, depth: int = 3) -> GraphRuntime:
    """The runtime a runner steps: ``model.verify_step`` with device-chosen host rows (the
    committed rows, ``accept_rows[:accept_count]``, gathered inside the replay)."""
    hr = HostRows(source="hidden", mode="device", rows_output="accept_rows", count_output="accept_count",
                  capacity=rows_per_step, depth=depth)
    return GraphRuntime(model.verify_step, model.inputs(verify=True), graphs=graphs, device=model.device,
                        host_rows=hr)


class SpecRunner:
    """Serves requests with speculative decoding through one GraphRuntime.

    ``k`` drafts per sequence and step; at most ``slots`` sequences at once (default the
    model's ``max_seqs``), split over ``lanes``; ``chunk`` prompt rows per lane step (more
    than the runtime's dynamic limit, 96 by default, makes a sliced step).
    ``record_rows`` keeps a copy of every committed hidden row per sequence (for checks).
    The drafter has ``observe(seq, first_pos, rows)`` (the committed rows of positions
    ``first_pos ..``, valid during the call), ``propose(seq, k) -> k tokens`` and
    ``forget(seq)``; see :class:`ToyDrafter`. The runner owns ``self.rt`` (its graphs and
    pinned buffers live as long as the runner); one host thread drives it.

    Raises InputError for a configuration whose verify rows would not fit the first slice
    of a step (acceptance is decided per slice, so a sequence's rows must share one);
    ``submit`` raises it for a request that does not fit the model.
    """

    def __init__(self, model: ToyDecoder, drafter, *, k: int = 4, slots: int | None = None, lanes: int = 2,
                 chunk: int = 128, graphs: bool = False, record_rows: bool = False):
        slots = slots or model.config.max_seqs
        if not (1 <= lanes <= slots <= model.config.max_seqs):
            raise InputError(expected("lanes, slots", f"1 <= lanes <= slots <= {model.config.max_seqs}",
                                      (lanes, slots)))
        if k < 0 or chunk < 1:
            raise InputError(expected("k, chunk", "k >= 0 and chunk >= 1", (k, chunk)))
        self.model, self.drafter, self.k, self.chunk, self.record_rows = model, drafter, k, chunk, record_rows
        caps = [slots // lanes + (i < slots % lanes) for i in range(lanes)]
        # A step commits at most k + 1 rows per sequence; while one lane steps, every other
        # lane holds its in-flight step's ring slot, so the ring needs >= lanes slots.
        self.rt = make_runtime(model, graphs=graphs, rows_per_step=max(caps) * (k + 1), depth=max(3, lanes))
        if max(caps) * (k + 1) > self.rt.dynamic_limit:  # verify rows go first: they must fit slice 0
            raise InputError(expected("k", f"(k + 1) * {max(caps)} sequences per lane <= {self.rt.dynamic_limit}", k))
        pin = model.device.type == "cuda"
        self.lanes = [_Lane(c, torch.empty(c * (k + 1) + chunk, dtype=torch.int64, pin_memory=pin)) for c in caps]
        self.waiting: deque[tuple[int, Request]] = deque()
        self.finished: list[Sequence] = []
        self._free_slots = list(range(slots))
        self._next_uid = 0
        self.phase_clock = PhaseClock()  # replace it (PhaseClock(clock=...)) to time on another clock
        self._device_timer = DeviceTimer() if model.device.type == "cuda" else None
        self.reset_stats()

    # -- public --------------------------------------------------------------------------
    def submit(self, requests) -> list[int]:
        """Queue requests; returns their uids. InputError if one does not fit the model."""
        uids, cfg = [], self.model.config
        for r in requests:
            if not r.prompt or r.max_new < 1 or len(r.prompt) + r.max_new - 1 > cfg.max_len:
                raise InputError(expected("request", f"a prompt and max_new >= 1 within {cfg.max_len} positions",
                                          (len(r.prompt), r.max_new)))
            if not all(0 <= t < cfg.vocab for t in r.prompt):
                raise InputError(expected("request.prompt", f"token ids in [0, {cfg.vocab})", r.prompt))
            self.waiting.append((self._next_uid, r))
            uids.append(self._next_uid)
            self._next_uid += 1
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
        t0, steps0 = clk.start(), self.steps
        if dev is not None:
            dev.reset()
        while True:
            busy = False
            for lane in self.lanes:
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
                    lane.inflight = self._launch(lane, groups, cols)
                    busy = True
            if not busy and all(lane.inflight is None for lane in self.lanes):
                break
        return self._report(t0, self.steps - steps0)

    def _report(self, t0: float, run_steps: int) -> RunReport:
        """The report of a run that started at ``t0`` (phase clock) and launched
        ``run_steps``; its last lap (this) is charged to ``loop``. Reading the device
        timer waits for the last step, which the run already waited for."""
        hist = tuple(self.hist[a] for a in range(self.k + 1))
        dev = self._device_timer.seconds() if self._device_timer is not None else None
        seconds = self.phase_clock.mark("loop") - t0
        busy = dev / seconds if dev is not None and seconds > 0 else None
        return RunReport(self.steps, self.tokens, seconds, hist, self.proposed, self.accepted, self.rows,
                         run_steps, dict(self.phase_clock.totals), dev, busy)

    def reset_stats(self) -> None:
        """Zero the counters and forget finished sequences (e.g. after a warm-up)."""
        self.steps = self.tokens = self.proposed = self.accepted = self.rows = 0
        self.hist: Counter[int] = Counter()
        self.finished = []

    # -- one step --------------------------------------------------------------------------
    def _admit(self, lane: _Lane) -> None:
        """Waiting prompts join while the lane has room (a retired sequence's slot is reused:
        the new sequence feeds positions from 0, so the old cells stay invisible)."""
        while len(lane.seqs) < lane.cap and self.waiting and self._free_slots:
            uid, r = self.waiting.popleft()
            lane.seqs.append(Sequence(uid, self._free_slots.pop(0), r.prompt, r.max_new, list(r.prompt)))

    def _build(self, lane: _Lane) -> tuple[list[_Group], dict[str, list[int]]]:
        """The lane's next step as columns: verify rows first (so every sequence's verify
        rows sit in the first slice even when a wide prefill gets sliced), then prefill
        chunks up to ``chunk`` rows."""
        cols: dict[str, list[int]] = {n: [] for n in ("tokens", "positions", "seq_ids", "cells", "want", "next_tokens")}
        groups: list[_Group] = []

        def add(seq: Sequence, toks: list[int], pos0: int, want: list[int], nxt: list[int], verify: bool) -> None:
            groups.append(_Group(seq, len(cols["tokens"]), len(toks), pos0, verify))
            pos = range(pos0, pos0 + len(toks))
            for name, vals in (("tokens", toks), ("positions", pos), ("seq_ids", [seq.slot] * len(toks)),
                               ("cells", [self.model.cell_for(seq.slot, p) for p in pos]), ("want", want),
                               ("next_tokens", nxt)):
                cols[name] += vals

        clk = self.phase_clock
        for seq in lane.seqs:
            if seq.decoding:
                k = min(self.k, seq.max_new - len(seq.generated) - 1)  # never draft past the limit
                clk.mark("build")
                drafts = self.drafter.propose(seq, k)
                clk.mark("draft")
                toks = [seq.tokens[-1]] + drafts
                add(seq, toks, len(seq.tokens) - 1, [1] * len(toks), toks[1:] + [-1], True)
        budget = self.chunk
        for seq in lane.seqs:
            n = min(budget, len(seq.prompt) - seq.prefilled)
            if not seq.decoding and n > 0:
                last = seq.prefilled + n == len(seq.prompt)
                add(seq, list(seq.prompt[seq.prefilled:seq.prefilled + n]), seq.prefilled,
                    [0] * (n - 1) + [int(last)], [-1] * n, False)
                seq.prefilled += n
                budget -= n
        return groups, cols

    def _launch(self, lane: _Lane, groups: list[_Group], cols: dict[str, list[int]]) -> _InFlight:
        """Stage, step (asynchronous on CUDA), and queue the copy of the tokens to pinned
        memory behind it: ``outputs`` die at the next step, which another lane launches
        before this one is read. Phases stage, step, queue; on CUDA the device timer's
        events bracket ``rt.step``."""
        clk, dev = self.phase_clock, self._device_timer
        T = len(cols["tokens"])
        if len(self.rt.plan(T)) == 1:
            inputs = self.rt.host_inputs(T)  # pinned staging of this step: fill in place, no packing
            for name, v in cols.items():
                inputs[name].numpy()[:] = v
        else:  # a sliced step cannot use one staging view; the runtime packs each slice
            inputs = {name: torch.tensor(v, dtype=torch.int64) for name, v in cols.items()}
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
        return _InFlight(groups, res.host_rows, tokens, done)

    def _finish(self, lane: _Lane, fl: _InFlight) -> None:
        """The one wait of a step, then: committed tokens and rows per sequence, drafter
        feedback, retirement. Releases the host-row slot at the end. Phases wait, read,
        observe, retire (what ran before this call is charged to loop)."""
        clk = self.phase_clock
        clk.mark("loop")
        if fl.done is not None:
            fl.done.synchronize()  # covers the gather too: it ran earlier on the same stream
        clk.mark("wait")
        idx, rows, tokens = fl.handle.indices().tolist(), fl.handle.rows(), fl.tokens.tolist()
        j = 0
        for g in fl.groups:
            j0 = j
            while j < len(idx) and idx[j] < g.row0 + g.n:
                j += 1
            got = idx[j0:j]
            if g.verify:  # the longest matching draft prefix plus one row: row0 .. row0 + c - 1
                ok = 1 <= len(got) <= g.n and got == list(range(g.row0, g.row0 + len(got)))
            else:  # a prompt chunk: only the last row of the whole prompt asks for a token
                ok = got == ([g.row0 + g.n - 1] if g.pos0 + g.n == len(g.seq.prompt) else [])
            if not ok:
                raise RuntimeError(f"sequence {g.seq.uid}: committed rows {got} do not fit its rows "
                                   f"[{g.row0}, {g.row0 + g.n})")
            if not got:
                continue  # a prompt chunk that does not end the prompt commits nothing
            first_pos = g.pos0 + (got[0] - g.row0)
            g.seq.tokens += [tokens[i] for i in got]
            clk.mark("read")
            self.drafter.observe(g.seq, first_pos, rows[j0:j])
            clk.mark("observe")
            if self.record_rows:
                g.seq.rows.append(rows[j0:j].clone())  # the slot is reused after release
            self.tokens += len(got)
            self.rows += len(got)
            if g.verify:
                self.hist[len(got) - 1] += 1
                self.proposed += g.n - 1
                self.accepted += len(got) - 1
        clk.mark("read")
        fl.handle.release()
        for seq in [s for s in lane.seqs if s.done]:
            lane.seqs.remove(seq)
            self._free_slots.append(seq.slot)
            self.drafter.forget(seq)
            self.finished.append(seq)
        clk.mark("retire")
