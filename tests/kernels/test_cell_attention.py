"""Tests of kernels/attention/: the Triton kernels (the interpreter on the CPU, the
compiled kernels on a GPU) against the torch reference, and both against a plain per-row
loop written here (gather the row's cells by hand, softmax, weighted sum, in float64).

Every output is poisoned (NaN) before the call, so a row the kernel forgot to write shows;
block tables are shuffled permutations of the pool's blocks (never contiguous by accident);
seeds are printed and can be replayed with CGRT_TEST_SEED.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # normally tests/conftest.py's job; must precede triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from cudagraph_rt.errors import CaptureError, InputError  # noqa: E402
from cudagraph_rt.kernels import attention as ca  # noqa: E402
from cudagraph_rt.kernels import common  # noqa: E402
from cudagraph_rt.kernels.attention import kernel as ca_kernel, launch as ca_launch, tuning as ca_tuning  # noqa: E402
from tests.support import run_compile_script  # noqa: E402
from tests.support.extras import needs_kernel, require  # noqa: E402
from tests.support.seeds import seeded_rng  # noqa: E402
from tests.support.step_rows import draw_step_rows  # noqa: E402

MODE = common.triton_backend()
DEV = torch.device("cuda") if MODE == "compiled" else torch.device("cpu")
cuda_only = pytest.mark.skipif(MODE != "compiled", reason="needs a CUDA GPU (compiled Triton)")


def small(tile_n=16, min_chunk=16, rows=8, programs=1, splits=1, **kw) -> ca.AttentionPlan:
    """A plan with interpreter-sized tiles (the kernel under test, not its defaults)."""
    return ca.AttentionPlan(rows, programs, splits, ca.AttentionConfig(tile_n=tile_n, min_chunk=min_chunk, **kw))


@pytest.fixture
def rng():
    return seeded_rng("CGRT_TEST_SEED", torch_too=True)


# --------------------------------------------------------------------------------------
# Problems and the independent oracle
# --------------------------------------------------------------------------------------
class Problem:
    """One layer's pool (random K/V, a shuffled block table) and one step's rows."""

    def __init__(self, rng, rows, *, Hq=4, Hkv=2, D=16, bs=4, S=4, MB=8, dtype=torch.float32, device=DEV,
                 fork=0, spare_blocks=3):
        self.bs, self.Hq, self.Hkv, self.D = bs, Hq, Hkv, D
        self.blocks = blocks = S * MB + spare_blocks
        seed = rng.randrange(2**31)
        perm = torch.randperm(blocks, generator=torch.Generator().manual_seed(seed))
        table = perm[: S * MB].view(S, MB).clone()
        if fork:  # sequence 1 shares sequence 0's first `fork` blocks (a fork by reference)
            table[1, :fork] = table[0, :fork]
        self.block_table = table.int().to(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.k = torch.randn(blocks * bs, Hkv, D, generator=gen, device=device).to(dtype)
        self.v = torch.randn(blocks * bs, Hkv, D, generator=gen, device=device).to(dtype)
        self.seq_ids = torch.tensor([s for s, _ in rows], dtype=torch.int64, device=device)
        self.positions = torch.tensor([p for _, p in rows], dtype=torch.int64, device=device)
        self.q = torch.randn(len(rows), Hq, D, generator=gen, device=device).to(dtype)

    def args(self):
        return self.q, self.k, self.v, self.block_table, self.seq_ids, self.positions

    def kernel(self, plan=None, out=None, **kw):
        out = torch.full_like(self.q, float("nan")) if out is None else out
        got = ca.cell_attention_triton(*self.args(), block_size=self.bs, out=out, plan=plan, **kw)
        assert got is out
        return out

    def reference(self, **kw):
        out = torch.full_like(self.q, float("nan"))
        return ca.cell_attention_reference(*self.args(), block_size=self.bs, out=out, **kw)


def loop_attention(pb: Problem, *, scale, window=None, slopes=None, bias_shift=0, splits=None,
                   counters=None) -> torch.Tensor:
    """The contract row by row in float64: the row's cells gathered one position at a time
    (``splits`` changes nothing here)."""
    q, k, v = (t.double().cpu() for t in (pb.q, pb.k, pb.v))
    table = pb.block_table.cpu().tolist()
    G = pb.Hq // pb.Hkv
    out = torch.zeros_like(q)
    for r, (s, p) in enumerate(zip(pb.seq_ids.tolist(), pb.positions.tolist())):
        if s < 0:
            continue
        lo = max(0, p - window + 1) if window else 0
        js = list(range(lo, p + 1))
        cells = [table[s][j // pb.bs] * pb.bs + j % pb.bs for j in js]
        for h in range(pb.Hq):
            kk, vv = k[cells, h // G], v[cells, h // G]
            score = scale * (kk @ q[r, h])
            if slopes is not None:
                score = score - float(slopes[h]) * torch.tensor([abs(p - bias_shift - j) for j in js]).double()
            out[r, h] = torch.softmax(score, 0) @ vv
    return out


def check(pb: Problem, plan=None, tol=2e-5, **kw):
    """Kernel == reference (fp32: reduction order only) and both == the loop; padding rows 0."""
    got = pb.kernel(plan, **kw)
    want = pb.reference(**kw)
    oracle = loop_attention(pb, **kw).to(got.dtype)
    assert not got.isnan().any(), "the kernel left rows unwritten"
    torch.testing.assert_close(got.cpu(), want.cpu(), atol=tol, rtol=tol)
    torch.testing.assert_close(got.cpu(), oracle, atol=tol * 5, rtol=tol * 5)
    pad = pb.seq_ids < 0
    assert (got[pad] == 0).all(), "padding rows must be exactly 0"
    return got


# --------------------------------------------------------------------------------------
# The reference itself (the models' CPU path)
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("G", [1, 2, 4])
def test_reference_matches_the_loop(rng, G):
    for _ in range(3):
        rows = [(rng.randrange(-1, 4), rng.randrange(32)) for _ in range(rng.randrange(1, 7))]
        pb = Problem(rng, rows, Hq=2 * G, Hkv=2, D=rng.choice([16, 24]), device=torch.device("cpu"))
        kw = dict(scale=rng.uniform(0.1, 0.5), window=rng.choice([None, 1, 5, 40]))
        if rng.random() < 0.5:
            kw.update(slopes=torch.rand(pb.Hq), bias_shift=rng.choice([0, 1]))
        got = pb.reference(**kw)
        torch.testing.assert_close(got, loop_attention(pb, **kw).float(), atol=1e-5, rtol=1e-5)
        assert (got[pb.seq_ids < 0] == 0).all()


# --------------------------------------------------------------------------------------
# The kernel on CPU (interpreter) or GPU, small shapes
# --------------------------------------------------------------------------------------
@needs_kernel
@pytest.mark.parametrize("G", [1, 2, 4])
def test_decode_rows_of_distinct_sequences(rng, G):
    rows = [(s, rng.randrange(30)) for s in rng.sample(range(4), 4)] + [(-1, 0)]
    pb = Problem(rng, rows, Hq=2 * G, Hkv=2)
    for plan in (small(rows=1), small(rows=4, programs=4), small(rows=8, programs=1, splits=3)):
        check(pb, plan, scale=0.3)


@needs_kernel
def test_verify_step_of_one_sequence_reads_its_context_once(rng, monkeypatch):
    """Width 8: five rows of one sequence at consecutive positions, three padding rows. One
    program per KV head serves all five rows: the tile steps are one pass over positions
    [0, p+4] per KV head (not five), and every row is still causal (own position only)."""
    p = rng.randrange(20, 26)
    rows = [(2, p + i) for i in range(5)] + [(-1, 0)] * 3
    rng.shuffle(rows)
    pb = Problem(rng, rows, Hq=8, Hkv=2)
    steps = count_tile_steps(monkeypatch)
    check(pb, small(rows=8, programs=1), scale=0.25)
    assert sorted(steps) == sorted(list(range(0, p + 5, 16)) * pb.Hkv)


def count_tile_steps(monkeypatch) -> list[int]:
    """Record the first position of every tile step (interpreter only: the jit helper is
    replaced by a counting wrapper the interpreted kernel calls as plain Python)."""
    if MODE != "interpreter":
        pytest.skip("counts tile steps through the interpreter")
    steps, inner = [], ca_kernel._attend_tile

    def counting(*args, **kwargs):
        steps.append(int(args[7]))
        return inner(*args, **kwargs)

    monkeypatch.setattr(ca_kernel, "_attend_tile", counting)
    return steps


def record_programs(monkeypatch) -> list[list[tuple]]:
    """Per program that serves groups (interpreter only, as count_tile_steps): the tile
    steps it makes, as (first position, the lanes of its group) pairs."""
    if MODE != "interpreter":
        pytest.skip("records the programs through the interpreter")
    programs, serve, tile = [], ca_kernel._serve_groups, ca_kernel._attend_tile

    def serving(*args, **kwargs):
        programs.append([])
        return serve(*args, **kwargs)

    def stepping(*args, **kwargs):
        lanes = tuple(int(i) for i in (args[9].handle.data >= 0).nonzero()[0])  # pos_g: -1 off the group
        programs[-1].append((int(args[7]), lanes))
        return tile(*args, **kwargs)

    monkeypatch.setattr(ca_kernel, "_serve_groups", serving)
    monkeypatch.setattr(ca_kernel, "_attend_tile", stepping)
    return programs


@needs_kernel
@pytest.mark.parametrize("splits, per_program", [(8, 1), (2, 2), (1, 4)])
def test_the_splits_are_shared_among_a_tiles_sequences(rng, monkeypatch, splits, per_program):
    """Four sequences' decode rows and padding in one tile (a small decode batch): with
    as many splits as sequences each program serves one sequence's rows (8 splits: each
    group's context in 2 sub-splits, read by 2 programs), with fewer each serves its share
    of the groups in turn; every group's positions read once per KV head all the same."""
    ctx = [rng.randrange(17, 31) for _ in range(4)]
    rows = [(s, ctx[s]) for s in range(4)] + [(-1, 0)] * 2
    rng.shuffle(rows)
    pb = Problem(rng, rows, Hq=4, Hkv=2)
    programs = record_programs(monkeypatch)
    check(pb, small(rows=8, splits=splits), scale=0.3)
    assert len(programs) == pb.Hkv * min(splits, 8), "every split with work serves"
    for steps in programs:
        assert len({lanes for _, lanes in steps}) == per_program, steps
    for s in range(4):  # each group: its tiles once per KV head, split or not
        lanes = {lanes for steps in programs for _, lanes in steps
                 if [r for r, (t, _) in enumerate(rows) if t == s][0] * 2 in lanes}
        assert len(lanes) == 1
        got = sorted(t for steps in programs for t, ln in steps if ln in lanes)
        assert got == sorted(list(range(0, ctx[s] + 1, 16)) * pb.Hkv), (s, got)


@needs_kernel
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(data=st.data())
def test_random_tiles_and_plans(data):
    """Random steps against the reference and the float64 loop: up to 8 rows of up to 4
    sequences (runs of consecutive positions, any order, padding rows), in tiles of 1 to
    8 rows served by 1 to R programs, 1 to 12 splits shared out among the groups, GQA,
    windows and position biases, shared blocks, cells gathered 1, 2 or 16 tiles at a time
    with short shares of 1, 2 or 16 tiles in one chunk (fresh seeds each example)."""
    import random

    rng = random.Random(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    rows = draw_step_rows(data, max_rows=8, max_seq=3)
    rng.shuffle(rows)
    G = data.draw(st.sampled_from([1, 2, 4]), label="G")
    pb = Problem(rng, rows, Hq=2 * G, Hkv=2, fork=data.draw(st.sampled_from([0, 3]), label="shared blocks"))
    R = data.draw(st.sampled_from([1, 2, 4, 8]), label="rows per tile")
    plan = small(rows=R, programs=data.draw(st.integers(1, R), label="programs"),
                 splits=data.draw(st.integers(1, 12), label="splits"), min_chunk=data.draw(st.sampled_from([1, 16])),
                 chunk_n=data.draw(st.sampled_from([16, 32, 256]), label="chunk_n"),
                 short_n=data.draw(st.sampled_from([16, 32, 256]), label="short_n"))
    kw = dict(scale=0.3, window=data.draw(st.sampled_from([None, 1, 3, 20]), label="window"))
    if data.draw(st.booleans(), label="bias"):
        kw.update(slopes=torch.rand(pb.Hq, device=DEV), bias_shift=data.draw(st.sampled_from([0, 1])))
    counters = ca.new_attention_counters(DEV, 256)
    check(pb, plan, counters=counters, **kw)
    assert not counters.any(), "the counters must be zero after the launch"


@needs_kernel
@pytest.mark.parametrize("programs", [1, 2, 4])
def test_a_tile_with_rows_of_several_sequences(rng, programs):
    """Interleaved sequences (A B A pad B C A) in one tile of 8 rows: every group is served
    (by one program looping or by several), rows of the same sequence out of order too."""
    base = {s: rng.randrange(8, 28) for s in (0, 1, 3)}
    order = [0, 1, 0, -1, 1, 3, 0]
    rows = [(s, base[s] - i) if s >= 0 else (-1, 0) for i, s in enumerate(order)]
    pb = Problem(rng, rows, Hq=4, Hkv=2)
    for splits in (1, 2):
        check(pb, small(rows=8, programs=programs, splits=splits), scale=0.3)


@needs_kernel
@pytest.mark.parametrize("plan", [small(rows=4), small(rows=4, splits=2), small(rows=4, programs=2, splits=3)])
def test_a_non_finite_cached_value_spoils_its_own_sequence_only(rng, plan):
    """Each row attends to its own sequence's cells, so a NaN V in one sequence's cache
    leaves the other sequences' rows finite (as the reference does); one program serving
    several groups of a tile must keep their lanes apart (a NaN row of V times another
    group's probability 0 is NaN)."""
    rows = [(0, 20), (2, 9), (3, 14), (0, 21)]
    pb = Problem(rng, rows)
    c = int(pb.block_table[0, 1]) * pb.bs + 2  # position 6 of sequence 0
    pb.v[c] = float("nan")
    got, want = pb.kernel(plan, scale=0.3), pb.reference(scale=0.3)
    assert torch.isnan(want[[0, 3]]).all() and torch.isfinite(want[[1, 2]]).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, equal_nan=True)


@pytest.mark.parametrize("case", ["nan k seen", "inf k seen", "nan v past the row", "inf v before the window"])
def test_non_finite_cells_matter_where_the_row_attends_only(rng, case):
    """Row r attends to the positions [lo, p] of its sequence and to nothing else, non-finite
    values included (the loop, the kernel). The reference zeroed every row whose softmax came
    out NaN (``nan_to_num``, meant for rows that see nothing), so a NaN or +inf K that a row
    sees gave exact 0 instead of NaN (the models' CPU path hid a NaN step), and it multiplied
    probability 0 by every cell of the row's block table, so a NaN or inf V that the row
    does not see (past its position: a stale cell of a reused block; before its window)
    made the row NaN while the kernel and the loop stay finite."""
    rows = [(0, 10), (1, 5), (-1, 0), (0, 12)]
    pb = Problem(rng, rows)
    cell = lambda pos: int(pb.block_table[0, pos // pb.bs]) * pb.bs + pos % pb.bs  # noqa: E731
    kw = dict(scale=0.3, window=5 if "window" in case else None)
    bad, what = case.split()[:2]
    (pb.k if what == "k" else pb.v)[cell({"seen": 3, "past": 20, "before": 2}[case.split()[2]])] = float(bad)
    want, oracle = pb.reference(**kw), loop_attention(pb, **kw).float()
    spoiled = case.endswith("seen")
    assert torch.isnan(oracle[[0, 3]]).all() == spoiled and torch.isfinite(oracle[[1, 2]]).all()
    torch.testing.assert_close(want, oracle, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert (want[2] == 0).all()
    if MODE != "unavailable":
        for plan in (small(rows=4), small(rows=4, programs=2, splits=3)):
            torch.testing.assert_close(pb.kernel(plan, **kw), want, atol=2e-5, rtol=2e-5, equal_nan=True)


@needs_kernel
def test_forked_sequences_share_blocks(rng):
    """Sequence 1 shares sequence 0's first three blocks (a fork); rows of both in one tile."""
    rows = [(0, 20), (1, 18), (1, 19), (0, 21), (1, 30)]
    pb = Problem(rng, rows, fork=3)
    for plan in (small(rows=8), small(rows=2, programs=2, splits=2)):
        check(pb, plan, scale=0.4)


@needs_kernel
def test_splits_with_contexts_shorter_than_the_splits(rng):
    """8 splits over contexts of 1..4 positions (most splits empty), and a group of two rows
    at 28 and 2 whose second split holds positions only the row at 28 sees."""
    rows = [(0, 0), (1, 3), (2, 1), (-1, 5), (3, 28), (3, 2)]
    pb = Problem(rng, rows)
    check(pb, small(rows=2, programs=2, splits=8, min_chunk=1), scale=0.5)


@needs_kernel
def test_sequence_ids_past_the_block_table_read_nothing(rng):
    """Outside the contract, but never out of bounds: a row of sequence S (the table has S
    rows) comes out 0 like padding, in its own tile and beside a good row, split or not."""
    pb = Problem(rng, [(1, 20), (4, 9), (0, 5)], S=4)
    outs = [pb.kernel(small(rows=2, programs=1, splits=splits), scale=0.3) for splits in (1, 3)]
    pb.seq_ids[1] = -1  # what the oracle should see
    want = loop_attention(pb, scale=0.3).float()
    for got in outs:
        assert (got[1] == 0).all()
        torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@needs_kernel
def test_sliding_window_skips_blocks_outside_it(rng, monkeypatch):
    """A window of 9 at positions 200 and 201 (one row per tile): each loop starts at the
    tile of 16 holding the window's first position (192), not at 0; the row at 7 with no
    window steps over its one tile."""
    rows = [(1, 200), (1, 201), (0, 7)]
    pb = Problem(rng, rows, S=2, MB=64)
    steps = count_tile_steps(monkeypatch)
    check(pb, small(rows=1, splits=1), scale=0.3, window=9)
    assert sorted(steps) == sorted([192, 192, 0] * pb.Hkv)


@needs_kernel
@pytest.mark.parametrize("shift", [0, 1])
def test_linear_position_bias_and_windows(rng, shift):
    rows = [(rng.randrange(4), rng.randrange(31)) for _ in range(6)]
    pb = Problem(rng, rows, Hq=8, Hkv=2)
    slopes = torch.rand(8, device=DEV) * 2
    slopes[0] = 16.0  # the toy's previous-token head
    for window in (None, 4):
        check(pb, small(rows=4, programs=2, splits=2), scale=0.3, window=window, slopes=slopes, bias_shift=shift)


@needs_kernel
def test_large_scores_need_the_running_max(rng):
    """Scores of several hundred (exp would overflow fp32 without the running max) over
    four splits: the splits' maxima differ and the merge must rescale them."""
    rows = [(0, 30), (1, 17), (1, 29)]
    pb = Problem(rng, rows)
    check(pb, small(rows=4, programs=1, splits=4), scale=60.0, tol=1e-4)


@needs_kernel
@pytest.mark.parametrize("D", [16, 64, 80])
def test_head_dims(rng, D):
    rows = [(0, 12), (1, 30), (-1, 0)]
    pb = Problem(rng, rows, Hq=4, Hkv=1, D=D)
    check(pb, small(rows=4, programs=1, splits=2), scale=D ** -0.5)


@needs_kernel
def test_long_context(rng):
    """A few hundred positions, split four ways (shares of about 3 tiles), two rows of
    one sequence plus another; the block table read a tile, two and eight tiles at a time
    (the long shares' loop), or the share at once (the short shares' loop)."""
    rows = [(0, 317), (0, 318), (1, 250)]
    pb = Problem(rng, rows, S=2, MB=20, bs=16, Hq=4, Hkv=1)
    for chunk_n, short_n in ((32, 32), (64, 32), (256, 32), (256, 128), (64, 512)):
        check(pb, small(tile_n=32, min_chunk=32, rows=4, programs=2, splits=4, chunk_n=chunk_n, short_n=short_n),
              scale=0.1)


@needs_kernel
@pytest.mark.parametrize("chunk_n, short_n", [(48, 16), (80, 48), (96, 40), (48, 8), (40, 1000)])
def test_chunk_sizes_of_any_number_of_tiles(rng, chunk_n, short_n):
    """chunk_n and short_n are positions, not a power-of-two number of tiles (3, 5 or 6
    tiles of 16; a short share of 2.5 or 3 tiles, of less than one, of more than a chunk):
    every such plan runs and reads every position once (shares of one to several tiles)."""
    rows = [(0, 100), (0, 101), (1, 70), (-1, 0)]
    pb = Problem(rng, rows, S=2, MB=28, bs=4, Hq=4, Hkv=2)
    for splits in (1, 3):
        check(pb, small(rows=4, programs=2, splits=splits, chunk_n=chunk_n, short_n=short_n), scale=0.2)


@needs_kernel
def test_default_plan_and_splits_argument(rng):
    """No plan given: the default (64 splits here, most empty) and an explicit split count."""
    rows = [(rng.randrange(4), rng.randrange(32)) for _ in range(3)]
    pb = Problem(rng, rows, Hq=2, Hkv=1)
    check(pb, None, scale=0.2)
    check(pb, None, scale=0.2, splits=5)


def record_split_stores(monkeypatch) -> list[int]:
    """The rows (first lane's) of every split partial stored (interpreter only, as
    count_tile_steps): a row that never shows took the one-split path."""
    if MODE != "interpreter":
        pytest.skip("records the partial stores through the interpreter")
    rows, inner = [], ca_kernel._store_split

    def recording(*args, **kwargs):
        rows.append(int(args[5].handle.data[0]))  # lane 0: the tile's first row
        return inner(*args, **kwargs)

    monkeypatch.setattr(ca_kernel, "_store_split", recording)
    return rows


@needs_kernel
def test_in_kernel_merge_leaves_its_counters_zero(rng):
    """The splits merge in the kernel through one counter per (tile, program, KV head):
    8 splits of a 121-position context, two launches on the same counters (as two replays
    of a graph would), each against the oracle; a counter not reset by the last split
    would leave the second launch's rows unwritten (NaN) and the buffer nonzero."""
    pb = Problem(rng, [(1, 120), (-1, 0), (3, 77)], S=4, MB=32)
    counters = ca.new_attention_counters(DEV, 16)
    plan = small(rows=1, splits=8)
    for _ in range(2):
        pb.q.normal_()
        check(pb, plan, scale=0.3, counters=counters)
        assert not counters.any(), counters


@needs_kernel
def test_merge_of_more_splits_than_one_merge_step(rng):
    """A verify tile (five rows of one sequence, three padding) of D 64 whose 10 busy
    splits (of 12, not a power of two) take three merge steps of 4."""
    rows = [(2, 150 + i) for i in range(5)] + [(-1, 0)] * 3
    pb = Problem(rng, rows, D=64, S=4, MB=48)
    plan = small(rows=8, splits=12, num_warps=1)
    assert ca.kernel_constants(plan, pb.Hq, pb.Hkv, pb.D, pb.bs, pb.k.dtype, False, False)["MERGE_CHUNK"] == 4
    counters = ca.new_attention_counters(DEV, 16)
    check(pb, plan, scale=0.2, counters=counters)
    assert not counters.any()


@needs_kernel
def test_a_row_with_one_busy_split_writes_directly(rng, monkeypatch):
    """8 splits of 16 positions: the rows at 3 and 15 (one split has work) write their
    output without partials or counter; the row at 120 merges eight; padding is 0."""
    pb = Problem(rng, [(0, 3), (1, 120), (-1, 0), (2, 15)], S=4, MB=32)
    stored = record_split_stores(monkeypatch)
    counters = ca.new_attention_counters(DEV, 16)
    check(pb, small(rows=1, splits=8), scale=0.3, counters=counters)
    assert sorted(set(stored)) == [1] and len(stored) == 8 * pb.Hkv, stored
    assert not counters.any()


@needs_kernel
@pytest.mark.parametrize("programs", [1, 2])
def test_groups_of_one_tile_with_different_split_counts(rng, programs):
    """One tile holds a long group (8 splits with work) and short ones (1 split): the
    short groups' lanes get -inf partials from the splits they do not use, and the
    merge of the tile's lanes reads them correctly; with P = 2 each program merges its
    own groups."""
    rows = [(0, 126), (1, 2), (0, 127), (-1, 0), (2, 40), (1, 3)]
    pb = Problem(rng, rows, S=4, MB=32)
    counters = ca.new_attention_counters(DEV, 32)  # tile x 2 programs x 2 KV heads x 8 row slots
    for window in (None, 50):
        check(pb, small(rows=8, programs=programs, splits=8), scale=0.3, window=window, counters=counters)
        assert not counters.any()


def test_shared_counters_are_never_allocated_during_capture(monkeypatch):
    """The process's counter buffer is allocated on first use; during a capture that is
    refused (a buffer allocated there would belong to the graph's pool)."""
    dev = torch.device("cuda", 7)
    monkeypatch.setattr(ca_launch, "_COUNTER_BUFFERS", {})
    monkeypatch.setattr(ca_launch, "resolve_device", lambda d: d)  # a GPU this machine may lack: not this test's
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(CaptureError, match="outside graph capture"):
        ca.attention_counters(dev, 10)
    assert ca_launch._COUNTER_BUFFERS == {dev: []}


@needs_kernel
def test_zero_rows_and_views(rng):
    pb = Problem(rng, [(0, 3)])
    empty = torch.empty(0, pb.Hq, pb.D, device=DEV)
    none = torch.empty(0, dtype=torch.int64, device=DEV)
    assert ca.cell_attention_triton(empty, pb.k, pb.v, pb.block_table, none, none, block_size=pb.bs,
                                    scale=1.0).shape == (0, pb.Hq, pb.D)
    # strided q and out (a [N, 2, Hq, D] buffer's first half) are read and written in place
    buf = torch.randn(1, 2, pb.Hq, pb.D, device=DEV)
    buf[:, 0] = pb.q
    out = torch.full((1, 2, pb.Hq, pb.D), float("nan"), device=DEV)
    ca.cell_attention_triton(buf[:, 0], pb.k, pb.v, pb.block_table, pb.seq_ids, pb.positions, block_size=pb.bs,
                             scale=0.5, out=out[:, 1], plan=small())
    torch.testing.assert_close(out[:, 1], pb.reference(scale=0.5), atol=2e-5, rtol=2e-5)
    assert out[:, 0].isnan().all()


# --------------------------------------------------------------------------------------
# write_cells
# --------------------------------------------------------------------------------------
@needs_kernel
def test_write_cells_matches_its_reference(rng):
    cells_n, Hkv, D = 40, 3, 20
    src = torch.randn(7, 2 * Hkv, D, device=DEV)  # k, v as strided views of one buffer
    k, v = src[:, :Hkv], src[:, Hkv:]
    scratch = 39
    cells = torch.tensor(rng.sample(range(39), 5) + [scratch, scratch], device=DEV)
    caches = [torch.full((cells_n, Hkv, D), float("nan"), device=DEV) for _ in range(4)]
    ca.write_cells_triton(k, v, caches[0], caches[1], cells)
    ca.write_cells_reference(k, v, caches[2], caches[3], cells)
    live = cells[:5]
    for got, want, rows in ((caches[0], caches[2], k), (caches[1], caches[3], v)):
        assert torch.equal(got[live], rows[:5]) and torch.equal(got[live], want[live])
        # two padding rows write the scratch cell at once: each element is one of theirs
        # (the contract leaves which one unspecified element by element)
        assert ((got[scratch] == rows[5]) | (got[scratch] == rows[6])).all()
        untouched = torch.ones(cells_n, dtype=torch.bool)
        untouched[cells.cpu()] = False
        assert got[untouched.to(DEV)].isnan().all(), "write_cells wrote cells it was not given"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_write_cells_reference_takes_either_index_dtype(rng, dtype):
    """The contract's cells are int32 or int64; the reference (the models' CPU path) takes
    both, as the kernel does."""
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    kc, vc = torch.full((6, 2, 8), float("nan")), torch.full((6, 2, 8), float("nan"))
    cells = torch.tensor(rng.sample(range(6), 3), dtype=dtype)
    ca.write_cells_reference(k, v, kc, vc, cells)
    assert torch.equal(kc[cells.long()], k) and torch.equal(vc[cells.long()], v)
    rest = torch.ones(6, dtype=torch.bool)
    rest[cells.long()] = False
    assert kc[rest].isnan().all() and vc[rest].isnan().all()


@needs_kernel
def test_write_cells_casts_to_the_cache_dtype(rng):
    k, v = torch.randn(3, 2, 16, device=DEV), torch.randn(3, 2, 16, device=DEV)
    kc, vc = torch.zeros(8, 2, 16, device=DEV, dtype=torch.float16), torch.zeros(8, 2, 16, device=DEV,
                                                                                dtype=torch.float16)
    cells = torch.tensor([5, 0, 2], device=DEV, dtype=torch.int32)
    ca.write_cells_triton(k, v, kc, vc, cells)
    assert torch.equal(kc[cells.long()], k.half()) and torch.equal(vc[cells.long()], v.half())


# --------------------------------------------------------------------------------------
# Dispatch, plans and bad input
# --------------------------------------------------------------------------------------
def test_cpu_dispatch_runs_the_reference_unless_asked(rng, monkeypatch):
    pb = Problem(rng, [(0, 9), (-1, 0), (2, 17)], device=torch.device("cpu"))
    want = pb.reference(scale=0.3)
    assert torch.equal(ca.cell_attention(*pb.args(), block_size=pb.bs, scale=0.3), want)
    if MODE == "interpreter":
        monkeypatch.setattr(common, "CPU_RUNS_KERNELS", True)
        used = []
        monkeypatch.setattr(ca, "cell_attention_triton", lambda *a, **k: used.append(1) or want)
        ca.cell_attention(*pb.args(), block_size=pb.bs, scale=0.3)
        assert used


def test_plans_depend_on_shapes_only():
    verify = ca.plan_attention(8, 32, 8, 64)
    assert (verify.rows_per_tile, verify.programs_per_tile) == (8, 1) and verify.splits > 1
    many = ca.plan_attention(64, 32, 8, 64)
    assert many.programs_per_tile == many.rows_per_tile  # distinct sequences run in parallel
    for n in (1, 2, 5, 8, 9, 33, 96):
        plan = ca.plan_attention(n, 32, 8, 128)
        assert 1 <= plan.splits <= ca_tuning.MAX_SPLITS and plan.rows_per_tile * 4 <= ca_tuning.MAX_TILE_LANES
        assert plan == ca.plan_attention(n, 32, 8, 128)
    assert ca.plan_attention(3, 4, 4, 16, splits=7).splits == 7
    assert ca.plan_attention(96, 128, 1, 64).rows_per_tile == 1  # G = 128 fills a tile alone
    decode, many = ca.plan_attention(1, 32, 8, 64), ca.plan_attention(64, 32, 8, 64)
    assert decode.rows_per_tile == many.rows_per_tile == 1 and decode.splits > 1  # G lanes a row, none idle
    assert verify.splits * verify.rows_per_tile * 4 <= ca_tuning.MERGE_LANE_SPLITS  # what the last split merges


@pytest.mark.parametrize("bad, name", [
    (dict(q=torch.zeros(2, 3, 16)), "q"),  # 3 query heads over 2 KV heads
    (dict(seq_ids=torch.zeros(3, dtype=torch.int64)), "seq_ids"),
    (dict(positions=torch.zeros(2)), "positions"),
    (dict(block_table=torch.zeros(4, 8, dtype=torch.int64)), "block_table"),
    (dict(window=0), "window"),
    (dict(slopes=torch.zeros(3)), "slopes"),
    (dict(out=torch.zeros(2, 4, 16, dtype=torch.float64)), "out"),
    (dict(splits=0), "splits"),
    (dict(block_size=0), "block_size"),
    (dict(v_cache=torch.zeros(10, 2, 8)), "v_cache"),
    (dict(counters=torch.zeros(16)), "counters"),
    pytest.param(dict(counters=torch.zeros(1, dtype=torch.int32)), "counters",  # the default plan splits: 2 triples
                 marks=needs_kernel),  # too few: known from the kernel's launch plan
    (dict(dependent="yes"), "dependent"),
    (dict(dependent=1), "dependent"),
])
def test_bad_input_names_the_argument(rng, bad, name):
    pb = Problem(rng, [(0, 3), (1, 5)], device=torch.device("cpu"))
    kw = dict(q=pb.q, k_cache=pb.k, v_cache=pb.v, block_table=pb.block_table, seq_ids=pb.seq_ids,
              positions=pb.positions, block_size=pb.bs, scale=1.0)
    kw.update(bad)
    out = kw.get("out")
    before = None if out is None else out.clone()
    with pytest.raises(InputError, match=rf"^{name}: expected"):
        ca.cell_attention_triton(**kw)
    assert before is None or torch.equal(out, before)


ENTRY_POINTS = {"kernel": lambda **kw: ca.cell_attention_triton(**kw),
                "reference": lambda **kw: ca.cell_attention_reference(**kw),
                "dispatch": lambda **kw: ca.cell_attention(**kw),
                "bind": lambda **kw: ca.plan_cell_attention(**{"out": torch.zeros_like(kw["q"]), **kw}).run()}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("bad, name", [
    (dict(window=True), "window"), (dict(window=2.0), "window"), (dict(block_size=True), "block_size"),
    (dict(block_size=4.0), "block_size"), (dict(splits=True), "splits"), (dict(bias_shift=1.5), "bias_shift"),
    (dict(bias_shift=True), "bias_shift"), (dict(bias_shift=None), "bias_shift"), (dict(scale="1"), "scale"),
    (dict(scale=float("nan")), "scale"), (dict(scale=True), "scale"), (dict(window=0), "window"),
], ids=lambda v: repr(v) if isinstance(v, dict) else v)
def test_bools_and_floats_are_not_ints_at_any_entry_point(rng, entry, bad, name):
    """cell_attention_triton(window=True) / block_size=True were taken as 1, bias_shift=1.5
    as 1; the reference (and cell_attention on a CPU, which runs it) checked nothing."""
    if entry in ("kernel", "bind"):  # the Triton kernel's entry points
        require("triton")
    pb = Problem(rng, [(0, 3), (1, 5)], device=torch.device("cpu"))
    kw = {**dict(q=pb.q, k_cache=pb.k, v_cache=pb.v, block_table=pb.block_table, seq_ids=pb.seq_ids,
                 positions=pb.positions, block_size=pb.bs, scale=1.0), **bad}
    if entry == "bind" and "splits" in bad:
        kw["plan"] = small(splits=kw.pop("splits"))
        name = "plan"
    with pytest.raises(InputError, match=rf"^{name}: expected"):
        ENTRY_POINTS[entry](**kw)


@pytest.mark.parametrize("name", ["q", "k_cache", "seq_ids"])
def test_the_dispatch_names_an_argument_that_is_not_a_tensor(rng, name):
    """cell_attention(q=[...]) raised AttributeError ('list' object has no attribute
    'device') while choosing the kernel or the reference, before any check."""
    pb = Problem(rng, [(0, 3), (1, 5)], device=torch.device("cpu"))
    kw = dict(q=pb.q, k_cache=pb.k, v_cache=pb.v, block_table=pb.block_table, seq_ids=pb.seq_ids,
              positions=pb.positions, block_size=pb.bs, scale=1.0)
    kw[name] = kw[name].tolist()
    with pytest.raises(InputError, match=rf"^{name}: expected"):
        ca.cell_attention(**kw)
    with pytest.raises(InputError, match=r"^k: expected"):
        ca.write_cells(pb.q.tolist(), pb.q, pb.k, pb.v, pb.seq_ids)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_cache_that_ends_in_a_partial_block_is_refused(rng, entry):
    """A cache of 2 blocks and 3 cells of block size 4: the kernel read blocks up to
    cells // block_size only, so a row whose table held the partial block skipped its
    existing cells, where the reference raised IndexError. The pool never makes such a
    cache (it allocates whole blocks and a scratch block): both refuse it, naming the
    cache and the block size, before anything runs."""
    if entry in ("kernel", "bind"):  # the Triton kernel's entry points
        require("triton")
    pb = Problem(rng, [(0, 6), (0, 9)], S=1, MB=3, spare_blocks=0, device=torch.device("cpu"))
    assert pb.k.shape[0] == 12
    k, v = pb.k[:11], pb.v[:11]
    out = torch.full_like(pb.q, float("nan"))
    kw = dict(q=pb.q, k_cache=k, v_cache=v, block_table=pb.block_table, seq_ids=pb.seq_ids, positions=pb.positions,
              block_size=pb.bs, scale=1.0, out=out)
    with pytest.raises(InputError, match=r"^k_cache: expected whole blocks of block_size 4 cells, got 11 cells"):
        ENTRY_POINTS[entry](**kw)
    assert out.isnan().all()


@pytest.mark.parametrize("entry", ["triton", "dispatch", "bind"])
def test_write_cells_entry_points_check_their_arguments(rng, entry):
    """write_cells on a CPU (the reference) wrote what it was given: a cells tensor of floats
    or of the wrong length raised torch's errors, or wrote."""
    if entry in ("triton", "bind"):  # the Triton kernel's entry points
        require("triton")
    run = {"triton": ca.write_cells_triton, "dispatch": ca.write_cells,
           "bind": lambda *a: ca.plan_write_cells(*a).run()}[entry]
    k, kc = torch.randn(3, 2, 16), torch.zeros(8, 2, 16)
    vc = kc.clone()
    for cells, name in ((torch.zeros(2, dtype=torch.int64), "cells"), (torch.zeros(3), "cells"),
                        ([0, 1, 2], "cells")):
        with pytest.raises(InputError, match=rf"^{name}: expected"):
            run(k, k, kc, vc, cells)
    assert not kc.any() and not vc.any()


@needs_kernel
def test_bad_plans_are_refused(rng):
    pb = Problem(rng, [(0, 3)], device=torch.device("cpu"))
    for plan in (small(tile_n=24), small(rows=2, programs=3), small(splits=0), small(chunk_n=0), small(short_n=0),
                 "fast"):
        with pytest.raises(InputError, match=r"^plan: expected"):
            pb.kernel(plan, scale=1.0)


def test_write_cells_bad_input(rng):
    k = torch.zeros(3, 2, 16)
    kc = torch.zeros(8, 2, 16)
    with pytest.raises(InputError, match=r"^cells: expected"):
        ca.write_cells_triton(k, k, kc, kc.clone(), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(InputError, match=r"^k_cache: expected"):
        ca.write_cells_triton(k, k, torch.zeros(8, 3, 16), torch.zeros(8, 3, 16), torch.zeros(3, dtype=torch.int64))


def test_kernels_compile_for_sm90_and_pipeline_their_loads():
    """CPU CI: the launches that matter compile for an H200 offline (the interpreter
    accepts what the compiler may reject) and load their K/V tiles asynchronously."""
    if torch.cuda.is_available():
        pytest.skip("the cuda tests compile the kernels for real here")
    require("triton")
    pytest.importorskip("triton.backends.nvidia.compiler")
    done = run_compile_script("compile_cell_attention.py")
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("pipelined") >= 5 and "not pipelined" not in done.stdout, done.stdout


# --------------------------------------------------------------------------------------
# H200: the compiled kernels at realistic sizes, against SDPA over each row's live cells
# --------------------------------------------------------------------------------------
def sdpa_rows(pb: Problem, *, scale) -> torch.Tensor:
    """torch SDPA per row over exactly the row's live cells (fp32 math)."""
    table = pb.block_table.long()
    out = torch.zeros(pb.q.shape, dtype=torch.float32, device=pb.q.device)
    G = pb.Hq // pb.Hkv
    for r, (s, p) in enumerate(zip(pb.seq_ids.tolist(), pb.positions.tolist())):
        if s < 0:
            continue
        j = torch.arange(p + 1, device=pb.q.device)
        cells = table[s, j // pb.bs] * pb.bs + j % pb.bs
        k = pb.k[cells].float().repeat_interleave(G, 1).transpose(0, 1)  # [Hq, L, D]
        v = pb.v[cells].float().repeat_interleave(G, 1).transpose(0, 1)
        out[r] = torch.nn.functional.scaled_dot_product_attention(pb.q[r].float()[:, None], k, v, scale=scale)[:, 0]
    return out


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128])
def test_cuda_against_sdpa(rng, dtype, D):
    """Contexts to 32k, N up to 96, GQA 4: distinct decode rows, a verify step, a mix."""
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    shapes = [  # (rows, sequences, blocks per sequence of 16)
        ([(0, 32767)], 1, 2048),
        ([(1, 8190 + i) for i in range(5)] + [(-1, 0)] * 3, 2, 520),
        ([(s, rng.randrange(1, 2048)) for s in range(64)], 64, 128),
        ([(rng.randrange(24), rng.randrange(4096)) if rng.random() < 0.9 else (-1, 0) for _ in range(96)], 24, 256),
    ]
    for rows, S, MB in shapes:
        pb = Problem(rng, rows, Hq=32, Hkv=8, D=D, bs=16, S=S, MB=MB, dtype=dtype)
        got = pb.kernel(scale=D ** -0.5)
        assert not got.isnan().any()
        torch.testing.assert_close(got.float(), sdpa_rows(pb, scale=D ** -0.5), atol=tol, rtol=tol)
        assert (got[pb.seq_ids < 0] == 0).all()


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_plans_against_the_reference(rng, dtype):
    """Every plan shape the bench sweeps gives the reference's answer (windows, bias too)."""
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    rows = [(s % 5, rng.randrange(600)) for s in range(20)] + [(-1, 0)] * 4
    pb = Problem(rng, rows, Hq=16, Hkv=4, D=80, bs=32, S=8, MB=24, dtype=dtype)
    slopes = torch.rand(16, device=DEV)
    for plan in (ca.AttentionPlan(r, p, s, ca.AttentionConfig(tile_n=t, num_warps=w, num_stages=st))
                 for r, p, s, t, w, st in [(1, 1, 1, 16, 2, 1), (8, 1, 16, 64, 4, 2), (8, 8, 4, 32, 4, 3),
                                           (4, 2, 64, 64, 8, 2), (16, 4, 2, 64, 4, 2)]):
        for kw in (dict(), dict(window=100, slopes=slopes, bias_shift=1)):
            got = pb.kernel(plan, scale=0.1, **kw)
            torch.testing.assert_close(got.float(), pb.reference(scale=0.1, **kw).float(), atol=tol, rtol=tol)


@pytest.mark.cuda
@cuda_only
def test_cuda_offsets_past_two_to_the_31(rng):
    """2**21 + 128 cells x 8 heads x 128 dims (bf16, 4 GiB a cache): the four live blocks
    are the top of the pool, every element of them past 2**31; write_cells and the
    attention reach them."""
    Hkv, D, bs = 8, 128, 16
    cells = 2**21 + 8 * bs
    k = torch.empty(cells, Hkv, D, device=DEV, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    top = cells // bs - 1 - torch.arange(4, device=DEV)  # the last four blocks
    table = top.int()[None]
    rows_k, rows_v = torch.randn(64, Hkv, D, device=DEV).bfloat16(), torch.randn(64, Hkv, D, device=DEV).bfloat16()
    j = torch.arange(64, device=DEV)
    cell_ids = top.long()[j // bs] * bs + j % bs
    assert int(cell_ids.min()) * Hkv * D > 2**31
    ca.write_cells_triton(rows_k, rows_v, k, v, cell_ids)
    q = torch.randn(2, 32, D, device=DEV).bfloat16()
    seq, pos = torch.zeros(2, dtype=torch.int64, device=DEV), torch.tensor([40, 63], device=DEV)
    got = ca.cell_attention_triton(q, k, v, table, seq, pos, block_size=bs, scale=D ** -0.5)
    for r, p in enumerate((40, 63)):
        kk = rows_k[: p + 1].float().repeat_interleave(4, 1).transpose(0, 1)
        vv = rows_v[: p + 1].float().repeat_interleave(4, 1).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(q[r].float()[:, None], kk, vv, scale=D ** -0.5)
        torch.testing.assert_close(got[r].float(), want[:, 0], atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("splits", [1, 8])
def test_cuda_graph_replays_follow_rewritten_inputs(rng, splits):
    """write_cells + attention captured once; positions, seq ids and block tables rewritten
    in place between replays (longer and shorter contexts, new padding) match eager runs."""
    from tests.support.models_for_tests import warm_and_capture

    N, Hq, Hkv, D, bs, S, MB = 8, 32, 8, 64, 16, 4, 256
    pb = Problem(rng, [(0, 10)] * N, Hq=Hq, Hkv=Hkv, D=D, bs=bs, S=S, MB=MB, dtype=torch.bfloat16)
    scratch = pb.blocks - 1  # never in a block table: padding rows write its first cell
    new_k, new_v = torch.randn(N, Hkv, D, device=DEV).bfloat16(), torch.randn(N, Hkv, D, device=DEV).bfloat16()
    cells = torch.zeros(N, dtype=torch.int64, device=DEV)
    out = torch.empty_like(pb.q)
    plan = ca.plan_attention(N, Hq, Hkv, D, splits=splits)

    def step():
        ca.write_cells_triton(new_k, new_v, pb.k, pb.v, cells)
        ca.cell_attention_triton(*pb.args(), block_size=bs, scale=0.125, out=out, plan=plan)

    graph = warm_and_capture(step)
    for _ in range(4):
        pairs = rng.sample([(s, p) for s in range(-1, S) for p in range(MB * bs)], N)  # distinct cells
        seqs, pos = [s for s, _ in pairs], [p if s >= 0 else 0 for s, p in pairs]
        pb.seq_ids.copy_(torch.tensor(seqs))
        pb.positions.copy_(torch.tensor(pos))
        pb.block_table.copy_(torch.randperm(scratch)[: S * MB].view(S, MB).int())
        table = pb.block_table.long().cpu()
        cells.copy_(torch.tensor([int(table[s, p // bs]) * bs + p % bs if s >= 0 else scratch * bs
                                  for s, p in zip(seqs, pos)]))
        new_k.normal_(), new_v.normal_(), pb.q.normal_()
        k0, v0 = pb.k.clone(), pb.v.clone()
        out.fill_(float("nan"))
        graph.replay()
        replayed, k1 = out.clone(), pb.k.clone()
        pb.k.copy_(k0), pb.v.copy_(v0)
        step()
        torch.testing.assert_close(replayed, out, atol=0, rtol=0)
        assert torch.equal(k1[: scratch * bs], pb.k[: scratch * bs])  # the scratch cell: any padding row wins
    assert not ca.attention_counters(DEV).any()  # every replay's last split reset its counter


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("rows", [1, 8])
def test_cuda_in_kernel_merge_is_race_free(rng, rows):
    """Real concurrency: 64 (width 1) or 16 (a verify step of 8 rows) splits of 20k
    positions finish in any order; 30 launches on one counter buffer all give the same
    bits (the merge sums in split order, whoever comes last), match SDPA, and leave the
    counters zero."""
    pos0 = 20000 + rng.randrange(64)
    pb = Problem(rng, [(0, pos0 + i) for i in range(rows)], Hq=32, Hkv=8, D=64, bs=16, S=1, MB=1300,
                 dtype=torch.bfloat16)
    counters = ca.new_attention_counters(DEV, 64)
    plan = ca.AttentionPlan(rows, 1, 64 if rows == 1 else 16, ca.AttentionConfig(tile_n=64, min_chunk=64))
    first = pb.kernel(plan, scale=0.125, counters=counters).clone()
    for _ in range(30):
        assert torch.equal(pb.kernel(plan, scale=0.125, counters=counters), first)
    assert not counters.any()
    torch.testing.assert_close(first.float(), sdpa_rows(pb, scale=0.125), atol=2e-2, rtol=2e-2)


if MODE == "compiled":
    import triton
    import triton.language as tl

    @triton.jit
    def _late_copy(src, dst, n, spins, BLOCK: tl.constexpr):
        """dst = src, written late: the launch after this one may start at once (the trigger
        comes first), then every program spins before it stores."""
        tl.extra.cuda.gdc_launch_dependents()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(src + offs, mask=offs < n, other=0.0)
        acc = tl.zeros([BLOCK], tl.float32)
        for _ in range(spins):
            acc = acc * 0.5 + 1.0
        tl.store(dst + offs, x + (acc * 0.0).to(x.dtype), mask=offs < n)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("rows", [1, 8])
def test_cuda_dependent_launches_read_what_the_launch_before_wrote(rng, monkeypatch, rotary, rows):
    """The pool's order with programmatic dependent launch, after a producer that lets the
    next launch start at once and writes the step's q, k, v (poisoned first) only after a
    long spin: the rotation/write (or, without it, the attention itself) follows it
    directly, then the attention with ``dependent=True``; eager and replayed from a graph.
    A kernel that did not wait would read the poison: each matches the launches without
    PDL bit for bit."""
    from cudagraph_rt.kernels import rotary_cells as rc
    from tests.support.models_for_tests import warm_and_capture

    if torch.cuda.get_device_capability(DEV)[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    assert common.pdl_launch(DEV), "Hopper: the dependent launches are on"
    Hq, Hkv, D, bs = 32, 8, 64, 16
    pos0 = 100 + rng.randrange(300)
    pb = Problem(rng, [(0, pos0 + i) for i in range(rows)], Hq=Hq, Hkv=Hkv, D=D, bs=bs, S=1, MB=64,
                 dtype=torch.bfloat16)
    table = pb.block_table.long().cpu()
    cells = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in range(pos0, pos0 + rows)], device=DEV)
    width = (Hq + 2 * Hkv) * D
    src = torch.randn(rows, width, device=DEV).bfloat16()
    qkv = torch.empty_like(src)
    q, k, v = (qkv[:, lo:hi].view(rows, -1, D) for lo, hi in ((0, Hq * D), (Hq * D, (Hq + Hkv) * D),
                                                             ((Hq + Hkv) * D, width)))
    cos, sin = torch.rand(rows, D, device=DEV), torch.rand(rows, D, device=DEV)
    q_out, out = torch.empty_like(q), torch.empty_like(q)
    if not rotary:  # the attention right after the producer: its q and the new K/V cells come late
        ca.write_cells_triton(src[:, Hq * D:(Hq + Hkv) * D].view(rows, Hkv, D),
                              src[:, (Hq + Hkv) * D:].view(rows, Hkv, D), pb.k, pb.v, cells)

    def step():
        for t in (qkv, q_out, out):
            t.fill_(float("nan"))
        _late_copy[(triton.cdiv(src.numel(), 1024),)](src, qkv, src.numel(), 20000, BLOCK=1024)
        if rotary:
            rows_q = rc.rotary_write_cells_triton(q, k, v, cos, sin, pb.k, pb.v, cells, q_out)
        else:
            rows_q = q
        ca.cell_attention_triton(rows_q, pb.k, pb.v, pb.block_table, pb.seq_ids, pb.positions, block_size=bs,
                                 scale=0.125, out=out, dependent=True)

    k0, v0 = pb.k.clone(), pb.v.clone()
    monkeypatch.setattr(common, "DEPENDENT_LAUNCH", False)
    step()
    want, want_k = out.clone(), pb.k.clone()
    assert want.isfinite().all()
    monkeypatch.setattr(common, "DEPENDENT_LAUNCH", True)
    for _ in range(3):
        pb.k.copy_(k0), pb.v.copy_(v0)
        step()
        assert torch.equal(out, want) and torch.equal(pb.k, want_k)
    graph = warm_and_capture(step)
    for _ in range(5):
        pb.k.copy_(k0), pb.v.copy_(v0)
        graph.replay()
        assert torch.equal(out, want) and torch.equal(pb.k, want_k)
