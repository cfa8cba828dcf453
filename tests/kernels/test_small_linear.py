"""The small-M linear kernel (kernels/small_linear.py) against its torch reference and float64.

On the CPU the Triton kernel runs in the interpreter (conftest sets TRITON_INTERPRET=1;
on a GPU machine the same tests run the compiled kernel on CUDA tensors): fp32, small
random shapes whose N and K are not multiples of the blocks, weights that are
row slices (and column slices) of bigger tensors, strided x, bias or none, into poisoned
outputs, for the default plan and explicit configs (one program per N block, split K
reduced by the last program, the broadcast path). The CUDA tests run the 1B Llama's shapes
in bf16 and fp32 and replay a captured launch with new x. SMALL_LINEAR_SEED=<n> replays.
"""
from __future__ import annotations

import math

import pytest
import torch

from cudagraph_rt.errors import CaptureError, InputError
from cudagraph_rt.kernels import common
from cudagraph_rt.kernels import small_linear as sl
from tests.support import run_compile_script
from tests.support.extras import needs_kernel, require
from tests.support.seeds import seeded_rng

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
DEV = torch.device("cuda" if common.triton_backend() == "compiled" and torch.cuda.is_available() else "cpu")

CONFIGS = [None,  # the default plan
           sl.LinearConfig(block_n=16, block_k=16, split_k=1),
           sl.LinearConfig(block_n=32, block_k=32, split_k=3),
           sl.LinearConfig(block_n=16, block_k=64, split_k=5, num_stages=2),
           sl.LinearConfig(block_n=8, block_k=32, split_k=2, dot=False),
           sl.LinearConfig(block_n=4, block_k=16, split_k=1, dot=False)]
LLAMA_1B = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}  # (N, K)


@pytest.fixture
def rng():
    return seeded_rng("SMALL_LINEAR_SEED", torch_too=True)


def strided_case(rng, m, n, k, *, bias, dtype=torch.float32, device=DEV):
    """x (sometimes a column slice of a wider tensor), weight as rows [r0, r0 + n) of a
    bigger merged tensor (sometimes also a column slice: row stride > K), bias or None."""
    wide = rng.random() < 0.5
    merged = torch.randn(n + rng.randrange(1, 40), k + (rng.randrange(1, 9) if wide else 0), dtype=dtype, device=device)
    r0 = rng.randrange(merged.shape[0] - n + 1)
    weight = merged[r0:r0 + n, :k]
    x_src = torch.randn(m, k + (3 if rng.random() < 0.5 else 0), dtype=dtype, device=device)
    x = x_src[:, :k]
    b = torch.randn(n, dtype=dtype, device=device) if bias else None
    return x, weight, b


def float64_linear(x, weight, bias):
    y = x.double() @ weight.double().T
    return y if bias is None else y + bias.double()


def assert_matches(y, x, weight, bias, msg):
    """Against the reference (fp32) and an independent float64 product, within fp32's
    rounding of a K-term sum."""
    want64 = float64_linear(x, weight, bias)
    scale = (x.double().abs() @ weight.double().abs().T).max().item() + 1.0
    tol = 4 * x.shape[1] * torch.finfo(torch.float32).eps * scale
    assert not torch.isnan(y).any(), f"{msg}: output not fully written"
    torch.testing.assert_close(y.double(), want64, rtol=0, atol=tol, msg=msg)
    torch.testing.assert_close(y, sl.small_linear_reference(x, weight, bias), rtol=1e-5, atol=tol, msg=msg)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "default" if c is None else
                         f"n{c.block_n}k{c.block_k}s{c.split_k}{'' if c.dot else 'bcast'}")
@needs_kernel
def test_random_shapes_match_the_reference_and_float64(config, rng):
    for case in range(4):
        m, n, k = rng.randrange(1, 17), rng.randrange(1, 120), rng.randrange(1, 300)
        if config is not None and not config.dot and m > 4:
            m = rng.randrange(1, 5)  # the broadcast path is for a few rows
        x, weight, bias = strided_case(rng, m, n, k, bias=rng.random() < 0.5)
        out = torch.full((m, n), float("nan"), device=DEV)
        y = sl.small_linear(x, weight, bias, out=out, config=config)
        assert y is out
        assert_matches(y, x, weight, bias, f"case {case}: M={m} N={n} K={k} {config}")


@needs_kernel
def test_a_new_output_and_empty_rows(rng):
    x, weight, bias = strided_case(rng, 3, 40, 70, bias=True)
    assert_matches(sl.small_linear(x, weight, bias), x, weight, bias, "new output")
    empty = sl.small_linear(x[:0], weight, bias)
    assert empty.shape == (0, 40)


@needs_kernel
def test_split_counters_reset_and_repeated_calls_stay_right(rng):
    """Every N block's counter is back at 0 after each launch, so the next launch (a
    graph replay in real use) reduces at the right program again, with new x."""
    config = sl.LinearConfig(block_n=16, block_k=16, split_k=4)
    _, weight, bias = strided_case(rng, 1, 70, 90, bias=True)
    for call in range(3):
        x = torch.randn(rng.randrange(1, 17), 90, device=DEV)
        out = torch.full((x.shape[0], 70), float("nan"), device=DEV)
        sl.small_linear(x, weight, bias, out=out, config=config)
        assert_matches(out, x, weight, bias, f"call {call}")
        counts, _ = sl.SCRATCH.get(x.device, 5, 16, 4)
        assert counts.shape == (5,) and not counts.any(), f"call {call}: counters {counts.tolist()}"
    assert all(not c.any() for c in sl.SCRATCH.counters())


@pytest.mark.parametrize("bad", ["x_rows", "x_dim", "x_dtype", "w_k", "w_dtype", "bias_shape", "out_shape",
                                 "out_dtype", "config_block", "config_split", "config_dot"])
def test_bad_arguments_are_refused_before_anything_happens(bad, rng):
    x, weight, bias = strided_case(rng, 4, 30, 50, bias=True)
    out = torch.full((4, 30), float("nan"), device=DEV)
    kw = dict(x=x, weight=weight, bias=bias, out=out, config=sl.LinearConfig(block_n=16, block_k=16, split_k=7))
    t = lambda *shape: torch.randn(*shape, device=DEV)  # noqa: E731
    name, change = {
        "x_rows": ("x", dict(x=t(17, 50))), "x_dim": ("x", dict(x=t(50))),
        "x_dtype": ("x", dict(x=x.double())), "w_k": ("weight", dict(weight=t(30, 49))),
        "w_dtype": ("weight", dict(weight=weight.half())), "bias_shape": ("bias", dict(bias=t(31))),
        "out_shape": ("out", dict(out=t(4, 31))), "out_dtype": ("out", dict(out=out.double())),
        "config_block": ("config", dict(config=sl.LinearConfig(block_n=24))),
        "config_split": ("config", dict(config=sl.LinearConfig(split_k=0))),
        "config_dot": ("config", dict(config=sl.LinearConfig(block_n=8, dot=True))),
    }[bad]
    kw.update(change)
    before = len(sl.SCRATCH.counters())
    with pytest.raises(InputError, match=f"^{name}: expected"):
        sl.small_linear(kw.pop("x"), kw.pop("weight"), **kw)
    assert torch.isnan(out).all(), "the output was written"
    assert len(sl.SCRATCH.counters()) == before, "a scratch was allocated"


def test_the_scratch_is_never_first_allocated_during_a_capture(monkeypatch):
    """A split shape first launched inside a capture would put its counters in the
    graph's pool: refused with CaptureError, before any allocation."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    before = len(sl.SCRATCH.counters())
    with pytest.raises(CaptureError, match="outside capture"):
        sl.SCRATCH.get(torch.device("cuda", 0), 3, 16, 2)
    assert len(sl.SCRATCH.counters()) == before


def test_the_default_plan_keeps_every_sm_busy_and_the_table_wins(monkeypatch):
    """For the 1B Llama's layer shapes at every width bucket, the default plan launches
    at least two programs per SM of an H200 (132), every split reading some K; a table
    entry replaces the rule for its key only."""
    for name, (n, k) in LLAMA_1B.items():
        for m in (1, 2, 4, 8, 16):
            c = sl.plan_linear(m, n, k, torch.bfloat16, "cpu")
            programs = -(-n // c.block_n) * c.split_k
            assert programs >= 2 * 132, f"{name} M={m}: {programs} programs ({c})"
            per = math.ceil(math.ceil(k / c.split_k) / c.block_k) * c.block_k  # whole tiles a split
            assert (c.split_k - 1) * per < k, f"{name} M={m}: the last split reads nothing ({c})"
    entry = sl.LinearConfig(block_n=64, block_k=128, split_k=2, num_warps=8)
    monkeypatch.setitem(sl.TUNED_CONFIGS, (2048, 8192, 4, 2), entry)
    assert sl.plan_linear(3, 2048, 8192, torch.bfloat16, "cpu") == entry
    assert sl.plan_linear(5, 2048, 8192, torch.bfloat16, "cpu") != entry  # bucket 8
    assert sl.plan_linear(3, 2048, 8192, torch.float32, "cpu") != entry  # another element size


@needs_kernel
def test_fp16_runs_too(rng):
    x, weight, bias = strided_case(rng, 5, 50, 64, bias=True, dtype=torch.float16)
    y = sl.small_linear(x, weight, bias, config=sl.LinearConfig(block_n=16, block_k=32, split_k=2))
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, sl.small_linear_reference(x, weight, bias), rtol=2e-3, atol=2e-3)


def test_the_launches_compile_for_sm90_with_16_byte_loads():
    """CPU CI: the planned launches of the 1B shapes and every --tune candidate compile for
    an H200 offline (the interpreter accepts what the compiler may reject), read the
    weight with 16-byte loads and, split, bump their counter with an acq_rel atomic."""
    if torch.cuda.is_available():
        pytest.skip("the cuda tests compile the kernel for real here")
    require("triton")
    pytest.importorskip("triton.backends.nvidia.compiler")
    done = run_compile_script("compile_small_linear.py")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("ok ") >= 18 and "FAILED" not in done.stdout, done.stdout


# ------------------------------------------------------------------------------ CUDA
def _merged_rows(n, k, dtype, gen):
    """Rows [64, 64 + n) of a merged [n + 128, k] weight (a row-slice view, as fused.py's)."""
    merged = torch.randn(n + 128, k, dtype=dtype, device="cuda", generator=gen) * 0.02
    return merged[64:64 + n]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(LLAMA_1B))
def test_cuda_llama_1b_shapes_match_the_reference(name, dtype, rng):
    n, k = LLAMA_1B[name]
    gen = torch.Generator("cuda").manual_seed(rng.randrange(2**31))
    weight = _merged_rows(n, k, dtype, gen)
    bias = torch.randn(n, dtype=dtype, device="cuda", generator=gen) if name == "qkv" else None
    for m in (1, 2, 5, 16):
        x = torch.randn(m, k, dtype=dtype, device="cuda", generator=gen)
        out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
        sl.small_linear(x, weight, bias, out=out)
        want = float64_linear(x, weight, bias)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol * want.abs().max().item(),
                                   msg=f"{name} M={m} {dtype}")


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["o", "down", "gate_up"])
def test_cuda_graph_replays_with_new_x_and_the_counters_reset(name, rng):
    """A captured launch (after a warm-up) replayed with new x copied into its static
    input gives each x's product, the same bits for the same x (the split order is
    fixed), and leaves every counter at 0."""
    n, k = LLAMA_1B[name]
    gen = torch.Generator("cuda").manual_seed(rng.randrange(2**31))
    weight = _merged_rows(n, k, torch.bfloat16, gen)
    for m in (1, 4, 16):
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            sl.small_linear(x, weight)  # compiles and allocates the scratch outside capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = sl.small_linear(x, weight)
        for replay in range(3):
            x.copy_(torch.randn(m, k, dtype=torch.bfloat16, device="cuda", generator=gen))
            out.fill_(float("nan"))
            graph.replay()
            first = out.clone()
            graph.replay()
            assert torch.equal(out, first), f"{name} M={m}: two replays of one x differ"
            want = float64_linear(x, weight, None)
            torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item(),
                                       msg=f"{name} M={m} replay {replay}")
        torch.cuda.synchronize()
        assert all(not c.any() for c in sl.SCRATCH.counters()), f"{name} M={m}: a counter was left set"
