"""Sampling through the models' steps and the speculative runner (issue 37), on the CPU with
graphs off and emulated: greedy settings give the greedy tokens bit for bit; a seed gives
the same tokens whatever the batch-mates, the width and the graph mode; speculative
decoding with rejection sampling is lossless (its tokens follow the target's own sampled
distribution, chi-square against the exact distribution from the one-sequence reference
and the sort-based sampler's probabilities); bad settings are refused before anything
changes."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudagraph_rt import InputError, SamplingParams
from cudagraph_rt.kernels.sampling import SamplingSettings
from cudagraph_rt.kernels.sampling.reference import reference_probs
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.models.choose import SAMPLING_INPUTS
from cudagraph_rt.sampling_params import derived_seed
from cudagraph_rt.speculative.proposal import Proposal
from cudagraph_rt.speculative.runner import Request, SpecRunner, ToyDrafter
from tests.support.sampling_cases import chi_square

MODEL = ToyDecoder(ToyConfig.tiny(max_len=48, max_seqs=8), "cpu")
V = MODEL.config.vocab
ALPHA = 1e-3  # chi-square significance (seeded runs: the outcome is fixed)


@pytest.fixture(autouse=True)
def _single_thread(one_thread):  # see conftest.py
    yield


def _rows(model, rng: random.Random, n: int, seq: int = 0) -> dict[str, torch.Tensor]:
    """One sequence's first n positions as a step's int rows (random tokens)."""
    model.reset_cache()
    toks = torch.tensor([rng.randrange(V) for _ in range(n)])
    return dict(tokens=toks, positions=torch.arange(n), seq_ids=torch.full((n,), seq),
                cells=torch.tensor(model.cell_range(seq, 0, n)), want=torch.ones(n, dtype=torch.int64))


def _settings_rows(rng: random.Random, n: int, temperature) -> dict[str, torch.Tensor]:
    return dict(temperature=torch.full((n,), float(temperature)),
                top_k=torch.tensor([rng.choice([0, 1, 3, V, 2 * V]) for _ in range(n)]),
                top_p=torch.tensor([rng.choice([1.0, 0.5, 0.01]) for _ in range(n)], dtype=torch.float32),
                min_p=torch.tensor([rng.choice([0.0, 0.3, 0.99]) for _ in range(n)], dtype=torch.float32),
                seed=torch.tensor([rng.randrange(2**63) for _ in range(n)]))


# ----------------------------------------------------------------------------- the step
@pytest.mark.parametrize("verify", [False, True])
def test_temperature_zero_is_the_greedy_step_bit_for_bit(verify):
    """Sampling inputs at temperature 0 (any other settings, any seed) give exactly the
    tokens and hidden rows of the step without them; padding pads are greedy too."""
    rng = random.Random(1)
    n = 7
    rows = _rows(MODEL, rng, n)
    if verify:
        rows["next_tokens"] = torch.cat([rows["tokens"][1:], torch.tensor([-1])])
    step = MODEL.verify_step if verify else MODEL.step
    want = step(rows)
    got = step({**rows, **_settings_rows(rng, n, 0.0)})
    assert torch.equal(got["tokens"], want["tokens"])
    assert torch.equal(got["hidden"], want["hidden"])
    pads = {k: torch.full((n,), s.pad, dtype=s.dtype) for k, s in MODEL.inputs(sampling=True).items()
            if k in SAMPLING_INPUTS}
    assert torch.equal(step({**rows, **pads})["tokens"], want["tokens"])


def test_sampled_step_follows_the_seed_not_the_row_or_width():
    """A row's token is a function of its logits, settings, seed and position: the same at
    width 1 and inside a wider step at another row, and it changes with the seed."""
    rng = random.Random(2)
    n = 6
    rows = _rows(MODEL, rng, n)
    s = _settings_rows(rng, n, 8.0)
    s["top_k"][:], s["top_p"][:], s["min_p"][:] = 0, 1.0, 0.0
    wide = MODEL.step({**rows, **s})["tokens"]
    for i in range(n):  # row i alone (the cache holds positions < i from the wide step)
        one = {k: v[i:i + 1] for k, v in {**rows, **s}.items()}
        assert MODEL.step(one)["tokens"].item() == wide[i].item(), f"row {i}"
    seeds = {MODEL.step({**rows, **s, "seed": torch.full((n,), x)})["tokens"][0].item() for x in range(40)}
    assert len(seeds) > 1, "the seed does not reach the draw"


def test_bad_sampling_inputs_are_refused_before_the_pool_is_written():
    rng = random.Random(3)
    rows = _rows(MODEL, rng, 4)
    s = _settings_rows(rng, 4, 1.0)
    before = MODEL.pool.k.clone() if hasattr(MODEL.pool, "k") else None
    digest = [t.clone() for t in _pool_tensors(MODEL)]
    cases = [({**rows, **{k: v for k, v in s.items() if k != "seed"}}, "seed"),
             ({**rows, **s, "temperature": torch.full((4,), -1.0)}, "temperature"),
             ({**rows, **s, "top_p": torch.zeros(4)}, "top_p"),
             ({**rows, **s, "top_k": torch.full((4,), 2.0)}, "top_k"),
             ({**rows, **s, "draft_q": torch.zeros(4, V)}, "draft_q")]
    for inputs, name in cases:
        with pytest.raises(InputError, match=name):
            MODEL.step(inputs)
        assert all(torch.equal(a, b) for a, b in zip(_pool_tensors(MODEL), digest)), name
    with pytest.raises(InputError, match="draft_q"):
        MODEL.verify_step({**rows, **s, "next_tokens": rows["tokens"], "draft_q": torch.zeros(4, V + 1)})
    del before


def _pool_tensors(model):
    return [t for t in vars(model.pool).values() if isinstance(t, torch.Tensor)]


# ----------------------------------------------------------------------------- SamplingParams
@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", True),
    ("top_k", -1), ("top_k", 1.5), ("top_k", True), ("top_p", 0.0), ("top_p", 1.01), ("top_p", "0.5"),
    ("min_p", 1.0), ("min_p", -0.01), ("seed", -1), ("seed", 2**63), ("seed", 1.0),
    # values a float32 / int64 row of the step cannot hold
    ("temperature", 1e39), ("top_p", 1e-46), ("min_p", 1 - 1e-12), ("top_k", 2**63)])
def test_sampling_params_are_checked_at_construction(field, value):
    with pytest.raises(InputError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_seed_none_is_derived_from_the_runner_seed_and_the_uid():
    assert derived_seed(0, 1) != derived_seed(0, 2) != derived_seed(1, 1)
    assert derived_seed(5, 7) == derived_seed(5, 7)
    r = SpecRunner(MODEL, ToyDrafter(MODEL, 0.5), k=0, seed=9)
    uids = r.submit([Request((1, 2), 3, SamplingParams(temperature=1.0)), Request((1, 2), 3, SamplingParams(seed=4))])
    got = [req.sampling.seed for _, req in r.waiting]
    assert got == [derived_seed(9, uids[0]), 4]


def test_a_bad_request_is_refused_before_anything_is_queued():
    r = SpecRunner(MODEL, ToyDrafter(MODEL, 0.5), k=2)
    with pytest.raises(InputError, match=r"requests\[1\].sampling"):
        r.submit([Request((1, 2), 3), Request((1, 2), 3, sampling={"temperature": 1.0})])
    assert not r.waiting and r._next_uid == 0
    greedy_only = SpecRunner(MODEL, ToyDrafter(MODEL, 0.5), k=2, sampling=False)
    with pytest.raises(InputError, match=r"requests\[0\].sampling"):
        greedy_only.submit([Request((1, 2), 3, SamplingParams(temperature=0.5))])
    for kw, name in [({"seed": -1}, "seed"), ({"sampling": 1}, "sampling"), ({"draft_q": "yes"}, "draft_q"),
                     ({"sampling": False, "draft_q": True}, "draft_q")]:
        with pytest.raises(InputError, match=name):
            SpecRunner(MODEL, ToyDrafter(MODEL, 0.5), k=2, **kw)


# ----------------------------------------------------------------------------- through the runner
def _serve(requests, *, k=3, graphs=False, slots=None, lanes=2, drafter=None, seed=0, sampling=True, model=MODEL):
    model.reset_cache()
    drafter = drafter or ToyDrafter(model, 0.6, seed=3)
    r = SpecRunner(model, drafter, k=k, graphs=graphs, slots=slots, lanes=lanes, seed=seed, sampling=sampling)
    uids = r.submit(requests)
    r.run()
    by_uid = {s.uid: s.generated for s in r.finished}
    return [by_uid[u] for u in uids]


def _requests(rng: random.Random, n: int, temperature=6.0):
    out = []
    for _ in range(n):
        sp = SamplingParams(temperature=rng.choice([0.0, temperature]), top_k=rng.choice([0, 4]),
                            top_p=rng.choice([1.0, 0.9]), seed=rng.randrange(2**40))
        out.append(Request(tuple(rng.randrange(V) for _ in range(rng.randrange(1, 6))), rng.randrange(2, 12), sp))
    return out


def test_greedy_requests_serve_the_greedy_tokens_with_the_sampler_in_the_step():
    rng = random.Random(4)
    reqs = [Request(r.prompt, r.max_new) for r in _requests(rng, 5)]
    got = _serve(reqs)
    assert got == _serve(reqs, sampling=False)
    assert got == [MODEL.greedy_generate(list(r.prompt), r.max_new) for r in reqs]


@pytest.mark.parametrize("k", [0, 2])
def test_same_seed_same_tokens_across_graph_modes_and_widths(k):
    """The same submissions give the same tokens with graphs off and emulated, and at other
    lane splits (other step widths and row placements)."""
    reqs = _requests(random.Random(5), 6)
    want = _serve(reqs, k=k)
    assert _serve(reqs, k=k, graphs="emulate") == want
    assert _serve(reqs, k=k, lanes=1) == want
    assert _serve(reqs, k=k, lanes=3, slots=3) == want


def test_same_seed_same_tokens_whatever_the_batch_mates():
    """Plain sampling (k = 0): a seeded request's tokens do not depend on who shares its
    steps, nor on where it was submitted."""
    rng = random.Random(6)
    mine = Request((5, 6, 7), 10, SamplingParams(temperature=8.0, top_p=0.95, seed=123))
    alone = _serve([mine], k=0)[0]
    for trial in range(3):
        others = _requests(rng, rng.randrange(1, 7), temperature=4.0)
        at = rng.randrange(len(others) + 1)
        got = _serve(others[:at] + [mine] + others[at:], k=0, lanes=rng.choice([1, 2]))[at]
        assert got == alone, f"trial {trial}"


# ----------------------------------------------------------------------------- lossless
class QDrafter:
    """A sampling drafter (test double): draft j is drawn from a fixed toy q_j over the
    vocabulary (row j of ``q``; its own RNG, independent of the target's randomness) and
    proposed with it."""

    draft_q = True

    def __init__(self, q: np.ndarray, seed: int = 0):
        self.q = q / q.sum(-1, keepdims=True)  # [k, V]: q_j for draft j
        self.rng = np.random.default_rng(seed)
        self._q = torch.tensor(self.q, dtype=torch.float32)

    def observe(self, c) -> None:
        pass

    def forget(self, seq) -> None:
        pass

    def propose(self, seqs, k: int) -> Proposal:
        toks = np.stack([self.rng.choice(self.q.shape[1], size=len(seqs), p=self.q[j]) for j in range(k)], 1)
        return Proposal(toks.astype(np.int64), self._q[None, :k].expand(len(seqs), k, -1).contiguous())


def _probs(prefix, sp: SamplingParams, model=MODEL) -> torch.Tensor:
    """The target's sampled distribution of the token after ``prefix`` (float64 [V]): the
    one-sequence reference's logits through the sort-based reference sampler's probabilities."""
    logits = model.reference_logits(list(prefix))[0][-1:].float()
    s = SamplingSettings.full(1, temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p)
    return reference_probs(logits, s)[0]


def _joint(prompt, sp: SamplingParams, n: int, model) -> dict[tuple, float]:
    """The exact distribution of the first ``n`` generated tokens (over their support)."""
    out = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, p in out.items():
            probs = _probs(prompt + prefix, sp, model)
            for t in torch.nonzero(probs > 0).flatten().tolist():
                nxt[prefix + (t,)] = p * probs[t].item()
        out = nxt
    return out


def _chi_square(samples: list[tuple], joint: dict[tuple, float]) -> tuple[float, int, float]:
    cells = sorted(joint)
    index = {c: i for i, c in enumerate(cells)}
    outside = [s for s in samples if s not in index]
    assert not outside, f"sampled outside the support: {outside[:3]}"
    counts = torch.bincount(torch.tensor([index[s] for s in samples]), minlength=len(cells)).double()
    return chi_square(counts, torch.tensor([joint[c] for c in cells], dtype=torch.float64))


def _toy_qs(support: list[tuple], k: int, seed: int) -> np.ndarray:
    """[k, V] toy q's unlike p and unlike each other: q_j puts 0.8 of its mass on the tokens
    the target keeps anywhere in ``support`` with random peaked weights of its own (so a q
    judged against another position's draft is far off), 0.2 spread over the vocabulary."""
    rng = np.random.default_rng(seed)
    kept = sorted({t for cell in support for t in cell})
    q = np.full((k, V), 0.2 / V)
    for j in range(k):
        w = np.exp(2.5 * rng.standard_normal(len(kept)))
        q[j, kept] += 0.8 * w / w.sum()
    return q


LOSSLESS = ToyDecoder(ToyConfig.tiny(max_len=16, max_seqs=64), "cpu")
CASES = [("plain", SamplingParams(temperature=6.0, top_k=3)),
         ("coin", SamplingParams(temperature=6.0, top_k=3)),
         ("q", SamplingParams(temperature=6.0, top_k=3)),
         ("coin", SamplingParams(temperature=10.0, top_k=4, top_p=0.8)),
         ("q", SamplingParams(temperature=10.0, top_k=4, top_p=0.8, min_p=0.2))]


@pytest.mark.parametrize("drafter, sp", CASES, ids=[f"{d}-{i}" for i, (d, _) in enumerate(CASES)])
def test_speculative_sampling_is_lossless(drafter, sp):
    """The first four generated tokens of many seeded requests (seed=None: one per uid),
    served with k = 3 drafts by a deterministic coin drafter or a sampling drafter with a
    toy q far from p, follow the exact joint distribution of plain sampling (chi-square at
    ALPHA over its support; a wrong acceptance rule moves mass toward the drafts)."""
    prompt, n_tok, samples = (9, 17, 3), 4, 6000
    model = LOSSLESS
    model.reset_cache()
    joint = _joint(prompt, sp, n_tok, model)
    if drafter == "plain":
        d, k = ToyDrafter(model, 0.5), 0
    elif drafter == "coin":
        d, k = ToyDrafter(model, 0.7, seed=11), 3
    else:
        d, k = QDrafter(_toy_qs(list(joint), 3, seed=13), seed=12), 3
    r = SpecRunner(model, d, k=k, lanes=1, slots=min(64, 96 // (k + 1)), seed=len(drafter) + int(sp.temperature))
    r.submit([Request(prompt, n_tok, sp)] * samples)
    rep = r.run()
    got = [tuple(s.generated) for s in r.finished]
    assert len(got) == samples
    if k:
        assert 0 < rep.accepted < rep.proposed, "the drafts must be sometimes accepted, sometimes not"
    stat, df, pvalue = _chi_square(got, joint)
    assert pvalue > ALPHA, f"{drafter}: chi-square {stat:.1f} on {df} df, p = {pvalue:.2e}"


# ----------------------------------------------------------------------------- property
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_property_any_settings_serve_tokens_in_the_kept_set(data):
    """Any valid SamplingParams through the runner: every generated token lies in the
    target's kept set at its position (the reference sampler's support), greedy settings
    give the greedy tokens, and the same submission twice gives the same tokens."""
    sp = SamplingParams(temperature=data.draw(st.sampled_from([0.0, 0.5, 3.0, 50.0])),
                        top_k=data.draw(st.integers(0, V + 2)),
                        top_p=data.draw(st.floats(0.01, 1.0)),
                        min_p=data.draw(st.floats(0.0, 0.99)),
                        seed=data.draw(st.one_of(st.none(), st.integers(0, 2**63 - 1))))
    prompt = tuple(data.draw(st.lists(st.integers(0, V - 1), min_size=1, max_size=4)))
    k = data.draw(st.integers(0, 3))
    req = Request(prompt, 5, sp)
    got = _serve([req], k=k, seed=data.draw(st.integers(0, 100)))[0]
    for i, t in enumerate(got):
        assert _probs(prompt + tuple(got[:i]), sp)[t] > 0, f"token {i} ({t}) outside the kept set"
    if sp.greedy:
        assert got == MODEL.greedy_generate(list(prompt), 5)


# ----------------------------------------------------------------------------- contracts at the edges
@pytest.mark.parametrize("family", ["toy", "llama"])
def test_a_sampled_row_draws_the_token_after_its_position(family):
    """A step row at position p samples the token of position p + 1: its token is
    kernels.sampling.sample of the one-sequence reference's logits at p with position p + 1
    (the key a draft model must use for the same token), for the toy and a transformers model."""
    from cudagraph_rt.kernels.sampling import sample

    if family == "toy":
        model = MODEL
    else:
        pytest.importorskip("transformers")
        from cudagraph_rt.models import hf
        model = hf.build(family, "tiny", dtype=torch.float32, device="cpu", max_len=32)
    rng = random.Random(7)
    n, v = 6, model.config.vocab
    model.reset_cache()
    toks = torch.tensor([rng.randrange(v) for _ in range(n)])
    rows = dict(tokens=toks, positions=torch.arange(n), seq_ids=torch.zeros(n, dtype=torch.int64),
                cells=torch.tensor(model.cell_range(0, 0, n)), want=torch.ones(n, dtype=torch.int64))
    s = dict(temperature=torch.full((n,), 3.0), top_k=torch.zeros(n, dtype=torch.int64), top_p=torch.ones(n),
             min_p=torch.zeros(n), seed=torch.tensor([rng.randrange(2**62) for _ in range(n)]))
    got = model.step({**rows, **s})["tokens"]
    logits = model.reference_logits(toks.tolist())[0].float()
    want = sample(logits, SamplingSettings(position=torch.arange(n) + 1, **s))
    assert torch.equal(got, want)
    greedy = model.step({**rows, **s, "temperature": torch.zeros(n)})["tokens"]
    assert not torch.equal(got, greedy), "temperature 3 never left the greedy token: the sampler is not used"


def test_draft_q_rows_of_zeros_are_a_deterministic_drafter():
    """A runner whose verify step takes draft_q, fed by a drafter that returns bare arrays
    (all-zero q rows), serves exactly what the runner without draft_q serves."""
    reqs = _requests(random.Random(8), 5)
    MODEL.reset_cache()
    r = SpecRunner(MODEL, ToyDrafter(MODEL, 0.6, seed=3), k=3, draft_q=True)
    uids = r.submit(reqs)
    r.run()
    got = {s.uid: s.generated for s in r.finished}
    assert [got[u] for u in uids] == _serve(reqs, k=3)


def test_a_q_the_runner_cannot_take_is_refused_before_the_step():
    """A Proposal with q to a runner without draft_q, or a q of the wrong shape: InputError
    naming drafter.propose, and the sequences keep their tokens."""
    class Bad(QDrafter):
        draft_q = False

    MODEL.reset_cache()
    r = SpecRunner(MODEL, Bad(np.ones((2, V))), k=2)
    r.submit([Request((1, 2, 3), 6, SamplingParams(temperature=2.0, seed=1))])
    r.run(max_steps=1)  # the prefill
    seq = r.lanes[0].seqs[0] if r.lanes[0].seqs else r.lanes[1].seqs[0]
    before = list(seq.tokens)
    with pytest.raises(InputError, match=r"drafter.propose\(...\).q"):
        r.run()
    assert seq.tokens == before


def test_sampling_flags_are_checked_while_parsing(capsys):
    from cudagraph_rt.cli import main

    for flag, value in [("--temperature", "-1"), ("--temperature", "nan"), ("--top-k", "-2"), ("--top-p", "0"),
                        ("--top-p", "1.5"), ("--min-p", "1"), ("--temperature", "1e39"), ("--top-p", "1e-46"),
                        ("--min-p", "0.99999999999"), ("--top-k", "99999999999999999999")]:
        assert main(["demo", flag, value]) == 2
        assert f"{flag}: expected" in capsys.readouterr().err


def test_each_draft_is_verified_against_its_own_q():
    """The verify step's draft_q row of draft j of a sequence is the q_j the drafter drew it
    from (rows of a verify group: the last committed token, then the drafts; the row that
    names draft j in next_tokens is the group's row j), and rows without a draft are zero.
    A q one row off is still lossless for the first draft (one-hot) but not for the rest,
    and too rare for the chi-square to see: checked here row by row."""
    MODEL.reset_cache()
    qs = _toy_qs([tuple(range(V))], 3, seed=5)
    r = SpecRunner(MODEL, QDrafter(qs, seed=6), k=3)
    seen = []
    step = r.rt.step

    def spy(**inputs):
        seen.append({k: torch.as_tensor(v).clone() for k, v in inputs.items()})
        return step(**inputs)

    r.rt.step = spy
    r.submit([Request((1, 2, 3), 9, SamplingParams(temperature=2.0)), Request((4, 5), 7, SamplingParams(temperature=1.0))])
    r.run()
    q = torch.tensor(qs / qs.sum(-1, keepdims=True), dtype=torch.float32)
    checked = 0
    for x in seen:
        T = x["tokens"].shape[0]
        for i in range(T):
            if x["want"][i] != 1 or x["next_tokens"][i] < 0:
                assert not x["draft_q"][i].any(), f"row {i} has no draft but a q"
                continue
            same = (x["seq_ids"] == x["seq_ids"][i]) & (x["want"] == 1)
            j = int(x["positions"][i] - x["positions"][same].min())
            assert torch.equal(x["draft_q"][i], q[j]), f"row {i}: draft {j} verified against another q"
            checked += 1
    assert checked > 10


class OnceBad:
    """A drafter whose first proposal is ``bad`` (then ToyDrafter's), for the runner's checks."""

    def __init__(self, bad):
        self.bad, self.inner = bad, ToyDrafter(MODEL, 0.6, seed=3)

    def observe(self, c) -> None:
        self.inner.observe(c)

    def forget(self, seq) -> None:
        self.inner.forget(seq)

    def propose(self, seqs, k: int):
        bad, self.bad = self.bad, None
        return bad(len(seqs), k) if bad is not None else self.inner.propose(seqs, k)


@pytest.mark.parametrize("bad, what", [
    (lambda n, k: np.zeros((n - 1, k), np.int64), "tokens"),       # a sequence without drafts
    (lambda n, k: np.zeros((n, k - 1), np.int64), "tokens"),       # too few drafts
    (lambda n, k: np.full((n, k), 1.7), "tokens"),                 # not token ids
    (lambda n, k: np.full((n, k), V, np.int64), "tokens"),         # past the vocabulary
    (lambda n, k: np.full((n, k), -1, np.int64), "tokens"),
    (lambda n, k: Proposal(np.zeros((n, k), np.int64), torch.full((n, k, V), float("nan"))), "q"),
    (lambda n, k: Proposal(np.zeros((n, k), np.int64), torch.full((n, k, V), 2.0 / V)), "q"),  # sums to 2
    (lambda n, k: Proposal(np.zeros((n, k), np.int64),                                         # 0 at the draft
                           torch.cat([torch.zeros(n, k, 1), torch.full((n, k, V - 1), 1.0 / (V - 1))], -1)), "q"),
])
def test_a_malformed_proposal_is_refused_naming_it_and_the_run_continues(bad, what):
    """A drafter's answer that would leave a sequence without drafts, feed a token outside
    the vocabulary or give the verify a q that is no distribution: InputError naming
    drafter.propose before anything of the step is built; the next run serves every
    request as if it had never happened (a list of lists is taken as the array it is)."""
    reqs = [Request((1, 2, 3), 6, SamplingParams(temperature=2.0, seed=1)), Request((4, 5), 6)]
    want = _serve(reqs, k=2)
    MODEL.reset_cache()
    r = SpecRunner(MODEL, OnceBad(bad), k=2, draft_q=True)
    uids = r.submit(reqs)
    with pytest.raises(InputError, match=rf"drafter.propose\(...\).{what}"):
        r.run()
    r.run()
    got = {s.uid: s.generated for s in r.finished}
    assert [got.get(u) for u in uids] == want


def test_a_step_that_fails_leaves_its_prompt_chunks_to_be_fed_again():
    """The step raises after the runner built it (here: the runtime's step itself): the
    prompt chunks it placed are not counted as fed, so the next run serves every request,
    the ones that shared the failed step included, exactly as an undisturbed run."""
    reqs = [Request((1, 2, 3, 4, 5), 5, SamplingParams(temperature=2.0, seed=2)), Request((6, 7, 8), 5)]
    want = _serve(reqs, k=2, lanes=1)
    MODEL.reset_cache()
    r = SpecRunner(MODEL, ToyDrafter(MODEL, 0.6, seed=3), k=2, lanes=1)
    uids = r.submit(reqs)
    real, calls = r.rt.step, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a step that fails")
        return real(*a, **kw)

    r.rt.step = failing
    with pytest.raises(RuntimeError, match="a step that fails"):
        r.run()
    r.run()
    got = {s.uid: s.generated for s in r.finished}
    assert [got.get(u) for u in uids] == want


@pytest.mark.parametrize("drafter", ["ngram", "coin"])
def test_the_demos_sampled_tokens_do_not_depend_on_how_many_run_at_once(capsys, drafter):
    """cgrt demo --json's tokens are for comparing runs: with the same --seed, a request's
    sampled tokens are the same whatever --slots (its warm-up requests take runner uids, so
    a seed derived from the uid would move with it; and the coin's drafts, keyed by uid,
    moved with the warm-up's size, which followed --slots)."""
    import json

    from cudagraph_rt.cli import main

    got = []
    for slots in ("4", "2"):
        assert main(["demo", "--device", "cpu", "--sequences", "4", "--max-new", "6", "--temperature", "5",
                     "--drafter", drafter, "--seed", "1", "--slots", slots, "--graphs", "off", "--quiet", "--json"]) == 0
        got.append(json.loads(capsys.readouterr().out)["tokens"])
    assert got[0] == got[1] and len(got[0]) == 4
