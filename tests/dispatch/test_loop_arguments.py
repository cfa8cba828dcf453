"""The device loop's contract at its edges (from an adversarial review): bad arguments are an
InputError naming them before the pool is touched; a drafter that fails or answers the
wrong shape mid-launch stops the loop with a LoopError and every committed token intact,
and the loop serves on once the drafter is sound again."""
from __future__ import annotations

import pytest
import torch

from cudagraph_rt.dispatch.loop import DeviceLoop, LoopError
from cudagraph_rt.errors import InputError
from cudagraph_rt.graphs import Graphs
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.speculative.loop_drafter import CoinRounds, LoopDrafter, PlanRounds
from cudagraph_rt.speculative.runner import Request
from tests.support.refusals import refused_with_pool_untouched

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = ToyDecoder(ToyConfig.tiny(max_len=64, max_seqs=3), "cpu")
REQS = [Request((1, 2), 30), Request((3, 4, 5), 25)]


def _reference():
    return {u: list(r.prompt) + MODEL.greedy_generate(list(r.prompt), r.max_new) for u, r in enumerate(REQS)}


class _Flaky(LoopDrafter):
    """The coin, but ``bad(calls)`` decides whether this call raises or answers wrong."""

    def __init__(self, bad):
        self.inner, self.bad, self.calls = CoinRounds(MODEL, 0.6, 2), bad, 0

    def fits(self, model):
        return self.inner.fits(model)

    def __call__(self, state, k):
        self.calls += 1
        out = self.bad(self.calls, self.inner(state, k))
        return out


@pytest.mark.parametrize("bad, cause", [
    (lambda n, d: (_ for _ in ()).throw(ValueError("drafter down")) if n == 3 else d, "ValueError: drafter down"),
    (lambda n, d: d[:1] if n == 3 else d, "an int64 tensor (3, 3)"),           # broadcast once, silently
    (lambda n, d: d.float() + 0.9 if n == 3 else d, "an int64 tensor (3, 3)"),  # truncated once, silently
    (lambda n, d: d.tolist() if n == 3 else d, "got list"),
])
def test_a_failing_drafter_stops_the_loop_with_the_committed_tokens_intact(bad, cause):
    MODEL.reset_cache()
    flaky = _Flaky(bad)
    loop = DeviceLoop(MODEL, flaky, k=3, rounds=8)
    loop.submit(REQS)
    with pytest.raises(LoopError, match="a round failed") as e:
        loop.run()
    assert cause in str(e.value.__cause__) or cause in str(e.value)
    ref = _reference()
    n_tok = loop.state.n_tok.tolist()
    for s, q in loop.sequences.items():  # host and device agree, and hold a prefix of greedy decoding
        assert len(q.tokens) == n_tok[s] and q.tokens == ref[q.uid][:len(q.tokens)]
    flaky.bad = lambda n, d: d  # sound again: the loop serves on to the end
    loop.run()
    assert {q.uid: q.tokens for q in loop.finished} == ref


@pytest.mark.parametrize("kw, named", [
    (dict(graphs="off"), "graphs"), (dict(graphs=Graphs.OFF), "graphs"), (dict(graphs=0), "graphs"),
    (dict(stop_tokens=None), "stop_tokens"), (dict(stop_tokens=5), "stop_tokens"),
    (dict(stop_tokens=[1.5]), "stop_tokens"), (dict(record_rows="no"), "record_rows"),
    (dict(conditional="x"), "conditional"), (dict(k=10**6), "k"), (dict(rounds=10**9), "rounds"),
    (dict(depth=10**9), "depth"), (dict(slots=4), "slots"),
])
def test_bad_arguments_are_refused_before_the_pool_is_touched(kw, named):
    refused_with_pool_untouched(MODEL, rf"^{named}: expected",
                                lambda: DeviceLoop(MODEL, CoinRounds(MODEL, 0.5, 0), **kw))


def test_a_tensor_of_stop_tokens_is_taken():
    MODEL.reset_cache()
    stop = _reference()[0][5]
    loop = DeviceLoop(MODEL, CoinRounds(MODEL, 0.5, 0), k=2, stop_tokens=torch.tensor([stop]))
    loop.submit(REQS[:1])
    loop.run()
    assert loop.finished[0].tokens[-1] == stop


def test_a_drafter_or_model_that_does_not_fit_is_refused():
    other = ToyDecoder(ToyConfig.tiny(max_len=64, max_seqs=3), "cpu")
    for drafter in (CoinRounds(other, 0.5, 0), PlanRounds(other, 0.5, 0)):
        with pytest.raises(InputError, match="^drafter: expected a LoopDrafter built for this model"):
            DeviceLoop(MODEL, drafter)
    with pytest.raises(InputError, match="^model: expected a Decoder"):
        DeviceLoop(object(), CoinRounds(MODEL, 0.5, 0))


@pytest.mark.parametrize("plans", [{5: [5, 1]}, {(1,): None}, [1, 2], {(1,): [1.0, 2.7]}, {(1,): "12"},
                                   {(): [1, 2]}, {(1, 2): [1, 3]}])
def test_bad_plans_are_refused_whole(plans):
    drafter = PlanRounds(MODEL, 0.5, 0, {(7,): [7, 8]})
    with pytest.raises(InputError, match="plans"):
        drafter._add(plans)
    assert drafter.plans == {(7,): [7, 8]}


@pytest.mark.parametrize("requests, named", [(5, "requests"), ([{"prompt": (1,), "max_new": 2}], r"requests\[0\]"),
                                             ("ab", "requests")])
def test_requests_that_are_no_requests_are_refused(requests, named):
    loop = DeviceLoop(MODEL, CoinRounds(MODEL, 0.5, 0), k=1)
    with pytest.raises(InputError, match=rf"^{named}: expected"):
        loop.submit(requests)
    assert not loop.waiting
