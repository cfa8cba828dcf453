"""Property test of the sampler's contract (kernels/sampling), each property stated on its own
terms rather than by a second implementation: hypothesis draws rows of logits (ties, masked
-inf entries, all float scales) and per-row settings, and checks what every token, kept
set, probability row and verify decision must satisfy; a few examples also run the Triton
kernels (the interpreter on a CPU) against the torch path.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudagraph_rt.kernels.sampling import SamplingPlan, SamplingSettings, launch, sample, verify
from cudagraph_rt.kernels.sampling.torch_path import process
from tests.support.extras import reason
from tests.support.sampling_cases import assert_same_tokens

pytestmark = [pytest.mark.usefixtures("one_thread"),  # see conftest.py
              # the interpreter evaluates both sides of every tl.where (-inf - -inf in masked lanes)
              pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]
TOL = 1e-5

VALUE = st.one_of(st.integers(-4, 4).map(float), st.floats(-30, 30, width=32), st.just(float("-inf")))


@st.composite
def rows(draw, max_rows=5, max_vocab=40):
    """(logits [N, V] float32, settings, draft [N]): at least one finite logit per row."""
    n, v = draw(st.integers(1, max_rows)), draw(st.integers(2, max_vocab))
    logits = torch.tensor([draw(st.lists(VALUE, min_size=v, max_size=v)) for _ in range(n)], dtype=torch.float32)
    for i in range(n):
        if not torch.isfinite(logits[i]).any():
            logits[i, draw(st.integers(0, v - 1))] = draw(st.floats(-30, 30, width=32))
    col = lambda s: [draw(s) for _ in range(n)]  # noqa: E731
    s = SamplingSettings(
        torch.tensor(col(st.one_of(st.just(0.0), st.floats(0.05, 3.0))), dtype=torch.float32),
        torch.tensor(col(st.integers(0, v + 2)), dtype=torch.int64),
        torch.tensor(col(st.one_of(st.just(1.0), st.floats(0.01, 1.0))), dtype=torch.float32),
        torch.tensor(col(st.one_of(st.just(0.0), st.floats(0.0, 0.9))), dtype=torch.float32),
        torch.tensor(col(st.integers(-2**63, 2**63 - 1)), dtype=torch.int64),
        torch.tensor(col(st.integers(0, 2**45)), dtype=torch.int64))
    return logits, s, torch.tensor(col(st.integers(-1, v - 1)), dtype=torch.int64)


def check_kept_set(pr, s: SamplingSettings, i: int) -> None:
    """Row i's kept set is an upper set of its scaled logits holding the maximum, and each
    filter's promise holds: fewer than k tokens above any kept one; at least top_p of the
    top-k set's mass, and no smaller upper set reaches it (min-p off); every kept p at
    least min_p * p_max."""
    x, kept, m = pr.s[i].double(), pr.kept[i], pr.m[i].double()
    assert kept[pr.argmax[i]], "the most probable token is always kept"
    low = x[kept].min()
    assert (x[~kept] < low).all(), "the kept set is every token at or above a threshold"
    k, v = int(s.top_k[i]), x.numel()
    if 0 < k < v:
        above = (x[None, :] > x[kept][:, None]).sum(1)
        assert (above < k).all(), "a kept token has k or more tokens above it"
    w = torch.exp(x - m)
    t_k = x.sort(descending=True).values[k - 1] if 0 < k < v else -math.inf
    z_k = w[x >= t_k].sum()
    if s.top_p[i] < 1 and s.min_p[i] == 0:
        assert w[kept].sum() >= s.top_p[i].double() * z_k * (1 - TOL), "top-p keeps too little mass"
        assert w[kept & (x > low)].sum() < s.top_p[i].double() * z_k * (1 + TOL), "a smaller set reaches top_p"
    if s.min_p[i] > 0:
        assert (x[kept] >= m + math.log(s.min_p[i].item()) - TOL * max(1.0, abs(m.item()))).all()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(rows())
def test_the_sampler_keeps_its_contract(case):
    logits, s, draft = case
    pr = process(logits, s)
    tokens = sample(logits, s)
    probs = pr.probs()
    for i in range(logits.shape[0]):
        if pr.greedy[i]:
            assert tokens[i] == logits[i].argmax(), "a greedy row is its first maximal logit"
            continue
        check_kept_set(pr, s, i)
        assert pr.kept[i, tokens[i]], "the token is in the kept set"
        assert abs(probs[i].double().sum().item() - 1) < 1e-5 and not probs[i][~pr.kept[i]].any()
    perm = torch.randperm(logits.shape[0])
    assert torch.equal(sample(logits[perm], s.rows(perm)), tokens[perm]), "a row's token depends on its row alone"
    got, p_d = verify(logits, s, draft)
    want_p = torch.where(draft >= 0, probs.gather(1, draft.clamp(min=0)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(p_d, want_p, rtol=1e-5, atol=1e-7)
    for i in range(logits.shape[0]):
        if got[i] == draft[i]:
            assert p_d[i] > 0, "a draft outside the kept set is never accepted"
        elif not pr.greedy[i]:
            assert pr.kept[i, got[i]], "a rejected draft's replacement comes from the kept set"


@pytest.mark.skipif(launch.triton_backend() == "unavailable", reason=reason("triton"))
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(rows(max_rows=3, max_vocab=40), st.integers(1, 3), st.sampled_from([4, 8, 16]))
def test_the_kernels_keep_the_torch_paths_tokens(case, passes, candidates):
    logits, s, draft = case
    dev = torch.device("cuda") if launch.triton_backend() == "compiled" else torch.device("cpu")
    logits, draft = logits.to(dev), draft.to(dev)
    s = SamplingSettings(*(t.to(dev) for t in s.tensors()))
    plan = SamplingPlan(chunk=16, block=16, search_block=16, candidates=candidates, search_passes=passes)
    got = verify(logits, s, draft, plan=plan, use_kernel=True)
    want = verify(logits, s, draft, use_kernel=False)
    assert_same_tokens(got[0], want[0], logits, s, "verify", draft=draft, most=0.5)
