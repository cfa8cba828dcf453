"""PlanRounds: the device loop's coin over a model's own greedy decoding, for any Decoder
(emulated on the CPU): the loop's tokens are plain greedy decoding whatever it drafts, a
coin of 1 accepts every draft and of 0 none, and the drafts are the coin's (checked
against a numpy re-draw of the same coins over the plan)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cudagraph_rt.dispatch.loop import DeviceLoop
from cudagraph_rt.errors import InputError
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.speculative.drafting import coin_key, draft_coins
from cudagraph_rt.speculative.loop_drafter import PlanRounds
from cudagraph_rt.speculative.runner import Request
from tests.support.extras import needs
from tests.support.seeds import seeded_rng

pytestmark = pytest.mark.usefixtures("one_thread")


def _toy():
    return ToyDecoder(ToyConfig.tiny(max_len=64, max_seqs=3), "cpu")


def _requests(rng, vocab, n):
    return [Request(tuple(rng.randrange(vocab) for _ in range(rng.randint(1, 6))), rng.randint(2, 30))
            for _ in range(n)]


def _plans(model, reqs):
    return {r.prompt: list(r.prompt) + model.greedy_generate(list(r.prompt), r.max_new) for r in reqs}


@pytest.mark.parametrize("p", [0.0, 0.6, 1.0])
def test_the_loop_decodes_greedy_and_accepts_by_the_coin(p):
    rng = seeded_rng("CGRT_LOOP_SEED")
    model, k = _toy(), rng.randint(1, 4)
    reqs = _requests(rng, model.config.vocab, rng.randint(1, 5))
    plans = _plans(model, reqs)
    loop = DeviceLoop(model, PlanRounds(model, p, rng.randrange(2**31), plans), k=k, rounds=rng.randint(1, 8))
    loop.submit(reqs)
    loop.run()
    assert len(loop.finished) == len(reqs)
    for q in loop.finished:
        r = reqs[q.uid]
        assert q.tokens == plans[r.prompt][:len(r.prompt) + r.max_new]
        full = [min(k, r.max_new - 2 - sum(q.accepts[:i])) + 1 for i in range(len(q.accepts))]
        if p == 1.0:  # every round commits all its drafts and the bonus
            assert q.accepts == full
        elif p == 0.0:
            assert set(q.accepts) == {1}


def test_the_drafts_are_the_coins_over_the_plan():
    rng = seeded_rng("CGRT_LOOP_SEED")
    model, k, p, seed = _toy(), 4, rng.choice([0.3, 0.7]), rng.randrange(2**31)
    reqs = _requests(rng, model.config.vocab, 3)
    plans = _plans(model, reqs)
    drafter = PlanRounds(model, p, seed, plans)
    loop = DeviceLoop(model, drafter, k=k, rounds=1)
    loop.submit(reqs)
    loop._admit()
    st = loop.state
    got = drafter(st, k).numpy()
    V = model.config.vocab
    thr, key = coin_key(p, seed)
    uid, n_tok = st.uid.numpy(), st.n_tok.numpy()
    right, off = draft_coins(np, key, thr, V, uid, n_tok, k)
    for s, q in loop.sequences.items():
        plan = plans[q.prompt] + [0] * (model.config.max_len + 1)
        truth = np.array(plan[n_tok[s]:n_tok[s] + k])
        assert got[s].tolist() == np.where(right[s], truth, (truth + off[s]) % V).tolist()
    assert 0 < right.mean() < 1 or p in (0.0, 1.0)


def test_a_prompt_without_a_plan_drafts_zero_and_still_decodes_greedy():
    model = _toy()
    reqs = [Request((3, 1, 4), 12)]
    loop = DeviceLoop(model, PlanRounds(model, 1.0, 0, {}), k=3, rounds=4)
    loop.submit(reqs)
    loop.run()
    assert loop.finished[0].generated == model.greedy_generate([3, 1, 4], 12)


@pytest.mark.parametrize("plans, named", [({(1, 2): [1, 3, 4]}, "plans"), ({(1,): [1, 10**6]}, "plans")])
def test_bad_plans_are_refused(plans, named):
    with pytest.raises(InputError, match=named):
        PlanRounds(_toy(), 0.5, 0, plans)


def test_a_drafter_that_is_not_a_loop_drafter_is_refused_before_the_pool_is_touched():
    model = _toy()
    before = model.pool.free_blocks
    with pytest.raises(InputError, match="drafter"):
        DeviceLoop(model, lambda state, k: torch.zeros(3, k, dtype=torch.int64), k=2)
    assert model.pool.free_blocks == before


@needs("transformers")
def test_a_transformers_model_decodes_greedy_through_the_loop():
    from cudagraph_rt.models import hf
    model = hf.build("llama", "tiny", dtype=torch.float32, device="cpu", max_len=48)
    rng = seeded_rng("CGRT_LOOP_SEED")
    reqs = _requests(rng, model.config.vocab, 2)
    plans = _plans(model, reqs)
    loop = DeviceLoop(model, PlanRounds(model, 0.7, 1, plans), k=3, rounds=3)
    loop.submit(reqs)
    loop.run()
    for q in loop.finished:
        r = reqs[q.uid]
        logits, _ = model.reference_logits(q.tokens)
        greedy, clear = logits.argmax(-1), model.clear_positions(logits)
        p0 = len(r.prompt) - 1
        gen = torch.tensor(q.generated)
        assert len(q.generated) == r.max_new
        differs = greedy[p0:p0 + len(gen)].cpu() != gen
        assert not bool((differs & clear[p0:p0 + len(gen)].cpu()).any())
