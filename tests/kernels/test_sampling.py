"""The sampler (kernels/sampling): its randomness, its Triton kernels against its torch path,
its distributions against a sort-based reference, rejection sampling's losslessness, and its
checks.

On the CPU the kernels run in the interpreter (conftest sets TRITON_INTERPRET=1) on small
vocabularies and a few programs; on a GPU machine the same tests run them compiled, and the
cuda tests add the 128k vocabulary and a captured graph. Random inputs are fresh each run
(SAMPLING_SEED=<n> replays); the distribution tests are seeded (chi-square at a fixed
significance, so a fixed seed makes them stable, and a changed seed tests again).
"""
from __future__ import annotations

import math

import pytest
import torch

from cudagraph_rt.errors import CaptureError, InputError
from cudagraph_rt.kernels.sampling import (SamplingPlan, SamplingSettings, SamplingWorkspace, Stream,
                                           check_setting_values, sample, sample_with_probs, verify)
from cudagraph_rt.kernels.sampling import launch, philox
from cudagraph_rt.kernels.sampling.reference import reference_probs, reference_sample
from cudagraph_rt.kernels.sampling.torch_path import process
from cudagraph_rt.models.cells import greedy_tokens
from tests.support import run_compile_script
from tests.support.extras import reason
from tests.support.sampling_cases import assert_same_tokens, chi_square, random_logits, random_settings
from tests.support.seeds import seeded_rng

pytestmark = [pytest.mark.usefixtures("one_thread"),  # see conftest.py
              # the interpreter evaluates both sides of every tl.where (-inf - -inf in masked lanes)
              pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]
KERNEL = launch.triton_backend() != "unavailable"
DEV = torch.device("cuda") if launch.triton_backend() == "compiled" and torch.cuda.is_available() else torch.device("cpu")
INTERP = launch.triton_backend() == "interpreter"
needs_kernel = pytest.mark.skipif(not KERNEL, reason=reason("triton"))  # names the extra that brings it
ALPHA = 1e-3  # chi-square significance
TRIALS = 100_000
PLANS = {  # small programs, so the interpreter has few to run; every phase of the kernels on each
    "one-pass": SamplingPlan(chunk=64, block=64, search_block=64, candidates=8, search_passes=1),
    "two-pass": SamplingPlan(chunk=128, block=64, search_block=32, candidates=16, search_passes=2),
    "default": None,
}
TILED = SamplingPlan(chunk=64, block=16, search_block=16, candidates=4, search_passes=1)  # 4 tiles a program


@pytest.fixture
def rng():
    return seeded_rng("SAMPLING_SEED", torch_too=True)


def tickets_back_at_zero():
    for ws in launch.WORKSPACES.all():
        assert int(ws.tickets.abs().sum()) == 0, f"workspace {ws.key}: a ticket was left raised"


def on(device, settings: SamplingSettings) -> SamplingSettings:
    return SamplingSettings(*(t.to(device) for t in settings.tensors()))


# ------------------------------------------------------------------------------ randomness
KNOWN_ANSWERS = [  # Random123 kat_vectors: philox4x32 10, counter[4] key[2] -> output[4]
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,want", KNOWN_ANSWERS)
def test_philox_known_answers(counter, key, want):
    t = [torch.tensor([v], dtype=torch.int64, device=DEV) for v in (*counter, *key)]
    assert [int(w) for w in philox.philox4x32(*t)] == list(want)


def test_the_draws_follow_the_documented_layout(rng):
    """Index i of (seed, position, stream) is word i % 4 of counter (i // 4, position's
    halves, stream) under the seed's halves (negative seeds and positions past 2**32)."""
    seed, pos = rng.randrange(-2**63, 0), rng.randrange(2**32, 2**40)
    words = philox.random_words(torch.tensor([seed]), torch.tensor([pos]), Stream.RESIDUAL, 10)[0]
    s, p = seed % 2**64, pos
    for i in range(10):
        c = [torch.tensor([v]) for v in (i // 4, p & 0xFFFFFFFF, p >> 32, int(Stream.RESIDUAL), s & 0xFFFFFFFF, s >> 32)]
        assert int(words[i]) == int(philox.philox4x32(*c)[i % 4]), i


def test_uniforms_are_odd_multiples_of_2_to_the_minus_24_and_uniform(rng):
    n = TRIALS
    seed = torch.full((1,), rng.randrange(2**62))
    u = philox.uniforms(seed, torch.zeros(1, dtype=torch.int64), Stream.SAMPLE, n)[0].double()
    scaled = u * 2**24
    assert bool(((scaled > 0) & (scaled < 2**24)).all()) and bool((scaled.remainder(2) == 1).all())
    _, _, pvalue = chi_square(torch.histc(u, bins=64, min=0, max=1), torch.full((64,), 1 / 64, dtype=torch.float64))
    assert pvalue > ALPHA
    g = philox.gumbel(seed, torch.zeros(1, dtype=torch.int64), Stream.SAMPLE, n)[0].double()
    assert abs(g.mean().item() - 0.5772156649) < 5 * math.pi / math.sqrt(6 * n)  # Euler's gamma, 5 sigma


def test_streams_positions_and_seeds_draw_unrelated_words(rng):
    seed, pos = rng.randrange(2**62), rng.randrange(2**30)
    draw = lambda s, p, st: philox.uniforms(torch.tensor([s]), torch.tensor([p]), st, 4096)[0].double()  # noqa: E731
    base = draw(seed, pos, Stream.SAMPLE)
    for other in (draw(seed, pos, Stream.ACCEPT), draw(seed, pos, Stream.RESIDUAL), draw(seed, pos, Stream.DRAFT),
                  draw(seed, pos + 1, Stream.SAMPLE), draw(seed + 1, pos, Stream.SAMPLE)):
        corr = torch.corrcoef(torch.stack([base, other]))[0, 1].item()
        assert abs(corr) < 5 / math.sqrt(4096), corr


@needs_kernel
def test_the_kernels_draw_the_same_bits(rng):
    import triton
    import triton.language as tl

    @triton.jit
    def draw(out_ptr, seed_ptr, pos_ptr, stream, BLOCK: tl.constexpr):
        b = tl.program_id(0) * BLOCK
        u = philox.tl_uniforms(tl.load(seed_ptr), tl.load(pos_ptr), stream, b, BLOCK)
        tl.store(out_ptr + b + tl.arange(0, BLOCK), u)

    seed = torch.tensor([rng.randrange(-2**63, 2**63)], device=DEV)
    pos = torch.tensor([rng.randrange(2**40)], device=DEV)
    out = torch.full((256,), float("nan"), device=DEV)
    draw[(4,)](out, seed, pos, int(Stream.DRAFT), BLOCK=64)
    assert torch.equal(out, philox.uniforms(seed, pos, Stream.DRAFT, 256)[0])


# ------------------------------------------------------------------------------ kernels == torch path
def poisoned(n):
    return torch.full((n,), -7, dtype=torch.int64, device=DEV), torch.full((n,), float("nan"), device=DEV)


@needs_kernel
@pytest.mark.parametrize("plan", list(PLANS), ids=list(PLANS))
def test_kernels_match_the_torch_path(plan, rng):
    plan = PLANS[plan]
    n, v = 6, rng.randrange(60, 260)
    dtype = rng.choice([torch.float32, torch.float16])
    logits, settings = random_logits(rng, n, v, dtype, DEV), random_settings(rng, n, v, DEV)
    stream = rng.choice([Stream.SAMPLE, Stream.DRAFT])
    tokens, _ = poisoned(n)
    sample(logits, settings, stream=stream, out=tokens, plan=plan, use_kernel=True)
    assert_same_tokens(tokens, sample(logits, settings, stream=stream, use_kernel=False), logits, settings,
                       "sample", stream=stream)
    pr = process(logits, settings)
    draft = torch.tensor([rng.choice([-1, -1, v + 3, int(pr.argmax[i]), rng.randrange(v)]) for i in range(n)],
                         device=DEV)
    out = poisoned(n)  # unchecked: a draft past the vocabulary (refused on host rows) counts as none on the device
    verify(logits, settings, draft, out=out, plan=plan, use_kernel=True, validate=False)
    want = verify(logits, settings, draft, use_kernel=False, validate=False)
    assert_same_tokens(out[0], want[0], logits, settings, "verify, one-hot q", draft=draft.where(draft < v, -1))
    torch.testing.assert_close(out[1], want[1], rtol=1e-5, atol=1e-7)
    tickets_back_at_zero()


@needs_kernel
@pytest.mark.parametrize("plan", ["one-pass", "two-pass"])
def test_kernels_match_the_torch_path_with_a_draft_models_q(plan, rng):
    plan = PLANS[plan]
    n, v = 6, rng.randrange(60, 260)
    logits, settings = random_logits(rng, n, v, device=DEV), random_settings(rng, n, v, DEV)
    draft_logits, draft_settings = random_logits(rng, n, v, device=DEV), random_settings(rng, n, v, DEV)
    draft, q = torch.full((n,), -7, dtype=torch.int64, device=DEV), torch.full((n, v), float("nan"), device=DEV)
    sample_with_probs(draft_logits, draft_settings, out=(draft, q), plan=plan, use_kernel=True)
    want_draft, want_q = sample_with_probs(draft_logits, draft_settings, use_kernel=False)
    assert_same_tokens(draft, want_draft, draft_logits, draft_settings, "draft", stream=Stream.DRAFT)
    torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-7)
    draft[0] = -1  # a bonus row among them
    out = poisoned(n)
    verify(logits, settings, draft, q=q, out=out, plan=plan, use_kernel=True)
    want = verify(logits, settings, draft, q=q, use_kernel=False)
    assert_same_tokens(out[0], want[0], logits, settings, "verify, full q", draft=draft, q=q)
    torch.testing.assert_close(out[1], want[1], rtol=1e-5, atol=1e-7)
    tickets_back_at_zero()


def greedy_case(rng, n=6, v=64):
    """Small integer logits (many ties, the maximum included; the first row all equal) in
    float32 and float16."""
    logits = torch.randint(-3, 3, (n, v), generator=torch.Generator().manual_seed(rng.randrange(2**31))).float()
    logits[0] = 1.0
    settings = random_settings(rng, n, v, kinds=("plain", "min_p"))  # batch-mates, quick under the interpreter
    settings.temperature[: n // 2] = torch.tensor([0.0, 1e-6, 0.0])[: n // 2]
    return logits, settings


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_kernel)], ids=["torch", "kernel"])
def test_temperature_zero_is_greedy_tokens_bit_for_bit(kernel, rng):
    logits, settings = greedy_case(rng)
    for dtype in (torch.float32, torch.float16):
        x, st = logits.to(dtype).to(DEV), on(DEV, settings)
        greedy = greedy_tokens(x)
        rows, plan = slice(0, 3), TILED if kernel else None  # ties within a lane, across its tiles
        assert torch.equal(sample(x, st, use_kernel=kernel, plan=plan)[rows], greedy[rows])
        draft = torch.stack([greedy[0], (greedy[1] + 1) % x.shape[1], torch.tensor(-1, device=DEV)]).to(DEV)
        draft = torch.cat([draft, torch.full((3,), -1, dtype=torch.int64, device=DEV)])
        tokens, p_d = verify(x, st, draft, use_kernel=kernel, plan=plan)
        assert torch.equal(tokens[rows], greedy[rows])
        assert p_d[rows].tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_kernel)], ids=["torch", "kernel"])
def test_a_rows_token_depends_only_on_its_own_row(kernel, rng):
    """Permuted rows, more batch-mates, one row alone: every row keeps its token."""
    n, v = 5, 96
    logits, settings = random_logits(rng, n, v, device=DEV), random_settings(rng, n, v, DEV)
    base = sample(logits, settings, use_kernel=kernel)
    perm = torch.randperm(n, device=DEV)
    assert torch.equal(sample(logits[perm], settings.rows(perm), use_kernel=kernel), base[perm])
    more_logits, more = random_logits(rng, 3, v, device=DEV), random_settings(rng, 3, v, DEV)
    wide = sample(torch.cat([more_logits, logits]), SamplingSettings(*(torch.cat([a, b]) for a, b in
                                                                       zip(more.tensors(), settings.tensors()))),
                  use_kernel=kernel)
    assert torch.equal(wide[3:], base)
    i = rng.randrange(n)
    assert torch.equal(sample(logits[i:i + 1], settings.rows(slice(i, i + 1)), use_kernel=kernel), base[i:i + 1])
    if kernel:
        tickets_back_at_zero()


@needs_kernel
def test_a_workspace_of_ones_own_serves_its_shape_and_refuses_another(rng):
    n, v = 4, 64
    logits, settings, plan = random_logits(rng, n, v, device=DEV), random_settings(rng, n, v, DEV), PLANS["two-pass"]
    ws = SamplingWorkspace.for_logits(logits, plan)
    assert ws not in launch.WORKSPACES.all()
    got = sample(logits, settings, plan=plan, workspace=ws, use_kernel=True)
    assert_same_tokens(got, sample(logits, settings, use_kernel=False), logits, settings, "own workspace")
    assert int(ws.tickets.abs().sum()) == 0
    with pytest.raises(InputError, match="^workspace: expected"):
        sample(logits[:2], settings.rows(slice(0, 2)), plan=plan, workspace=ws, use_kernel=True)


def test_a_workspace_is_never_first_allocated_during_a_capture(monkeypatch):
    """A shape first sampled inside a capture would put its tickets in the graph's pool:
    refused with CaptureError, before any allocation."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    before = len(launch.WORKSPACES.all())
    with pytest.raises(CaptureError, match="outside capture"):
        launch.WORKSPACES.get(torch.device("cuda", 0), 3, 7, 16)
    assert len(launch.WORKSPACES.all()) == before


# ------------------------------------------------------------------------------ distributions
DISTRIBUTION_CASES = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.9, temperature=1.5),
    "min_p": dict(min_p=0.08, temperature=1.4),
    "combined": dict(temperature=1.3, top_k=10, top_p=0.8, min_p=0.05),
}


def one_row_trials(logits_row, seed: int, **setting) -> tuple[torch.Tensor, SamplingSettings]:
    """TRIALS copies of one row, each at its own position (fresh randomness per trial)."""
    s = SamplingSettings.full(TRIALS, seed=seed, **setting)
    s.position.copy_(torch.arange(TRIALS))
    return logits_row.expand(TRIALS, -1).contiguous(), s


@pytest.mark.parametrize("case", list(DISTRIBUTION_CASES))
def test_the_sampled_distribution_is_the_references(case):
    gen = torch.Generator().manual_seed(20260)
    row = torch.randn(24, generator=gen) * 1.5
    logits, s = one_row_trials(row, 977, **DISTRIBUTION_CASES[case])
    p = reference_probs(logits[:1], s.rows(slice(0, 1)))[0]
    assert int((p > 0).sum()) > 2, "a case with a trivial support tests nothing"
    stat, df, pvalue = chi_square(torch.bincount(sample(logits, s), minlength=24).double(), p)
    assert pvalue > ALPHA, (case, stat, df)
    stat, df, pvalue = chi_square(torch.bincount(reference_sample(logits, s, gen), minlength=24).double(), p)
    assert pvalue > ALPHA, ("the reference's own sampler", case, stat, df)


def test_the_kept_set_is_the_references(rng):
    """On continuous logits (no ties), every row's kept set is exactly the reference's,
    except rows whose boundary lies within float32 rounding (skipped, and few)."""
    n, v = 400, 64
    logits = random_logits(rng, n, v, masked=False)
    settings = random_settings(rng, n, v, kinds=("top_k", "top_p", "min_p", "k_and_p", "all", "plain"))
    kept = process(logits, settings).kept
    ref = reference_probs(logits, settings) > 0
    bad = [i for i in range(n) if not torch.equal(kept[i], ref[i])]
    from tests.support.sampling_cases import near_tie
    unexplained = [i for i in bad if not near_tie(logits, settings, i, tol=1e-5)]
    assert not unexplained and len(bad) <= 4, (unexplained, bad)
    probs = process(logits, settings).probs().double()
    torch.testing.assert_close(probs, reference_probs(logits, settings), rtol=1e-4, atol=1e-6)


# ------------------------------------------------------------------------------ rejection sampling
def lossless_case(target_row, target: dict, draft_tokens, q_row=None):
    """TRIALS verifies of one target row: the emitted tokens' counts and the acceptance rate."""
    logits, s = one_row_trials(target_row, 4242, **target)
    q = None if q_row is None else q_row.expand(TRIALS, -1).contiguous()
    tokens, p_d = verify(logits, s, draft_tokens, q=q)
    accepted = (tokens == draft_tokens).double().mean().item()
    return torch.bincount(tokens, minlength=logits.shape[1]).double(), accepted, reference_probs(logits[:1],
                                                                                                 s.rows(slice(0, 1)))[0]


@pytest.mark.parametrize("which", ["likely", "unlikely", "outside"])
def test_rejection_with_a_deterministic_draft_is_lossless(which):
    gen = torch.Generator().manual_seed(31337)
    row = torch.randn(16, generator=gen) * 1.5
    target = dict(temperature=0.9, top_k=8)
    p = reference_probs(row[None], SamplingSettings.full(1, **target))[0]
    order = p.argsort(descending=True)
    d = {"likely": order[0], "unlikely": order[5], "outside": order[12]}[which]
    counts, accepted, p = lossless_case(row, target, torch.full((TRIALS,), int(d)))
    stat, df, pvalue = chi_square(counts, p)
    assert pvalue > ALPHA, (which, stat, df)
    alpha = p[d].item()  # sum(min(p, one-hot q)) = p(d)
    assert abs(accepted - alpha) <= 4.5 * math.sqrt(max(alpha * (1 - alpha), 1e-12) / TRIALS) + 1e-12, (accepted, alpha)


def test_rejection_with_a_draft_models_q_is_lossless():
    """Drafts drawn from q (the draft model's own stream), verified against p: the emitted
    tokens follow p, and the acceptance rate is sum(min(p, q))."""
    gen = torch.Generator().manual_seed(8675309)
    v = 16
    row, draft_row = torch.randn(v, generator=gen) * 1.5, torch.randn(v, generator=gen) * 1.5
    target, drafting = dict(temperature=0.8, top_p=0.9), dict(temperature=1.1, top_k=10)
    draft_logits, ds = one_row_trials(draft_row, 4242, **drafting)  # same seed and positions as the target's
    d, q = sample_with_probs(draft_logits, ds)
    q_ref = reference_probs(draft_logits[:1], ds.rows(slice(0, 1)))[0]
    torch.testing.assert_close(q[0].double(), q_ref, rtol=1e-5, atol=1e-7)
    stat, df, pvalue = chi_square(torch.bincount(d, minlength=v).double(), q_ref)
    assert pvalue > ALPHA, ("the drafts follow q", stat, df)
    counts, accepted, p = lossless_case(row, target, d, q[0])
    stat, df, pvalue = chi_square(counts, p)
    assert pvalue > ALPHA, (stat, df)
    alpha = torch.minimum(p, q_ref).sum().item()
    assert abs(accepted - alpha) <= 4.5 * math.sqrt(alpha * (1 - alpha) / TRIALS), (accepted, alpha)


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_kernel)], ids=["torch", "kernel"])
def test_a_token_equals_its_draft_exactly_when_accepted(kernel, rng):
    """Drafts at each row's most probable token with q twice p there and p elsewhere: every
    rejection (u * q(d) >= p(d), about half) meets a p - q with no positive entry, the
    corner where the residual falls back to p, and still never returns the draft, so
    ``greedy_accept``'s ``tokens != next_tokens`` is the rejection, exactly."""
    n, v = 12, 48
    logits = random_logits(rng, n, v, masked=False)
    settings = random_settings(rng, n, v, kinds=("plain", "top_k", "top_p"))
    pr = process(logits, settings)
    rows, d = torch.arange(n), pr.argmax
    p = pr.probs()
    q = p.clone()
    q[rows, d] *= 2
    tokens, p_d = verify(logits.to(DEV), on(DEV, settings), d.to(DEV), q=q.to(DEV), use_kernel=kernel)
    accepted = philox.uniform(settings.seed, settings.position, Stream.ACCEPT) * q[rows, d] < p[rows, d]
    assert accepted.any() and (~accepted).any(), "a case with one outcome tests nothing"
    assert torch.equal(tokens.cpu() == d, accepted)
    torch.testing.assert_close(p_d.cpu(), p[rows, d], rtol=1e-5, atol=1e-7)


def test_a_bonus_row_is_a_plain_sample(rng):
    n, v = 6, 50
    logits, settings = random_logits(rng, n, v), random_settings(rng, n, v)
    tokens, p_d = verify(logits, settings, torch.full((n,), -1))
    assert torch.equal(tokens, sample(logits, settings)) and not p_d.any()


# ------------------------------------------------------------------------------ bad input
BAD_VALUES = [("temperature", -0.5), ("temperature", float("nan")), ("temperature", float("inf")),
              ("top_k", -1), ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")), ("min_p", 1.0),
              ("min_p", -0.1), ("min_p", float("nan"))]


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=needs_kernel)], ids=["torch", "kernel"])
@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={v}" for n, v in BAD_VALUES])
def test_a_bad_setting_is_an_input_error_before_anything_runs(name, value, kernel, monkeypatch):
    n, v = 4, 32
    settings = SamplingSettings.full(n)
    getattr(settings, name)[2] = value
    monkeypatch.setattr(launch, "_launch_all", lambda *a: pytest.fail("launched"))
    tokens, p_d = torch.full((n,), -7), torch.full((n,), float("nan"))
    with pytest.raises(InputError, match=f"^{name}: expected .* in row 2"):
        verify(torch.randn(n, v), settings, torch.full((n,), -1), out=(tokens, p_d), use_kernel=kernel)
    assert (tokens == -7).all() and p_d.isnan().all()
    with pytest.raises(InputError, match=f"^{name}:"):
        check_setting_values(settings)


def test_a_draft_outside_the_vocabulary_is_an_input_error_on_host_rows():
    with pytest.raises(InputError, match="^draft: expected a token in"):
        verify(torch.randn(2, 10), SamplingSettings.full(2), torch.tensor([3, 10]))


def bad_shape_cases():
    n, v = 4, 32
    good = SamplingSettings.full(n)
    yield "logits", dict(logits=torch.randn(n, v).to(torch.int64))
    yield "logits", dict(logits=torch.randn(n))
    yield "logits", dict(logits=torch.randn(v, n).T)
    for name in ("temperature", "top_k", "top_p", "min_p", "seed", "position"):
        t = getattr(good, name)
        yield name, dict(settings=SamplingSettings(**{**vars(good), name: t[:3]}))
        yield name, dict(settings=SamplingSettings(**{**vars(good), name: t.to(torch.float64 if t.is_floating_point()
                                                                                else torch.int32)}))
        if torch.cuda.is_available():
            yield name, dict(settings=SamplingSettings(**{**vars(good), name: t.cuda()}))
    yield "draft", dict(draft=torch.full((n,), -1, dtype=torch.int32))
    yield "draft", dict(draft=torch.full((n + 1,), -1))
    yield "q", dict(q=torch.rand(n, v + 1))
    yield "q", dict(q=torch.rand(n, v, dtype=torch.float64))
    yield "settings", dict(settings=(1.0, 0, 1.0, 0.0, 0, 0))
    yield "out_tokens", dict(out=(torch.empty(n, dtype=torch.int32), torch.empty(n)))
    yield "out_p", dict(out=(torch.empty(n, dtype=torch.int64), torch.empty(n + 1)))


@pytest.mark.parametrize("name,change", list(bad_shape_cases()), ids=[n for n, _ in bad_shape_cases()])
def test_a_bad_shape_dtype_or_device_is_an_input_error_naming_it(name, change, monkeypatch):
    n, v = 4, 32
    args = dict(logits=torch.randn(n, v), settings=SamplingSettings.full(n), draft=torch.full((n,), -1), q=None,
                out=None)
    args.update(change)
    monkeypatch.setattr(launch, "_launch_all", lambda *a: pytest.fail("launched"))
    with pytest.raises(InputError, match=f"^{name}: expected"):
        verify(args["logits"], args["settings"], args["draft"], q=args["q"], out=args["out"],
               use_kernel=True if INTERP else None)


def test_a_bad_probabilities_output_is_an_input_error_naming_it():
    with pytest.raises(InputError, match="^out_probs: expected"):
        sample_with_probs(torch.randn(2, 8), SamplingSettings.full(2), out=(torch.empty(2, dtype=torch.int64),
                                                                            torch.empty(2, 9)))


@pytest.mark.parametrize("stream", [Stream.ACCEPT, Stream.RESIDUAL, True, 3.0, "3", None, 7])
def test_a_stream_other_than_sample_or_draft_is_refused(stream):
    with pytest.raises(InputError, match="^stream: expected"):
        sample(torch.randn(2, 8), SamplingSettings.full(2), stream=stream)


@pytest.mark.parametrize("name,value", [("out", torch.empty(2, dtype=torch.int64)), ("out", (None,)),
                                        ("plan", {"chunk": 64}), ("workspace", "ws")])
def test_outputs_plans_and_workspaces_of_another_kind_are_refused(name, value):
    with pytest.raises(InputError, match=f"^{name}: expected"):
        verify(torch.randn(2, 8), SamplingSettings.full(2), torch.full((2,), -1), **{name: value})


@needs_kernel
def test_a_plan_out_of_shape_is_refused():
    plan = SamplingPlan(chunk=64, block=64, search_block=64, candidates=6, search_passes=1)
    with pytest.raises(InputError, match="^plan.candidates: expected"):
        sample(torch.randn(2, 8, device=DEV), SamplingSettings.full(2, device=DEV), use_kernel=True, plan=plan)


# ------------------------------------------------------------------------------ the bench
@needs_kernel
def test_the_bench_runs_in_smoke_mode(capsys):
    from cudagraph_rt.kernels.sampling import bench
    if DEV.type == "cuda":
        pytest.skip("the smoke run is for CPUs (the GPU run is the real bench)")
    assert bench.main(["--smoke", "--rows", "1", "--vocab", "64"]) == 0
    out = capsys.readouterr().out
    assert "top_p=0.9" in out and "NO" not in out


@needs_kernel
def test_the_kernels_compile_for_sm90_as_the_default_plans_launch_them():
    """The interpreter accepts what the compiler refuses: every launch of the default plans
    (1 and 64 rows of 128,256 logits, a vocabulary of 1) compiled offline for sm_90, with
    its ticket atomic, a round-to-nearest 1 / T and libdevice's log (compile_sampling.py)."""
    if torch.cuda.is_available():
        pytest.skip("the cuda tests compile the kernels for real here")
    pytest.importorskip("triton.backends.nvidia.compiler")
    done = run_compile_script("compile_sampling.py")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("ok ") >= 28 and "FAILED" not in done.stdout, done.stdout


# ------------------------------------------------------------------------------ CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_full_vocabulary_matches_the_torch_path(rows, dtype, rng):
    v = 128256
    logits = random_logits(rng, rows, v, dtype, "cuda")
    settings = random_settings(rng, rows, v, "cuda")
    tokens = sample(logits, settings)
    assert_same_tokens(tokens, sample(logits, settings, use_kernel=False), logits, settings, "sample")
    draft = torch.randint(-1, v, (rows,), device="cuda")
    got, want = verify(logits, settings, draft), verify(logits, settings, draft, use_kernel=False)
    assert_same_tokens(got[0], want[0], logits, settings, "verify", draft=draft)
    tickets_back_at_zero()


@pytest.mark.cuda
def test_cuda_a_captured_graph_follows_settings_written_in_place(rng):
    rows, v = 4, 128256
    logits = random_logits(rng, rows, v, torch.bfloat16, "cuda")
    settings = random_settings(rng, rows, v, "cuda")
    out = torch.full((rows,), -7, dtype=torch.int64, device="cuda")
    sample(logits, settings, out=out)  # compile and allocate the workspace outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample(logits, settings, out=out)
    for _ in range(3):
        new = random_settings(rng, rows, v, "cuda")
        for mine, theirs in zip(settings.tensors(), new.tensors()):
            mine.copy_(theirs)
        logits.copy_(random_logits(rng, rows, v, torch.bfloat16, "cuda"))
        out.fill_(-7)
        graph.replay()
        assert_same_tokens(out, sample(logits, settings, use_kernel=False), logits, settings, "replay")
    tickets_back_at_zero()
