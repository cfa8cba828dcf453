"""The rotary + K/V write kernel against its torch reference and against transformers' own
rotary function (interpreter on a CPU, fp32; compiled on CUDA, bf16 too)."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cudagraph_rt.errors import InputError  # noqa: E402
from cudagraph_rt.kernels import common  # noqa: E402
from cudagraph_rt.kernels import rotary_cells as rc  # noqa: E402
from tests.support.extras import needs, needs_kernel  # noqa: E402
from tests.support.seeds import seeded_rng  # noqa: E402

MODE = common.triton_backend()
DEV = torch.device("cuda") if MODE == "compiled" else torch.device("cpu")
cuda_only = pytest.mark.skipif(MODE != "compiled", reason="needs a CUDA GPU (compiled Triton)")


@pytest.fixture
def rng():
    return seeded_rng("CGRT_TEST_SEED", torch_too=True)


class Rows:
    """One step's q/k/v as views of one merged projection output [N, (Hq + 2 Hkv) * D] (as
    the fused q/k/v linear leaves them), the rows' rotary tables at random positions, and
    caches poisoned with NaN."""

    def __init__(self, rng, N, *, Hq=4, Hkv=2, D=16, cells=40, dtype=torch.float32, device=DEV, padding=0):
        gen = torch.Generator(device=device).manual_seed(rng.randrange(2**31))
        merged = torch.randn(N, (Hq + 2 * Hkv) * D, generator=gen, device=device).to(dtype)
        self.q = merged[:, :Hq * D].view(N, Hq, D)
        self.k = merged[:, Hq * D:(Hq + Hkv) * D].view(N, Hkv, D)
        self.v = merged[:, (Hq + Hkv) * D:].view(N, Hkv, D)
        pos = torch.tensor([rng.randrange(4096) for _ in range(N)], device=device)
        inv = 1.0 / 10000 ** (torch.arange(0, D, 2, device=device).float() / D)
        freqs = pos[:, None].float() * inv[None, :]
        emb = torch.cat((freqs, freqs), -1)
        self.cos, self.sin = emb.cos().to(dtype), emb.sin().to(dtype)
        self.scratch = cells - 1
        live = rng.sample(range(cells - 1), N - padding)
        self.cells = torch.tensor(live + [self.scratch] * padding, device=device)
        self.kc = torch.full((cells, Hkv, D), float("nan"), dtype=dtype, device=device)
        self.vc = torch.full_like(self.kc, float("nan"))
        self.q_out = torch.full_like(self.q, float("nan"))

    def args(self):
        return self.q, self.k, self.v, self.cos, self.sin, self.kc, self.vc, self.cells, self.q_out


def hf_rotate(x, cos, sin):
    """transformers' own apply_rotary_pos_emb on x [N, H, D] (its layout [1, H, N, D])."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t = x.permute(1, 0, 2)[None]
    out, _ = apply_rotary_pos_emb(t, t, cos[None], sin[None])
    return out[0].permute(1, 0, 2)


@needs("transformers")
def test_reference_is_transformers_rotation():
    """In fp32 (one rounding either way) the reference is transformers' function."""
    r = Rows(seeded_rng("CGRT_TEST_SEED"), 5, device=torch.device("cpu"))
    torch.testing.assert_close(rc.rotate_reference(r.q, r.cos, r.sin, torch.float32), hf_rotate(r.q, r.cos, r.sin))


@needs_kernel
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(N=st.integers(1, 6), G=st.sampled_from([1, 2, 4]), Hkv=st.sampled_from([1, 2, 3]),
       D=st.sampled_from([8, 16, 20]), padding=st.integers(0, 2), seed=st.integers(0, 2**31 - 1))
def test_kernel_matches_the_reference(N, G, Hkv, D, padding, seed):
    """Random rows (GQA groups, head dims that are not powers of two, padding rows on the
    scratch cell): q_out, the cells given and nothing else."""
    import random

    padding = min(padding, N - 1)
    got = Rows(random.Random(seed), N, Hq=G * Hkv, Hkv=Hkv, D=D, padding=padding)
    want = Rows(random.Random(seed), N, Hq=G * Hkv, Hkv=Hkv, D=D, padding=padding)
    assert rc.rotary_write_cells_triton(*got.args()) is got.q_out
    rc.rotary_write_cells_reference(*want.args())
    torch.testing.assert_close(got.q_out, want.q_out, atol=1e-6, rtol=1e-6)
    live = got.cells[:N - padding]
    torch.testing.assert_close(got.kc[live], want.kc[live], atol=1e-6, rtol=1e-6)
    assert torch.equal(got.vc[live], got.v[:N - padding])
    untouched = torch.ones(got.kc.shape[0], dtype=torch.bool)
    untouched[got.cells.cpu()] = False
    assert got.kc[untouched.to(DEV)].isnan().all() and got.vc[untouched.to(DEV)].isnan().all()
    if padding:  # each element of the scratch cell is one padding row's
        rot = rc.rotate_reference(got.k, got.cos, got.sin, got.kc.dtype)[N - padding:]
        assert (got.kc[got.scratch][None] == rot).any(0).all()


@needs_kernel
def test_cells_outside_the_caches_write_nothing(rng):
    r = Rows(rng, 3)
    r.cells = torch.tensor([-1, r.kc.shape[0], 5], device=DEV)
    rc.rotary_write_cells_triton(*r.args())
    assert not r.q_out.isnan().any(), "q_out is written for every row"
    rest = torch.ones(r.kc.shape[0], dtype=torch.bool)
    rest[5] = False
    assert r.kc[rest.to(DEV)].isnan().all() and r.vc[rest.to(DEV)].isnan().all()
    assert not r.kc[5].isnan().any()


def test_dispatch_runs_the_reference_on_a_cpu_and_checks_first(rng, monkeypatch):
    """On CPU tensors (no CGRT_CPU_KERNELS) the entry point is the reference; bad input is
    refused before anything is written."""
    r = Rows(rng, 4, device=torch.device("cpu"))
    monkeypatch.setattr(rc, "runs_kernel", lambda t: False)
    rc.rotary_write_cells(*r.args())
    torch.testing.assert_close(r.q_out, rc.rotate_reference(r.q, r.cos, r.sin, torch.float32))
    bad = Rows(rng, 4, device=torch.device("cpu"))
    with pytest.raises(InputError, match=r"^cos: expected"):
        rc.rotary_write_cells(bad.q, bad.k, bad.v, bad.cos[:, :8], bad.sin, bad.kc, bad.vc, bad.cells, bad.q_out)
    assert bad.q_out.isnan().all() and bad.kc.isnan().all()


@pytest.mark.parametrize("case,name", [
    ("odd_d", "q"), ("k_rows", "k"), ("v_shape", "v"), ("groups", "q"), ("cos_rows", "cos"), ("sin_dtype", "sin"),
    ("cache_heads", "k_cache"), ("cells_rows", "cells"), ("q_out_shape", "q_out"), ("q_out_none", "q_out"),
    ("no_kv_heads", "k")])
def test_bad_input_names_the_argument(rng, case, name):
    r = Rows(rng, 3, device=torch.device("cpu"))
    a = dict(q=r.q, k=r.k, v=r.v, cos=r.cos, sin=r.sin, k_cache=r.kc, v_cache=r.vc, cells=r.cells, q_out=r.q_out)
    if case == "odd_d":
        a["q"] = torch.randn(3, 4, 15)
    elif case == "k_rows":
        a["k"] = r.k[:2]
    elif case == "v_shape":
        a["v"] = torch.randn(3, 1, 16)
    elif case == "groups":
        a["q"], a["q_out"] = torch.randn(3, 3, 16), torch.randn(3, 3, 16)
    elif case == "cos_rows":
        a["cos"] = r.cos[:2]
    elif case == "sin_dtype":
        a["sin"] = r.sin.long()
    elif case == "cache_heads":
        a["k_cache"] = a["v_cache"] = torch.zeros(40, 1, 16)
    elif case == "cells_rows":
        a["cells"] = r.cells[:2]
    elif case == "no_kv_heads":
        a["k"], a["v"] = torch.randn(3, 0, 16), torch.randn(3, 0, 16)
    elif case == "q_out_shape":
        a["q_out"] = torch.empty(3, 4, 8)
    else:
        a["q_out"] = None
    with pytest.raises(InputError, match=rf"^{name}: expected"):
        rc.rotary_write_cells(**a)
    assert r.kc.isnan().all() and r.vc.isnan().all(), "nothing is written before the check"


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_against_the_reference(rng, dtype):
    """The 1B's shapes (32 query heads, 8 KV heads, D 64) and a wider head (D 128), one row
    and a verify step's 8: bit-equal to the reference in fp32 up to fma contraction, one
    bf16 ulp in bf16."""
    import random

    for N, Hq, Hkv, D in ((1, 32, 8, 64), (8, 32, 8, 64), (5, 16, 4, 128)):
        seed, padding = rng.randrange(2**31), 1 if N > 1 else 0
        got, want = (Rows(random.Random(seed), N, Hq=Hq, Hkv=Hkv, D=D, cells=4096, dtype=dtype, padding=padding)
                     for _ in range(2))
        rc.rotary_write_cells_triton(*got.args())
        rc.rotary_write_cells_reference(*want.args())
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.q_out, want.q_out, atol=tol, rtol=tol)
        live = got.cells[:N - padding]
        torch.testing.assert_close(got.kc[live], want.kc[live], atol=tol, rtol=tol)
        assert torch.equal(got.vc[live], want.vc[live])
