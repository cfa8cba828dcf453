"""The runner's and the drafters' contract at its edges (CPU, graphs off): regressions from
an adversarial review of this round's runner (each docstring states the contract and the
failure the test caught before its fix, in the past of that review), plus edges the other
runner tests do not draw (controlled drafts at extreme keys and seeds, the reference
drafter through the runner)."""
from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraph_rt import InputError
from cudagraph_rt.speculative.device_drafter import DeviceDrafter
from cudagraph_rt.speculative.drafting import CommittedRows, DraftRule, controlled_drafts, controlled_drafts_py
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.speculative.runner import ReferenceDrafter, Request, SpecRunner, ToyDrafter
from cudagraph_rt.tools.demo import serve as demo
from tests.support.refusals import refused_with_pool_untouched

MODEL = ToyDecoder(ToyConfig.tiny(max_len=48, max_seqs=6), "cpu")


@pytest.fixture(autouse=True)
def _single_thread(one_thread):  # see conftest.py
    yield


def _greedy_ok(runner):
    return all(s.generated == MODEL.greedy_generate(list(s.prompt), s.max_new) for s in runner.finished)


# ----------------------------------------------------------------------------- cut runs
def _two_lane_runner(drafter):
    MODEL.reset_cache()
    runner = SpecRunner(MODEL, drafter, k=2, lanes=2, slots=2)
    runner.submit([Request((1, 2, 3), 20), Request((4, 5, 6), 20)])
    assert runner.run(max_steps=2).run_steps == 2  # both lanes prefilled
    return runner


def test_capped_runs_take_turns_over_lanes():
    """run(): "Lanes take turns"; with max_steps "unfinished sequences stay in their lanes
    and a later run continues them". Each run restarts the lane loop at lane 0, so
    run(max_steps=1) called again and again only ever steps lane 0: lane 1's sequence makes
    no progress at all until lane 0 has drained (here: 6 runs, lane 1 stuck at 4 tokens)."""
    runner = _two_lane_runner(ToyDrafter(MODEL, 0.5, 0))
    lane1 = runner.lanes[1].seqs[0]
    before = len(lane1.tokens)
    for _ in range(6):
        assert runner.run(max_steps=1).run_steps == 1
    assert len(lane1.tokens) > before, "lane 1 never stepped in 6 runs of max_steps=1"


def test_device_drafter_survives_capped_runs_that_continue():
    """Same seed: DeviceDrafter must serve what ToyDrafter serves (README), and a capped run
    must be continuable. Because run(max_steps=1) always steps lane 0 only (see above),
    lane 0's observes rotate DeviceDrafter's depth-3 output buffers over lane 1's drafts,
    and when lane 1 finally steps: RuntimeError 'sequence 1: its drafts were overwritten
    (DeviceDrafter depth 3)' -- with lanes=2 < depth, a configuration the docs allow.
    (ToyDrafter serves the same calls fine.)"""
    runner = _two_lane_runner(DeviceDrafter(MODEL, 0.5, 0, k=2))
    while runner.run(max_steps=1).run_steps:
        pass
    assert _greedy_ok(runner) and len(runner.finished) == 2


def test_a_too_shallow_device_drafter_is_refused_or_served():
    """DeviceDrafter needs depth >= lanes (+1 by its docstring), but nothing checks it:
    demo.make_drafter(kind="gpu") always builds depth 3 (it is not told --lanes) and
    SpecRunner(lanes=4) takes it. A run capped at 8 steps (2 fair turns of 4 lanes) then
    continued ends its flush with 4 observes, so lane 0's drafts are overwritten:
    RuntimeError 'sequence 0: its drafts were overwritten (DeviceDrafter depth 3)'.
    Refusing the pair up front (InputError) or serving it would both be fine."""
    MODEL.reset_cache()
    reqs = [Request((i + 1, 2, 3), 12) for i in range(4)]
    d = demo.make_drafter(MODEL, 0.5, 0, reqs, "gpu", 2, False)
    try:
        runner = SpecRunner(MODEL, d, k=2, lanes=4, slots=4)
    except InputError:
        return
    runner.submit(reqs)
    assert runner.run(max_steps=8).run_steps == 8
    runner.run()
    assert _greedy_ok(runner) and len(runner.finished) == 4


# ----------------------------------------------------------------------------- seeds
def test_device_drafter_takes_every_seed_the_host_drafter_takes():
    """The coin is of (seed, uid, position) with the seed reduced to 32 bits
    (DraftRule.for_toy: seed & M32), so ToyDrafter takes any int and the same seed must give
    DeviceDrafter the same drafts. DeviceDrafter(seed=2**64 - 1) (or any seed >= 2**64 - 1)
    raises ValueError 'Overflow when unpacking long long' from
    torch.Generator().manual_seed(seed + 1) in DeviceDrafter.__init__."""
    reqs = [Request((3, 17, 42, 7), 12), Request((9,), 10)]
    hist = {}
    for kind in ("host", "device"):
        MODEL.reset_cache()
        seed = 2**64 - 1
        d = ToyDrafter(MODEL, 0.5, seed) if kind == "host" else DeviceDrafter(MODEL, 0.5, seed, k=3)
        runner = SpecRunner(MODEL, d, k=3)
        runner.submit(reqs)
        hist[kind] = runner.run().accept_hist
        assert _greedy_ok(runner)
    assert hist["host"] == hist["device"]


def test_reference_drafter_takes_a_negative_seed_like_the_other_drafters():
    """ToyDrafter and DeviceDrafter take seed=-1 (reduced to 32 bits); ReferenceDrafter
    accepts it in __init__ and then fails mid-run, inside propose, with numpy's bare
    ValueError 'expected non-negative integer' (np.random.default_rng([seed, uid]))."""
    MODEL.reset_cache()
    runner = SpecRunner(MODEL, ReferenceDrafter(MODEL, 0.5, seed=-1), k=3)
    runner.submit([Request((3, 17, 42), 8)])
    runner.run()
    assert _greedy_ok(runner)


@pytest.mark.parametrize("n", [2, 300])
def test_device_drafter_observes_more_rows_than_one_graph_step(n):
    """observe stages its rows in the drafter runtime's host_inputs arrays when the step is
    one slice, else in arrays of its own that the runtime slices (n > its dynamic limit):
    both must draft what ToyDrafter drafts, and rows that stop encoding their token are
    caught either way."""
    rng = np.random.default_rng()
    tokens = [int(x) for x in rng.integers(0, MODEL.config.vocab, n + 1)]
    seq = SimpleNamespace(uid=int(rng.integers(0, 2**31)), tokens=tokens)
    fed = torch.as_tensor(tokens[:n])
    rows = torch.randn(n, MODEL.hidden_width) * 0.01
    rows[:, :MODEL.emb.shape[1]] += MODEL.emb.float().cpu()[fed]  # rows that encode their fed tokens
    d = DeviceDrafter(MODEL, 0.5, 7, k=3)
    if n > 2:
        assert len(d.rt.plan(n)) > 1, "not a sliced step: the test misses the path it is for"
    host = ToyDrafter(MODEL, 0.5, 7)
    for drafter in (host, d):
        drafter.observe(CommittedRows.of(seq, 0, rows))
    assert np.array_equal(d.propose([seq], 3), host.propose([seq], 3))
    bad = rows.clone()
    bad[int(rng.integers(0, n))] = 0.0
    d.observe(CommittedRows.of(seq, 0, bad))
    with pytest.raises(RuntimeError, match="do not encode"):
        d.propose([seq], 3)
    d.close()


# ----------------------------------------------------------------------------- ReferenceDrafter
def test_reference_drafter_prepare_plans_every_request():
    """prepare(requests): "Plan every request's greedy continuation now (outside any timed
    run)". Plans are cached by prompt only (_plan ignores n on a hit), so a longer request
    whose prompt was first prepared for a shorter one gets the short plan, and propose
    re-plans (an eager greedy_generate, counted in replans/replan_seconds) inside the run,
    although the output never left the plan (p=1, deterministic toy): replans == 1."""
    MODEL.reset_cache()
    reqs = [Request((3, 17, 42), 3), Request((3, 17, 42), 20)]
    d = ReferenceDrafter(MODEL, 1.0)
    d.prepare(reqs)
    runner = SpecRunner(MODEL, d, k=3)
    runner.submit(reqs)
    rep = runner.run()
    assert _greedy_ok(runner) and rep.accepted == rep.proposed
    assert d.replans == 0


class _NotAToy:
    """The toy behind a proxy, so demo.serve picks the ReferenceDrafter (as for hf models)."""

    def __init__(self, m):
        self.__dict__["_m"] = m

    def __getattr__(self, name):
        return getattr(self._m, name)


def test_demo_serve_reports_replans_of_the_timed_run_only(monkeypatch):
    """serve() reports the timed run (seconds, tokens, ...) and its 'replans' and
    'replan_seconds'; bench.hf subtracts replan_seconds from the timed seconds ("re-plans
    timed apart"). The drafter is made before the warm-up run and its counters are never
    reset, so re-plans of the warm-up (here the expensive first one, an eager generate) are
    reported as the timed run's: replans 3 where the timed run re-planned 2 times."""
    reqs = [Request((3, 17, 42), 12), Request((5, 6), 10)]
    plans = [SimpleNamespace(prompt=r.prompt, tokens=list(r.prompt) + MODEL.greedy_generate(list(r.prompt), r.max_new))
             for r in reqs]
    plans[0].tokens[3] = (plans[0].tokens[3] + 1) % MODEL.config.vocab  # a near-tie's stand-in: output leaves it
    seen = {}
    make, profiled = demo.make_drafter, demo.profiled

    def make_drafter(*a, **kw):
        seen["d"] = make(*a, **kw)
        return seen["d"]

    def timed(fn, path, title):  # called for the timed run only
        seen["before"] = seen["d"].replans
        return profiled(fn, path, title)

    monkeypatch.setattr(demo, "make_drafter", make_drafter)
    monkeypatch.setattr(demo, "profiled", timed)
    args = SimpleNamespace(k=3, accept_prob=1.0, seed=0, slots=2, lanes=1, chunk=128, rounds=0, drafter="host")
    r = demo.serve(_NotAToy(MODEL), reqs, False, args, plans=plans)
    assert isinstance(seen["d"], ReferenceDrafter) and r["check"]["ok"]
    assert seen["d"].replans > seen["before"]  # the timed run re-planned too
    assert r["replans"] == seen["d"].replans - seen["before"]


def test_plans_from_served_runs_keep_the_longer_plan_of_a_shared_prompt():
    """prepare_from(sequences): served sequences' tokens become the plans of their prompts
    (bench spec: each untimed spec run plans the next). Two served requests of one prompt
    with different max_new: the one served last replaced the other's plan, so the longer
    request found its plan too short and propose ran an eager greedy_generate inside the
    timed run, counted neither in replans nor in replan_seconds (the bench's "re-plans timed
    apart"). The longer plan covers both (the shorter is its prefix): keep it; and a plan
    made inside propose is a re-plan (counted and timed)."""
    MODEL.reset_cache()
    prompt = (3, 17, 42)
    long = list(prompt) + MODEL.greedy_generate(list(prompt), 20)
    served = [SimpleNamespace(prompt=prompt, tokens=long), SimpleNamespace(prompt=prompt, tokens=long[:6])]
    calls = []
    model = _NotAToy(MODEL)
    model.__dict__["greedy_generate"] = lambda toks, n: calls.append(n) or MODEL.greedy_generate(toks, n)
    d = ReferenceDrafter(model, 1.0)
    d.prepare_from(served)
    runner = SpecRunner(MODEL, d, k=3)
    runner.submit([Request(prompt, 20), Request(prompt, 3)])
    rep = runner.run()
    assert _greedy_ok(runner) and rep.accepted == rep.proposed
    assert calls == [] and d.replans == 0  # the plans covered both requests
    d2 = ReferenceDrafter(model, 1.0)  # no plan at all: planned inside propose, a counted re-plan
    MODEL.reset_cache()
    runner = SpecRunner(MODEL, d2, k=3)
    runner.submit([Request(prompt, 20)])
    runner.run()
    assert _greedy_ok(runner) and len(calls) == 1 and d2.replans == 1 and d2.replan_seconds > 0


# ----------------------------------------------------------------------------- configuration errors
def test_slots_zero_is_refused():
    """SpecRunner's contract: InputError unless 1 <= lanes <= slots <= max_seqs. slots=0 is
    silently replaced by max_seqs (`slots = slots or model.config.max_seqs`), and
    `cgrt demo --slots 0` runs with 8 slots."""
    with pytest.raises(InputError, match="slots"):
        SpecRunner(MODEL, ToyDrafter(MODEL, 0.5), slots=0, lanes=1)


@pytest.mark.parametrize("max_new", ["0", "-3"])
def test_demo_max_new_error_names_the_flag(capsys, max_new):
    """A bad flag gets 'cgrt demo: --flag: expected ..., got ...' (exit 2). --max-new 0
    prints 'cgrt demo: empty range for randrange() (1, 1, 0)' (make_requests checks only
    max_new > max_len; random.randint fails on max_new < 1)."""
    from cudagraph_rt import cli
    assert cli.main(["demo", "--device", "cpu", "--sequences", "2", "--max-new", max_new]) == 2
    assert "--max-new" in capsys.readouterr().err


# ----------------------------------------------------------------------------- kept (passing)
EDGE_UIDS = [0, 1, 2**31 - 1, 2**32 - 1, 2**32, 2**32 + 1, 2**62, 2**63 - 1]
EDGE_POS = [2, 3, 2**32 - 2, 2**32 - 1, 2**32, 2**63 - 3, 2**63 - 2, 2**63 - 1]


class _Toks:
    """A token list of any length whose last two tokens are given (positions near 2**63)."""

    def __init__(self, n, prev, cur):
        self.n, self.prev, self.cur = n, prev, cur

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {-2: self.prev, -1: self.cur}[i]


@settings(max_examples=25, deadline=None)
@given(seed=st.one_of(st.sampled_from([0, 2**32, 2**32 + 5, 2**63 - 1, 2**64 + 3, -1]), st.integers(-2**70, 2**70)),
       p=st.sampled_from([0.0, 1.0, 5e-324, 2**-33, 1.5 * 2**-32, 1 - 1e-16, 0.5]),
       k=st.integers(0, 5))
def test_controlled_drafts_agree_on_edge_keys(seed, p, k):
    """Kept (passes): numpy, torch and the Python-int path draw the same drafts for uids and
    positions near 2**32 and 2**63 - 1 (int64 wrap-around of pos + j), seeds outside
    [0, 2**32) and accept_prob 0, 1 and below 2**-32; p=1 (0) makes every draft right
    (wrong). The existing test draws uids < 2**62, positions < 500 and seeds < 2**40."""
    model = ToyDecoder(ToyConfig.tiny(vocab=120), "cpu")
    r = DraftRule.for_toy(model, p, seed)
    rt = DraftRule(torch.from_numpy(r.pi_a), torch.from_numpy(r.pi_b), r.b, r.vocab, r.threshold, r.seed_key)
    U = np.array([u for u in EDGE_UIDS for _ in EDGE_POS], np.int64)
    P = np.array([q for _ in EDGE_UIDS for q in EDGE_POS], np.int64)
    prev, cur = np.arange(len(U)) % 120, (7 * np.arange(len(U)) + 3) % 120
    a = controlled_drafts(np, r, U, P, prev, cur, k)
    b = controlled_drafts(torch, rt, *map(torch.from_numpy, (U, P, prev, cur)), k).numpy()
    seqs = [SimpleNamespace(uid=int(u), tokens=_Toks(int(q), int(x), int(y))) for u, q, x, y in zip(U, P, prev, cur)]
    c = np.array(controlled_drafts_py(r, seqs, k), np.int64).reshape(len(U), k)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    if p in (0.0, 1.0) or p < 2**-33:
        for g in range(len(U)):
            pv, cv = int(prev[g]), int(cur[g])
            for j in range(k):
                assert (int(a[g, j]) == model.design_next(pv, cv)) == (p == 1.0)
                pv, cv = cv, int(a[g, j])


def test_reference_drafter_serves_greedy_through_the_runner():
    """Kept (passes): ReferenceDrafter through SpecRunner on the toy (no existing test runs
    it): tokens equal greedy decoding, p=1 accepts every draft, p=0 none."""
    reqs = [Request(tuple(range(i, 2 * i + 5)), 10 + i) for i in range(5)] + [Request((7,) * 48, 1)]
    for p in (1.0, 0.0):
        MODEL.reset_cache()
        d = ReferenceDrafter(MODEL, p, seed=3)
        d.prepare(reqs)
        runner = SpecRunner(MODEL, d, k=3, lanes=2, slots=4, chunk=16)
        runner.submit(reqs)
        rep = runner.run()
        assert _greedy_ok(runner) and len(runner.finished) == len(reqs)
        assert rep.accepted == (rep.proposed if p == 1.0 else 0) and rep.proposed > 0
        assert d.replans == 0


# ------------------------------------------------------- submit and the drafter's k (issue 22)
def test_a_refused_submit_leaves_the_queue_as_it_was():
    """submit([good, bad]) raised InputError but left ``good`` queued with no uid returned:
    a retry served it twice. All or none now."""
    MODEL.reset_cache()
    runner = SpecRunner(MODEL, ToyDrafter(MODEL, 0.5, 0), k=2)
    good, late = Request((1, 2, 3), 4), Request((7, 8), 3)
    for bad, name in [(Request((4, 5), 0), r"requests\[1\].max_new: expected an int >= 1, got 0"),
                      (Request((4, 5), 2.5), r"requests\[1\].max_new: expected an int >= 1, got 2.5"),
                      (Request((4, 5), True), r"requests\[1\].max_new: expected an int >= 1, got True"),
                      (Request((4, MODEL.config.vocab), 2), r"requests\[1\].prompt: expected token ids"),
                      (Request((), 2), r"requests\[1\]: expected a prompt")]:
        with pytest.raises(InputError) as ei:
            runner.submit([good, bad, late])
        assert len(runner.waiting) == 0, f"a refused submit queued {len(runner.waiting)} of its requests"
        assert re.search(name, str(ei.value)), str(ei.value)
    assert runner.submit([good, late]) == [0, 1]  # the uids a refused call never took
    runner.run()
    assert sorted(s.uid for s in runner.finished) == [0, 1] and _greedy_ok(runner)
    assert [len(s.generated) for s in sorted(runner.finished, key=lambda s: s.uid)] == [4, 3]


@pytest.mark.parametrize("drafter_k", [1, 3])
def test_a_device_drafter_with_a_smaller_k_is_refused_before_any_step(drafter_k):
    """A DeviceDrafter proposing at most k=1 under a runner with k=4 failed in propose(),
    after the first steps launched; the runner refuses it at construction now."""
    MODEL.reset_cache()
    d = DeviceDrafter(MODEL, 0.5, 0, k=drafter_k, depth=3)
    with pytest.raises(InputError, match=rf"drafter.k: expected >= the runner's k = 4 .*got {drafter_k}"):
        SpecRunner(MODEL, d, k=4, lanes=2)
    assert d.rt.stats().steps == 0
    ok = SpecRunner(MODEL, d, k=drafter_k, lanes=2)  # its own k (or less) is served
    ok.submit([Request((1, 2, 3), 6)])
    ok.run()
    assert _greedy_ok(ok)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_the_reference_drafter_refuses_a_row_with_one_non_finite_entry(bad):
    """ReferenceDrafter.observe "checks one finite host row per committed token": a row is
    finite only when every entry is; one NaN (or inf) entry in one row is a RuntimeError
    naming the row's position, and finite rows pass."""
    from cudagraph_rt.speculative.runner import Sequence
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    drafter = ReferenceDrafter(MODEL, 0.5, seed=1)
    seq = Sequence(uid=7, slot=0, prompt=(1, 2, 3), max_new=8, tokens=[1, 2, 3, 4, 5, 6])
    rows = torch.randn(3, MODEL.hidden_width, generator=gen)
    drafter.observe(CommittedRows.of(seq, 2, rows.clone()))  # positions 2, 3, 4: finite
    j = int(torch.randint(0, 3, (1,), generator=gen))
    rows[j, int(torch.randint(0, rows.shape[1], (1,), generator=gen))] = bad
    with pytest.raises(RuntimeError, match=rf"sequence 7: non-finite host rows at position {2 + j}"):
        drafter.observe(CommittedRows.of(seq, 2, rows))


# ----------------------------------------------------------------------------- bad arguments (issue 35)
def _served(runner, reqs) -> tuple:
    """What a run of ``reqs`` produced: each request's tokens, and the runner's counters."""
    runner.submit(reqs)
    rep = runner.run()
    done = sorted(runner.finished, key=lambda s: s.uid)
    return [s.generated for s in done], rep.steps, rep.tokens, rep.accept_hist


@pytest.mark.parametrize("kw, name", [
    (dict(k=True), "k"), (dict(k=-1), "k"), (dict(k=2.0), "k"), (dict(k="2"), "k"),
    (dict(lanes=1.0), "lanes"), (dict(lanes=True), "lanes"), (dict(lanes=0), "lanes"),
    (dict(chunk=2.5), "chunk"), (dict(chunk=0), "chunk"), (dict(chunk=False), "chunk"),
    (dict(slots=2.0), "slots"), (dict(slots=True), "slots"), (dict(slots=np.float64(2)), "slots"),
    (dict(record_rows=1), "record_rows"), (dict(record_rows="yes"), "record_rows"),
])
def test_bad_runner_arguments_are_refused_naming_them_before_any_block_is_taken(kw, name):
    """SpecRunner(k=True) was taken as k=1 by the checks and failed raw in run() ('an integer
    is required') after the sequence took a KV block; lanes=1.0 and chunk=2.5 failed raw in
    the constructor (TypeError from range / torch.empty)."""
    refused_with_pool_untouched(MODEL, rf"^{name}\b.*: expected",
                                lambda: SpecRunner(MODEL, ToyDrafter(MODEL, 0.5, 0), **kw))


def test_numpy_integers_are_taken_as_ints_by_the_runner():
    """k=np.int64(2) was refused naming 'HostRows.capacity' (the runner passed it on); numpy
    integers are integers: the run is the plain ints' run, token for token."""
    reqs = [Request((1, 2, 3), 9), Request((4, 5), 7), Request((6,), 8)]
    MODEL.reset_cache()
    plain = _served(SpecRunner(MODEL, ToyDrafter(MODEL, 0.6, 1), k=2, lanes=2, slots=3, chunk=5), reqs)
    MODEL.reset_cache()
    runner = SpecRunner(MODEL, ToyDrafter(MODEL, 0.6, 1), k=np.int64(2), lanes=np.int32(2), slots=np.int64(3),
                        chunk=np.uint8(5))
    assert type(runner.k) is int and type(runner.chunk) is int
    assert _served(runner, reqs) == plain


def test_numpy_and_torch_prompts_are_served_as_lists_of_ints():
    """A numpy or torch prompt failed raw in submit ('truth value of an array ... is
    ambiguous'); a 1-D integer array or tensor is a list of token ids."""
    prompts = [(1, 2, 3), (4, 5, 6, 7), (8,)]
    MODEL.reset_cache()
    plain = _served(SpecRunner(MODEL, ToyDrafter(MODEL, 0.5, 3), k=2), [Request(p, 6) for p in prompts])
    for make in (lambda p: np.array(p, np.int64), lambda p: np.array(p, np.uint16), lambda p: torch.tensor(p),
                 lambda p: torch.tensor(p, dtype=torch.int32), lambda p: [np.int64(t) for t in p]):
        MODEL.reset_cache()
        runner = SpecRunner(MODEL, ToyDrafter(MODEL, 0.5, 3), k=2)
        assert _served(runner, [Request(make(p), 6) for p in prompts]) == plain
        assert all(type(s.prompt) is tuple and all(type(t) is int for t in s.prompt) for s in runner.finished)


@pytest.mark.parametrize("prompt", [np.array([1.0, 2.0]), torch.tensor([1.5, 2.0]), np.array([[1, 2]]),
                                    torch.tensor([True, False]), [1, True], [1.5, 2], (1, np.float64(2.0)),
                                    "12", torch.tensor(3), np.array([1, 2**40])],
                         ids=["np-float", "torch-float", "2-d", "torch-bool", "bool-token", "float-token",
                              "np-float-token", "str", "0-d", "past-vocab"])
def test_prompts_that_are_not_token_lists_are_refused_at_submit(prompt):
    MODEL.reset_cache()
    runner = SpecRunner(MODEL, ToyDrafter(MODEL, 0.5, 0), k=2)
    with pytest.raises(InputError, match=r"^requests\[0\]\.prompt: expected"):
        runner.submit([Request(prompt, 3)])
    assert not runner.waiting and MODEL.pool.free_blocks == MODEL.pool.num_blocks


@pytest.mark.parametrize("make, name", [
    (lambda: ToyDrafter(MODEL, True), "accept_prob"), (lambda: ToyDrafter(MODEL, "0.5"), "accept_prob"),
    (lambda: ToyDrafter(MODEL, float("nan")), "accept_prob"), (lambda: ToyDrafter(MODEL, 0.5, 1.5), "seed"),
    (lambda: ToyDrafter(MODEL, 0.5, True), "seed"), (lambda: ToyDrafter(object(), 0.5), "model"),
    (lambda: ReferenceDrafter(MODEL, 0.5, seed=2.5), "seed"), (lambda: ReferenceDrafter(MODEL, False), "accept_prob"),
    (lambda: ReferenceDrafter(MODEL, [0.5]), "accept_prob"), (lambda: ReferenceDrafter(None, 0.5), "model"),
    (lambda: DeviceDrafter(MODEL, 0.5, k=True), "k"), (lambda: DeviceDrafter(MODEL, 0.5, depth=3.0), "depth"),
    (lambda: DeviceDrafter(MODEL, 0.5, hidden=0), "hidden"), (lambda: DeviceDrafter(MODEL, 0.5, seed=0.5), "seed"),
    (lambda: DeviceDrafter(MODEL, 0.5, graphs="no"), "graphs"),
])
def test_bad_drafter_arguments_are_refused_naming_them(make, name):
    """ToyDrafter(accept_prob="0.5") and seed=1.5 failed raw (TypeError); ReferenceDrafter
    took seed=2.5 and failed later, inside propose; DeviceDrafter(k=True) drafted 1."""
    with pytest.raises(InputError, match=rf"^{name}: expected"):
        make()


def test_numpy_drafter_arguments_draft_as_the_plain_ones():
    """accept_prob may be any real number in [0, 1] (numpy floats, an int 0 or 1), seed and
    k any integer (numpy ones included): the same drafts as the plain values."""
    reqs = [Request((1, 2, 3), 9), Request((4, 5), 7)]
    runs = []
    for p, seed, k in ((0.5, 7, 3), (np.float32(0.5), np.int64(7), np.int8(3))):
        MODEL.reset_cache()
        runs.append(_served(SpecRunner(MODEL, DeviceDrafter(MODEL, p, seed, k=k), k=3), reqs))
        MODEL.reset_cache()
        runs.append(_served(SpecRunner(MODEL, ToyDrafter(MODEL, p, seed), k=3), reqs))
    assert runs[0] == runs[1] == runs[2] == runs[3]


def test_a_chunk_past_every_prompt_is_no_chunking():
    """chunk=10**9 ('never split a prompt') allocated a pinned token buffer of 10**9 rows per
    lane (8 GB; 'can't allocate memory' or the OOM killer). A lane step's prompt rows are
    bounded by its sequences' prompts: the run is the one of a chunk as long as max_len."""
    reqs = [Request(tuple(range(1, 40)), 5), Request((4, 5, 6), 6)]
    runs = []
    for chunk in (MODEL.config.max_len, 10**9, 2**62):
        MODEL.reset_cache()
        runs.append(_served(SpecRunner(MODEL, ToyDrafter(MODEL, 0.5, 2), k=2, chunk=chunk), reqs))
    assert runs[0] == runs[1] == runs[2]
