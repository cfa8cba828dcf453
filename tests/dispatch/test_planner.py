"""The device-side planner against the host runner's own layout (issue 38, item 1).

For random loop states (live slots, token counts, tokens left, drafts, some bad), the rows,
positions, cells, pads and width that ``dispatch.planner.plan_round`` writes on the device
equal what ``SpecRunner._build`` lays out on the host for the same sequences and drafts,
and the width the runtime's planner picks for that step; the stops it decides (a bad
token id, a position without a KV block, nothing live, N rounds, a full ring) are
checked against what the state says."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudagraph_rt.dispatch.planner import plan_round
from cudagraph_rt.dispatch.state import LoopRing, LoopShape, LoopState, RoundRows, Stop
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.speculative import runner as runner_module
from cudagraph_rt.speculative.runner import COLUMNS, Sequence, SpecRunner
from cudagraph_rt.widths import default_widths

MODEL = ToyDecoder(ToyConfig.tiny(max_len=64, max_seqs=6), "cpu")
S, MAX_LEN, V = 6, 64, MODEL.config.vocab
POISON = -7
_RUNNERS: dict[int, SpecRunner] = {}


@pytest.fixture(autouse=True)
def _single_thread(one_thread):  # see conftest.py
    yield


class _GivenDrafts:
    """A host drafter that proposes the drafts the test drew for each slot."""

    drafts = np.zeros((S, 0), np.int64)

    def observe(self, c):
        pass

    def propose(self, seqs, k):
        return self.drafts[[s.slot for s in seqs], :k]

    def forget(self, seq):
        pass


def _runner(k: int) -> SpecRunner:
    if k not in _RUNNERS:
        _RUNNERS[k] = SpecRunner(MODEL, _GivenDrafts(), k=k, slots=S, lanes=1)
    return _RUNNERS[k]


@st.composite
def loop_states(draw):
    k = draw(st.integers(0, 4))
    slots = []
    for slot in range(S):
        if not draw(st.booleans()):
            continue
        n_tok = draw(st.integers(2, MAX_LEN))
        prompt = draw(st.integers(1, n_tok - 1))
        remaining = draw(st.integers(1, MAX_LEN - n_tok + 1))
        tokens = draw(st.lists(st.integers(0, V - 1), min_size=n_tok, max_size=n_tok))
        slots.append((slot, prompt, remaining, tokens))
    bad = draw(st.booleans())
    drafts = draw(st.lists(st.integers(0, V - 1), min_size=S * k, max_size=S * k))
    drafts = np.array(drafts, np.int64).reshape(S, k)
    if bad and k and slots:
        slot, j = draw(st.sampled_from([s[0] for s in slots])), draw(st.integers(0, k - 1))
        drafts[slot, j] = draw(st.sampled_from([V, V + 5, -1, -3]))
    return k, slots, drafts


def _host_plan(k, slots, drafts):
    """What the host runner lays out: its columns and the runtime's width for them."""
    MODEL.reset_cache()
    runner = _runner(k)
    runner.drafter.drafts = drafts
    lane = runner.lanes[0]
    lane.seqs = [Sequence(uid=100 + slot, slot=slot, prompt=tuple(t[:p]), max_new=len(t) - p + rem, tokens=list(t),
                          prefilled=p) for slot, p, rem, t in slots]
    # the layout of any drafts, bad ones included: the runner's own check of a proposal
    # (which refuses a token outside the vocabulary) is tested with the runner
    real = runner_module.read_proposal
    runner_module.read_proposal = lambda p, n, k, *_: (np.asarray(p)[:, :k].tolist(), None)
    try:
        _, cols = runner._build(lane)
    finally:
        runner_module.read_proposal = real
    T = len(cols[0])
    return cols, T, (runner.rt.plan(T)[0].width if T else None)


def _device_plan(k, slots, drafts, *, reserve=lambda n_tok, ks: n_tok + ks, round_=0, max_rounds=8, head=0):
    widths = default_widths(64)
    shape = LoopShape(S, k, widths, V, MODEL.pool.block_size, MODEL.scratch_cell, depth=4)
    state, rows = LoopState(S, (), MODEL.device), RoundRows(shape, MODEL.device)
    ring = LoopRing(shape, MODEL.hidden_width, MODEL.config.dtype, MODEL.device)
    for slot, p, rem, t in slots:
        ks = min(k, rem - 1)
        state.live[slot], state.uid[slot], state.n_tok[slot], state.remaining[slot] = True, 100 + slot, len(t), rem
        state.prev[slot], state.cur[slot], state.reserved[slot] = t[-2], t[-1], reserve(len(t), ks)
    state.round.fill_(round_)
    state.max_rounds.fill_(max_rounds)
    ring.head.fill_(head)
    rows.drafts.copy_(torch.from_numpy(drafts))
    arena = {name: torch.full((shape.rows,), POISON, dtype=torch.int64) for name in COLUMNS}
    plan_round(state, rows, arena, MODEL.pool.block_table, ring, shape, torch.tensor(widths))
    return state, rows, arena, widths


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loop_states())
def test_the_device_plan_is_the_host_runners(case):
    k, slots, drafts = case
    cols, T, width = _host_plan(k, slots, drafts)
    state, rows, arena, widths = _device_plan(k, slots, drafts)
    bad = [(r, t) for r, t in enumerate(cols[0]) if not 0 <= t < V] + \
          [(r, t) for r, t in enumerate(cols[5]) if not -1 <= t < V]
    if not slots:
        assert int(state.status) == Stop.FINISHED and int(rows.go) == 0
        assert int(rows.width_index) == len(widths)
        return
    if bad:
        r = next(i for i, t in enumerate(cols[0]) if not 0 <= t < V)  # the first row feeding it
        assert int(state.status) == Stop.BAD_TOKEN and int(rows.go) == 0
        assert int(rows.width_index) == len(widths)
        assert state.error.tolist() == [cols[2][r], cols[0][r], cols[1][r]]
        return
    assert int(state.status) == Stop.RUNNING and int(rows.go) == 1
    assert widths[int(rows.width_index)] == width
    pads = dict(tokens=0, positions=0, seq_ids=-1, cells=MODEL.scratch_cell, want=0, next_tokens=-1)
    for name, col in zip(COLUMNS, cols):
        assert arena[name][:T].tolist() == col, name
        assert (arena[name][T:] == pads[name]).all(), name
    assert rows.slot[:T].tolist() == cols[2] and (rows.slot[T:] == S).all()
    assert rows.pos[:T].tolist() == cols[1]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loop_states(), st.integers(0, 3))
def test_a_round_past_the_reserved_blocks_stops_the_loop(case, short):
    k, slots, drafts = case
    drafts = np.clip(drafts, 0, V - 1)
    if not slots:
        return
    _host_plan(k, slots, drafts)  # the blocks the host runner would take
    state, rows, *_ = _device_plan(k, slots, drafts, reserve=lambda n_tok, ks: n_tok + ks - short)
    assert int(state.status) == (Stop.POOL if short else Stop.RUNNING)
    assert int(rows.go) == (0 if short else 1)


@pytest.mark.parametrize("round_, max_rounds, head, stop", [(3, 3, 0, Stop.ROUNDS), (0, 8, 4, Stop.RING_FULL),
                                                            (2, 3, 3, Stop.RUNNING)])
def test_rounds_and_the_ring_stop_the_loop(round_, max_rounds, head, stop):
    slots = [(1, 3, 9, list(range(10, 20))), (4, 2, 4, list(range(30, 33)))]
    drafts = np.arange(S * 3, dtype=np.int64).reshape(S, 3)
    state, rows, *_ = _device_plan(3, slots, drafts, round_=round_, max_rounds=max_rounds, head=min(head, 4))
    assert int(state.status) == stop
    assert int(rows.go) == (stop == Stop.RUNNING)


def test_a_stop_already_decided_is_kept():
    """A commit that stopped the loop (RETIRED) is not overwritten by the next plan."""
    slots = [(0, 3, 9, list(range(10, 20)))]
    widths = default_widths(64)
    shape = LoopShape(S, 2, widths, V, MODEL.pool.block_size, MODEL.scratch_cell, depth=4)
    state, rows = LoopState(S, (), MODEL.device), RoundRows(shape, MODEL.device)
    ring = LoopRing(shape, MODEL.hidden_width, MODEL.config.dtype, MODEL.device)
    state.live[0], state.n_tok[0], state.remaining[0], state.reserved[0], state.max_rounds[0] = True, 10, 9, 64, 5
    state.status.fill_(int(Stop.RETIRED))
    arena = {name: torch.full((shape.rows,), POISON, dtype=torch.int64) for name in COLUMNS}
    plan_round(state, rows, arena, MODEL.pool.block_table, ring, shape, torch.tensor(widths))
    assert int(state.status) == Stop.RETIRED and int(rows.go) == 0 and int(rows.width_index) == len(widths)
