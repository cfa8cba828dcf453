"""Property test of the device loop (cudagraph_rt.dispatch, emulated on the CPU) against the
host runner: hypothesis draws the slots, k, rounds per launch, ring depth, stop tokens,
the coin, and requests with their own sampling settings and seeds; the loop's tokens must
be SpecRunner's (the same coin drafts the same tokens, the same seeds draw the same
samples), cut after a request's first stop token, its bookkeeping must add up, and where it
streams (on_tokens) every token is heard once, in order."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudagraph_rt.dispatch.loop import DeviceLoop
from cudagraph_rt.dispatch.state import Finish
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.sampling_params import SamplingParams
from cudagraph_rt.speculative.loop_drafter import CoinRounds
from cudagraph_rt.speculative.runner import Request, SpecRunner, ToyDrafter

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

MODEL = ToyDecoder(ToyConfig.tiny(max_len=48, max_seqs=4), "cpu")
V = MODEL.config.vocab

SAMPLING = st.one_of(
    st.just(SamplingParams()),
    st.builds(SamplingParams, temperature=st.sampled_from([0.5, 3.0, 8.0]), top_k=st.sampled_from([0, 1, 7]),
              top_p=st.sampled_from([1.0, 0.8, 0.3]), min_p=st.sampled_from([0.0, 0.1]),
              seed=st.one_of(st.none(), st.integers(0, 2**62))))


@st.composite
def scenario(draw):
    reqs = draw(st.lists(st.builds(Request, st.lists(st.integers(0, V - 1), min_size=1, max_size=8).map(tuple),
                                   st.integers(1, 30), SAMPLING), min_size=1, max_size=6))
    return dict(requests=reqs, slots=draw(st.integers(1, 4)), k=draw(st.integers(0, 4)),
                rounds=draw(st.integers(1, 6)), depth=draw(st.one_of(st.none(), st.integers(1, 4))),
                stops=tuple(draw(st.lists(st.integers(0, V - 1), max_size=3))),
                p=draw(st.sampled_from([0.0, 0.5, 0.9, 1.0])), coin=draw(st.integers(0, 2**31)),
                seed=draw(st.integers(0, 2**62)), stream=draw(st.booleans()))


def _cut(tokens, prompt_len, stops):
    """``tokens`` after its first generated stop token (kept) is dropped."""
    for i in range(prompt_len, len(tokens)):
        if tokens[i] in stops:
            return tokens[:i + 1]
    return tokens


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_the_loop_serves_the_host_runners_tokens(sc):
    sampled = any(not r.sampling.greedy for r in sc["requests"])
    MODEL.reset_cache()
    runner = SpecRunner(MODEL, ToyDrafter(MODEL, sc["p"], sc["coin"]), k=sc["k"], lanes=1, slots=sc["slots"],
                        seed=sc["seed"])
    runner.submit(sc["requests"])
    runner.run()
    want = {s.uid: s.tokens for s in runner.finished}
    MODEL.reset_cache()
    heard: dict[int, list[int]] = {}
    on_tokens = (lambda uid, toks: heard.setdefault(uid, []).extend(toks)) if sc["stream"] else None
    loop = DeviceLoop(MODEL, CoinRounds(MODEL, sc["p"], sc["coin"]), k=sc["k"], rounds=sc["rounds"],
                      depth=sc["depth"], stop_tokens=sc["stops"], slots=sc["slots"], sampling=sampled,
                      seed=sc["seed"], on_tokens=on_tokens)
    uids = loop.submit(sc["requests"])
    reports = loop.run()
    got = {q.uid: q for q in loop.finished}
    assert sorted(got) == uids and not loop.sequences and not loop.waiting
    for uid, r in enumerate(sc["requests"]):
        q = got[uid]
        assert q.tokens == _cut(want[uid], len(r.prompt), set(sc["stops"])), uid
        n = len(q.generated)
        assert sum(q.accepts) == n - 1  # the prefill commits the first token, each round the rest
        stopped = q.generated[-1] in sc["stops"]
        assert q.finish == (Finish.STOP_TOKEN if stopped else Finish.MAX_TOKENS)
        assert n == r.max_new or stopped
        assert all(1 <= a <= sc["k"] + 1 for a in q.accepts)
        if sc["stream"]:  # streamed: every token heard once, in order
            assert heard[uid] == q.generated
    depth = sc["depth"] or sc["rounds"]
    assert all(rep.rounds <= min(sc["rounds"], depth) for rep in reports)
    assert MODEL.pool.free_blocks == MODEL.pool.num_blocks  # every retired sequence gave its blocks back
