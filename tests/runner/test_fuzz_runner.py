"""Property fuzz of the speculative-decoding runner and its drafters (CPU, graphs off),
against plain greedy decoding (``ToyDecoder.greedy_generate``, one sequence, eager).

Hypothesis draws the requests (prompt lengths, token limits down to 1, prompts that end
exactly at ``max_len``), ``k`` (0 included), lanes, slots, chunk (1 included), accept
probability, the drafter (host or device) and how the run is cut (``max_steps`` pieces).
Properties: every token equals greedy decoding; one hidden row per generated token, equal
to the reference's row; counters add up (tokens = rows = sum of limits, accepted = the
histogram's sum, accepted <= proposed); the host and the device drafter, same seed, accept
exactly the same drafts. ``--hypothesis-seed=N`` replays a run.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudagraph_rt.speculative.device_drafter import DeviceDrafter
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.speculative.runner import Request, SpecRunner, ToyDrafter

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
MODEL = ToyDecoder(ToyConfig.tiny(max_len=48, max_seqs=6), "cpu")
V, L = MODEL.config.vocab, MODEL.config.max_len


@st.composite
def workloads(draw):
    reqs = []
    for _ in range(draw(st.integers(1, 7))):
        n = draw(st.integers(1, L - 1))
        max_new = draw(st.integers(1, L + 1 - n))  # prompt + max_new - 1 <= max_len
        reqs.append(Request(tuple(draw(st.lists(st.integers(0, V - 1), min_size=n, max_size=n))), max_new))
    lanes = draw(st.integers(1, 3))
    slots = draw(st.integers(lanes, 6))
    cfg = dict(k=draw(st.integers(0, 5)), lanes=lanes, slots=slots, chunk=draw(st.sampled_from([1, 3, 16, 64])))
    return reqs, cfg, draw(st.sampled_from([0.0, 0.4, 0.8, 1.0])), draw(st.integers(0, 2**31)), draw(
        st.sampled_from([None, 1, 3]))


def _serve(reqs, cfg, p, seed, piece, kind):
    MODEL.reset_cache()
    drafter = ToyDrafter(MODEL, p, seed) if kind == "host" else DeviceDrafter(MODEL, p, seed, k=max(cfg["k"], 1),
                                                                              depth=cfg["lanes"] + 1)
    runner = SpecRunner(MODEL, drafter, record_rows=True, **cfg)
    runner.submit(reqs)
    rep = runner.run(max_steps=piece)
    while piece is not None and rep.run_steps:  # a cut run continues where it stopped
        rep = runner.run(max_steps=piece)
    return runner, rep


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_runner_equals_greedy_with_either_drafter(w):
    reqs, cfg, p, seed, piece = w
    hists = {}
    for kind in ("host", "device"):
        runner, rep = _serve(reqs, cfg, p, seed, piece, kind)
        by_uid = {s.uid: s for s in runner.finished}
        assert sorted(by_uid) == list(range(len(reqs)))
        for uid, r in enumerate(reqs):
            seq = by_uid[uid]
            assert seq.generated == MODEL.greedy_generate(list(r.prompt), r.max_new), (kind, uid)
            rows = torch.cat(seq.rows)
            _, ref = MODEL.reference(seq.tokens[:-1])  # the last token is never fed
            p0 = len(r.prompt) - 1
            torch.testing.assert_close(rows, ref[p0:p0 + r.max_new], atol=1e-4, rtol=1e-4)
        assert rep.tokens == rep.rows == sum(r.max_new for r in reqs)
        assert rep.accepted == sum(a * n for a, n in enumerate(rep.accept_hist)) <= rep.proposed
        if p == 1.0:
            assert rep.accepted == rep.proposed
        if p == 0.0:
            assert rep.accepted == 0
        hists[kind] = (rep.accept_hist, rep.proposed, rep.accepted, rep.steps)
    assert hists["host"] == hists["device"]


@pytest.mark.parametrize("bad", ["k", "depth"])
def test_device_drafter_refuses_bad_settings(bad):
    from cudagraph_rt import InputError
    with pytest.raises(InputError, match=bad):
        DeviceDrafter(MODEL, 0.5, k=0 if bad == "k" else 2, depth=1 if bad == "depth" else 3)
