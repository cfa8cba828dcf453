"""Tests of kernels/row_gather/: the Triton gather against its torch reference and
against the contract itself (the "Contract" in the package's docstring).

Where the kernel runs: tests/conftest.py sets TRITON_INTERPRET=1 on machines without
CUDA before anything imports triton, so the "kernel" tests run the interpreter on CPU
tensors (fp32/fp16 only). On a GPU machine the same tests run the compiled kernel on CUDA
tensors (bf16 included), and the @pytest.mark.cuda tests add CUDA-graph capture into a
pinned host ring.

Oracle: every kernel result is compared exactly with gather_rows_reference run on the
same inputs into an identically poisoned destination, and independently checked against
the contract (`_check_contract`), which is computed here from Python lists, not from the
code under test. Destinations are poisoned (NaN rows, -7 meta) so "nothing else
changed" is visible. Inputs are fresh random each run; the seed is printed (shown by
pytest on failure) and can be pinned with CGRT_TEST_SEED.
"""
from __future__ import annotations

import os

import torch

# Normally done by tests/conftest.py; repeated so this file also works on its own
# (--noconftest). It must happen before triton is imported: triton.jit picks interpreted
# or compiled when the kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest  # noqa: E402

from cudagraph_rt.errors import InputError  # noqa: E402
from cudagraph_rt.kernels import common  # noqa: E402
from cudagraph_rt.kernels import row_gather as rg  # noqa: E402
from tests.support.models_for_tests import warm_and_capture  # noqa: E402
from tests.support.extras import kernel_skip, require  # noqa: E402
from tests.support.seeds import seeded_rng  # noqa: E402

MODE = common.triton_backend()
if MODE == "interpreter":
    KDEV = torch.device("cpu")
elif MODE == "compiled" and torch.cuda.is_available():
    KDEV = torch.device("cuda")
else:
    KDEV = None

needs_kernel = kernel_skip(KDEV is None, f"kernel mode {MODE!r}: needs CUDA or TRITON_INTERPRET=1 set before import")
_no_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or MODE != "compiled", reason="needs a CUDA GPU (compiled Triton)"
)


def cuda_test(fn):
    """@pytest.mark.cuda (the conftest skips it without a GPU) plus a local skip, so the
    file does not depend on the conftest hook."""
    return pytest.mark.cuda(_no_cuda(fn))


FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HS = [1, 3, 64, 1000, 4096]
POISON_META = -7


@pytest.fixture
def rng():
    """A seeded python RNG plus torch's global seed: fresh each run, reproducible on
    demand (CGRT_TEST_SEED=<n>)."""
    return seeded_rng("CGRT_TEST_SEED", torch_too=True)


def _skip_unsupported(dtype):
    if dtype == torch.bfloat16 and KDEV is not None and KDEV.type == "cpu":
        pytest.skip("the Triton interpreter has no bfloat16")


def _poisoned(S, C, H, dtype, device, pin=False):
    dst = torch.full((S, C, H), float("nan"), dtype=dtype, device=device, pin_memory=pin)
    meta = torch.full((S, 2 + C), POISON_META, dtype=torch.int32, device=device, pin_memory=pin)
    return dst, meta


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _assert_same(got_dst, got_meta, want_dst, want_meta, what=""):
    """Bitwise-equal (NaN == NaN) data and equal meta: a gather is a copy, no tolerance."""
    torch.testing.assert_close(
        got_dst.cpu(), want_dst.cpu(), rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what}\n{m}"
    )
    assert torch.equal(got_meta.cpu(), want_meta.cpu()), f"{what}\nmeta got\n{got_meta}\nwant\n{want_meta}"


def _check_contract(src, rows, count, dst, meta, src_slot=None, dst_slot=None, *, before_dst, before_meta):
    """Check dst/meta after a launch against the written contract, from Python values.

    before_*: copies taken just before the launch; everything not named by the contract
    must still equal them.
    """
    src, dst, meta = src.cpu(), dst.cpu(), meta.cpu()
    before_dst, before_meta = before_dst.cpu(), before_meta.cpu()
    S, C, _ = dst.shape
    rows_l = rows.cpu().tolist()
    R, c = len(rows_l), int(count.cpu()[0])
    d = 0 if dst_slot is None else int(dst_slot.cpu()[0])
    s = 0 if src_slot is None else int(src_slot.cpu()[0])
    slabs = src.shape[0] if src.dim() == 3 else 1
    N = src.shape[-2]
    want_dst, want_meta = before_dst.clone(), before_meta.clone()
    if 0 <= d < S:
        n = max(0, min(c, C, R))
        src_ok = 0 <= s < slabs
        bad_rows = [r for r in rows_l[:n] if not 0 <= r < N]
        want_meta[d, 0] = n
        want_meta[d, 1] = (1 * bool(bad_rows)) | (2 * (c > C)) | (4 * (c < 0 or c > R)) | (8 * (not src_ok))
        for j in range(n):
            want_meta[d, 2 + j] = rows_l[j]
            if src_ok and 0 <= rows_l[j] < N:
                want_dst[d, j] = (src[s] if src.dim() == 3 else src)[rows_l[j]]
    _assert_same(dst, meta, want_dst, want_meta, f"contract: count={c} rows={rows_l} src_slot={s} dst_slot={d}")


def _run_both(src, rows, count, S, C, *, src_slot=None, dst_slot=None, dst_device=None, pin=False):
    """Run kernel and reference into fresh poisoned rings; check both agree and obey the
    contract. Returns the kernel's (dst, meta)."""
    H, dtype = src.shape[-1], src.dtype
    dst_device = src.device if dst_device is None else dst_device
    kd, km = _poisoned(S, C, H, dtype, dst_device, pin)
    rd, rm = _poisoned(S, C, H, dtype, dst_device, pin)
    before_dst, before_meta = kd.clone(), km.clone()
    rg.gather_rows(src, rows, count, kd, km, src_slot=src_slot, dst_slot=dst_slot)
    rg.gather_rows_reference(src, rows, count, rd, rm, src_slot=src_slot, dst_slot=dst_slot)
    if src.is_cuda:
        torch.cuda.synchronize()
    _assert_same(kd, km, rd, rm, f"kernel vs reference: count={count.tolist()} rows={rows.tolist()}")
    _check_contract(src, rows, count, kd, km, src_slot, dst_slot, before_dst=before_dst, before_meta=before_meta)
    return kd, km


# --------------------------------------------------------------------------------------
# Kernel vs reference (interpreter on CPU, compiled on CUDA)
# --------------------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("H", HS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_kernel_matches_reference_over_counts(dtype, H, rng):
    _skip_unsupported(dtype)
    N = rng.randint(5, 12)  # src rows
    R = rng.randint(N - 2, N + 2)  # row-list length (a padded step width)
    C = rng.randint(R - 1, R + 1)  # slot capacity, sometimes below R
    S = 3
    src = torch.randn(N, H, device=KDEV).to(dtype)
    # Every count the slot can hold; for wide H a sample, to keep CPU CI fast.
    counts = list(range(min(R, C) + 1))
    if H >= 1000:
        counts = sorted({0, 1, min(R, C), rng.choice(counts)})
    for c in counts:
        # Random rows, duplicates allowed, int32 or int64.
        rows = torch.randint(0, N, (R,), device=KDEV, dtype=rng.choice([torch.int32, torch.int64]))
        _run_both(src, rows, _i32([c], KDEV), S, C, dst_slot=_i32([rng.randrange(S)], KDEV))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_bad_indices_are_flagged_and_skipped(dtype, rng):
    N, R, C, S, H = 8, 10, 10, 2, rng.choice([3, 64, 1000])
    src = torch.randn(N, H, device=KDEV).to(dtype)
    for bad in ([-1], [N], [N + 5, -100], [-(2**31)]):
        rows_l = [rng.randrange(N) for _ in range(R)]
        where = rng.sample(range(R), len(bad))
        for w, b in zip(where, bad):
            rows_l[w] = b
        count = max(where) + 1 + rng.randint(0, R - 1 - max(where))  # bad rows are inside the count
        _, km = _run_both(src, _i32(rows_l, KDEV), _i32([count], KDEV), S, C)
        assert int(km[0, 1]) == 1  # FLAG_INDEX alone


@needs_kernel
def test_bad_index_past_count_is_not_flagged(rng):
    """Indices past count are never used, so they neither flag nor get read."""
    N, R, C, H = 6, 8, 8, 64
    src = torch.randn(N, H, device=KDEV)
    count = rng.randint(0, R - 1)
    rows_l = [rng.randrange(N) for _ in range(count)] + [-1 if j % 2 else N + j for j in range(R - count)]
    _, km = _run_both(src, _i32(rows_l, KDEV), _i32([count], KDEV), 1, C)
    assert int(km[0, 1]) == 0


@needs_kernel
@pytest.mark.parametrize(
    "R,C,count",
    [(8, 8, -1), (8, 8, -(2**31)), (8, 5, 6), (8, 5, 8), (8, 5, 2**31 - 1),
     (4, 8, 6), (0, 4, 0), (0, 4, 1), (6, 0, 0), (6, 0, 3)],
)
def test_count_out_of_range(R, C, count, rng):
    """count < 0, count > C and count > len(rows) are flagged; meta[0] is clamped."""
    N, H = 7, rng.choice([1, 64])
    src = torch.randn(N, H, device=KDEV)
    rows = torch.randint(0, N, (R,), device=KDEV, dtype=torch.int32)
    _, km = _run_both(src, rows, _i32([count], KDEV), 2, C)
    assert int(km[0, 0]) == max(0, min(count, C, R))
    assert int(km[0, 1]) == 2 * (count > C) + 4 * (count < 0 or count > R)  # FLAG_CAPACITY, FLAG_COUNT


@needs_kernel
@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64], ids=str)
def test_src_slot_and_dst_slot_pick_slabs(rows_dtype, rng):
    S_src, N, R, C, S, H = 3, 6, 6, 6, 4, rng.choice([3, 1000])
    src = torch.randn(S_src, N, H, device=KDEV)
    for s in list(range(S_src)) + [-1, S_src]:  # out-of-range slab: flagged, nothing copied
        d = rng.randrange(S)
        rows = torch.randint(0, N, (R,), device=KDEV, dtype=rows_dtype)
        count = rng.randint(1, R)
        _, km = _run_both(src, rows, _i32([count], KDEV), S, C, src_slot=_i32([s], KDEV), dst_slot=_i32([d], KDEV))
        assert int(km[d, 1]) == 8 * (not 0 <= s < S_src)  # FLAG_SRC_SLOT


@needs_kernel
@pytest.mark.parametrize("d", [-1, 4, 2**31 - 1])
def test_dst_slot_out_of_range_writes_nothing(d, rng):
    N, R, C, S, H = 5, 5, 5, 4, 64
    src = torch.randn(N, H, device=KDEV)
    rows = torch.randint(0, N, (R,), device=KDEV, dtype=torch.int32)
    kd, km = _run_both(src, rows, _i32([R], KDEV), S, C, dst_slot=_i32([d], KDEV))
    assert bool(torch.isnan(kd).all()) and bool((km == POISON_META).all())


@needs_kernel
def test_values_are_read_from_device_memory_at_each_launch(rng):
    """One set of tensors, rewritten in place between launches (what replays do): each
    launch follows the current rows/count/slot, and earlier slots keep their rows."""
    N, R, C, S, H = 9, 8, 8, 3, 64
    src = torch.randn(N, H, device=KDEV)
    rows = torch.zeros(R, device=KDEV, dtype=torch.int32)
    count = _i32([0], KDEV)
    slot = _i32([0], KDEV)
    kd, km = _poisoned(S, C, H, src.dtype, KDEV)
    rd, rm = _poisoned(S, C, H, src.dtype, KDEV)
    for step in range(2 * S):
        rows.copy_(torch.randint(0, N, (R,), dtype=torch.int32))
        count.fill_(rng.randint(0, R))
        slot.fill_(step % S)
        src.copy_(torch.randn(N, H))
        # The slot about to be reused is re-poisoned, as a host ring would not be, to
        # prove that rows past this step's count are not written.
        kd[step % S] = float("nan")
        rd[step % S] = float("nan")
        km[step % S] = POISON_META
        rm[step % S] = POISON_META
        before_dst, before_meta = kd.clone(), km.clone()
        rg.gather_rows(src, rows, count, kd, km, dst_slot=slot)
        rg.gather_rows_reference(src, rows, count, rd, rm, dst_slot=slot)
        _assert_same(kd, km, rd, rm, f"step {step}")
        _check_contract(src, rows, count, kd, km, dst_slot=slot, before_dst=before_dst, before_meta=before_meta)


@needs_kernel
def test_strided_rows_and_padded_src(rng):
    """rows may be a strided view; src/dst rows may be padded (row stride > H)."""
    N, R, C, H = 7, 6, 6, 12
    base = torch.randn(N, H + 4, device=KDEV)
    src = base[:, :H]  # row stride H + 4, last dim contiguous
    rows = torch.randint(0, N, (2 * R,), device=KDEV, dtype=torch.int64)[::2]
    _run_both(src, rows, _i32([rng.randint(0, R)], KDEV), 2, C)


# --------------------------------------------------------------------------------------
# Host side: validation, dispatch, launch plan
# --------------------------------------------------------------------------------------
def _good_args(device="cpu"):
    N, R, C, S, H = 4, 4, 4, 2, 8
    return dict(
        src=torch.randn(N, H, device=device),
        rows=torch.zeros(R, dtype=torch.int32, device=device),
        count=_i32([1], device),
        dst=torch.full((S, C, H), float("nan"), device=device),
        meta=torch.full((S, 2 + C), POISON_META, dtype=torch.int32, device=device),
    )


_BAD = {
    "src": [lambda a: a["src"][0], lambda a: a["src"].to(torch.float64), lambda a: a["src"].to(torch.int32),
            lambda a: a["src"].t(), lambda a: a["src"][:, :0]],
    "rows": [lambda a: a["rows"].view(2, 2), lambda a: a["rows"].float(), lambda a: a["rows"].to(torch.int16),
             lambda a: 3],
    "count": [lambda a: a["count"].long(), lambda a: _i32([1, 2], "cpu"), lambda a: _i32(1, "cpu"), lambda a: 1],
    "dst": [lambda a: a["dst"].half(), lambda a: a["dst"][..., :4], lambda a: a["dst"][0], lambda a: a["dst"][:0],
            lambda a: a["dst"].transpose(1, 2)],
    "meta": [lambda a: a["meta"].long(), lambda a: a["meta"][:, :-1], lambda a: a["meta"][:1],
             lambda a: torch.full((2, 12), POISON_META, dtype=torch.int32)[:, ::2]],  # right shape, stride 2
}


@pytest.mark.parametrize("impl", [rg.gather_rows, rg.gather_rows_reference], ids=["kernel", "reference"])
@pytest.mark.parametrize("arg,i", [(k, i) for k, fs in _BAD.items() for i in range(len(fs))])
def test_validation_names_the_argument_and_writes_nothing(impl, arg, i):
    a = _good_args()
    a[arg] = _BAD[arg][i](a)
    dst = a["dst"] if isinstance(a["dst"], torch.Tensor) else None
    meta = a["meta"] if isinstance(a["meta"], torch.Tensor) else None
    before = (dst.clone() if dst is not None else None, meta.clone() if meta is not None else None)
    with pytest.raises(InputError, match=rf"^{arg}: expected .+, got .+"):
        impl(a["src"], a["rows"], a["count"], a["dst"], a["meta"])
    if dst is not None:
        torch.testing.assert_close(dst, before[0], rtol=0, atol=0, equal_nan=True)
    if meta is not None:
        assert torch.equal(meta, before[1])


@pytest.mark.parametrize("impl", [rg.gather_rows, rg.gather_rows_reference], ids=["kernel", "reference"])
def test_validation_of_slots(impl):
    a = _good_args()
    with pytest.raises(InputError, match=r"^src_slot: expected None for a 2-D src"):
        impl(**a, src_slot=_i32([0], "cpu"))
    a3 = dict(a, src=torch.randn(2, 4, 8))
    with pytest.raises(InputError, match=r"^src_slot: expected an int32 tensor of shape \(1,\)"):
        impl(**a3, src_slot=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(InputError, match=r"^dst_slot: expected an int32 tensor of shape \(1,\)"):
        impl(**a, dst_slot=_i32([[0]], "cpu"))
    assert bool(torch.isnan(a["dst"]).all()) and bool((a["meta"] == POISON_META).all())


def test_choose_gather_dispatch():
    src = torch.zeros(2, 2)
    assert rg.choose_gather(src) is rg.gather_rows_reference  # CPU tensors: the reference
    assert rg.choose_gather(src, use_kernel=False) is rg.gather_rows_reference
    if MODE == "interpreter":
        assert rg.choose_gather(src, use_kernel=True) is rg.gather_rows
    else:
        with pytest.raises(InputError, match=r"^use_kernel: expected"):
            rg.choose_gather(src, use_kernel=True)
    if torch.cuda.is_available() and MODE == "compiled":
        assert rg.choose_gather(src.cuda()) is rg.gather_rows


@pytest.mark.parametrize("use_kernel", [None, True])
def test_gather_rows_auto_on_cpu(use_kernel, rng):
    if use_kernel and MODE != "interpreter":
        require("triton")
        pytest.skip("the kernel runs on CPU tensors only under TRITON_INTERPRET=1")
    N, R, C, S, H = 6, 6, 6, 2, 5
    src, rows = torch.randn(N, H), torch.randint(0, N, (R,), dtype=torch.int32)
    count, slot = _i32([rng.randint(0, R)], "cpu"), _i32([1], "cpu")
    dst, meta = _poisoned(S, C, H, src.dtype, "cpu")
    before = (dst.clone(), meta.clone())
    rg.gather_rows_auto(src, rows, count, dst, meta, dst_slot=slot, use_kernel=use_kernel)
    _check_contract(src, rows, count, dst, meta, dst_slot=slot, before_dst=before[0], before_meta=before[1])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_plan_launch_covers_every_row_and_column(dtype, rng):
    for _ in range(50):
        H, R, C, S = rng.randint(1, 9000), rng.randint(0, 300), rng.randint(0, 300), rng.randint(1, 4)
        shape = (R + 1, H) if rng.random() < 0.5 else (2, R + 1, H)
        # rows padded past H (a view of a wider tensor: the last dimension stays contiguous,
        # the row and slab strides are not multiples of H) in about half the cases
        pad_src, pad_dst = (rng.randint(1, 7), rng.randint(1, 7)) if rng.random() < 0.5 else (0, 0)
        src = torch.empty(*shape[:-1], H + pad_src, dtype=dtype)[..., :H]
        rows = torch.empty(R, dtype=torch.int32)
        dst = torch.empty(S, C, H + pad_dst, dtype=dtype)[..., :H]
        p = rg.plan_launch(src, rows, dst)
        assert p.grid[0] >= 1 and p.grid[0] * p.rows_per_program >= min(R, C)
        assert p.grid[1] * p.block_h >= H and p.block_h <= 1024
        assert p.block_h & (p.block_h - 1) == 0 and p.rows_per_program & (p.rows_per_program - 1) == 0
        # The alignment hint must be honest: VEC divides H and every row/slab stride.
        assert p.vec * src.element_size() <= 16
        for st in (H, src.stride(-2), src.stride(0), dst.stride(0), dst.stride(1)):
            assert st % p.vec == 0


# --------------------------------------------------------------------------------------
# CUDA: captured graphs writing into a pinned host ring
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("H", [3, 1000, 4096])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
@cuda_test
def test_cuda_graph_into_pinned_ring(dtype, H, rng):
    """Capture once; every replay gets new rows/count/slot/src values in the static
    device tensors; the pinned ring must equal the reference ring after each replay."""
    N, R, C, S = 24, 16, 16, 3
    src = torch.randn(N, H, device="cuda").to(dtype)
    rows = torch.zeros(R, device="cuda", dtype=torch.int32)
    count = _i32([0], "cuda")
    slot = _i32([0], "cuda")
    dst, meta = _poisoned(S, C, H, dtype, "cpu", pin=True)
    assert dst.is_pinned() and meta.is_pinned()
    want_dst, want_meta = dst.clone(), meta.clone()  # reference ring on plain CPU memory

    # validate=True inside the capture: its metadata checks must be capture-safe
    graph = warm_and_capture(lambda: rg.gather_rows(src, rows, count, dst, meta, dst_slot=slot))
    # The warm-up and capture-time launches may have written slot 0: start from poison.
    dst.fill_(float("nan"))
    meta.fill_(POISON_META)
    for step in range(8):
        rows_l = [rng.randrange(N) for _ in range(R)]
        if step % 3 == 2:
            rows_l[rng.randrange(R)] = rng.choice([-1, N, N + 100])  # a bad row, flagged
        c = rng.randint(0, R) if step != 5 else R + 3  # one replay asks for too many rows
        d = step % S
        rows.copy_(torch.tensor(rows_l, dtype=torch.int32))
        count.fill_(c)
        slot.fill_(d)
        src.copy_(torch.randn(N, H).to(dtype))
        dst[d] = float("nan")  # host poisons the slot it is about to reuse
        meta[d] = POISON_META
        want_dst[d] = float("nan")
        want_meta[d] = POISON_META
        before_dst, before_meta = dst.clone(), meta.clone()
        graph.replay()
        torch.cuda.synchronize()
        rg.gather_rows_reference(src.cpu(), rows.cpu(), count.cpu(), want_dst, want_meta, dst_slot=slot.cpu())
        _assert_same(dst, meta, want_dst, want_meta, f"replay {step}: count={c} slot={d}")
        _check_contract(src, rows, count, dst, meta, dst_slot=slot, before_dst=before_dst, before_meta=before_meta)
        n = max(0, min(c, C, R))
        assert bool(torch.isnan(dst[d, n:]).all()), "rows past count were written"


@cuda_test
def test_cuda_graph_src_slabs_and_flags(rng):
    S_src, N, R, C, S, H = 3, 12, 12, 8, 2, 1000
    dtype = torch.bfloat16
    src = torch.randn(S_src, N, H, device="cuda").to(dtype)
    rows = torch.zeros(R, device="cuda", dtype=torch.int64)
    count, s_slot, d_slot = _i32([0], "cuda"), _i32([0], "cuda"), _i32([0], "cuda")
    dst, meta = _poisoned(S, C, H, dtype, "cpu", pin=True)
    graph = warm_and_capture(lambda: rg.gather_rows(src, rows, count, dst, meta, src_slot=s_slot, dst_slot=d_slot))
    cases = [(0, 5), (2, 8), (1, 10), (S_src, 4), (-1, 3), (1, -2), (0, 0)]  # (slab, count)
    for step, (s, c) in enumerate(cases):
        rows.copy_(torch.randint(-1, N + 1, (R,)))
        count.fill_(c)
        s_slot.fill_(s)
        d_slot.fill_(step % S)
        dst.fill_(float("nan"))
        meta.fill_(POISON_META)
        before_dst, before_meta = dst.clone(), meta.clone()
        graph.replay()
        torch.cuda.synchronize()
        _check_contract(src, rows, count, dst, meta, s_slot, d_slot, before_dst=before_dst, before_meta=before_meta)


@cuda_test
@pytest.mark.parametrize("which", ["dst", "meta"])
def test_cuda_rejects_unpinned_host_memory(which):
    a = _good_args("cuda")
    a["dst"], a["meta"] = a["dst"].cpu().pin_memory(), a["meta"].cpu().pin_memory()
    a[which] = a[which].clone()  # a plain (pageable) copy
    assert not a[which].is_pinned()
    with pytest.raises(InputError, match=rf"^{which}: expected a CUDA tensor or PINNED host memory"):
        rg.gather_rows(**a)


@cuda_test
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_cuda_eager_pinned_and_device_destinations(dtype, rng):
    N, R, C, S, H = 10, 10, 12, 2, 4096 + 8
    src = torch.randn(N, H, device="cuda").to(dtype)
    rows = torch.randint(-1, N + 1, (R,), device="cuda", dtype=torch.int32)
    count, slot = _i32([rng.randint(0, R)], "cuda"), _i32([1], "cuda")
    _run_both(src, rows, count, S, C, dst_slot=slot, dst_device=torch.device("cpu"), pin=True)
    _run_both(src, rows, count, S, C, dst_slot=slot)


@cuda_test
def test_cuda_bench_gather_runs():
    b = rg.bench_gather(H=1000, rows=16, count=9, dtype=torch.float16, iters=5)
    assert b.payload_bytes == 9 * 1000 * 2 and b.us_per_replay > 0 and b.gbytes_per_s > 0
