"""The attention modules whose rotary embedding runs in the pool's K/V write
(cudagraph_rt.models.hf_rotary), against the modules' own forward (rotation by transformers)
on the same weights and steps; the op and pool surface it uses."""
from __future__ import annotations

import random

import pytest
import torch

from tests.support.extras import require

require("transformers")

from cudagraph_rt import InputError  # noqa: E402
from cudagraph_rt.kernels.rotary_cells import rotate_reference  # noqa: E402
from cudagraph_rt.models import attention_op, hf, hf_rotary  # noqa: E402
from cudagraph_rt.models import pool as pool_mod  # noqa: E402
from cudagraph_rt.models.pool import KVPool  # noqa: E402
from cudagraph_rt.sweep.checks import Tolerance  # noqa: E402
from tests.models.test_hf import poison, random_schedule, rows_to_inputs  # noqa: E402
from tests.support.seeds import seeded_rng  # noqa: E402

TOL = Tolerance.for_dtype(torch.float32)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def rng() -> random.Random:
    return seeded_rng("HF_TEST_SEED")


@pytest.fixture
def rotations(monkeypatch):
    """How many times the pool's rotating write ran (CPU: its reference)."""
    calls = []
    real = pool_mod.rotary_write_cells_reference
    monkeypatch.setattr(pool_mod, "rotary_write_cells_reference", lambda *a: (calls.append(1), real(*a))[1])
    return calls


def _run(m, steps, seed):
    poison(m, seed)
    hidden = []
    with torch.no_grad():
        for rows in steps:
            out = m.step(rows_to_inputs(m, rows, len(rows) + 2))
            hidden.append((out["hidden"][:len(rows)].clone(), out["tokens"][:len(rows)].clone()))
    return hidden


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_rotation_in_the_pool_equals_the_modules_own(rng, family, rotations):
    """The same packed, padded steps through one model with the pool rotating q and k and
    with transformers rotating them: hidden rows within fp32 tolerance, tokens equal where
    the margin is clear; the pool's rotation ran once per layer and step in the first and
    never in the second."""
    base = hf.build(family, "tiny", seed=rng.randrange(1 << 30), max_len=64)
    ours = hf.HFDecoder(base.model, max_seqs=8, max_len=64)
    theirs = hf.HFDecoder(base.model, max_seqs=8, max_len=64, rotary_in_pool=False)
    assert ours.rotary_in_pool and not theirs.rotary_in_pool
    _, steps = random_schedule(rng, ours, n_seqs=3)
    seed = rng.randrange(1 << 30)
    got = _run(ours, steps, seed)
    assert len(rotations) == len(steps) * base.config.layers
    rotations.clear()
    want = _run(theirs, steps, seed)
    assert not rotations, "rotary_in_pool=False still rotated in the pool"
    for (h, t), (h2, t2) in zip(got, want):
        err, bound = TOL.errors(h, h2)
        assert (err <= bound).all(), f"{(err / bound).max():.3g} of tolerance"
        logits = ours.head(h2)
        clear = ours.clear_positions(logits.float())
        assert ((t == t2) | ~clear).all()


def test_outside_a_step_the_class_forward_runs(rng):
    """The model's own forward (reference, generate) is unchanged by the install, and
    uninstall removes it."""
    m = hf.build("qwen3", "tiny", seed=rng.randrange(1 << 30))
    ids = torch.tensor([[rng.randrange(m.config.vocab) for _ in range(7)]])
    with torch.no_grad():
        installed = m.model(ids).logits
        assert hf_rotary.uninstall(m.model) == m.config.layers
        assert hf_rotary.uninstall(m.model) == 0
        assert torch.equal(m.model(ids).logits, installed)
    assert hf_rotary.install(m.model) == m.config.layers == hf_rotary.install(m.model)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_a_model_with_the_forward_installed_pickles_and_copies(rng, rotations, how):
    """torch.save / pickle and copy.deepcopy of a model the install reached: the copy's
    modules keep the forward (uninstall finds it on every layer), bound to the copy: a
    decoder on the copy steps bit-equal to the original's, rotating in the pool, and a
    change of the copy's weights changes the copy's rows only."""
    import copy
    import io

    m = hf.build("qwen3", "tiny", seed=rng.randrange(1 << 30), max_len=64)
    if how == "pickle":
        buf = io.BytesIO()
        torch.save(m.model, buf)
        buf.seek(0)
        clone = torch.load(buf, weights_only=False)
    else:
        clone = copy.deepcopy(m.model)
    twin = hf.HFDecoder(clone, max_seqs=8, max_len=64)
    _, steps = random_schedule(rng, m, n_seqs=2)
    seed = rng.randrange(1 << 30)
    want = _run(m, steps, seed)
    assert len(rotations) == len(steps) * m.config.layers
    got = _run(twin, steps, seed)
    assert len(rotations) == 2 * len(steps) * m.config.layers, "the copy's modules rotate in the pool"
    assert all(torch.equal(h, h2) for (h, _), (h2, _) in zip(got, want))
    with torch.no_grad():
        for layer in clone.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.5)
    changed = _run(twin, steps, seed)
    assert not all(torch.equal(h, h2) for (h, _), (h2, _) in zip(changed, want))
    assert all(torch.equal(h, h2) for (h, _), (h2, _) in zip(_run(m, steps, seed), want))
    assert hf_rotary.uninstall(clone) == m.config.layers


def test_eager_piece_attention_takes_the_class_forward(rng, rotations):
    """attention="eager-piece" gets rotated q and k from the class's forward (its marked
    call is the plain attention): the pool's rotation never runs."""
    m = hf.build("llama", "tiny", seed=rng.randrange(1 << 30), attention="eager-piece")
    rows = [(rng.randrange(m.config.vocab), p, 0, 1, -1) for p in range(5)]
    with torch.no_grad():
        m.step(rows_to_inputs(m, rows))
    assert not rotations


def test_rotary_in_pool_must_be_a_bool():
    base = hf.build("llama", "tiny")
    with pytest.raises(InputError, match=r"^rotary_in_pool: expected a bool"):
        hf.HFDecoder(base.model, rotary_in_pool="yes")


def _pools(seed, rng):
    pools = [KVPool(layers=2, kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu", cells=6 * 16 + 16,
                    max_seqs=3, max_seq_len=32, block_size=16) for _ in range(2)]
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(pools[0].k.shape, generator=g)
    for p in pools:
        p.k.copy_(noise)
        p.v.copy_(-noise)
    seqs = [0, 0, 1, 2, -1]
    pos = [3, 4, rng.randrange(30), rng.randrange(30), 0]
    for p in pools:
        for s, q in zip(seqs, pos):
            if s >= 0:
                p.cell_range(s, 0, q + 1)
    cells = torch.tensor([pools[0].cell_for(s, q) if s >= 0 else pools[0].scratch_cell for s, q in zip(seqs, pos)])
    q, k, v = (torch.randn(5, h, 16, generator=g) for h in (4, 2, 2))
    cos, sin = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    return pools, (q, k, v, torch.tensor(seqs), torch.tensor(pos), cells), (cos, sin)


def test_pool_attend_with_rotary_equals_attend_of_rotated_rows(rng):
    """KVPool.attend(rotary=) == KVPool.attend of q and k rotated first (the reference
    rotation), in the output and in every cell; the op, called eagerly, the same."""
    (a, b), (q, k, v, seqs, pos, cells), (cos, sin) = _pools(rng.randrange(1 << 30), rng)
    got = a.attend(1, q, k, v, seqs, pos, cells, scale=0.3, rotary=(cos, sin))
    want = b.attend(1, rotate_reference(q, cos, sin, q.dtype), rotate_reference(k, cos, sin, k.dtype), v, seqs, pos,
                    cells, scale=0.3)
    assert torch.equal(got, want) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    out = torch.full_like(q, float("nan"))
    torch.ops.cgrt.attend_cells(q, k, v, seqs, pos, cells, out, attention_op.pool_id(a), 1, 0.3, None, None, 0,
                                cos, sin)
    assert torch.equal(out, want)


def test_the_op_with_rotary_passes_torch_library_opcheck(rng):
    (a, _), args, (cos, sin) = _pools(rng.randrange(1 << 30), rng)
    out = torch.empty_like(args[0])
    torch.library.opcheck(torch.ops.cgrt.attend_cells.default,
                          (*args, out, attention_op.pool_id(a), 0, 0.25, None, None, 0, cos, sin))


# ------------------------------------------------------------------------------ stateful fuzz
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402


def _cells(m, s: int, n: int) -> torch.Tensor:
    """The cells of ``s``'s first ``n`` positions, read from the block table (no block is
    taken or copied, as cell_range might)."""
    j = torch.arange(n)
    bs = m.pool.block_size
    return m.pool.block_table[s].long()[j // bs] * bs + j % bs


class TwinDecoders(RuleBasedStateMachine):
    """One model, two decoders on pools of their own: the pool rotating q and k, and
    transformers rotating them. Random packed, padded steps of several sequences, forks,
    frees and the forward uninstalled and installed again in between; after every step
    both give the same hidden rows (fp32 tolerance) and, where the margin is clear, the
    same tokens; after every rule both pools hold the same K/V (within tolerance)."""

    @initialize(family=st.sampled_from(hf.FAMILIES), seed=st.integers(0, 2**30))
    def build(self, family, seed):
        base = hf.build(family, "tiny", seed=seed, max_seqs=4, max_len=32)
        self.ours = hf.HFDecoder(base.model, max_seqs=4, max_len=32)
        self.theirs = hf.HFDecoder(base.model, max_seqs=4, max_len=32, rotary_in_pool=False)
        self.lens = {s: 0 for s in range(4)}
        self.rng = random.Random(seed)

    @rule(seqs=st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True), n=st.integers(1, 4),
          pad=st.integers(0, 3))
    def step(self, seqs, n, pad):
        rows = []
        for s in seqs:
            take = min(n, 32 - self.lens[s])
            rows += [(self.rng.randrange(self.ours.config.vocab), p, s, 1, -1)
                     for p in range(self.lens[s], self.lens[s] + take)]
            self.lens[s] += take
        if not rows:
            return
        self.rng.shuffle(rows)
        with torch.no_grad():
            a = self.ours.step(rows_to_inputs(self.ours, rows, len(rows) + pad))
            b = self.theirs.step(rows_to_inputs(self.theirs, rows, len(rows) + pad))
        err, bound = TOL.errors(a["hidden"][:len(rows)], b["hidden"][:len(rows)])
        assert (err <= bound).all(), f"{(err / bound).max():.3g} of tolerance"
        clear = self.ours.clear_positions(self.ours.head(b["hidden"][:len(rows)]).float())
        assert ((a["tokens"][:len(rows)] == b["tokens"][:len(rows)]) | ~clear).all()

    @rule(src=st.integers(0, 3), dst=st.integers(0, 3), frac=st.floats(0, 1))
    def fork(self, src, dst, frac):
        upto = int(self.lens[src] * frac)
        if src == dst or upto == 0:
            return
        for m in (self.ours, self.theirs):
            m.free_seq(dst)
            m.fork_seq(src, dst, upto)
        self.lens[dst] = upto

    @rule(s=st.integers(0, 3))
    def free(self, s):
        for m in (self.ours, self.theirs):
            m.free_seq(s)
        self.lens[s] = 0

    @rule()
    def reinstall(self):
        hf_rotary.uninstall(self.ours.model)
        hf_rotary.install(self.ours.model)

    @rule()
    def uninstall(self):
        hf_rotary.uninstall(self.ours.model)

    @invariant()
    def same_cells(self):
        if hasattr(self, "ours"):
            for s, n in self.lens.items():
                if n:
                    a, b = (_cells(m, s, n) for m in (self.ours, self.theirs))
                    torch.testing.assert_close(self.ours.pool.k[:, a], self.theirs.pool.k[:, b], atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(self.ours.pool.v[:, a], self.theirs.pool.v[:, b], atol=1e-5, rtol=1e-5)


TwinDecoders.TestCase.settings = settings(max_examples=12, stateful_step_count=10, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
test_twin_decoders = TwinDecoders.TestCase
