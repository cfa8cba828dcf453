"""The toy decoder against its eager single-sequence reference.

Every test draws fresh random inputs from a seed printed on failure (TOY_TEST_SEED=<n> to
replay one). A small host runner below builds padded steps from chunks of sequences.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cudagraph_rt.errors import InputError
from cudagraph_rt.models import ToyConfig, ToyDecoder
from tests.support.models_for_tests import python_acceptance
from tests.support.seeds import seeded_rng

DTYPES = [torch.float32, torch.bfloat16]
# Hidden rows are O(1..4): fp32 differs by reduction order only; bf16 by a few ulps (1/64 at 2..4).
ATOL = {torch.float32: 1e-4, torch.bfloat16: 0.07}


@pytest.fixture
def rng() -> random.Random:
    return seeded_rng("TOY_TEST_SEED", torch_too=True)


def model_for(dtype=torch.float32, device="cpu", **kw) -> ToyDecoder:
    return ToyDecoder(ToyConfig.tiny(dtype=dtype, **kw), device)


# --------------------------------------------------------------------------- host runner
Row = tuple[int, int, int, int, int]  # (token, position, seq, want, next_token)


def chunk_rows(model: ToyDecoder, seq: int, toks: list[int], start: int, wants: list[int],
               nexts: list[int] | None = None) -> list[Row]:
    nexts = nexts if nexts is not None else [-1] * len(toks)
    return [(t, start + i, seq, w, n) for i, (t, w, n) in enumerate(zip(toks, wants, nexts))]


def build(model: ToyDecoder, rows: list[Row], width: int, verify: bool = False,
          pad_cell: int | None = None) -> dict[str, torch.Tensor]:
    """Rows then padding up to ``width`` with the pad values of ``model.inputs()``."""
    specs = model.inputs(verify)
    cols = {"tokens": [r[0] for r in rows], "positions": [r[1] for r in rows], "seq_ids": [r[2] for r in rows],
            "cells": [model.cell_for(r[2], r[1]) for r in rows], "want": [r[3] for r in rows],
            "next_tokens": [r[4] for r in rows]}
    out = {}
    for name, spec in specs.items():
        pad = pad_cell if (name == "cells" and pad_cell is not None) else spec.pad
        out[name] = torch.tensor(cols[name] + [pad] * (width - len(rows)), dtype=spec.dtype, device=model.device)
    return out


def random_schedule(rng: random.Random, model: ToyDecoder, n_seqs: int, max_chunk: int = 12,
                    max_len: int | None = None):
    """Random sequences (up to ``max_len`` tokens), and steps mixing a random chunk of
    several of them each."""
    cfg, cap = model.config, max_len or model.config.max_len
    seqs = {s: [rng.randrange(cfg.vocab) for _ in range(rng.randint(cap // 4, cap))]
            for s in rng.sample(range(cfg.max_seqs), n_seqs)}
    fed, steps = dict.fromkeys(seqs, 0), []
    while any(fed[s] < len(seqs[s]) for s in seqs):
        step = []
        for s in rng.sample(list(seqs), rng.randint(1, n_seqs)):
            n = min(rng.randint(1, max_chunk), len(seqs[s]) - fed[s])
            if n > 0:
                step.append((s, fed[s], n, [rng.randint(0, 1) for _ in range(n)]))
                fed[s] += n
        steps.append(step)
    return seqs, steps


def run_schedule(model, rng, seqs, steps, corrupt=None, widths=None):
    """Run ``steps`` padded to random widths (or to ``widths``, one per step); returns
    (out, rows) per step. ``corrupt``: {step index: cell} gives that step's padding rows that cell."""
    results = []
    for k, step in enumerate(steps):
        rows = [r for s, start, n, wants in step for r in chunk_rows(model, s, seqs[s][start:start + n], start, wants)]
        width = widths[k] if widths else len(rows) + rng.randint(1 if corrupt and k in corrupt else 0, len(rows))
        results.append((model.step(build(model, rows, width, pad_cell=(corrupt or {}).get(k))), rows))
    return results


def deviations(model, seqs, results) -> tuple[int, float]:
    """(token mismatches, worst hidden difference) of the real rows against the reference."""
    refs = {s: model.reference(t) for s, t in seqs.items()}
    bad, worst = 0, 0.0
    for out, rows in results:
        for i, (_, p, s, want, _) in enumerate(rows):
            greedy, hidden = refs[s]
            bad += int(out["tokens"][i]) != (int(greedy[p]) if want else -1)
            worst = max(worst, (out["hidden"][i].float() - hidden[p].float()).abs().max().item())
    return bad, worst


# --------------------------------------------------------------------------- tests
def test_inputs_and_sizes():
    m = model_for()
    specs = m.inputs(verify=True)
    assert list(specs) == ["tokens", "positions", "seq_ids", "cells", "want", "next_tokens"]
    assert "next_tokens" not in m.inputs()
    assert all(s.dtype == torch.int64 and s.shape == () for s in specs.values())
    assert {k: s.pad for k, s in specs.items()} == dict(
        tokens=0, positions=0, seq_ids=-1, cells=m.scratch_cell, want=0, next_tokens=-1)
    cfg, pool = m.config, m.pool
    bs = cfg.block_size
    assert cfg.cells == cfg.max_seqs * cfg.max_len and bs == pool.block_size  # tiny: 128 is whole blocks
    assert pool.num_blocks * bs == cfg.cells and m.scratch_cell == pool.scratch_cell == cfg.cells
    assert pool.k.shape == pool.v.shape == (cfg.layers, cfg.cells + bs, cfg.heads, cfg.hidden // cfg.heads)
    assert pool.block_table.shape == (cfg.max_seqs, -(-cfg.max_len // bs)) and pool.block_table.dtype == torch.int32
    assert (pool.block_table == pool.scratch_block).all() and pool.free_blocks == pool.num_blocks
    cell = m.cell_for(3, 5)  # the first block taken, at offset 5
    blk = int(pool.block_table[3, 0])
    assert blk != pool.scratch_block and cell == blk * bs + 5 and pool.free_blocks == pool.num_blocks - 1
    assert m.cell_for(3, 6) == cell + 1 and m.cell_for(3, 5) == cell  # same block: nothing taken
    assert pool.free_blocks == pool.num_blocks - 1
    with pytest.raises(InputError, match="seq"):
        m.cell_for(cfg.max_seqs, 0)
    with pytest.raises(InputError, match="pos"):
        m.cell_for(0, cfg.max_len)
    assert ToyConfig.tiny(max_len=40).cells == 8 * 48  # whole blocks per sequence
    assert ToyConfig.bench().cells == 262144 and ToyConfig.tiny(cells=100).cells == 100


def test_config_validation():
    bench = ToyConfig.bench()
    assert bench.dtype == torch.bfloat16 and bench.factors == (128, 64)
    for bad in [dict(vocab=127), dict(heads=5), dict(heads=16), dict(hidden=32), dict(taps=(2,)),
                dict(taps=()), dict(max_len=0), dict(dtype=torch.int64), dict(layers=True), dict(cells=0),
                dict(block_size=0), dict(cells=1.5)]:
        with pytest.raises(InputError):
            ToyConfig.tiny(**bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_padded_steps_match_reference(rng, dtype):
    m = model_for(dtype)
    seqs, steps = random_schedule(rng, m, n_seqs=rng.randint(3, m.config.max_seqs))
    results = run_schedule(m, rng, seqs, steps)
    assert sum(len(r) for _, r in results) == sum(len(t) for t in seqs.values())
    assert max(len(r) for _, r in results) > 8  # real mixes, not single rows
    bad, worst = deviations(m, seqs, results)
    assert bad == 0 and worst <= ATOL[dtype], (bad, worst)


def test_outputs_shapes_and_masking(rng):
    m = model_for()
    rows = chunk_rows(m, 0, [rng.randrange(128) for _ in range(5)], 0, [1, 0, 1, 0, 0])
    out = m.step(build(m, rows, 8))
    assert out["tokens"].dtype == torch.int64 and out["tokens"].shape == (8,)
    assert out["hidden"].shape == (8, m.hidden_width) and out["hidden"].dtype == m.config.dtype
    assert out["tokens"][[1, 3, 4, 5, 6, 7]].eq(-1).all() and out["tokens"][[0, 2]].ge(0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_padding_only_step_leaves_every_other_cell(rng, dtype):
    m = model_for(dtype)
    seqs, steps = random_schedule(rng, m, n_seqs=4)
    half = len(steps) // 2
    run_schedule(m, rng, seqs, steps[:half])
    pool, sc = m.pool, m.scratch_cell
    assert pool.free_blocks < pool.num_blocks  # live blocks exist
    for t in (pool.k, pool.v):
        t[:, sc] = 1234.0  # poison the scratch cell: the padding rows must write it
    before = [t[:, :sc].clone() for t in (pool.k, pool.v)]
    table, free = pool.block_table.clone(), pool.free_blocks
    out = m.step(build(m, [], rng.randint(1, 97)))
    assert out["tokens"].eq(-1).all()
    for a, b in zip(before, (pool.k, pool.v)):
        assert torch.equal(a, b[:, :sc])
    assert torch.equal(table, pool.block_table) and pool.free_blocks == free
    assert all((t[:, sc] != 1234.0).all() for t in (pool.k, pool.v))
    # ...and the sequences carry on exactly as if nothing happened.
    later = run_schedule(m, rng, seqs, steps[half:])
    bad, worst = deviations(m, seqs, later)
    assert bad == 0 and worst <= ATOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_corrupted_pad_cell_changes_later_rows(rng, dtype):
    """Padding rows pointing at a live cell (a runner bug) must be visible downstream: against
    a clean run of the same steps at the same widths, the rows that attend to that cell change
    and every other row stays bit for bit the same."""
    m = model_for(dtype)
    seqs, steps = random_schedule(rng, m, n_seqs=3, max_chunk=6)
    # Corrupt the last cell a sequence fed at step k, where that sequence continues later.
    k, (s, start, n, _) = next((k, c) for k in range(len(steps) - 1) for c in steps[k]
                               if any(c2[0] == c[0] for later in steps[k + 1:] for c2 in later))
    sizes = [sum(c[2] for c in step) for step in steps]
    widths = [t + rng.randint(1 if j == k + 1 else 0, t) for j, t in enumerate(sizes)]
    m.reset_cache()
    clean = run_schedule(m, rng, seqs, steps, corrupt={k + 1: m.scratch_cell}, widths=widths)
    bad, worst = deviations(m, seqs, clean)
    assert bad == 0 and worst <= ATOL[dtype], (bad, worst)
    m.reset_cache()
    corrupted = run_schedule(m, rng, seqs, steps, corrupt={k + 1: m.cell_for(s, start + n - 1)}, widths=widths)
    changed, reads_it = [], []
    for j, ((a, rows), (b, _)) in enumerate(zip(clean, corrupted)):
        for i, (_, _, seq, _, _) in enumerate(rows):
            (reads_it if j > k and seq == s else changed).append(
                not torch.equal(a["hidden"][i], b["hidden"][i]) or int(a["tokens"][i]) != int(b["tokens"][i]))
    assert reads_it and any(reads_it), "the corrupted cell changed none of the rows that attend to it"
    assert not any(changed), "rows that never attend to the corrupted cell changed"


def draft(rng: random.Random, truth: list[int], k: int, vocab: int) -> list[int]:
    """k draft tokens: a random-length correct prefix of ``truth``, then random tokens."""
    good = rng.randint(0, k)
    return truth[:good] + [rng.randrange(vocab) for _ in range(k - good)]


def test_verify_step_acceptance_matches_python(rng):
    m = model_for()
    V, prompts = m.config.vocab, {}
    for s in rng.sample(range(m.config.max_seqs), 5):
        prompts[s] = [rng.randrange(V) for _ in range(rng.randint(1, 30))]
        m.step(build(m, chunk_rows(m, s, prompts[s], 0, [0] * len(prompts[s])), len(prompts[s])))
    # Several verify steps on the same prompts: draft cells are rewritten, and stale cells
    # of longer earlier drafts must stay invisible (they sit at later positions).
    for _ in range(4):
        rows, truths, first = [], {}, True
        for s in rng.sample(list(prompts), len(prompts)):
            p = prompts[s]
            k = 4 if first else rng.randint(0, 6)
            truths[s] = m.greedy_generate(p, k + 2)  # k + 1 rows, the last may add a bonus
            drafts = draft(rng, truths[s][1:], k, V)
            if first:  # one sure mismatch in the middle of a chain
                drafts[2] = (truths[s][3] + 1) % V
            first = False
            toks = [truths[s][0]] + drafts
            rows += chunk_rows(m, s, toks, len(p), [1] * (k + 1), toks[1:] + [-1])
        out = m.verify_step(build(m, rows, len(rows) + rng.randint(0, 20), verify=True))
        tokens, got = out["tokens"].tolist(), out["committed"].tolist()
        want = python_acceptance(tokens, rows)
        assert got[: len(rows)] == want and not any(got[len(rows):])
        idx = [i for i, c in enumerate(want) if c]
        assert out["accept_count"].tolist() == [len(idx)] and out["accept_count"].dtype == torch.int32
        assert out["accept_rows"].dtype == torch.int32
        assert out["accept_rows"].tolist() == idx + [0] * (len(out["accept_rows"]) - len(idx))
        assert 0 < len(idx) < len(rows)
        for s, truth in truths.items():  # accepted tokens continue plain greedy decoding
            acc = [tokens[i] for i in idx if rows[i][2] == s]
            assert acc == truth[1: 1 + len(acc)]


def test_speculative_decoding_keeps_greedy_output(rng):
    """Prefill mixed into verify steps, random drafts, committed tokens only: the generated
    text equals plain greedy decoding."""
    m = model_for()
    V, L, n_new = m.config.vocab, m.config.max_len, 24
    prompts = {s: [rng.randrange(V) for _ in range(rng.randint(1, 40))] for s in rng.sample(range(8), 4)}
    truth = {s: m.greedy_generate(p, n_new) for s, p in prompts.items()}
    fed = {s: [] for s in prompts}  # tokens whose K/V are in the cache
    pending = {s: list(p) for s, p in prompts.items()}  # tokens to feed next (prompt, then one)
    gen = {s: [] for s in prompts}
    steps = accepted = 0
    while any(len(g) < n_new for g in gen.values()):
        steps += 1
        assert steps < 200, "no progress"
        rows = []
        for s in rng.sample(list(prompts), len(prompts)):
            if len(gen[s]) >= n_new:
                continue
            start = len(fed[s])
            if len(pending[s]) > 1:  # prefill chunk: only the last row asks for a token
                rows += chunk_rows(m, s, pending[s], start, [0] * (len(pending[s]) - 1) + [1])
            else:
                k = min(rng.randint(0, 5), L - 1 - start)
                guess = truth[s][len(gen[s]):] + [0] * k
                toks = pending[s] + draft(rng, guess, k, V)
                rows += chunk_rows(m, s, toks, start, [1] * (k + 1), toks[1:] + [-1])
        out = m.verify_step(build(m, rows, len(rows) + rng.randint(0, 8), verify=True))
        committed, tokens = out["committed"].tolist(), out["tokens"].tolist()
        for s in prompts:
            mine = [i for i, r in enumerate(rows) if r[2] == s]
            acc = [tokens[i] for i in mine if committed[i]]
            if not mine:
                continue
            assert acc, "every sequence commits at least its last matching row"
            fed_now = [rows[i][0] for i in mine]
            n_fed = len(fed_now) if len(pending[s]) > 1 else len(acc)
            fed[s] += fed_now[:n_fed]
            gen[s] += acc
            accepted += len(acc) - 1
            pending[s] = [acc[-1]]
    assert {s: g[:n_new] for s, g in gen.items()} == truth
    assert accepted > 0  # drafts were actually accepted, not only bonus tokens


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_margin_is_wide(rng, dtype):
    m = model_for(dtype)
    eps, gaps, top = torch.finfo(dtype).eps, [], 0.0
    for _ in range(48):
        logits = m.reference_logits([rng.randrange(m.config.vocab) for _ in range(m.config.max_len)])[0]
        two = logits.topk(2, -1).values
        gaps.append(float((two[:, 0] - two[:, 1]).min()))
        top = max(top, float(logits.abs().max()))
    # Dtype noise of a logit is about eps * |largest logit|; the gap must dwarf it.
    assert min(gaps) >= 0.75 * m.design_margin and min(gaps) >= 32 * eps * top, (min(gaps), top)
    assert abs(m.logit_margin(contexts=8, seed=rng.randrange(1000)) - min(gaps)) < 0.5 * m.design_margin


def test_next_token_depends_on_context_through_attention(rng):
    m = model_for()
    V, A_B = m.config.vocab, m.config.factors
    toks = [rng.randrange(V) for _ in range(64)]
    greedy = m.reference(toks)[0].tolist()
    assert greedy == [m.design_next(toks[max(p - 1, 0)], toks[p]) for p in range(64)]
    changed = 0
    for _ in range(20):
        p = rng.randrange(1, 63)
        alt = list(toks)
        alt[p - 1] = (toks[p - 1] // A_B[1]) * A_B[1] + (toks[p - 1] + rng.randrange(1, A_B[1])) % A_B[1]
        new = m.reference(alt)[0].tolist()
        assert new[: p - 1] == greedy[: p - 1]  # causal: earlier positions unchanged
        changed += new[p] != greedy[p]
    assert changed == 20  # a different predecessor (b factor) always changes the next token


def test_deterministic_from_seed(rng):
    seed = rng.randrange(10**6)
    a, b, c = (model_for(seed=s) for s in (seed, seed, seed + 1))
    names = ("emb", "pos", "wqkv", "wo", "w1", "w2", "wout")
    assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in names)
    assert not any(torch.equal(getattr(a, n), getattr(c, n)) for n in names)
    toks = [rng.randrange(a.config.vocab) for _ in range(50)]
    ra, rb, rc = (m.reference(toks) for m in (a, b, c))
    assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1]) and not torch.equal(ra[0], rc[0])
    seqs, steps = random_schedule(rng, a, n_seqs=3)
    st = rng.getstate()
    oa = run_schedule(a, rng, seqs, steps)
    rng.setstate(st)
    ob = run_schedule(b, rng, seqs, steps)
    assert all(torch.equal(x[k], y[k]) for (x, _), (y, _) in zip(oa, ob) for k in x)


def test_bad_inputs_raise_before_writing():
    m = model_for()
    good = build(m, chunk_rows(m, 0, [1, 2], 0, [1, 1]), 4)
    for t in (m.pool.k, m.pool.v):
        t.fill_(7.0)  # any write would show
    table = m.pool.block_table.clone()
    for name, bad in [("want", None), ("cells", good["cells"].int()), ("positions", good["positions"][:3])]:
        inputs = {k: v for k, v in good.items() if k != name}
        if bad is not None:
            inputs[name] = bad
        with pytest.raises(InputError, match=name):
            m.step(inputs)
    with pytest.raises(InputError, match="next_tokens"):
        m.verify_step(good)
    assert (m.pool.k == 7.0).all() and (m.pool.v == 7.0).all() and torch.equal(table, m.pool.block_table)
    with pytest.raises(InputError):
        m.reference([])
    with pytest.raises(InputError):
        m.reference([m.config.vocab])


# --------------------------------------------------------------------------- GPU
@pytest.mark.cuda
def test_bench_config_on_cuda_matches_reference():
    rng = seeded_rng("TOY_TEST_SEED")
    m = ToyDecoder(ToyConfig.bench(), "cuda")
    seqs, steps = random_schedule(rng, m, n_seqs=6, max_chunk=10, max_len=96)
    bad, worst = deviations(m, seqs, run_schedule(m, rng, seqs, steps))
    assert bad == 0 and worst <= 0.1, (bad, worst)  # bench hidden rows are O(1)


@pytest.mark.cuda
def test_step_replays_from_a_cuda_graph():
    rng = seeded_rng("TOY_TEST_SEED")
    m, width = model_for(torch.bfloat16, "cuda"), 64
    static = build(m, [], width, verify=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            m.verify_step(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m.verify_step(static)
    m.reset_cache()
    seqs, steps = random_schedule(rng, m, n_seqs=4, max_chunk=8)
    results = []
    for step in steps:
        rows = [r for s, st, n, w in step for r in chunk_rows(m, s, seqs[s][st:st + n], st, w)]
        for k, v in build(m, rows, width, verify=True).items():
            static[k].copy_(v)
        graph.replay()
        results.append(({k: v.clone() for k, v in out.items()}, rows))
    bad, worst = deviations(m, seqs, results)
    assert bad == 0 and worst <= ATOL[torch.bfloat16] * 2, (bad, worst)


def test_compiled_step_attends_through_the_opaque_op(rng):
    """torch.compile of the toy's step: each layer's attention is one cgrt::attend_cells call
    (inductor must not re-generate the cell kernel nor hold the pool; on the H200 a traced
    kernel failed to compile), and the compiled step's rows equal the eager step's."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    eager, m = model_for(), model_for()
    seqs, steps = random_schedule(rng, eager, n_seqs=2, max_chunk=6)
    rows = [r for s, start, n, wants in steps[0] for r in chunk_rows(eager, s, seqs[s][start:start + n], start, wants)]
    width = len(rows) + 2  # each model takes the rows' blocks in its own pool
    torch._dynamo.reset()
    try:
        got = torch.compile(m.step, backend=record, fullgraph=True)(build(m, rows, width))
    finally:
        torch._dynamo.reset()
    want = eager.step(build(eager, rows, width))
    calls = [n for g in graphs for n in g.graph.nodes if n.target in (torch.ops.cgrt.attend_cells, torch.ops.cgrt.attend_cells.default)]
    assert len(calls) == m.config.layers, [str(n.target) for g in graphs for n in g.graph.nodes][:40]
    torch.testing.assert_close(got["hidden"], want["hidden"], rtol=1e-5, atol=1e-5)
    assert torch.equal(got["tokens"], want["tokens"])


# --------------------------------------------------------------------------- bad arguments (issue 35)
@pytest.mark.parametrize("bad", [dict(taps=(True,)), dict(taps=(0, False)), dict(taps=(1.0,)), dict(layers=2.0),
                                 dict(seed=True), dict(block_size=np.float64(16))], ids=repr)
def test_bools_and_floats_are_not_config_ints(bad):
    """ToyConfig(taps=(True,)) was taken as taps=(1,)."""
    name = next(iter(bad))
    with pytest.raises(InputError, match=rf"^ToyConfig\.{name}: expected"):
        ToyConfig.tiny(**bad)


def test_a_seed_past_what_a_generator_takes_is_refused_by_the_config():
    """ToyConfig(seed=2**64) was taken, and ToyDecoder then failed raw in torch.Generator
    ('Overflow when unpacking long long')."""
    assert ToyConfig.tiny(seed=2**64 - 1).seed == 2**64 - 1
    with pytest.raises(InputError, match=r"^ToyConfig\.seed: expected an int in \[0, 18446744073709551615\]"):
        ToyConfig.tiny(seed=2**64)


def test_numpy_integer_config_is_the_plain_config():
    cfg = ToyConfig.tiny(vocab=np.int64(128), layers=np.int32(2), taps=(np.int64(1), 0), seed=np.uint8(3),
                         block_size=np.int64(8))
    assert cfg == ToyConfig.tiny(taps=(1, 0), seed=3, block_size=8)
    assert all(type(getattr(cfg, f)) is int for f in ("vocab", "layers", "seed", "block_size", "cells"))
    assert all(type(t) is int for t in cfg.taps)


@pytest.mark.parametrize("tokens", [[1.5, 2], [1, 2.0], [True, 2], np.array([1.0, 2.0]), torch.tensor([1.5]),
                                    np.array([[1, 2]]), "12", 7, [1, None]], ids=repr)
def test_token_lists_that_are_not_ids_are_refused_by_every_reference_entry(tokens):
    """ToyDecoder.reference([1.5, 2]) fed token 1 (int(1.5)); greedy_generate likewise."""
    m = model_for()
    for call in (m.reference, m.reference_logits, lambda t: m.greedy_generate(t, 2)):
        with pytest.raises(InputError, match=r"^(tokens|prompt): expected"):
            call(tokens)


def test_numpy_and_torch_token_lists_are_the_plain_lists(rng):
    m = model_for()
    toks = [rng.randrange(m.config.vocab) for _ in range(9)]
    want_tokens, want_hidden = m.reference(toks)
    gen = m.greedy_generate(toks, 4)
    for same in (np.array(toks), np.array(toks, np.int32), torch.tensor(toks), tuple(np.int64(t) for t in toks)):
        got_tokens, got_hidden = m.reference(same)
        assert torch.equal(got_tokens, want_tokens) and torch.equal(got_hidden, want_hidden)
        assert m.greedy_generate(same, 4) == gen


@pytest.mark.parametrize("n", [True, 1.0, -1, "2"], ids=repr)
def test_greedy_generate_takes_a_count_of_new_tokens(n):
    with pytest.raises(InputError, match=r"^n: expected"):
        model_for().greedy_generate([1, 2], n)


def test_a_step_of_lists_or_a_non_dict_is_an_input_error():
    """ToyDecoder.step with a list of tokens raised AttributeError ('list' object has no
    attribute 'shape'): the step takes tensors, and says so."""
    m = model_for()
    good = build(m, chunk_rows(m, 0, [1, 2], 0, [1, 1]), 2)
    for t in (m.pool.k, m.pool.v):
        t.fill_(7.0)
    for name in good:
        bad = {**good, name: good[name].tolist()}
        with pytest.raises(InputError, match=rf"^{name}: expected a 1-D tensor"):
            m.step(bad)
    with pytest.raises(InputError, match=r"^inputs: expected a dict"):
        m.step(list(good.values()))
    assert (m.pool.k == 7.0).all() and (m.pool.v == 7.0).all()


@pytest.mark.parametrize("config", [5, "tiny", {"vocab": 128}, ToyConfig], ids=repr)
def test_a_config_that_is_not_a_toy_config_is_refused(config):
    """ToyDecoder(5) raised AttributeError ('int' object has no attribute 'seed')."""
    with pytest.raises(InputError, match=r"^config: expected a ToyConfig or None"):
        ToyDecoder(config, "cpu")
