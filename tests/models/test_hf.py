"""transformers causal LMs on the cell KV pool (cudagraph_rt.models.hf), against the
model's own forward with no cache and its own ``generate``.

CPU tests use the tiny random-init configs (fp32) of every family; the cuda ones check
graphs on == graphs off bit for bit, bf16, and the 1b shape. Inputs are fresh random each
run from a seed printed on failure (HF_TEST_SEED=<n> replays one).
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.support.extras import require

require("transformers")

from cudagraph_rt import GraphRuntime, InputError, InputSpec  # noqa: E402
from cudagraph_rt.models import hf  # noqa: E402
from cudagraph_rt.models import attention_op, hf_rotary  # noqa: E402
from cudagraph_rt.models.accept import greedy_accept  # noqa: E402
from cudagraph_rt.speculative.runner import ReferenceDrafter, Request, SpecRunner  # noqa: E402
from cudagraph_rt.sweep import HFAdapter, run_sweep  # noqa: E402
from cudagraph_rt.sweep.checks import Tolerance  # noqa: E402
from tests.support.models_for_tests import python_acceptance  # noqa: E402
from tests.support.seeds import seeded_rng

FAMILIES = hf.FAMILIES
# fp32: the packed step and the one-sequence forward differ by reduction order only.
TOL = Tolerance.for_dtype(torch.float32)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture
def rng() -> random.Random:
    return seeded_rng("HF_TEST_SEED")


_MODELS: dict = {}


def model_for(family: str, device="cpu", dtype=torch.float32, max_len: int = 64) -> hf.HFDecoder:
    """One random-init model per (family, device, dtype), a fresh pool per call."""
    key = (family, str(device), dtype)
    if key not in _MODELS:
        _MODELS[key] = hf.build(family, "tiny", dtype=dtype, device=device, max_len=max_len)
    base = _MODELS[key]
    return hf.HFDecoder(base.model, max_seqs=base.config.max_seqs, max_len=base.config.max_len, family=family,
                        size="tiny")


def poison(m: hf.HFDecoder, seed: int) -> None:
    """Large finite garbage in every K/V cell (all are free, so none may be seen: a mask that
    lets one through changes rows by far more than any tolerance; NaN would make even a
    correct mask's 0-weight products NaN)."""
    g = torch.Generator(device=m.device).manual_seed(seed)
    m.pool.k.copy_(torch.randn(m.pool.k.shape, generator=g, device=m.device) * 100)
    m.pool.v.copy_(torch.randn(m.pool.v.shape, generator=g, device=m.device) * 100)


def rows_to_inputs(m, rows, width: int | None = None, verify: bool = False) -> dict[str, torch.Tensor]:
    """rows: (token, pos, seq, want, next_token); padded to ``width`` with the pad values."""
    specs = m.inputs(verify)
    width = width or len(rows)
    cols = {k: [] for k in specs}
    for tok, pos, seq, want, nxt in rows:
        for k, v in (("tokens", tok), ("positions", pos), ("seq_ids", seq), ("cells", m.cell_for(seq, pos)),
                     ("want", want), ("next_tokens", nxt)):
            if k in cols:
                cols[k].append(v)
    for k in cols:
        cols[k] += [specs[k].pad] * (width - len(rows))
    return {k: torch.tensor(v, dtype=torch.int64, device=m.device) for k, v in cols.items()}


def random_schedule(rng, m, n_seqs: int, max_chunk: int = 9):
    """Random prompts for ``n_seqs`` sequence ids and a schedule of packed steps, each taking
    a random chunk from several sequences in a shuffled row order."""
    V, L = m.config.vocab, m.config.max_len
    seqs = {s: [rng.randrange(V) for _ in range(rng.randint(1, L))] for s in rng.sample(range(m.config.max_seqs), n_seqs)}
    fed = {s: 0 for s in seqs}
    steps = []
    while any(fed[s] < len(t) for s, t in seqs.items()):
        rows, open_ = [], [s for s in seqs if fed[s] < len(seqs[s])]
        for s in rng.sample(open_, rng.randint(1, len(open_))):
            n = min(rng.randint(1, max_chunk), len(seqs[s]) - fed[s])
            rows += [(seqs[s][p], p, s, rng.randint(0, 1), -1) for p in range(fed[s], fed[s] + n)]
            fed[s] += n
        rng.shuffle(rows)
        steps.append(rows)
    return seqs, steps


@pytest.mark.parametrize("family", FAMILIES)
def test_cell_cache_matches_no_cache_forward(rng, family):
    """Many sequences in packed, padded, shuffled steps: every hidden row equals the model's
    own no-cache forward of that sequence (fp32 tolerance), every token its greedy argmax
    where the margin is clear, -1 where no token was asked for."""
    m = model_for(family)
    poison(m, rng.randrange(1 << 30))
    seqs, steps = random_schedule(rng, m, n_seqs=rng.randint(2, 5))
    got_h = {s: torch.full((len(t), m.config.hidden), float("nan")) for s, t in seqs.items()}
    got_t = {s: torch.full((len(t),), -7, dtype=torch.int64) for s, t in seqs.items()}
    with torch.no_grad():
        for rows in steps:
            out = m.step(rows_to_inputs(m, rows, len(rows) + rng.randint(0, 5)))
            assert out["tokens"].shape[0] >= len(rows)
            for i, (_, pos, s, want, _) in enumerate(rows):
                got_h[s][pos] = out["hidden"][i].float()
                got_t[s][pos] = out["tokens"][i] if want else (-1 if out["tokens"][i] == -1 else -9)
            assert (out["tokens"][len(rows):] == -1).all()  # padding rows want no token
    for s, toks in seqs.items():
        logits, hidden = m.reference_logits(toks)
        err, bound = TOL.errors(got_h[s], hidden)
        assert (err <= bound).all(), f"seq {s}: hidden rows off by {(err / bound).max():.3g} of tolerance"
        asked = got_t[s] != -1
        assert (got_t[s] != -9).all()
        clear = m.clear_positions(logits)
        ref = logits.argmax(-1)
        assert ((got_t[s] == ref) | ~asked | ~clear).all()


def test_reference_is_the_models_own_forward(rng):
    m = model_for("llama")
    toks = [rng.randrange(m.config.vocab) for _ in range(rng.randint(2, 40))]
    logits, _ = m.reference_logits(toks)
    with torch.no_grad():
        own = m.model(torch.tensor([toks])).logits[0].float()
    assert torch.equal(logits, own)
    impl = m.model.config._attn_implementation
    m.step(rows_to_inputs(m, [(toks[0], 0, 0, 1, -1)]))
    assert m.model.config._attn_implementation == impl  # restored after the step


def test_sliding_window_is_applied(rng):
    """Mistral's tiny window (16): a sequence longer than it matches the model's own forward
    (above), and the window matters (without it the rows differ)."""
    m = model_for("mistral")
    toks = [rng.randrange(m.config.vocab) for _ in range(40)]
    _, hidden = m.reference_logits(toks)
    m.model.config.sliding_window = None
    try:
        _, no_window = m.reference_logits(toks)
    finally:
        m.model.config.sliding_window = 16
    assert (hidden[20:] - no_window[20:]).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rotary_in_pool", [True, False])
def test_no_mask_tensor_reaches_the_attention(family, rotary_in_pool):
    """transformers builds no mask for the pool's attention (none is passed): every
    attention module's call gets ``attention_mask=None`` (and with transformers rotating,
    every call of the registered attention function), and the pool's state, not a mask,
    decides."""
    from transformers import AttentionInterface

    base = model_for(family)
    m = hf.HFDecoder(base.model, max_seqs=base.config.max_seqs, max_len=base.config.max_len,
                     rotary_in_pool=rotary_in_pool)
    seen, given = [], []

    def spy(module, query, key, value, attention_mask, **kw):
        seen.append(attention_mask)
        return hf.cell_attention(module, query, key, value, attention_mask, **kw)

    def hook(module, args, kwargs):
        given.append(kwargs["attention_mask"] if "attention_mask" in kwargs else args[2])

    hooks = [mod.register_forward_pre_hook(hook, with_kwargs=True) for mod in m.model.modules()
             if hf_rotary.installable(mod)]
    AttentionInterface.register(hf.ATTENTION, spy)
    try:
        m.step(rows_to_inputs(m, [(1, 0, 0, 1, -1), (2, 1, 0, 1, -1)], width=4))
    finally:
        AttentionInterface.register(hf.ATTENTION, hf.cell_attention)
        for h in hooks:
            h.remove()
    assert len(given) == m.config.layers and all(x is None for x in given), given
    assert len(seen) == (0 if rotary_in_pool else m.config.layers) and all(x is None for x in seen), seen


def test_padding_rows_write_only_the_scratch_cell(rng):
    m = model_for("qwen3")
    m.reset_cache()
    toks = [rng.randrange(m.config.vocab) for _ in range(12)]
    m.step(rows_to_inputs(m, [(t, p, 3, 0, -1) for p, t in enumerate(toks)]))
    pool, sc = m.pool, m.scratch_cell
    for t in (pool.k, pool.v):
        t[:, sc] = 1234.0  # poison the scratch cell: the padding rows must write it
    k, v, table = pool.k[:, :sc].clone(), pool.v[:, :sc].clone(), pool.block_table.clone()
    out = m.step(rows_to_inputs(m, [], width=rng.randint(1, 16)))
    assert torch.equal(pool.k[:, :sc], k) and torch.equal(pool.v[:, :sc], v)
    assert torch.equal(pool.block_table, table)
    assert (pool.k[:, sc] != 1234.0).all() and (pool.v[:, sc] != 1234.0).all()
    assert (out["tokens"] == -1).all()


def test_bad_inputs_name_the_argument():
    m = model_for("llama")
    good = rows_to_inputs(m, [(1, 0, 0, 1, -1)])
    with pytest.raises(InputError, match="positions"):
        m.step({**good, "positions": good["positions"].to(torch.int32)})
    with pytest.raises(InputError, match="missing"):
        m.step({k: v for k, v in good.items() if k != "cells"})
    with pytest.raises(InputError, match="next_tokens"):
        m.verify_step(good)
    with pytest.raises(InputError, match="family"):
        hf.hf_config("gpt2")
    with pytest.raises(InputError, match="--model"):
        hf.parse_model("hf:gpt2")
    with pytest.raises(InputError, match="max_len"):
        hf.HFDecoder(m.model, max_len=10**7)


@pytest.mark.parametrize("device", ["gpu", "meta", 1.5] + ([] if torch.cuda.is_available() else ["cuda:0"]),
                         ids=repr)
def test_build_on_a_device_this_machine_lacks_is_an_input_error(device):
    """hf.build(device="gpu") raised torch's RuntimeError, "cuda:0" on a CPU machine an
    AssertionError, before or while building the model: InputError naming it, first."""
    with pytest.raises(InputError, match=r"^device: expected"):
        hf.build("llama", "tiny", device=device)


def test_token_lists_that_are_not_ids_are_refused_by_the_references():
    """HFDecoder.reference([1.5, 2]) fed token 1; greedy_generate([1.5]) likewise."""
    m = model_for("llama")
    for bad in ([1.5, 2], [True, 2], torch.tensor([1.0, 2.0])):
        for call in (m.reference, m.reference_logits, lambda t: m.greedy_generate(t, 2)):
            with pytest.raises(InputError, match=r"^(tokens|prompt): expected"):
                call(bad)
    toks = [3, 17, 42]
    assert m.greedy_generate(torch.tensor(toks), 3) == m.greedy_generate(toks, 3)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_verify_step_acceptance(rng, family):
    """Drafts from plain greedy decoding with random wrong tokens: committed rows follow the
    slow acceptance rule, and the accepted tokens continue ``generate(do_sample=False)``."""
    m = model_for(family)
    m.reset_cache()
    V, prompts = m.config.vocab, {}
    for s in rng.sample(range(m.config.max_seqs), 4):
        prompts[s] = [rng.randrange(V) for _ in range(rng.randint(1, 20))]
        m.step(rows_to_inputs(m, [(t, p, s, 0, -1) for p, t in enumerate(prompts[s])]))
    rows, truths = [], {}
    for j, s in enumerate(prompts):
        p, k = prompts[s], rng.randint(1, 5)
        truths[s] = m.greedy_generate(p, k + 2)
        good = 1 if j == 0 else rng.randint(0, k)  # the first sequence: a sure mismatch after one
        drafts = truths[s][1:1 + good] + [(truths[s][1 + i] + 1 + rng.randrange(V - 1)) % V for i in range(good, k)]
        toks = [truths[s][0]] + drafts
        rows += [(t, len(p) + i, s, 1, (toks + [-1])[i + 1]) for i, t in enumerate(toks)]
    out = m.verify_step(rows_to_inputs(m, rows, len(rows) + rng.randint(0, 6), verify=True))
    tokens, got = out["tokens"].tolist(), out["committed"].tolist()
    want = python_acceptance(tokens, rows)
    assert got[:len(rows)] == want and not any(got[len(rows):])
    idx = [i for i, c in enumerate(want) if c]
    assert out["accept_count"].tolist() == [len(idx)]
    assert out["accept_rows"].tolist() == idx + [0] * (len(tokens) - len(idx))
    for s, truth in truths.items():
        acc = [tokens[i] for i in idx if rows[i][2] == s]
        assert acc == truth[1:1 + len(acc)]
    # the same acceptance as the shared function on the same tokens
    inp = rows_to_inputs(m, rows, len(tokens), verify=True)
    shared = greedy_accept(out["tokens"], inp["next_tokens"], inp["positions"], inp["seq_ids"], inp["want"])
    assert torch.equal(shared["committed"], out["committed"])


@pytest.mark.parametrize("family", FAMILIES)
def test_runtime_greedy_decoding_equals_generate(rng, family):
    """Prefill then one token per step through a GraphRuntime (graphs off), two sequences
    sharing each step: the tokens equal ``model.generate(do_sample=False)``."""
    m = model_for(family)
    m.reset_cache()
    rt = GraphRuntime(m.step, m.inputs(), graphs=False, device=m.device)
    V, n = m.config.vocab, 12
    prompts = {s: [rng.randrange(V) for _ in range(rng.randint(1, 20))] for s in (1, 6)}
    seqs = {s: list(p) for s, p in prompts.items()}
    # rows of each step are grouped by sequence in dict order; one row per sequence asks
    rows = [(t, i, s, int(i == len(p) - 1), -1) for s, p in prompts.items() for i, t in enumerate(p)]
    for _ in range(n):
        toks = rt.step(**rows_to_inputs(m, rows)).outputs["tokens"].tolist()
        asked = [t for t in toks if t != -1]
        assert len(asked) == len(seqs)
        for s, t in zip(seqs, asked):
            seqs[s].append(t)
        rows = [(seqs[s][-1], len(seqs[s]) - 1, s, 1, -1) for s in seqs]
    rt.close()
    for s, p in prompts.items():
        ids = torch.tensor([p])
        want = m.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
        assert len(want) == n
        assert seqs[s][len(p):] == want, f"seq {s}"
        assert m.greedy_generate(p, n) == want


def test_clear_positions_rule():
    """Clear iff top1 - top2 > MARGIN_ULPS * eps * max|logit| of the row."""
    m = model_for("llama")
    eps, ulps = torch.finfo(torch.float32).eps, hf.MARGIN_ULPS[torch.float32]
    row = torch.zeros(3, m.config.vocab)
    row[:, 5] = 10.0
    row[0, 7] = 10.0 - 2 * ulps * eps * 10  # clear
    row[1, 7] = 10.0 - 0.5 * ulps * eps * 10  # a near-tie
    row[2, 7] = 10.0  # an exact tie
    assert m.clear_positions(row).tolist() == [True, False, False]


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_sweep_graphs_off(rng, family):
    """The width sweep through HFAdapter, graphs off: every width against the reference."""
    adapter = HFAdapter(model=model_for(family, max_len=64), widths=(1, 2, 4, 8, 16))
    report = run_sweep(adapter, graphs="off", seed=rng.randrange(1 << 30), repeats=1, extras=(24,))
    assert report.ok, report.summary()
    assert report.modes[0].steps_checked >= 18


class _StolenCellAdapter(HFAdapter):
    """A broken integration: padding rows write cell 0 (seq 0, position 0), a live cell."""

    def build(self, graphs):
        self.model.reset_cache()
        specs = dict(self.model.inputs(), cells=InputSpec(pad=0))
        return GraphRuntime(self.model.step, specs, widths=self.widths, graphs=graphs, device=self.device)


def test_sweep_catches_a_padding_row_in_a_live_cell(rng):
    adapter = _StolenCellAdapter(model=model_for("llama", max_len=64), widths=(1, 2, 4, 8, 16))
    report = run_sweep(adapter, graphs="off", seed=rng.randrange(1 << 30), repeats=2, extras=())
    assert not report.ok
    assert any(k in ("hidden", "model state") for k, _ in report.modes[0].kinds)


def test_speculative_runner_keeps_greedy_output(rng):
    """SpecRunner with the ReferenceDrafter (k=3, p=0.6) through the runtime, graphs off:
    every sequence's output equals model.generate(do_sample=False), some drafts were
    accepted and some rejected, and one host row arrived per generated token."""
    m = model_for("qwen2")
    m.reset_cache()
    V = m.config.vocab
    reqs = [Request(tuple(rng.randrange(V) for _ in range(rng.randint(1, 20))), rng.randint(2, 14))
            for _ in range(6)]
    drafter = ReferenceDrafter(m, 0.6, seed=rng.randrange(1000))
    runner = SpecRunner(m, drafter, k=3, slots=4, lanes=2, graphs=False, record_rows=True)
    runner.submit(reqs)
    rep = runner.run()
    assert len(runner.finished) == len(reqs)
    assert 0 < rep.accepted < rep.proposed
    for seq in runner.finished:
        assert seq.generated == m.greedy_generate(list(seq.prompt), seq.max_new), f"uid {seq.uid}"
        assert sum(r.shape[0] for r in seq.rows) == seq.max_new


def test_from_local_directory(tmp_path, rng):
    """``build(path=...)`` loads a saved model (local files only) with the same outputs."""
    m = model_for("qwen3")
    m.model.save_pretrained(tmp_path)
    loaded = hf.build("qwen3", "tiny", device="cpu", path=str(tmp_path), max_len=m.config.max_len)
    toks = [rng.randrange(m.config.vocab) for _ in range(10)]
    assert torch.equal(loaded.reference_logits(toks)[0], m.reference_logits(toks)[0])
    with pytest.raises(InputError, match="path"):
        hf.build("qwen3", path=str(tmp_path / "missing"))


def test_cli_demo_and_sweep_take_hf_models():
    from cudagraph_rt import cli

    assert cli.main(["demo", "--model", "hf:llama", "--sequences", "4", "--max-new", "8", "--json"]) == 0
    assert cli.main(["sweep", "--model", "hf:mistral", "--widths", "1,2,4", "--repeats", "1", "--extras", "none",
                     "--seed", "5"]) == 0
    assert cli.main(["sweep", "--model", "hf:bert"]) == 2
    assert cli.main(["sweep", "--size", "1b"]) == 2  # the toy has no 1b size


# ------------------------------------------------------------------------------ CUDA
def _on_off(m, rng, widths=(1, 2, 4, 8, 16, 32), on=True):
    """The same random packed steps through graphs on and graphs off (fresh pools): every
    output bit-identical. Every row's sequence holds the blocks of all positions up to the
    row's own before the step (a position without a block reads the scratch block, whose
    contents are whatever padding rows last wrote: the capture's padding rows differ from
    graphs off's, so a gap there would compare undefined cells, not the runtime)."""
    outs = {}
    V, L = m.config.vocab, min(m.config.max_len, 64)
    r = random.Random(rng.randrange(1 << 30))
    plan = []
    for _ in range(12):
        T = r.randint(1, widths[-1])
        plan.append([(r.randrange(V), p, s, r.randint(0, 1), -1)
                     for s in range(min(4, m.config.max_seqs)) for p in range(0, L, max(1, L // (T // 4 + 1)))][:T])
    for graphs in (on, False):
        m.reset_cache()
        rt = GraphRuntime(m.step, m.inputs(), widths=widths, graphs=graphs, device=m.device)
        rt.capture()
        got = []
        for rows in plan:
            for _, pos, seq, _, _ in rows:
                m.cell_range(seq, 0, pos + 1)
            res = rt.step(**rows_to_inputs(m, rows))
            got.append({k: v.clone() for k, v in res.outputs.items()})
        if m.device.type == "cuda":
            torch.cuda.synchronize()
        rt.close()
        outs[graphs] = got
    for a, b in zip(outs[on], outs[False]):
        for k in a:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphs_on_equal_off_cuda(rng, family, dtype):
    _on_off(model_for(family, device="cuda", dtype=dtype), rng)


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_cell_cache_matches_reference_cuda(rng, family):
    """bf16 on the GPU: packed, padded steps against the one-sequence forward, hidden rows
    within the sweep's bf16 rule and tokens equal where the margin is clear."""
    m = model_for(family, device="cuda", dtype=torch.bfloat16)
    m.reset_cache()
    seqs, steps = random_schedule(rng, m, n_seqs=4)
    got = {s: torch.zeros(len(t), m.config.hidden, device="cuda") for s, t in seqs.items()}
    toks = {s: torch.full((len(t),), -1, dtype=torch.int64, device="cuda") for s, t in seqs.items()}
    with torch.no_grad():
        for rows in steps:
            rows = [(t, p, s, 1, n) for t, p, s, _, n in rows]
            out = m.step(rows_to_inputs(m, rows, len(rows) + rng.randint(0, 3)))
            for i, (_, pos, s, _, _) in enumerate(rows):
                got[s][pos] = out["hidden"][i].float()
                toks[s][pos] = out["tokens"][i]
    tol = Tolerance.for_dtype(torch.bfloat16)
    for s, t in seqs.items():
        logits, hidden = m.reference_logits(t)
        err, bound = tol.errors(got[s], hidden)
        assert (err <= bound).all(), f"seq {s}: {(err / bound).max():.3g} of tolerance"
        clear = m.clear_positions(logits)
        assert ((toks[s] == logits.argmax(-1)) | ~clear).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_graphs_emulated_equal_off(rng, family):
    """The graph path's code (emulated on a CPU) against graphs off, on the same steps as
    the cuda test above."""
    _on_off(model_for(family, device="cpu", dtype=torch.float32), rng, on="emulate")


@pytest.mark.cuda
def test_1b_graphs_on_equal_off_cuda(rng):
    """The Llama-3.2-1B shape in bf16: a few widths, graphs on == off bit for bit."""
    m = hf.build("llama", "1b", device="cuda", max_seqs=4, max_len=128)
    _on_off(m, rng, widths=(1, 4, 16))


def test_bench_quick_runs_every_section(tmp_path):
    """``cgrt bench --model hf:llama --quick``: the CPU smoke run of the HF bench writes every
    section (children, capture and the weight-read floor skipped on a CPU, with the reason) and
    judges no goal there (a CPU's figures are not GPU figures)."""
    import json

    from cudagraph_rt import cli
    from cudagraph_rt.tools.bench import hf as bench_hf

    out = tmp_path / "b.json"
    assert cli.main(["bench", "--model", "hf:llama", "--quick", "--json", str(out)]) in (0, 1)
    r = json.loads(out.read_text())
    assert r["greedy"]["status"] == "ok" and r["spec"]["status"] == "ok" and r["compiled"]["status"] == "skipped"
    assert "floor" in r["compiled"]["reason"] and "floor" not in r["compiled"]
    assert r["spec"]["spec"]["check_ok"] and r["spec"]["greedy"]["check_ok"]
    # the timed spec run follows plans from untimed spec runs: each pass is reported, and on
    # fp32 (no near-ties) the plans hold, so the timed run re-plans nothing
    assert len(r["spec"]["plan_passes"]) == bench_hf.SPEC_PLAN_PASSES and r["spec"]["spec"]["replans"] == 0
    assert 0 < r["spec"]["draft_acceptance"] < 1 and r["spec"]["spec"]["accepted"] > 0
    for name in ("greedy", "spec"):  # where a step's host time goes (the runner's phases, summing to the wall time)
        phases = r["spec"][name]["host_phases_us_per_step"]
        assert phases and abs(sum(phases.values()) * r["spec"][name]["steps"] / 1e6 - r["spec"][name]["seconds"]) \
            < 0.05 * r["spec"][name]["seconds"], (name, phases)
    assert r["greedy"]["rows"][0]["agree_with_eager"] == r["meta"]["new"]  # fp32: the same tokens as generate
    d = r["dispatch"]  # the device loop (emulated), host-driven rounds and the host runner: the same tokens
    assert d["status"] == "ok" and [x["sequences"] for x in d["rows"]] == [1, 2]
    assert all(x["tokens_equal"] and x["checks_ok"] and x["device"]["tokens"] > 0 for x in d["rows"])
    assert r["goals"] == []
    assert cli.main(["bench", "--model", "hf:gpt2"]) == 2


def test_bench_spec_plans_each_run_by_the_one_before(monkeypatch):
    """The spec section serves greedy, then SPEC_PLAN_PASSES untimed spec runs, then the
    timed one; each run after greedy is planned by exactly the previous run's finished
    sequences, and only greedy's and the timed run's figures are reported."""
    from types import SimpleNamespace

    from cudagraph_rt.tools.bench import hf as bench_hf
    from cudagraph_rt.tools.demo import serve as serving

    calls, real = [], serving.serve

    def recording(model, requests, graphs, args, plans=None):
        r = real(model, requests, graphs, args, plans=plans)
        calls.append((args.k, plans, r["finished_seqs"], r["tokens_per_s"]))
        return r

    monkeypatch.setattr(serving, "serve", recording)
    ctx = SimpleNamespace(model=model_for("llama"), spec_sequences=2, new=6, seed=random.randrange(1 << 20),
                          graphs=False)
    out = bench_hf.sec_spec(ctx)
    assert [k for k, *_ in calls] == [0, 0] + [4] * (bench_hf.SPEC_PLAN_PASSES + 1)  # an untimed plain run first
    assert calls[0][1] is None
    for before, after in zip(calls, calls[1:]):
        assert after[1] is before[2] and len(after[1]) == 2
    assert out["greedy"]["tokens_per_s"] == calls[1][3] and out["spec"]["tokens_per_s"] == calls[-1][3]
    assert len(out["plan_passes"]) == bench_hf.SPEC_PLAN_PASSES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_registered_attention_equals_sdpa_over_the_live_cells(dtype):
    """The registered attention function (one ``pool.attend``) against torch's SDPA over
    exactly each row's live positions, gathered by hand: random pools and block sizes,
    sequences grown by ``cell_range`` in random chunks (so their blocks interleave), random
    rows of a step (several per sequence, padding rows), GQA groups, windows; the rows' own
    K/V are written by the call (fp32: reduction order only; bf16: rounded probabilities)."""
    from types import SimpleNamespace

    from cudagraph_rt.models.pool import KVPool, default_cells

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))  # noqa: E731
    for _ in range(6):
        kvh, G, d, bs, S, L = ri(1, 3), ri(1, 3), 16, 2 ** ri(1, 4), ri(1, 4), ri(4, 40)
        pool = KVPool(layers=2, kv_heads=kvh, head_dim=d, dtype=dtype, device="cpu", cells=default_cells(S, L, bs) + ri(0, 50),
                      max_seqs=S, max_seq_len=L, block_size=bs)
        pool.k.copy_(torch.randn(pool.k.shape, generator=g))
        pool.v.copy_(torch.randn(pool.v.shape, generator=g))
        lens = [ri(1, L) for _ in range(S)]
        fed = [0] * S
        while fed != lens:  # interleaved growth: a sequence's blocks are not consecutive
            s = ri(0, S - 1)
            n = min(ri(1, 9), lens[s] - fed[s])
            if not n:  # s is full: a range of no positions at its end is refused (InputError)
                continue
            pool.cell_range(s, fed[s], n)
            fed[s] += n
        rows = [(s, p) for s in range(S) for p in sorted({ri(0, lens[s] - 1) for _ in range(3)})]
        seq = torch.tensor([s for s, _ in rows] + [-1] * ri(0, 3))
        pos = torch.tensor([p for _, p in rows] + [0] * (len(seq) - len(rows)))
        cells = torch.tensor([pool.cell_for(s, p) for s, p in rows] + [pool.scratch_cell] * (len(seq) - len(rows)))
        q = torch.randn(1, kvh * G, len(seq), d, generator=g).to(dtype)
        k, v = (torch.randn(1, kvh, len(seq), d, generator=g).to(dtype) for _ in range(2))
        window, layer = (None, ri(1, 12))[ri(0, 1)], ri(0, 1)
        state = hf._CellStep(attention_op.pool_id(pool), seq, pos, cells)
        got, _ = hf.cell_attention(SimpleNamespace(layer_idx=layer), q, k, v, None, scaling=d ** -0.5,
                                   cgrt_cells=state, sliding_window=window)
        assert got.shape == (1, len(seq), kvh * G, d) and got.dtype == dtype
        kc, vc = pool.k[layer], pool.v[layer]
        for i, (s, p) in enumerate(rows):
            assert torch.equal(kc[cells[i]], k[0, :, i]) and torch.equal(vc[cells[i]], v[0, :, i])
            lo = 0 if window is None else max(0, p - window + 1)
            idx = torch.tensor([pool.cell_for(s, j) for j in range(lo, p + 1)])
            kk, vv = (c[idx].float().repeat_interleave(G, 1).transpose(0, 1) for c in (kc, vc))  # [heads, n, d]
            want = torch.nn.functional.scaled_dot_product_attention(q[0, :, i:i + 1].float(), kk, vv,
                                                                    scale=d ** -0.5)[:, 0]
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(got[0, i].float(), want, atol=tol, rtol=tol)
        assert (got[0, len(rows):] == 0).all()  # padding rows read nothing


@pytest.mark.parametrize("vocab", [512, 128256, 1000, 97])
def test_greedy_tokens_is_argmax_first_maximum_included(vocab):
    """The two-stage argmax of the step equals torch's argmax, ties resolved to the first
    maximal logit as argmax does: ties planted within a chunk, across chunks, and at a
    chunk's last and the next chunk's first logit."""
    from cudagraph_rt.models.cells import chunk_count, greedy_tokens

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    logits = torch.randn(9, vocab, generator=g)
    c = chunk_count(vocab)
    size = vocab // c
    picks = torch.randint(0, vocab, (9, 3), generator=g)
    for r in range(1, 9):  # row 0 keeps no planted tie
        a, b = sorted(picks[r, :2].tolist()) if r < 5 else (size - 1, min(size, vocab - 1))
        logits[r, a] = logits[r, b] = logits[r].max() + 1
    got, want = greedy_tokens(logits), logits.argmax(-1)
    assert torch.equal(got, want), (c, got.tolist(), want.tolist())
