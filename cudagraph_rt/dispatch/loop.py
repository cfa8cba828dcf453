"""DeviceLoop: serve requests with the speculative rounds dispatched on the device.

The host admits requests into the model's sequence slots, prefills their prompts with
one ordinary step of the runtime, reserves KV blocks ahead, then launches the loop: up to
``rounds`` rounds of draft -> verify -> accept -> commit with no host work in between
(one outer-graph launch on CUDA with conditional nodes; the same rounds driven by the host
otherwise). After a launch it reads the ring (every round's committed tokens and hidden
rows), appends them to the sequences, retires the finished ones and launches again.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from ..checks import as_bool, as_int, token_ids
from ..errors import CapacityError, InputError, expected
from ..graphs import Graphs, as_graphs
from ..models.protocol import Decoder
from ..runtime import GraphRuntime
from ..sampling_params import SamplingParams
from ..speculative.intake import blocks_for, check_request
from ..speculative.loop_drafter import LoopDrafter
from ..widths import check_widths, default_dynamic_limit, default_widths
from .rounds import EAGER_ROUNDS, EventSpans, HostRounds, RoundBody, RoundOps, compiled_rounds
from .state import SAMPLING, Finish, LoopReadback, LoopRing, LoopShape, LoopState, RingMirror, RoundRows, Stop

log = logging.getLogger(__name__)


PROMPT_ROWS = 512  # a prompt step up to this many rows runs as one step (the dynamic path), wider ones sliced
MAX_ROUNDS = 1 << 16  # rounds per launch and ring entries: the ring holds an entry of rows per round


class LoopError(CapacityError):
    """The loop stopped on something the host cannot continue past (a bad token id from
    the drafter, a KV pool with no block for the next round). Raised after the rounds
    before it were read: every sequence's committed tokens and rows are intact
    (``DeviceLoop.sequences``), the failing round's step never ran."""


@dataclass
class LoopSequence:
    """One request while it is served: ``tokens`` = prompt + generated (the last one
    committed, not fed yet); ``rows``: its committed hidden rows when recorded; ``accepts``:
    rows committed per round (1 + accepted drafts)."""

    uid: int
    slot: int
    prompt: tuple[int, ...]
    max_new: int
    tokens: list[int]
    accepts: list[int] = field(default_factory=list)
    finish: Finish = Finish.NOT
    sampling: SamplingParams = SamplingParams()
    _blocks: list[torch.Tensor] = field(default_factory=list, repr=False)  # [n, hidden] per read, not split yet
    _rows: list[torch.Tensor] = field(default_factory=list, repr=False)

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def rows(self) -> list[torch.Tensor]:
        """Its committed hidden rows when recorded, in order: each ``[1, hidden]`` on the
        host with storage of its own (split off the launches' copies at the first access
        after them, not while the loop serves)."""
        if self._blocks:
            self._rows.extend(r.clone() for b in self._blocks for r in b.split(1))
            self._blocks.clear()
        return self._rows

    def add_rows(self, block: torch.Tensor) -> None:
        """Append committed rows ``[n, hidden]``: a host tensor (or a view of one) that
        nothing writes again."""
        self._blocks.append(block)


@dataclass(frozen=True)
class LaunchReport:
    """One launch: the rounds it ran, the tokens it committed, why it stopped and, on CUDA,
    its device time (events around the launch; None elsewhere)."""

    rounds: int
    tokens: int
    stop: Stop
    device_seconds: float | None = None


def _check_parts(model, drafter, on_tokens, round_ops) -> None:
    if on_tokens is not None and not callable(on_tokens):
        raise InputError(expected("on_tokens", "a callable (uid, tokens) or None", type(on_tokens).__name__))
    if not isinstance(drafter, LoopDrafter) or not drafter.fits(model):
        raise InputError(expected("drafter", "a LoopDrafter built for this model (drafts drawn on the device: "
                                             "CoinRounds, PlanRounds)", type(drafter).__name__))
    if round_ops is not None and not (isinstance(round_ops, RoundOps) and callable(round_ops.plan)
                                      and callable(round_ops.commit)):
        raise InputError(expected("round_ops", "a RoundOps (EAGER_ROUNDS, compiled_rounds()) or None",
                                  type(round_ops).__name__))


def _entry_rows(counts: list[int], slots: list[int], W: int, first: int = 0):
    """Each ring entry from ``first`` on (entry ``e`` holds rows ``e * W`` onwards, ``counts[e]``
    of them) as ``{slot: its row indices}``, slots in order of their first row."""
    for e in range(first, len(counts)):
        per: dict[int, list[int]] = {}
        for r in range(e * W, e * W + counts[e]):
            per.setdefault(slots[r], []).append(r)
        yield per


def _loop_widths(widths, rows: int) -> tuple[int, ...]:
    ws = default_widths(1 << max(0, rows - 1).bit_length()) if widths is None else check_widths(widths)
    if ws[-1] < rows:
        raise InputError(expected("widths", f"a widest width >= slots * (k + 1) = {rows} (a round's rows)", ws))
    return ws


class DeviceLoop:
    """Serves requests with ``k`` drafts per sequence and round on ``model`` (a Decoder on a
    KV pool; ``slots`` of its sequence ids serve at once, default its ``max_seqs``), the
    drafts drawn on the device by ``drafter`` (a ``speculative.loop_drafter.LoopDrafter``:
    ``CoinRounds`` for the toy, ``PlanRounds`` for any model).

    ``graphs``: "emulate" (the loop's semantics on any device, a CPU included) or True (CUDA
    graphs; the outer graph of conditional nodes where :func:`.support.conditional_support`
    allows, else the host-driven rounds, with a log message naming what is missing).
    ``rounds``: rounds per launch; ``depth``: ring entries (default ``rounds``);
    ``stop_tokens``: ids that end a sequence (the stop token is kept); ``record_rows``: keep
    each committed hidden row, on the host (copied once a launch has ended). ``sampling``:
    the verify step samples each row with its request's ``SamplingParams`` (rejection
    sampling of the drafts, deterministic ones: q one-hot) and ``seed`` seeds the requests
    that give none, as ``SpecRunner`` does (the same seed and drafts give its tokens);
    without it, requests must be greedy. The loop owns ``self.rt`` (its graphs, its pinned
    buffers); ``self.note`` says how its rounds run (one outer graph, host-driven and why,
    emulated). ``on_tokens(uid, tokens)``: each
    sequence's tokens as they are committed, in order, each once: the first at its prompt's
    step, then each round's while the launch runs on (every round's commit copies the
    ring's tokens to a pinned mirror the host polls; without it the host reads them after
    the launch). Called on the host; an exception it raises stops the loop (LoopError).
    ``round_ops``: how each round's plan and commit run (:class:`.rounds.RoundOps`; default:
    compiled by torch.compile with CUDA graphs, eager when emulated). A prompt step of up to
    ``PROMPT_ROWS`` rows runs as one step, wider ones in slices.
    Raises InputError for bad arguments, before the model's pool is touched."""

    def __init__(self, model, drafter, *, k: int = 4, graphs="emulate", rounds: int = 64, depth: int | None = None,
                 stop_tokens=(), widths=None, record_rows: bool = False, conditional: bool = True,
                 slots: int | None = None, sampling: bool = False, seed: int = 0, on_tokens=None,
                 round_ops: RoundOps | None = None):
        if not isinstance(model, Decoder):
            raise InputError(expected("model", "a Decoder (a model on a KV pool)", type(model).__name__))
        cfg = model.config
        k = as_int("k", k, 0, cfg.max_len - 1)
        rounds = as_int("rounds", rounds, 1, MAX_ROUNDS)
        S = cfg.max_seqs if slots is None else as_int("slots", slots, 1, cfg.max_seqs)
        depth = rounds if depth is None else as_int("depth", depth, 1, MAX_ROUNDS)
        stops = token_ids("stop_tokens", stop_tokens, cfg.vocab)
        record_rows, conditional = as_bool("record_rows", record_rows), as_bool("conditional", conditional)
        _check_parts(model, drafter, on_tokens, round_ops)
        mode = as_graphs(graphs)
        if mode is Graphs.OFF:
            raise InputError(expected("graphs", "True or 'emulate' (the loop replays captured widths)", graphs))
        graphs = True if mode is Graphs.ON else "emulate"
        pool = model.pool
        ws = _loop_widths(widths, S * (k + 1))
        self.sampling, self.seed = as_bool("sampling", sampling), as_int("seed", seed, 0, 2**63 - 1)
        self.model, self.k, self.rounds, self.record_rows = model, k, rounds, record_rows
        specs = model.inputs(verify=True, sampling=self.sampling)
        self.rt = GraphRuntime(_RowOutputs(model.verify_step), specs, widths=ws, graphs=graphs,
                               device=model.device, keep_graphs=graphs is True,
                               dynamic_limit=max(default_dynamic_limit(ws), min(S * cfg.max_len, PROMPT_ROWS)))
        self.shape = LoopShape(S, k, ws, model.config.vocab, pool.block_size, model.scratch_cell, depth)
        self.state = LoopState(S, stops, model.device)
        self.rows = RoundRows(self.shape, model.device)
        self.ring = LoopRing(self.shape, model.hidden_width, model.config.dtype, model.device)
        self.readback = LoopReadback(self.ring, self.state, model.device)
        self._stop_tokens = frozenset(stops)
        self.on_tokens = on_tokens
        if on_tokens is not None:
            self.ring.mirror = RingMirror(self.ring, model.device)
        self._streamed = 0  # mirror entries of this launch already handed to on_tokens
        self._got: dict[str, list[int]] = {}  # what the last drain read back
        self.rt.capture()
        if round_ops is None:
            round_ops = compiled_rounds() if graphs is True else EAGER_ROUNDS
        self.body = RoundBody(self.rt, self.state, self.rows, self.ring, self.shape, pool.block_table, drafter,
                              round_ops)
        self.runner = self._runner(graphs, conditional)
        self.waiting: deque = deque()
        self.sequences: dict[int, LoopSequence] = {}  # slot -> the sequence it serves
        self.finished: list[LoopSequence] = []
        self.launches: list[LaunchReport] = []
        self.prefills = 0  # the prompts' steps (one per admission round)
        self.prefill_device_seconds: float | None = None  # their device time (CUDA)
        self._next_uid = 0

    def _runner(self, graphs, conditional: bool):
        """The rounds' runner, and ``self.note``: why the rounds run as they do."""
        if graphs is True and conditional:
            from .support import conditional_support
            support = conditional_support()
            if support.ok:
                from .conditional import ConditionalRounds
                self.note = "one launch of the outer graph (conditional nodes) runs up to `rounds` rounds"
                return ConditionalRounds(self.body)
            log.warning("device dispatch: %s; the rounds run host-driven", support.message)
            self.note = f"host-driven rounds: {support.message}"
        elif graphs is True:
            self.note = "host-driven rounds (conditional=False)"
        else:
            self.note = "emulated (graphs='emulate'): the host runs the WHILE / SWITCH semantics round by round"
        return HostRounds(self.body)

    # -- public ------------------------------------------------------------------------
    def submit(self, requests) -> list[int]:
        """Queue requests (``prompt``, ``max_new``, optional ``sampling``: a SamplingParams,
        greedy by default, its seed resolved here as ``SpecRunner`` resolves it); their uids.
        All or none (InputError)."""
        reqs = []
        if isinstance(requests, (str, bytes)) or not hasattr(requests, "__iter__"):
            raise InputError(expected("requests", "an iterable of Requests", type(requests).__name__))
        for i, r in enumerate(list(requests)):
            r = check_request(i, r, self.model, self.sampling, "loop")
            reqs.append((r.prompt, r.max_new, r.sampling))
        uids = list(range(self._next_uid, self._next_uid + len(reqs)))
        reqs = [(prompt, n, sp.seeded(self.seed, uid)) for uid, (prompt, n, sp) in zip(uids, reqs)]
        self.waiting.extend(zip(uids, reqs))
        self._next_uid += len(reqs)
        return uids

    def run(self) -> list[LaunchReport]:
        """Serve until every request is done; the launches' reports. LoopError when a launch
        stops on a bad token or a full pool (see :class:`LoopError`), or when a waiting
        request's worst case needs more KV blocks than the pool has free with nothing
        served (it would wait for ever)."""
        start = len(self.launches)
        while self.waiting or self.sequences:
            admitted = self._admit()
            if self.sequences:
                self.launch()
            elif self.waiting and not admitted:  # (a request that finished at its prefill frees its slot at once)
                uid, (prompt, n, _) = self.waiting[0]
                pool = self.model.pool
                raise LoopError(f"device loop: request {uid} needs {blocks_for(self.model, len(prompt), n)} KV blocks "
                                f"(prompt {len(prompt)}, max_new {n}), the pool has {pool.free_blocks} free of "
                                f"{pool.num_blocks}; it stays queued")
        return self.launches[start:]

    def launch(self) -> LaunchReport:
        """One launch of up to ``rounds`` rounds for the sequences in the slots, read back."""
        self._reserve()
        st = self.state
        for t, v in ((st.status, 0), (st.round, 0), (st.max_rounds, self.rounds),
                     (st.stop_on_retire, int(bool(self.waiting))), (self.ring.head, 0), (st.error, -1)):
            t.fill_(v)
        self.body.unfeed()
        streaming = self.on_tokens is not None
        if streaming:
            self.ring.mirror.reset()
            self._streamed = 0
        try:
            device_seconds = self.runner.run(self._stream) if streaming else self.runner.run()
        except BaseException as e:
            # what the rounds before the failure committed is read back (it stays intact)
            self.launches.append(self._drain())
            if not isinstance(e, Exception):  # KeyboardInterrupt and the like go on as they are
                raise
            raise LoopError(f"device loop: a round failed ({type(e).__name__}: {e}); the rounds before it were read "
                            "back, every sequence's committed tokens are kept") from e
        report = replace(self._drain(), device_seconds=device_seconds)
        self.launches.append(report)
        if streaming:
            try:
                self._stream()  # what the last polls did not see (the launch has ended: all of it)
            except Exception as e:
                raise LoopError(f"device loop: on_tokens failed ({type(e).__name__}: {e}); every sequence's "
                                "committed tokens are kept") from e
        if report.stop == Stop.BAD_TOKEN:
            slot, tok, pos = st.error.tolist()
            raise LoopError(f"device loop: sequence {self.sequences[slot].uid} (slot {slot}) would feed token id "
                            f"{tok} at position {pos}, outside [0, {self.shape.vocab}) (a drafter's bad draft); "
                            "the round did not run, its committed tokens are kept")
        self._retire()
        return report

    # -- between launches (host) ----------------------------------------------------------
    def _admit(self) -> int:
        """Waiting requests join free slots while the pool's free blocks cover every served
        sequence's remaining worst case and theirs (as SpecRunner admits); then one prefill
        step of their prompts, whose last rows give each its first token. Returns how many
        joined."""
        pool, joined = self.model.pool, []
        free = [s for s in range(self.shape.slots) if s not in self.sequences]
        while self.waiting and free:
            uid, (prompt, n, sp) = self.waiting[0]
            slot = free[0]
            self.model.free_seq(slot)
            owed = sum(blocks_for(self.model, len(q.prompt), q.max_new)
                       - sum(b is not None for b in pool.blocks(q.slot)) for q in self.sequences.values())
            if owed + blocks_for(self.model, len(prompt), n) > pool.free_blocks:
                break
            self.waiting.popleft()
            free.pop(0)
            self.sequences[slot] = seq = LoopSequence(uid, slot, prompt, n, list(prompt), sampling=sp)
            joined.append(seq)
        if joined:
            self._prefill(joined)
            self.prefills += 1
        return len(joined)

    def _prefill(self, seqs: list[LoopSequence]) -> None:
        cols = {name: [] for name in ("tokens", "positions", "seq_ids", "cells", "want", "next_tokens")}
        for q in seqs:
            n = len(q.prompt)
            cols["tokens"] += q.prompt
            cols["positions"] += range(n)
            cols["seq_ids"] += [q.slot] * n
            cols["cells"] += self.model.cell_range(q.slot, 0, n)
            cols["want"] += [0] * (n - 1) + [1]
            cols["next_tokens"] += [-1] * n
            if self.sampling:
                for name, v in _settings(q.sampling).items():
                    cols.setdefault(name, []).extend([v] * n)
        spans = EventSpans(self.model.device)
        t = spans.begin()
        out = self.rt.step(**{name: torch.tensor(c, dtype=SAMPLING.get(name, (torch.int64,))[0])
                              for name, c in cols.items()}).outputs
        spans.end(t)
        last = torch.tensor(list(_ends(len(q.prompt) for q in seqs)), device=self.model.device)
        first = out["tokens"][last].tolist()
        rows = self.readback.to_host(out["hidden"][last]) if self.record_rows else None
        finish = {}
        dev = spans.seconds()
        self.prefill_device_seconds = None if dev is None else (self.prefill_device_seconds or 0.0) + dev
        st = self.state
        for i, (q, t) in enumerate(zip(seqs, first)):
            self.body.drafter.admit(q.slot, q.uid, q.prompt)
            q.tokens.append(t)
            if self.on_tokens is not None:
                self.on_tokens(q.uid, [t])
            if self.record_rows:
                q.add_rows(rows[i:i + 1])
            s = q.slot
            done = Finish.STOP_TOKEN if t in self._stop_tokens else Finish.MAX_TOKENS if q.max_new <= 1 else Finish.NOT
            for name, v in _settings(q.sampling).items():
                st.settings[name][s] = v
            st.live[s], st.uid[s], st.n_tok[s], st.remaining[s] = done == Finish.NOT, q.uid, len(q.tokens), q.max_new - 1
            st.prev[s], st.cur[s], st.reserved[s], st.finish[s] = q.tokens[-2], t, len(q.prompt), done
            finish[s] = done
        self._retire(finish)

    def _reserve(self) -> None:
        """KV blocks for every live sequence's next ``rounds`` rounds (at least its next
        one), capped at its last position; LoopError when not even the next round fits."""
        pool, k, st = self.model.pool, self.k, self.state
        for s, q in self.sequences.items():
            fed = len(q.tokens) - 1  # positions [0, fed) hold K/V
            last = len(q.prompt) + q.max_new - 1  # positions a sequence ever feeds
            have = int(st.reserved[s])
            for want in (min(last, fed + self.rounds * (k + 1)), min(last, fed + k + 1)):
                try:
                    if want > have:
                        self.model.cell_range(s, have, want - have)
                    st.reserved[s] = max(want, have)
                    break
                except CapacityError as e:
                    err = e
            else:
                raise LoopError(f"device loop: sequence {q.uid} (slot {s}) needs KV blocks for positions "
                                f"{have}..{min(last, fed + k + 1) - 1}, {pool.free_blocks} free of "
                                f"{pool.num_blocks}; its committed tokens are kept") from err

    def _stream(self) -> None:
        """Hand ``on_tokens`` the mirror's entries it has not had, in round order."""
        m, W = self.ring.mirror, self.shape.rows
        head = int(m.head[0])
        if head <= self._streamed:
            return
        counts, tokens, slots = m.counts[:head].tolist(), m.tokens.tolist(), m.slots.tolist()
        for per in _entry_rows(counts, slots, W, self._streamed):
            for s, rs in per.items():
                self.on_tokens(self.sequences[s].uid, [tokens[r] for r in rs])
        self._streamed = head

    def _drain(self) -> LaunchReport:
        """The ring's entries of this launch, appended to their sequences (round order)."""
        W = self.shape.rows
        got = self._got = self.readback.fetch()
        head = got["head"][0]
        counts, tokens, slots = got["counts"][:head], got["tokens"], got["slots"]
        kept: dict[int, list[int]] = {}
        for per in _entry_rows(counts, slots, W):
            for s, rs in per.items():
                q = self.sequences[s]
                q.tokens.extend(tokens[r] for r in rs)
                q.accepts.append(len(rs))
                kept.setdefault(s, []).extend(rs)
        if self.record_rows and kept:
            order = [r for rs in kept.values() for r in rs]  # grouped by sequence
            block = self.readback.rows(order)
            for s, part in zip(kept, block.split([len(rs) for rs in kept.values()])):
                self.sequences[s].add_rows(part)
        total, n_tok = sum(counts), got["n_tok"]
        for s, q in self.sequences.items():
            if len(q.tokens) != n_tok[s]:
                raise RuntimeError(f"device loop: sequence {q.uid} has {len(q.tokens)} tokens on the host, "
                                   f"{n_tok[s]} on the device")
        return LaunchReport(got["round"][0], total, Stop(got["status"][0]))

    def _retire(self, finish: dict[int, int] | None = None) -> None:
        """The sequences whose ``finish`` (by slot; default: what the last drain read) is set leave."""
        finish = dict(enumerate(self._got["finish"])) if finish is None else finish
        for s in [s for s in self.sequences if finish.get(s, Finish.NOT) != Finish.NOT]:
            q = self.sequences.pop(s)
            q.finish = Finish(finish[s])
            self.state.live[s] = False
            self.model.free_seq(s)
            self.finished.append(q)


class _RowOutputs:
    """A verify step's per-row outputs (``tokens``, ``hidden``, ``committed``): the loop
    commits on the device, so the packed count the host-row gather reads is dropped."""

    def __init__(self, verify_step):
        self.verify_step = verify_step

    def __call__(self, inputs):
        out = self.verify_step(inputs)
        return {name: out[name] for name in ("tokens", "hidden", "committed")}


def _settings(sp: SamplingParams) -> dict:
    """A request's values of the sampling columns (its seed resolved at submit)."""
    return {"temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p, "min_p": sp.min_p, "seed": sp.seed}


def _ends(lengths):
    """The index of each group's last row, for consecutive groups of these lengths."""
    end = 0
    for n in lengths:
        end += n
        yield end - 1
