"""The device loop's semantics, emulated on the CPU (issue 38, item 2): tokens, accept
counts and hidden rows bit-equal to the host-driven loop (SpecRunner with the device coin
drafter, greedy), each stop condition, and failures inside the loop (a bad token id from
the drafter, a pool with no block for the next round) that stop it with a clear error and
leave every sequence's committed tokens and rows intact."""
from __future__ import annotations

import re
from collections import Counter

import pytest
import torch

from cudagraph_rt.dispatch.loop import DeviceLoop, LoopError
from cudagraph_rt.dispatch.state import Finish, Stop
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.speculative.device_drafter import DeviceDrafter
from cudagraph_rt.speculative.loop_drafter import CoinRounds, LoopDrafter
from cudagraph_rt.errors import InputError
from cudagraph_rt.sampling_params import SamplingParams
from cudagraph_rt.speculative.runner import Request, SpecRunner, ToyDrafter
from tests.support.seeds import seeded_rng

MODEL = ToyDecoder(ToyConfig.tiny(max_len=64, max_seqs=3), "cpu")


@pytest.fixture(autouse=True)
def _single_thread(one_thread):  # see conftest.py
    yield


def _requests(rng, n=3):
    V = MODEL.config.vocab
    return [Request(tuple(rng.randrange(V) for _ in range(rng.randint(1, 6))), rng.randint(1, 30)) for _ in range(n)]


def _host(reqs, k, p, seed):
    """The host-driven loop's finished sequences by uid, and its accept histogram."""
    MODEL.reset_cache()
    drafter = DeviceDrafter(MODEL, p, seed, k=k) if k else ToyDrafter(MODEL, p, seed)
    runner = SpecRunner(MODEL, drafter, k=k, lanes=1, record_rows=True)
    runner.submit(reqs)
    runner.run()
    return {s.uid: s for s in runner.finished}, runner.hist


def _loop(k, p, coin_seed, **kw):
    MODEL.reset_cache()
    return DeviceLoop(MODEL, kw.pop("drafter", None) or CoinRounds(MODEL, p, coin_seed), k=k, record_rows=True, **kw)


@pytest.mark.parametrize("k, rounds", [(0, 5), (1, 64), (3, 4), (4, 2)])
def test_tokens_and_rows_equal_the_host_loop(k, rounds):
    rng = seeded_rng("CGRT_LOOP_SEED")
    p, seed = rng.choice([0.3, 0.6, 0.9, 1.0]), rng.randrange(2**31)  # p > 0: a stale draft state shows
    reqs = _requests(rng, rng.randint(1, 5))
    want, hist = _host(reqs, k, p, seed)
    loop = _loop(k, p, seed, rounds=rounds)
    loop.submit(reqs)
    loop.run()
    got = {q.uid: q for q in loop.finished}
    assert sorted(got) == sorted(want)
    # Tokens bit for bit; rows to rounding: the two loops batch the same rows into steps of
    # different row counts (a request that waits joins the host loop's verify step but the
    # loop's own prefill step; a sequence that retires mid-launch), and a CPU matmul's row
    # may round differently with the rows beside it.
    same = lambda a, b: torch.allclose(a, b, 1e-4, 1e-4)  # noqa: E731
    for uid, q in got.items():
        assert q.tokens == want[uid].tokens
        assert same(torch.cat(q.rows), torch.cat(want[uid].rows))
        assert q.finish == Finish.MAX_TOKENS
    assert Counter(a - 1 for q in got.values() for a in q.accepts) == hist


@pytest.mark.parametrize("k", [0, 3])
def test_sampled_tokens_equal_the_host_runners_for_the_same_seeds(k):
    """Sampling (issue 37) inside the loop: each row samples with its request's settings and
    the verify rejection-samples the drafts; with the same seeds and the same drafts (the
    coin of the same state) the tokens are SpecRunner's bit for bit, whatever the rounds."""
    rng = seeded_rng("CGRT_LOOP_SEED")
    p, seed = rng.choice([0.3, 0.8]), rng.randrange(2**31)
    # the toy's logits are peaked (its greedy rule): temperatures this high make the draws random
    settings = [SamplingParams(temperature=rng.choice([3.0, 5.0, 10.0]), top_k=rng.choice([0, 9]),
                               top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]),
                               seed=rng.choice([None, rng.randrange(2**40)])) for _ in range(4)]
    settings[0] = SamplingParams()  # a greedy request among sampled ones
    reqs = [Request(r.prompt, r.max_new, sp) for r, sp in zip(_requests(rng, 4), settings)]
    MODEL.reset_cache()
    runner = SpecRunner(MODEL, ToyDrafter(MODEL, p, seed), k=k, lanes=1, seed=seed)
    runner.submit(reqs)
    runner.run()
    want = {q.uid: q.tokens for q in runner.finished}
    loop = _loop(k, p, seed, rounds=rng.randint(1, 6), sampling=True, seed=seed)
    loop.submit(reqs)
    loop.run()
    got = {q.uid: q.tokens for q in loop.finished}
    assert got == want
    greedy_tokens = {u: list(r.prompt) + MODEL.greedy_generate(list(r.prompt), r.max_new) for u, r in enumerate(reqs)}
    assert got[0] == greedy_tokens[0] and any(got[u] != greedy_tokens[u] for u in range(1, 4))  # the others sampled
    greedy = _loop(k, p, seed, rounds=4)  # the greedy loop refuses a sampled request, before anything runs
    with pytest.raises(InputError, match=r"requests\[1\].sampling"):
        greedy.submit(reqs)
    assert not greedy.waiting


def test_a_stop_token_ends_its_sequence_and_keeps_the_token():
    rng = seeded_rng("CGRT_LOOP_SEED")
    reqs = [Request((5, 6, 7), 30), Request((9,), 25)]
    want, _ = _host(reqs, 3, 0.7, 1)
    stop = want[0].generated[rng.randint(1, 20)]
    loop = _loop(3, 0.7, 1, rounds=6, stop_tokens=(stop,))
    loop.submit(reqs)
    loop.run()
    for q in loop.finished:
        ref = want[q.uid].generated
        cut = ref.index(stop) + 1 if stop in ref else len(ref)
        assert q.generated == ref[:cut]
        assert q.finish == (Finish.STOP_TOKEN if stop in ref else Finish.MAX_TOKENS)
        # a sequence that stops leaves the others' later rounds narrower than the host loop's:
        # the same rows up to the reduction order of another width
        torch.testing.assert_close(torch.cat(q.rows), torch.cat(want[q.uid].rows)[:len(q.tokens) - len(q.prompt)])


def test_rounds_ring_and_finished_stop_a_launch():
    reqs = [Request((1, 2), 30), Request((3,), 30)]
    loop = _loop(2, 0.5, 4, rounds=3)
    loop.submit(reqs)
    reports = loop.run()
    assert all(r.stop == Stop.ROUNDS and r.rounds == 3 for r in reports[:-1])
    assert reports[-1].stop == Stop.FINISHED
    ring = _loop(2, 0.5, 4, rounds=8, depth=2)
    ring.submit(reqs)
    reports = ring.run()
    assert all(r.stop == Stop.RING_FULL and r.rounds == 2 for r in reports[:-1])
    assert [q.tokens for q in sorted(ring.finished, key=lambda q: q.uid)] == \
           [q.tokens for q in sorted(loop.finished, key=lambda q: q.uid)]


def test_a_retired_sequence_stops_the_launch_while_requests_wait():
    reqs = [Request((1, 2), 4), Request((3,), 30), Request((4,), 30), Request((8, 9), 6)]
    want, _ = _host(reqs, 2, 0.5, 2)
    loop = _loop(2, 0.5, 2, rounds=64)
    loop.submit(reqs)
    reports = loop.run()
    assert reports[0].stop == Stop.RETIRED
    assert reports[-1].stop == Stop.FINISHED
    assert {q.uid: q.tokens for q in loop.finished} == {u: s.tokens for u, s in want.items()}


class _BadAt(LoopDrafter):
    """The coin drafter, but slot 1 drafts ``bad`` once its sequence holds ``at`` tokens."""

    def __init__(self, inner, at, bad):
        self.inner, self.at, self.bad = inner, at, bad

    def __call__(self, state, k):
        d = self.inner(state, k)
        hit = (state.n_tok >= self.at) & (torch.arange(d.shape[0]) == 1)
        return torch.where(hit[:, None], torch.full_like(d, self.bad), d)


def _intact(loop, want):
    """Every sequence (served or finished) holds a prefix of its reference tokens and rows."""
    for q in [*loop.sequences.values(), *loop.finished]:
        ref = want[q.uid]
        assert q.tokens == ref.tokens[:len(q.tokens)]
        assert torch.equal(torch.cat(q.rows), torch.cat(ref.rows)[:len(q.tokens) - len(q.prompt)])
    n_tok = loop.state.n_tok.tolist()
    assert all(len(q.tokens) == n_tok[s] for s, q in loop.sequences.items())


@pytest.mark.parametrize("bad", [MODEL.config.vocab, MODEL.config.vocab + 7, -1])
def test_a_bad_token_id_stops_the_loop_with_the_committed_rows_intact(bad):
    reqs = [Request((1, 2), 30), Request((3, 4, 5), 30)]
    want, _ = _host(reqs, 3, 0.8, 5)
    loop = _loop(3, 0.8, 5, rounds=4, drafter=_BadAt(CoinRounds(MODEL, 0.8, 5), 14, bad))
    loop.submit(reqs)
    with pytest.raises(LoopError, match=re.escape(f"token id {bad} at position")) as e:
        loop.run()
    assert "sequence 1 (slot 1)" in str(e.value)
    assert loop.launches[-1].stop == Stop.BAD_TOKEN
    assert 14 <= len(loop.sequences[1].tokens) < len(want[1].tokens)
    _intact(loop, want)


def test_a_full_pool_stops_the_loop_with_the_committed_rows_intact():
    """Another user of the pool takes its free blocks between launches: the loop runs what
    its reserved blocks hold (stopping at POOL), then refuses with LoopError."""
    reqs = [Request((1, 2), 40), Request((3,), 40)]
    want, _ = _host(reqs, 2, 0.6, 3)
    small = ToyDecoder(ToyConfig.tiny(max_len=64, max_seqs=3, cells=96), "cpu")  # 6 blocks: the two requests' worst case
    loop = DeviceLoop(small, CoinRounds(small, 0.6, 3), k=2, rounds=2, record_rows=True)
    loop.submit(reqs)
    loop._admit()
    loop.launch()
    pool = small.pool
    assert pool.free_blocks == 4
    small.cell_range(2, 0, 4 * pool.block_size)  # slot 2 (unused) takes every free block
    with pytest.raises(LoopError, match=r"needs KV blocks for positions \d+\.\.\d+, 0 free of"):
        while True:
            loop.launch()
    assert Stop.POOL in [r.stop for r in loop.launches]
    _intact(loop, want)


def test_requests_that_finish_at_their_prefill_free_their_slot_for_the_next():
    """max_new = 1: a request ends at its prompt's step; with one slot, the loop went
    idle with the next request still queued (found by the property test)."""
    MODEL.reset_cache()
    loop = DeviceLoop(MODEL, CoinRounds(MODEL, 0.5, 0), k=2, slots=1)
    reqs = [Request((0,), 1), Request((0,), 1), Request((5, 6), 3)]
    assert loop.submit(reqs) == [0, 1, 2]
    loop.run()
    assert sorted(q.uid for q in loop.finished) == [0, 1, 2] and not loop.waiting
    for q in loop.finished:
        r = reqs[q.uid]
        assert q.generated == MODEL.greedy_generate(list(r.prompt), r.max_new)


def test_a_request_the_pool_can_never_hold_is_refused_at_submit():
    small = ToyDecoder(ToyConfig.tiny(max_len=64, max_seqs=3, cells=32), "cpu")  # 2 blocks of 16
    loop = DeviceLoop(small, CoinRounds(small, 0.5, 0), k=2)
    with pytest.raises(InputError, match=r"requests\[1\]: expected at most 32 positions \(the model's whole KV "
                                         r"pool\), got \(2, 40\)"):
        loop.submit([Request((1,), 4), Request((1, 2), 40)])  # 41 positions: 3 blocks
    assert not loop.waiting and small.pool.free_blocks == 2


def test_a_request_waiting_on_blocks_another_user_holds_is_an_error_not_a_silent_stop():
    small = ToyDecoder(ToyConfig.tiny(max_len=64, max_seqs=3, cells=64), "cpu")  # 4 blocks of 16
    loop = DeviceLoop(small, CoinRounds(small, 0.5, 0), k=2, slots=2)
    small.cell_range(2, 0, 3 * 16)  # slot 2, outside the loop's, holds 3 blocks
    loop.submit([Request((1, 2), 20)])  # 21 positions: 2 blocks
    with pytest.raises(LoopError, match=r"request 0 needs 2 KV blocks .* 1 free of 4; it stays queued"):
        loop.run()
    assert len(loop.waiting) == 1 and small.pool.free_blocks == 1


def test_on_tokens_hears_every_token_once_in_order_while_the_launch_runs():
    """Streaming: each round's commit copies the ring's tokens to a mirror the host reads
    while the loop runs on (emulated: after each round), so on_tokens hears the rounds of
    a launch before the launch returns; per request the tokens it hears are its generated
    tokens, in order, each once, cut at a stop token."""
    rng = seeded_rng("CGRT_LOOP_SEED")
    reqs = _requests(rng, 3)
    want, _ = _host(reqs, 3, 0.7, 4)
    heard: dict[int, list[int]] = {}
    calls: list[tuple[int, int]] = []  # (uid, launches finished when heard)

    def on_tokens(uid, tokens):
        heard.setdefault(uid, []).extend(tokens)
        calls.append((uid, len(loop.launches)))

    stop = want[0].generated[-1] if len(want[0].generated) > 2 else None
    loop = _loop(3, 0.7, 4, rounds=64, on_tokens=on_tokens, stop_tokens=() if stop is None else (stop,))
    loop.submit(reqs)
    loop.run()
    for q in loop.finished:
        assert heard[q.uid] == q.generated
        assert q.generated == want[q.uid].generated[:len(q.generated)]
    first_launch = [u for u, n in calls if n == 0]
    assert len(first_launch) > len(reqs)  # the first token of each, then rounds heard inside the launch


def test_an_on_tokens_that_raises_stops_the_loop_and_it_serves_on():
    reqs = [Request((1, 2), 20), Request((3,), 20)]
    want, _ = _host(reqs, 2, 0.6, 3)
    state = {"fail": True, "heard": {}}

    def on_tokens(uid, tokens):
        if state["fail"] and len(state["heard"].get(uid, [])) >= 5:
            raise RuntimeError("the client went away")
        state["heard"].setdefault(uid, []).extend(tokens)

    loop = _loop(2, 0.6, 3, rounds=4, on_tokens=on_tokens)
    loop.submit(reqs)
    with pytest.raises(LoopError, match="the client went away"):
        loop.run()
    state["fail"] = False
    loop.run()
    assert {q.uid: q.tokens for q in loop.finished} == {u: s.tokens for u, s in want.items()}
    with pytest.raises(InputError, match="^on_tokens: expected a callable"):
        _loop(2, 0.6, 3, on_tokens="print")


def test_compiled_rounds_equal_the_eager_rounds():
    """The plan and commit fused by torch.compile (the default with CUDA graphs; inductor's
    CPU code here) give the eager rounds' tokens, finishes and rows bit for bit, stop
    tokens, retirements and several launches included."""
    from cudagraph_rt.dispatch.rounds import EAGER_ROUNDS, compiled_rounds

    rng = seeded_rng("CGRT_LOOP_SEED")
    reqs = _requests(rng, 4)
    p, seed, stop = rng.choice([0.4, 0.8]), rng.randrange(2**31), rng.randrange(MODEL.config.vocab)
    got = {}
    for ops in (EAGER_ROUNDS, compiled_rounds()):
        loop = _loop(3, p, seed, rounds=rng.randint(2, 6), stop_tokens=(stop,), round_ops=ops)
        loop.submit(reqs)
        loop.run()
        got[ops.name] = {q.uid: (q.tokens, q.finish, torch.cat(q.rows)) for q in loop.finished}
        assert len(loop.launches) > 1
    eager, fused = got["eager"], got["compiled"]
    assert sorted(eager) == sorted(fused) == list(range(len(reqs)))
    for uid, (tokens, finish, rows) in eager.items():
        assert fused[uid][0] == tokens and fused[uid][1] == finish and torch.equal(fused[uid][2], rows)


def test_round_ops_must_be_a_round_ops_object():
    MODEL.reset_cache()
    with pytest.raises(InputError, match="^round_ops: expected"):
        DeviceLoop(MODEL, CoinRounds(MODEL, 0.5, 1), k=2, round_ops="compiled")
    from cudagraph_rt.dispatch.rounds import RoundOps
    with pytest.raises(InputError, match="^round_ops: expected"):
        DeviceLoop(MODEL, CoinRounds(MODEL, 0.5, 1), k=2, round_ops=RoundOps("x", None, None))


class _Restless(LoopDrafter):
    """The coin, with a Python attribute that changes at each call (torch.compile guards on
    it, so each round of compiled ops would compile again)."""

    def __init__(self, p, seed):
        self.inner, self.calls = CoinRounds(MODEL, p, seed), 0

    def fits(self, model):
        return self.inner.fits(model)

    def __call__(self, state, k):
        self.calls += 1
        return self.inner(state, k) + 0 * self.calls


def test_each_loop_compiles_its_own_rounds_and_falls_back_to_eager_where_compiling_fails(caplog):
    """Loops do not share torch.compile's recompile budget (two loops of different coins
    each run compiled under a limit of one graph), and compiled ops that cannot compile
    any more (a drafter whose Python state changes every round) leave the loop eager, with
    a log message, and the same tokens."""
    from cudagraph_rt.dispatch.rounds import compiled_rounds

    rng = seeded_rng("CGRT_LOOP_SEED")
    reqs = _requests(rng, 3)
    with torch._dynamo.config.patch(recompile_limit=1):
        for seed in rng.sample(range(2**31), 2):
            want, _ = _host(reqs, 2, 0.6, seed)
            loop = _loop(2, 0.6, seed, rounds=4, round_ops=compiled_rounds())
            loop.submit(reqs)
            loop.run()
            assert loop.body.ops.name == "compiled"
            assert {q.uid: q.tokens for q in loop.finished} == {u: s.tokens for u, s in want.items()}
        want, _ = _host(reqs, 2, 0.6, 5)
        caplog.set_level("WARNING", logger="cudagraph_rt.dispatch.rounds")
        loop = _loop(2, 0.6, 5, rounds=4, drafter=_Restless(0.6, 5), round_ops=compiled_rounds())
        loop.submit(reqs)
        loop.run()
    assert loop.body.ops.name == "eager" and "run eagerly from now on" in caplog.text
    assert {q.uid: q.tokens for q in loop.finished} == {u: s.tokens for u, s in want.items()}


def test_kept_rows_hold_no_other_rows_storage():
    rng = seeded_rng("CGRT_LOOP_SEED")
    loop = _loop(3, 0.7, 1, rounds=5)
    loop.submit(_requests(rng, 3))
    loop.run()
    rows = [r for q in loop.finished for r in q.rows]
    assert rows and all(r.untyped_storage().nbytes() == r.numel() * r.element_size() for r in rows)
