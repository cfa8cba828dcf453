"""The paged KV pool (cudagraph_rt.models.pool) against a plain Python model of who holds
which block, and every model on it: a prompt's snapshot forked to another sequence (the
prefix cache), the step's cost independent of the pool's size, no capture hazard.

Inputs are fresh random each run from a seed printed on failure (POOL_TEST_SEED=<n>
replays one; hypothesis prints its own falsifying example).
"""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from cudagraph_rt import CapacityError, GraphRuntime, InputError
from cudagraph_rt.models import Decoder, KVPool, ToyConfig, ToyDecoder
from cudagraph_rt.models.pool import default_cells
from tests.support.extras import require
from tests.support.seeds import seeded_rng

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture
def rng() -> random.Random:
    return seeded_rng("POOL_TEST_SEED", torch_too=True)


def small_pool(blocks=6, bs=4, seqs=3, max_len=20, layers=2, device="cpu") -> KVPool:
    return KVPool(layers=layers, kv_heads=1, head_dim=2, dtype=torch.float32, device=device, cells=blocks * bs,
                  max_seqs=seqs, max_seq_len=max_len, block_size=bs)


def snapshot(pool: KVPool) -> tuple:
    """Everything a refused call must leave alone: host state, the device table, the caches."""
    return (pool.free_blocks, [pool.blocks(s) for s in range(pool.max_seqs)],
            [pool.refcount(b) for b in range(pool.num_blocks)], pool.block_table.clone(), pool.k.clone(),
            pool.v.clone())


def same(a: tuple, b: tuple) -> bool:
    return a[:3] == b[:3] and all(torch.equal(x, y) for x, y in zip(a[3:], b[3:]))


def table_cell(pool: KVPool, seq: int, pos: int) -> int:
    """The cell of (seq, pos) read from the DEVICE table, by the rule of the kernel contract."""
    bs = pool.block_size
    return int(pool.block_table[seq, pos // bs]) * bs + pos % bs


# ----------------------------------------------------------------------------- the allocator
def test_layout_growth_and_reuse_after_free():
    pool = small_pool()
    bs, sc = pool.block_size, pool.scratch_cell
    assert (pool.num_blocks, pool.scratch_block, sc) == (6, 6, 24)
    assert pool.k.shape == (2, 28, 1, 2) and pool.block_table.shape == (3, 5)
    assert (pool.block_table == 6).all() and pool.free_blocks == 6
    a = pool.cell_range(0, 0, 6)  # two blocks for seq 0
    assert len(set(a)) == 6 and pool.free_blocks == 4
    assert a == [table_cell(pool, 0, p) for p in range(6)]
    assert all(c // bs == a[0] // bs for c in a[:4]) and a[4] // bs != a[0] // bs
    b = pool.cell_range(1, 0, 3)
    assert not set(a) & set(b) and pool.free_blocks == 3
    assert pool.cell_range(0, 4, 2) == a[4:] and pool.free_blocks == 3  # held: nothing taken
    assert pool.cell_for(0, 9) // bs not in {c // bs for c in a + b} and pool.free_blocks == 2
    assert pool.blocks(0)[1] == a[4] // bs and pool.blocks(0)[3] is None  # position 12..15 never written
    held = {c // bs for c in a} | {pool.cell_for(0, 9) // bs}
    pool.free(0)
    assert pool.free_blocks == 5 and (pool.block_table[0] == pool.scratch_block).all()
    assert pool.blocks(0) == [None] * 5 and all(pool.refcount(x) == 0 for x in held)
    again = pool.cell_range(2, 0, 12)  # the freed blocks serve the next sequence
    assert {c // bs for c in again} == held and pool.free_blocks == 2
    pool.reset()
    assert pool.free_blocks == 6 and (pool.block_table == pool.scratch_block).all()


def test_a_sequence_may_use_the_whole_pool_and_max_seq_len():
    """No per-sequence reservation: one sequence takes every block (its own positions limit)."""
    pool = small_pool(blocks=5, bs=4, seqs=4, max_len=20)
    cells = pool.cell_range(3, 0, 20)
    assert len(set(cells)) == 20 and pool.free_blocks == 0
    with pytest.raises(CapacityError, match=r"seq 0: positions 0\.\.0 need 1 new block\(s\) of 4 cells, 0 free of 5"):
        pool.cell_for(0, 0)
    with pytest.raises(InputError, match="max_seq_len 20"):
        pool.cell_range(3, 18, 3)


def test_capacity_error_is_all_or_nothing():
    pool = small_pool(blocks=4, bs=4)
    pool.cell_range(0, 0, 8)
    pool.k.normal_()
    before = snapshot(pool)
    with pytest.raises(CapacityError, match=r"seq 1: positions 2\.\.12 need 4 new block\(s\) of 4 cells, 2 free of 4"):
        pool.cell_range(1, 2, 11)
    assert same(before, snapshot(pool))
    assert len(pool.cell_range(1, 2, 6)) == 6  # two blocks fit


@pytest.mark.parametrize("call, match", [
    (lambda p: p.cell_for(3, 0), "seq: expected a sequence id in \\[0, 3\\), got 3"),
    (lambda p: p.cell_for(-1, 0), "seq"),
    (lambda p: p.cell_for(True, 0), "seq"),
    (lambda p: p.cell_for(0, 20), "pos: expected in \\[0, 20\\), got 20"),
    (lambda p: p.cell_for(0, -1), "pos"),
    (lambda p: p.cell_for(0, 1.0), "pos"),
    (lambda p: p.cell_range(0, 0, -1), "n"),
    (lambda p: p.free(7), "seq"),
    (lambda p: p.fork(0, 0, 4), "dst: expected a sequence other than src 0"),
    (lambda p: p.fork(0, 1, 21), "upto"),
    (lambda p: p.fork(1, 2, 3), "src: expected a sequence holding positions \\[0, 3\\), got seq 1 without block"),
    (lambda p: p.refcount(6), "block"),
    # issue 35: a 0-d tensor or array passed operator.index (a device sync on CUDA), a bool as a count
    (lambda p: p.cell_for(torch.tensor(1), 0), "seq: expected a sequence id in \\[0, 3\\), got tensor\\(1\\)"),
    (lambda p: p.cell_range(0, __import__("numpy").array(0), 2), "pos0: expected an int >= 0, got array\\(0\\)"),
    (lambda p: p.cell_range(0, 0, True), "n: expected an int >= 0, got True"),
])
def test_bad_arguments_change_nothing(call, match):
    pool = small_pool()
    pool.cell_range(0, 0, 5)
    before = snapshot(pool)
    with pytest.raises(InputError, match=match):
        call(pool)
    assert same(before, snapshot(pool))


def test_bad_constructor_arguments():
    for kw, name in ((dict(cells=0), "cells"), (dict(block_size=0), "block_size"), (dict(max_seqs=True), "max_seqs"),
                     (dict(dtype=torch.int32), "dtype"), (dict(head_dim=2.0), "head_dim")):
        args = {**dict(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", cells=8, max_seqs=2,
                       max_seq_len=8, block_size=4), **kw}
        with pytest.raises(InputError, match=f"KVPool.{name}"):
            KVPool(**args)
    assert default_cells(3, 10, 4) == 36


# ----------------------------------------------------------------------------- fork and copy-on-write
def test_fork_shares_whole_blocks_and_copies_the_partial():
    pool = small_pool(blocks=8, bs=4)
    src = pool.cell_range(0, 0, 10)  # blocks for 0..3, 4..7 and a partial 8..9
    pool.k[:, src] = torch.arange(10.0)[None, :, None, None]
    pool.v[:, src] = -torch.arange(10.0)[None, :, None, None]
    pool.fork(0, 1, 10)
    s0, s1 = pool.blocks(0), pool.blocks(1)
    assert s1[:2] == s0[:2] and s1[2] not in s0 and s1[2] is not None and s1[3:] == [None] * 2
    assert [pool.refcount(b) for b in s0[:3]] == [2, 2, 1] and pool.free_blocks == 8 - 4
    for p in range(10):  # the clone reads the source's values, the partial block included
        c = table_cell(pool, 1, p)
        assert pool.k[1, c, 0, 0] == p and pool.v[0, c, 0, 1] == -p
    # copy-on-write: the source rewrites position 5 (a shared block): it gets its own copy
    c5 = pool.cell_for(0, 5)
    assert c5 // 4 not in s1 and pool.refcount(s1[1]) == 1 and pool.free_blocks == 3
    pool.k[:, c5] = 99.0
    assert pool.k[0, table_cell(pool, 1, 5), 0, 0] == 5  # the clone still reads the old value
    assert pool.k[0, table_cell(pool, 0, 4), 0, 0] == 4  # the copy carried the block's other cells
    # freeing the source never frees a block the clone reads
    pool.free(0)
    assert pool.refcount(s1[0]) == 1 and pool.free_blocks == 8 - 3
    assert [float(pool.k[0, table_cell(pool, 1, p), 0, 0]) for p in range(10)] == [float(p) for p in range(10)]


def test_fork_releases_dst_first_and_is_all_or_nothing():
    pool = small_pool(blocks=4, bs=4, seqs=4)
    pool.cell_range(0, 0, 6)
    pool.cell_range(1, 0, 8)
    assert pool.free_blocks == 0
    pool.fork(0, 1, 6)  # dst's two blocks are freed first, so the partial block fits
    b0 = pool.blocks(0)[0]
    assert pool.free_blocks == 1 and pool.blocks(1)[0] == b0 and pool.refcount(b0) == 2
    pool.cell_for(2, 0)
    before = snapshot(pool)
    with pytest.raises(CapacityError, match=r"fork of seq 0 into seq 3 \(upto 5\): needs 1 block .* 0 free of 4"):
        pool.fork(0, 3, 5)
    assert same(before, snapshot(pool))
    pool.fork(0, 3, 4)  # a whole block only: nothing to copy, nothing taken
    assert pool.refcount(b0) == 3 and pool.free_blocks == 0 and pool.blocks(3)[1:] == [None] * 4
    pool.fork(0, 2, 5)  # seq 2's own block is released first: room for the partial
    assert pool.refcount(b0) == 4 and pool.free_blocks == 0 and pool.blocks(2)[1] not in pool.blocks(0)


def test_device_cells_read_the_table_on_the_device(rng):
    pool = small_pool(blocks=12, bs=4, seqs=4, max_len=16)
    lens = [rng.randint(1, 16) for _ in range(3)]
    for s, n in enumerate(lens):
        pool.cell_range(s, 0, n)
    rows = [(s, rng.randrange(n)) for s, n in enumerate(lens) for _ in range(3)]
    seq = torch.tensor([s for s, _ in rows] + [-1, -1])
    pos = torch.tensor([p for _, p in rows] + [0, 5])
    got = pool.device_cells(seq, pos)
    assert got.dtype == torch.int64
    assert got.tolist() == [pool.cell_for(s, p) for s, p in rows] + [pool.scratch_cell] * 2


# ----------------------------------------------------------------------------- allocator fuzz
class PoolMachine(RuleBasedStateMachine):
    """Random grow / fork / free / reset against a plain model: which abstract block each
    sequence's table entry names, their refcounts, and the value each live sequence owns at
    each position. Every op that returns cells writes fresh values through them (both
    layers, K and V); the invariant reads every live sequence's positions back through the
    DEVICE block table and the device-side cell rule."""

    @initialize(blocks=st.integers(1, 10), bs=st.sampled_from([1, 2, 4, 8]), seqs=st.integers(1, 4),
                max_len=st.integers(1, 24))
    def setup(self, blocks, bs, seqs, max_len):
        self.pool = small_pool(blocks=blocks, bs=bs, seqs=seqs, max_len=max_len)
        self.bs, self.n_blocks, self.seqs, self.max_len = bs, blocks, seqs, max_len
        self.table = [dict() for _ in range(seqs)]  # seq -> {block index: abstract block id}
        self.refs: dict[int, int] = {}
        self.data = [dict() for _ in range(seqs)]  # seq -> {pos: value}
        self.next_id, self.next_value = 0, 1.0

    # -- the plain model --------------------------------------------------------------------
    def _fresh(self) -> int:
        self.next_id += 1
        return self.next_id

    def _drop(self, bid: int) -> None:
        self.refs[bid] -= 1
        if not self.refs[bid]:
            del self.refs[bid]

    def _write(self, seq: int, positions: list[int], cells: list[int]) -> None:
        vals = torch.arange(self.next_value, self.next_value + len(cells))
        self.next_value += len(cells)
        idx = torch.tensor(cells)
        for layer in range(2):
            self.pool.k[layer, idx, 0, 0] = vals + layer
            self.pool.v[layer, idx, 0, 1] = -vals - layer
        for p, v in zip(positions, vals.tolist()):
            self.data[seq][p] = v

    # -- rules ------------------------------------------------------------------------------
    def _length(self, seq: int) -> int:
        return max(self.data[seq], default=-1) + 1

    @rule(seq=st.integers(0, 3), n=st.integers(1, 12))
    def append(self, seq, n):
        """A sequence grows at its end (the common case)."""
        seq %= self.seqs
        self.grow(seq, min(self._length(seq), self.max_len - 1), n)

    @rule(seq=st.integers(0, 3), back=st.integers(1, 12), n=st.integers(1, 12))
    def rewrite(self, seq, back, n):
        """A sequence rewrites positions it holds (a rejected draft, a rewound source)."""
        seq %= self.seqs
        self.grow(seq, max(0, self._length(seq) - back), n)

    @rule(seq=st.integers(0, 3), pos0=st.integers(0, 23), n=st.integers(1, 12))
    def grow(self, seq, pos0, n):
        """Any positions, holes included."""
        seq, pos0 = seq % self.seqs, pos0 % self.max_len
        n = min(n, self.max_len - pos0)
        blocks = range(pos0 // self.bs, (pos0 + n - 1) // self.bs + 1)
        row = self.table[seq]
        need = [b for b in blocks if b not in row or self.refs[row[b]] > 1]
        if len(need) > self.n_blocks - len(self.refs):
            before = snapshot(self.pool)
            with pytest.raises(CapacityError, match=f"seq {seq}: .* need {len(need)} new block"):
                self.pool.cell_range(seq, pos0, n)
            assert same(before, snapshot(self.pool))
            return
        cells = self.pool.cell_range(seq, pos0, n)
        for b in need:
            if b in row:
                self._drop(row[b])
            row[b] = self._fresh()
            self.refs[row[b]] = 1
        assert len(cells) == n and len(set(cells)) == n
        self._write(seq, list(range(pos0, pos0 + n)), cells)

    @rule(src=st.integers(0, 3), dst=st.integers(0, 3), cut=st.integers(0, 24))
    def fork(self, src, dst, cut):
        """Fork below the source's length (mostly) or anywhere (a bad ``upto`` sometimes)."""
        src, dst = src % self.seqs, dst % self.seqs
        upto = max(0, self._length(src) - cut) if cut < 20 else cut % (self.max_len + 1)
        full, partial = divmod(upto, self.bs)
        held = all(b in self.table[src] for b in range(full + (partial > 0)))
        if src == dst or not held:
            with pytest.raises(InputError):
                self.pool.fork(src, dst, upto)
            return
        released = sum(1 for bid in self.table[dst].values() if self.refs[bid] == 1)
        if partial and self.n_blocks - len(self.refs) + released < 1:
            with pytest.raises(CapacityError, match=f"fork of seq {src} into seq {dst}"):
                self.pool.fork(src, dst, upto)
            return
        self.pool.fork(src, dst, upto)
        self._free(dst)
        for b in range(full):
            self.table[dst][b] = self.table[src][b]
            self.refs[self.table[src][b]] += 1
        if partial:
            self.table[dst][full] = self._fresh()
            self.refs[self.table[dst][full]] = 1
        self.data[dst] = {p: v for p, v in self.data[src].items() if p < upto}

    def _free(self, seq: int) -> None:
        for bid in self.table[seq].values():
            self._drop(bid)
        self.table[seq].clear()
        self.data[seq].clear()

    @rule(seq=st.integers(0, 3))
    def free(self, seq):
        seq %= self.seqs
        self.pool.free(seq)
        self._free(seq)

    @rule()
    def reset(self):
        self.pool.reset()
        for s in range(self.seqs):
            self.table[s].clear()
            self.data[s].clear()
        self.refs.clear()

    # -- invariants -------------------------------------------------------------------------
    @invariant()
    def counts_agree(self):
        assert self.pool.free_blocks == self.n_blocks - len(self.refs)
        for s in range(self.seqs):
            assert [b is not None for b in self.pool.blocks(s)] == [b in self.table[s] for b in
                                                                   range(self.pool.max_blocks)]
        real = sorted(self.pool.refcount(b) for b in range(self.n_blocks) if self.pool.refcount(b))
        assert real == sorted(self.refs.values())

    @invariant()
    def every_sequence_reads_its_own_values(self):
        rows = [(s, p, v) for s in range(self.seqs) for p, v in self.data[s].items()]
        if not rows:
            return
        seq, pos = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
        cells = self.pool.device_cells(seq, pos)
        want = torch.tensor([r[2] for r in rows])
        for layer in range(2):
            assert torch.equal(self.pool.k[layer, cells, 0, 0], want + layer)
            assert torch.equal(self.pool.v[layer, cells, 0, 1], -want - layer)
        unused = self.pool.block_table[[s for s in range(self.seqs) for b in range(self.pool.max_blocks)
                                        if b not in self.table[s]],
                                       [b for s in range(self.seqs) for b in range(self.pool.max_blocks)
                                        if b not in self.table[s]]]
        assert (unused == self.pool.scratch_block).all()  # a stray read stays in bounds


TestPoolFuzz = PoolMachine.TestCase
TestPoolFuzz.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, print_blob=True,
                                 suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- every model on the pool
def _hf(family="llama", device="cpu", dtype=torch.float32):
    require("transformers")
    from cudagraph_rt.models import hf

    return hf.build(family, "tiny", device=device, dtype=dtype)


MODELS = {"toy": lambda device="cpu": ToyDecoder(device=device), "hf:llama": lambda device="cpu": _hf(device=device),
          "hf:mistral": lambda device="cpu": _hf("mistral", device=device)}


def test_every_model_is_a_decoder():
    for make in MODELS.values():
        m = make()
        assert isinstance(m, Decoder) and isinstance(m.pool, KVPool)
        assert m.scratch_cell == m.pool.scratch_cell and m.pool.max_seq_len == m.config.max_len
        assert m.pool.num_blocks * m.pool.block_size >= m.config.max_seqs * m.config.max_len


def _check_rows(model, got_tokens, got_hidden, tokens, first: int):
    """Rows at positions first.. of one sequence of ``tokens`` against the eager reference:
    hidden rows to tolerance, greedy tokens where the reference's margin is clear."""
    from cudagraph_rt.sweep.checks import Tolerance

    logits, hidden = model.reference_logits(tokens)
    clear = model.clear_positions(logits) if hasattr(model, "clear_positions") else torch.ones(len(tokens), dtype=bool)
    n = len(got_tokens)
    err, bound = Tolerance.for_dtype(model.config.dtype, model.device).errors(
        torch.stack(got_hidden).float().cpu(), hidden[first:first + n].float().cpu())
    assert (err <= bound).all(), f"hidden rows off by {(err / bound).max():.3g} of tolerance"
    ref = logits.argmax(-1)[first:first + n].cpu()
    ok = (torch.tensor(got_tokens) == ref) | ~clear[first:first + n].cpu()
    assert ok.all(), (got_tokens, ref.tolist())


def prefix_cache_run(model, rng: random.Random, graphs: bool) -> None:
    """The seed's prefix cache: sequence A prefills a prompt in random chunks; B forks A's
    snapshot at the prompt's end (its whole blocks shared, the partial one copied); then
    every step mixes B's greedy decode row with a chunk of A's new tokens (A rewinds into
    its last shared block first, so its writes land in a block B reads: copy-on-write, then
    in its own partial block, then past the prompt), padded to the
    runtime's widths. B's tokens must be eager greedy decoding from the prompt, A's rows the
    eager reference of A's own tokens. (Forks at a block boundary and every other mix of
    sharing: the allocator fuzz above.)"""
    pool, bs, V = model.pool, model.pool.block_size, model.config.vocab
    P = rng.choice([p for p in range(bs + 1, 3 * bs) if p % bs])  # whole blocks to share and a partial one
    prompt = [rng.randrange(V) for _ in range(P)]
    a_seq, b_seq = rng.sample(range(model.config.max_seqs), 2)
    model.reset_cache()
    rt = GraphRuntime(model.step, model.inputs(), widths=(1, 2, 4, 8, 16), graphs=graphs, device=model.device)
    rt.capture()

    def step(rows):  # rows: (token, pos, seq, want); returns [(token, hidden row)] per row
        rng.shuffle(rows)
        res = rt.step(tokens=[r[0] for r in rows], positions=[r[1] for r in rows], seq_ids=[r[2] for r in rows],
                      cells=[model.cell_for(r[2], r[1]) for r in rows], want=[r[3] for r in rows])
        out = [(int(t), h.clone()) for t, h in zip(res.outputs["tokens"].tolist(), res.outputs["hidden"])]
        return {(r[2], r[1]): o for r, o in zip(rows, out)}

    fed = 0
    while fed < P:
        n = min(rng.randint(1, 9), P - fed)
        got = step([(prompt[p], p, a_seq, int(p == P - 1)) for p in range(fed, fed + n)])
        fed += n
    first = got[(a_seq, P - 1)][0]
    free = pool.free_blocks
    model.fork_seq(a_seq, b_seq, P)
    shared = P // bs
    assert pool.blocks(b_seq)[:shared] == pool.blocks(a_seq)[:shared]
    assert all(pool.refcount(b) == 2 for b in pool.blocks(a_seq)[:shared])
    assert pool.free_blocks == free - (P % bs > 0)  # only the partial block was copied
    n_new = 10
    r = rng.randint(max(0, shared * bs - 8), shared * bs - 1)  # A rewinds into its last shared block
    a_tokens = prompt[:r] + [rng.randrange(V) for _ in range(P + n_new - r)]
    b_tokens, b_rows, a_rows, a_next = prompt + [first], [], {}, r
    for _ in range(n_new):
        rows = [(b_tokens[-1], len(b_tokens) - 1, b_seq, 1)]
        k = rng.randint(1, 4)
        rows += [(a_tokens[p], p, a_seq, 1) for p in range(a_next, min(a_next + k, len(a_tokens)))]
        got = step(rows)
        tok, h = got[(b_seq, len(b_tokens) - 1)]
        b_rows.append(h)
        b_tokens.append(tok)
        for p in range(a_next, min(a_next + k, len(a_tokens))):
            a_rows[p] = got[(a_seq, p)]
        a_next = min(a_next + k, len(a_tokens))
    want, got = model.greedy_generate(prompt, n_new + 1), b_tokens[P:]
    if got != want:  # only a near-tie of random weights may round the other way (transformers models)
        i = next(j for j, (x, y) in enumerate(zip(got, want)) if x != y)
        logits = model.reference_logits(b_tokens[:P + i])[0]
        assert hasattr(model, "clear_positions") and not model.clear_positions(logits)[-1], (
            f"B left greedy decoding at a clear token: {got} vs {want}")
    _check_rows(model, b_tokens[P + 1:], b_rows, b_tokens[:-1], P)
    a_pos = sorted(a_rows)
    _check_rows(model, [a_rows[p][0] for p in a_pos], [a_rows[p][1] for p in a_pos], a_tokens[:a_pos[-1] + 1], r)
    assert pool.blocks(a_seq)[r // bs] != pool.blocks(b_seq)[r // bs]  # A copied the block it rewrote
    assert pool.blocks(a_seq)[:r // bs] == pool.blocks(b_seq)[:r // bs]  # the rest is still shared
    rt.close()


@pytest.mark.parametrize("name", ["toy", "hf:llama"])
def test_prefix_cache_fork_continues_as_eager_greedy(rng, name):
    prefix_cache_run(MODELS[name](), rng, graphs=False)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["toy", "hf:llama", "hf:mistral"])
def test_prefix_cache_fork_continues_as_eager_greedy_with_graphs_cuda(rng, name):
    prefix_cache_run(MODELS[name]("cuda"), rng, graphs=True)


class _OpSizes(TorchDispatchMode):
    """Every aten op's output shapes, outputs that alias the pool's K/V storage (its own
    layers, its in-place writes) named "pool" instead: what a step computes and moves."""

    def __init__(self, pool: KVPool):
        super().__init__()
        self.pool_storage = {pool.k.untyped_storage().data_ptr(), pool.v.untyped_storage().data_ptr()}
        self.log: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        shapes = tuple("pool" if t.untyped_storage().data_ptr() in self.pool_storage else tuple(t.shape)
                       for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        self.log.append((str(func), shapes))
        return out


@pytest.mark.parametrize("name", ["toy", "hf:llama"])
def test_a_step_costs_the_same_on_a_pool_64x_larger(rng, name):
    """The same rows on a 1,024-cell and a 65,536-cell pool run the same aten ops with the
    same output shapes (only views and in-place writes of the pool itself differ): nothing
    a step computes or moves grows with the pool. The attention's gather is bounded by the
    block table's positions per row (``max_len``), not by the pool's cells."""
    logs, rows = [], None
    for cells in (1024, 65536):
        if name == "toy":
            m = ToyDecoder(ToyConfig.tiny(cells=cells), "cpu")
        else:
            from cudagraph_rt.models import hf

            m = hf.HFDecoder(_hf().model, max_seqs=8, max_len=128, cells=cells)
        if rows is None:
            rows = [(s, p) for s in rng.sample(range(8), 3) for p in range(rng.randint(1, 40))]
            toks = [rng.randrange(m.config.vocab) for _ in rows]
        inputs = {k: torch.tensor(v) for k, v in dict(
            tokens=toks, positions=[p for _, p in rows], seq_ids=[s for s, _ in rows],
            cells=[m.cell_for(s, p) for s, p in rows], want=[1] * len(rows)).items()}
        with torch.no_grad(), _OpSizes(m.pool) as sizes:
            m.step(inputs)
        logs.append(sizes.log)
    assert logs[0] == logs[1]
    span = m.pool.max_blocks * m.pool.block_size
    dims = {d for _, shapes in logs[1] for s in shapes if s != "pool" for d in s}
    assert span in dims and not dims & {1024, 65536, m.pool.scratch_cell, m.pool.k.shape[1]}


def test_inspect_on_a_cpu_finds_no_hazard_in_the_toy_step(capsys):
    import json

    from cudagraph_rt import cli

    assert cli.main(["inspect", "--json", "--widths", "1,2,8"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [w["width"] for w in doc["widths"]] == [1, 2, 8]
    assert all(w["hazards"] == [] for w in doc["widths"]), doc


# ----------------------------------------------------------------------------- the runner on the pool
def test_runner_on_a_small_pool_admits_by_free_blocks_and_frees_on_retire(rng):
    """A pool of two blocks (32 positions) under six slots: a prompt waits, with slots
    free, until the free blocks cover its worst case; every output is plain greedy
    decoding; every block is back in the pool at the end. A request larger than the whole
    pool (but within max_len) is refused at submit."""
    from cudagraph_rt.speculative.runner import Request, SpecRunner, ToyDrafter

    m = ToyDecoder(ToyConfig.tiny(max_seqs=6, max_len=48, cells=32), "cpu")
    V = m.config.vocab
    runner = SpecRunner(m, ToyDrafter(m, 0.6, rng.randrange(100)), k=3, slots=6, lanes=2)
    with pytest.raises(InputError, match=r"at most 32 positions \(the model's whole KV pool\)"):
        runner.submit([Request(tuple([1] * 30), 4)])  # 33 positions fed: 3 blocks
    reqs = []
    for _ in range(8):
        n = rng.randint(1, 24)
        reqs.append(Request(tuple(rng.randrange(V) for _ in range(n)), rng.randint(2, 33 - n)))
    runner.submit(reqs)
    held_back, admit = [], runner._admit

    def watch(lane):
        admit(lane)
        held_back.append(bool(runner.waiting) and bool(runner._free_slots) and len(lane.seqs) < lane.cap)

    runner._admit = watch
    runner.run()
    assert len(runner.finished) == len(reqs) and any(held_back)
    for s in runner.finished:
        assert s.generated == m.greedy_generate(list(s.prompt), s.max_new), s.uid
    assert m.pool.free_blocks == m.pool.num_blocks


# ----------------------------------------------------------------------------- bad arguments (issue 35)
def _no_cuda_devices() -> list:
    """Devices this machine lacks or torch cannot place a pool on (CUDA ones only without CUDA)."""
    lacking = ["gpu", "cuda:99", 99, "meta", object(), 1.5, True]
    return lacking + (["cuda", "cuda:0", 0] if not torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _no_cuda_devices(), ids=repr)
def test_a_device_this_machine_lacks_is_an_input_error_naming_it(device):
    """KVPool(device="gpu") raised torch's RuntimeError, device=None a TypeError and
    "cuda:0" on a CPU machine an AssertionError ('Torch not compiled with CUDA'), where the
    docstring promises InputError (GraphRuntime's check, shared now)."""
    with pytest.raises(InputError, match=r"^KVPool\.device: expected"):
        KVPool(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=device, cells=8, max_seqs=2,
               max_seq_len=8, block_size=4)
    with pytest.raises(InputError, match=r"^device: expected"):
        ToyDecoder(ToyConfig.tiny(layers=1, taps=(0,)), device)
    from cudagraph_rt.kernels.attention import attention_counters, new_attention_counters
    for make in (new_attention_counters, attention_counters):
        with pytest.raises(InputError, match=r"^device: expected"):
            make(device)


def test_no_device_means_cuda_when_there_is_one_else_the_cpu():
    want = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    pool = KVPool(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=None, cells=8, max_seqs=2,
                  max_seq_len=8, block_size=4)
    assert pool.device == pool.k.device == want


def test_numpy_integer_sizes_build_the_plain_pool():
    """The sizes were checked through operator.index but kept as given: np.int64 block
    sizes leaked into the cells handed out (np.int64 cells, np.int64 arithmetic)."""
    import numpy as np
    plain = small_pool()
    pool = KVPool(layers=np.int64(2), kv_heads=np.int32(1), head_dim=np.int64(2), dtype=torch.float32, device="cpu",
                  cells=np.int64(24), max_seqs=np.int16(3), max_seq_len=np.int64(20), block_size=np.int64(4))
    for name in ("block_size", "max_seqs", "max_seq_len", "num_blocks", "scratch_cell", "max_blocks"):
        assert type(getattr(pool, name)) is int and getattr(pool, name) == getattr(plain, name), name
    assert pool.cell_range(1, 0, 6) == plain.cell_range(1, 0, 6)
    assert all(type(c) is int for c in pool.cell_range(2, 0, 5))


@pytest.mark.parametrize("cells, block_size", [(2**31, 16), (2**31 - 16, 16), (2**40, 1), (10**18, 4)])
def test_a_pool_past_what_the_attention_addresses_is_refused_before_allocating(cells, block_size):
    """KVPool(cells=2**31) tried to allocate its caches (16 GiB and up; torch's 'can't allocate
    memory', or the OOM killer) for a cache the attention refuses anyway (fewer than 2**31
    cells, the scratch block included): InputError naming cells, before any allocation."""
    with pytest.raises(InputError, match=r"^KVPool\.cells: expected at most 2147483647 cells"):
        KVPool(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", cells=cells, max_seqs=1,
               max_seq_len=8, block_size=block_size)


@pytest.mark.parametrize("entries", [True, 0, 2.0, "8"])
def test_bad_counter_sizes_are_refused(entries):
    from cudagraph_rt.kernels.attention import new_attention_counters
    with pytest.raises(InputError, match=r"^entries: expected"):
        new_attention_counters("cpu", entries)
