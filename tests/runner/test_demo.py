"""The speculative-decoding host runner (cudagraph_rt.speculative.runner) and `cgrt demo`.

CPU tests run the runner with graphs off; the cuda ones replay graphs. Prompts are fresh
random each run from a seed printed on failure (DEMO_TEST_SEED=<n> replays one).
"""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cudagraph_rt import InputError, cli
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.speculative.device_drafter import DeviceDrafter
from cudagraph_rt.speculative.drafting import CommittedRows, DraftRule, controlled_drafts, controlled_drafts_py
from cudagraph_rt.speculative.runner import PHASES, PhaseClock, Request, SpecRunner, ToyDrafter
from cudagraph_rt.sweep.checks import Tolerance
from tests.support.seeds import seeded_rng


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture
def rng() -> random.Random:
    return seeded_rng("DEMO_TEST_SEED")


def requests_for(rng: random.Random, model: ToyDecoder, n: int, max_new: int = 16, max_prompt: int = 40):
    V = model.config.vocab
    return [Request(tuple(rng.randrange(V) for _ in range(rng.randint(1, max_prompt))),
                    rng.randint(1, max_new)) for _ in range(n)]


def serve(model, reqs, *, p=0.5, seed=0, record_rows=False, spy=None, device="cpu", **kw):
    runner = SpecRunner(model, ToyDrafter(model, p, seed), graphs=device == "cuda", record_rows=record_rows, **kw)
    if spy is not None:  # record every launched step: (T, [(uid, verify) per group])
        launch = runner._launch
        runner._launch = lambda lane, groups, cols: (spy.append((len(cols[0]), [(g.seq.uid, g.verify) for g in groups])),
                                                     launch(lane, groups, cols))[1]
    runner.submit(reqs)
    return runner, runner.run()


def assert_greedy(model, runner, reqs):
    by_uid = {s.uid: s for s in runner.finished}
    assert sorted(by_uid) == list(range(len(reqs)))
    for uid, r in enumerate(reqs):
        assert by_uid[uid].generated == model.greedy_generate(list(r.prompt), r.max_new), uid


# ----------------------------------------------------------------------------- CLI
def test_cli_demo_smoke(capsys):
    argv = ["demo", "--sequences", "5", "--max-new", "12", "--k", "3", "--slots", "4"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "graphs on: skipped" in out and "greedy mismatches none" in out
    assert cli.main(argv + ["--json", "--accept-prob", "1", "--rounds", "4"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] and [r["graphs"] for r in rep["runs"]] == [False]
    run = rep["runs"][0]
    assert run["steps"] == 4 and run["tokens"] == run["rows_consumed"] == run["check"]["rows_checked"] > 0
    assert run["accepted"] == run["proposed"] > 0  # p = 1: every draft accepted
    assert sum(run["widths"]["eager_calls"].values()) + sum(run["widths"]["dynamic_calls"].values()) >= 4
    # the time split: every phase, non-negative, summing to the wall time; no GPU busy on a CPU
    assert list(run["host_phases_s"]) == list(PHASES) and min(run["host_phases_s"].values()) >= 0
    assert sum(run["host_phases_s"].values()) == pytest.approx(run["seconds"], rel=1e-6)
    per_step = run["host_phases_us_per_step"]
    assert sum(per_step.values()) == pytest.approx(run["seconds"] * 1e6 / run["steps"], rel=1e-6)
    assert run["gpu_busy"] is None and run["device_seconds"] is None


def test_cli_demo_refuses_the_device_drafter_with_tp(capsys):
    assert cli.main(["demo", "--tp", "2", "--drafter", "gpu", "--device", "cpu"]) == 2
    assert "--drafter" in capsys.readouterr().err


def test_cli_demo_refuses_graphs_on_a_cpu(capsys):
    assert cli.main(["demo", "--graphs", "on", "--device", "cpu"]) == 2
    assert "CUDA graphs need a GPU" in capsys.readouterr().err


# ----------------------------------------------------------------------------- runner
@pytest.mark.parametrize("p", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("lanes", [1, 2])
def test_tokens_equal_greedy_decoding(rng, p, lanes):
    model = ToyDecoder(ToyConfig.tiny(), "cpu")
    reqs = requests_for(rng, model, 7)
    runner, rep = serve(model, reqs, p=p, seed=rng.randrange(1000), k=rng.randint(1, 6), lanes=lanes,
                        slots=rng.randint(lanes, 8), chunk=rng.choice([16, 48, 128]))
    assert_greedy(model, runner, reqs)
    assert rep.tokens == sum(r.max_new for r in reqs) == rep.rows
    assert sum(rep.accept_hist) > 0 or all(r.max_new == 1 for r in reqs)
    if p == 0.0:
        assert rep.accepted == 0
    if p == 1.0:
        assert rep.accepted == rep.proposed  # the drafter knows the greedy rule
    assert rep.accepted == sum(a * n for a, n in enumerate(rep.accept_hist))


def test_sequences_join_and_retire(rng):
    model = ToyDecoder(ToyConfig.tiny(), "cpu")
    reqs = requests_for(rng, model, 9, max_new=20)
    log: list = []
    runner, _ = serve(model, reqs, p=0.6, seed=rng.randrange(1000), k=3, lanes=2, slots=4, chunk=24, spy=log)
    assert_greedy(model, runner, reqs)
    assert {s.slot for s in runner.finished} <= set(range(4))  # slots are reused
    live = [{uid for uid, _ in groups} for _, groups in log]
    assert max(map(len, live)) <= 2  # 4 slots over 2 lanes
    # New prompts prefill in the same step as other sequences verify, after earlier ones retired.
    mixed = [i for i, (_, groups) in enumerate(log) if {v for _, v in groups} == {True, False}]
    assert mixed and any(min(uid for uid, v in log[i][1] if not v) >= 4 for i in mixed)
    assert len({T for T, _ in log}) > 3  # the step width varies


def test_wide_prefill_takes_the_dynamic_path_and_slices(rng):
    model = ToyDecoder(ToyConfig.tiny(), "cpu")
    reqs = [Request(tuple(rng.randrange(128) for _ in range(n)), m) for n, m in [(100, 8), (90, 12), (70, 5), (3, 9)]]
    log: list = []
    runner, _ = serve(model, reqs, k=4, lanes=1, slots=4, chunk=200, spy=log)
    assert_greedy(model, runner, reqs)
    plans = [runner.rt.plan(T) for T, _ in log]
    assert any(len(p) > 1 for p in plans)  # sliced
    assert any(s.path == "dynamic" for p in plans for s in p)
    st = runner.rt.stats()
    assert st.slices > st.steps and st.dynamic_calls


def test_host_rows_equal_reference_hidden_rows(rng):
    model = ToyDecoder(ToyConfig.tiny(), "cpu")
    reqs = requests_for(rng, model, 6, max_new=24)
    runner, rep = serve(model, reqs, p=0.5, seed=rng.randrange(1000), k=4, record_rows=True, chunk=32)
    assert rep.rows == sum(r.max_new for r in reqs)
    for seq in runner.finished:
        _, hidden = model.reference(seq.tokens)
        p0 = len(seq.prompt) - 1  # last prompt row, then every fed generated token
        got = torch.cat(seq.rows)
        assert got.shape == (seq.max_new, model.hidden_width)
        torch.testing.assert_close(got, hidden[p0:p0 + seq.max_new], atol=1e-4, rtol=1e-4)


def test_a_capped_run_continues(rng):
    model = ToyDecoder(ToyConfig.tiny(), "cpu")
    reqs = requests_for(rng, model, 5)
    runner = SpecRunner(model, ToyDrafter(model, 0.5, 1), k=3)
    runner.submit(reqs)
    assert runner.run(max_steps=3).steps == 3
    assert runner.run().steps > 3
    assert_greedy(model, runner, reqs)


@pytest.mark.parametrize("kind", ["host", "device"])
def test_drafter_consumes_the_host_rows(kind):
    model = ToyDecoder(ToyConfig.tiny(), "cpu")
    make = (lambda: ToyDrafter(model, 1.0)) if kind == "host" else (lambda: DeviceDrafter(model, 1.0, k=2))
    runner = SpecRunner(model, make(), k=2, record_rows=True)
    runner.submit([Request((5, 9, 11), 6)])
    runner.run()
    seq = runner.finished[0]
    d = make()
    with pytest.raises(RuntimeError, match="before its committed rows"):
        d.propose([seq], 2)
    rows = torch.cat(seq.rows)  # one row per committed token, positions 2 .. 7
    d.observe(CommittedRows.of(seq, len(seq.tokens) - 1 - rows.shape[0], rows))
    drafts = d.propose([seq], 2)
    assert drafts.shape == (1, 2) and drafts[0, 0] == model.design_next(seq.tokens[-2], seq.tokens[-1])
    with pytest.raises(RuntimeError, match="host rows for"):
        d.observe(CommittedRows.of(seq, 2, rows[:-1]))
    flipped = CommittedRows.of(seq, 2, rows.flip(0))
    if kind == "host":
        with pytest.raises(RuntimeError, match="do not encode"):
            d.observe(flipped)
    else:  # checked on the device, reported where its drafts are read
        d.observe(flipped)
        with pytest.raises(RuntimeError, match="do not encode"):
            d.propose([seq], 2)


def test_controlled_drafts_agree_in_numpy_and_torch_and_follow_the_rule(rng):
    model = ToyDecoder(ToyConfig.tiny(vocab=120), "cpu")
    G, k, p = rng.randint(1, 30), rng.randint(1, 6), rng.random()
    rule_np = DraftRule.for_toy(model, p, rng.randrange(2**40))
    rule_t = DraftRule(torch.from_numpy(rule_np.pi_a), torch.from_numpy(rule_np.pi_b), rule_np.b, rule_np.vocab,
                       rule_np.threshold, rule_np.seed_key)  # the same rule, torch tables
    cols = [np.array([rng.randrange(lo, hi) for _ in range(G)], np.int64) for lo, hi in ((0, 2**62), (2, 500), (0, 120),
                                                                                         (0, 120))]
    a = controlled_drafts(np, rule_np, *cols, k)
    b = controlled_drafts(torch, rule_t, *(torch.from_numpy(c) for c in cols), k).numpy()
    np.testing.assert_array_equal(a, b)
    seqs = [SimpleNamespace(uid=int(u), tokens=[0] * (int(q) - 2) + [int(x), int(y)]) for u, q, x, y in zip(*cols)]
    np.testing.assert_array_equal(a, np.array(controlled_drafts_py(rule_np, seqs, k)).reshape(G, k))
    uid, pos, prev, cur = cols
    assert ((a >= 0) & (a < 120)).all()
    for p_, right in ((1.0, True), (0.0, False)):  # every draft right, or every draft wrong
        d = controlled_drafts(np, DraftRule.for_toy(model, p_, 3), *cols, k)
        for g in range(G):
            pv, cv = int(prev[g]), int(cur[g])
            for j in range(k):  # draft j against the rule's token after the drafts before it
                assert (int(d[g, j]) == model.design_next(pv, cv)) == right
                pv, cv = cv, int(d[g, j])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_device_drafter_drafts_what_the_host_drafter_does(rng, device):
    """Same seed, same coins: the device drafter (its own GraphRuntime; graphs and its own
    stream on CUDA) accepts exactly what the host drafter does, and tokens stay greedy."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = ToyDecoder(ToyConfig.tiny(dtype=dtype), device)
    reqs = requests_for(rng, model, 9, max_new=20)
    seed, k, p = rng.randrange(1000), rng.randint(1, 5), rng.choice([0.3, 0.7])
    reports = {}
    for kind in ("host", "device"):
        model.reset_cache()
        drafter = ToyDrafter(model, p, seed) if kind == "host" else DeviceDrafter(
            model, p, seed, k=k, graphs=device == "cuda")
        runner = SpecRunner(model, drafter, k=k, lanes=2, slots=6, chunk=32, graphs=device == "cuda")
        runner.submit(reqs)
        reports[kind] = runner.run()
        assert_greedy(model, runner, reqs)
        if kind == "device" and device == "cuda":
            assert sum(drafter.rt.stats().graph_replays.values()) > 0
    assert reports["host"].accept_hist == reports["device"].accept_hist
    assert 0 < reports["device"].accepted < reports["device"].proposed


def test_half_precision_tolerance_holds_for_float32_copies():
    """The demo compares fp32 copies of bf16 rows: the bound is bf16's (8 eps = 6.25%), not
    fp32's (a 16-layer bf16 model's 2% was flagged as a 20,000-fold miss)."""
    ref = torch.randn(4, 256)
    got = ref * 1.02
    err, bound = Tolerance.for_dtype(torch.bfloat16).errors(got, ref)
    assert (err <= bound).all()
    err, bound = Tolerance.for_dtype(torch.bfloat16).errors(ref * 1.1, ref)
    assert (err > bound).all()  # 10 % is still caught
    err, bound = Tolerance.for_dtype(torch.float32).errors(got, ref)
    assert (err > bound).all()


class _FakeClock:
    """Seconds that move only when the test's own work advances them."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_phases_charge_each_call_to_its_phase_on_a_fake_clock(rng):
    """drafter.propose costs 1 s, rt.step 1000 s, drafter.observe 10**6 s, nothing else
    anything: the report's phases must be exactly those sums, the rest 0, their sum the
    run's seconds, and the tokens still greedy decoding."""
    model = ToyDecoder(ToyConfig.tiny(), "cpu")
    reqs = requests_for(rng, model, 5, max_new=10)
    runner = SpecRunner(model, ToyDrafter(model, 0.5, rng.randrange(1000)), k=3, lanes=2, slots=4, chunk=32)
    clock, calls = _FakeClock(), {"propose": 0, "step": 0, "observe": 0}
    runner.phase_clock = PhaseClock(clock=clock)

    def costly(obj, name, key, cost):
        real = getattr(obj, name)

        def call(*a, **kw):
            out = real(*a, **kw)  # the real work runs on no clock; only the cost is charged
            calls[key] += 1
            clock.t += cost
            return out
        setattr(obj, name, call)

    costly(runner.drafter, "propose", "propose", 1.0)
    costly(runner.rt, "step", "step", 1000.0)
    costly(runner.drafter, "observe", "observe", 1e6)
    runner.submit(reqs)
    rep = runner.run()
    assert_greedy(model, runner, reqs)
    want = dict.fromkeys(PHASES, 0.0)
    want.update(draft=calls["propose"] * 1.0, step=calls["step"] * 1000.0, observe=calls["observe"] * 1e6)
    assert rep.phases == pytest.approx(want) and rep.run_steps == rep.steps == calls["step"] > 0
    assert rep.seconds == pytest.approx(sum(want.values()))
    assert rep.phase_us_per_step()["step"] == pytest.approx(1000.0 * 1e6)
    assert rep.gpu_busy is None and rep.device_seconds is None  # a CPU: not available
    again = runner.run()  # nothing left: a new run starts its phases at zero
    assert again.run_steps == 0 and sum(again.phases.values()) == 0 and again.phase_us_per_step() == {}


def test_bad_configurations_raise():
    model = ToyDecoder(ToyConfig.tiny(), "cpu")
    d = ToyDrafter(model, 0.5)
    with pytest.raises(InputError, match="k"):
        SpecRunner(model, d, k=40, lanes=1)  # 8 * 41 verify rows cannot share the first slice
    with pytest.raises(InputError, match="lanes"):
        SpecRunner(model, d, lanes=9)
    with pytest.raises(InputError, match="accept_prob"):
        ToyDrafter(model, 1.5)
    runner = SpecRunner(model, d)
    with pytest.raises(InputError, match="request"):
        runner.submit([Request(tuple(range(100)), 30)])  # 129 positions > max_len 128
    with pytest.raises(InputError, match="prompt"):
        runner.submit([Request((128,), 3)])
    assert not runner.waiting


# ----------------------------------------------------------------------------- GPU
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphs_on_equal_greedy_and_off(rng, dtype):
    model = ToyDecoder(ToyConfig.tiny(dtype=dtype), "cuda")
    reqs = requests_for(rng, model, 10, max_new=24)
    reports = []
    for graphs in (True, False):
        model.reset_cache()
        runner = SpecRunner(model, ToyDrafter(model, 0.6, 3), k=4, graphs=graphs, record_rows=True, chunk=128)
        runner.submit(reqs)
        reports.append(runner.run())
        assert_greedy(model, runner, reqs)
        if graphs:
            assert sum(runner.rt.stats().graph_replays.values()) > 0
        for seq in runner.finished:
            p0 = len(seq.prompt) - 1
            want = model.reference(seq.tokens)[1][p0:p0 + seq.max_new].float().cpu()
            torch.testing.assert_close(torch.cat(seq.rows).float(), want, atol=0.1 if dtype != torch.float32
                                       else 1e-3, rtol=0.05 if dtype != torch.float32 else 1e-3)
    assert reports[0].accept_hist == reports[1].accept_hist  # the drafter is deterministic


@pytest.mark.cuda
def test_cli_demo_on_cuda_both(capsys):
    assert cli.main(["demo", "--device", "cuda", "--graphs", "both", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["graphs"] for r in rep["runs"]] == [True, False] and rep["ok"]
    for r in rep["runs"]:  # device time of the steps from CUDA events, within the wall time
        assert 0 < r["device_seconds"] <= r["seconds"] * 1.01 and r["gpu_busy"] == pytest.approx(
            r["device_seconds"] / r["seconds"])
        assert sum(r["host_phases_s"].values()) == pytest.approx(r["seconds"], rel=1e-6)


@pytest.mark.cuda
def test_cli_demo_device_dispatch_on_cuda_both(capsys):
    """``--dispatch device`` on the GPU: the outer graph of conditional nodes serves the
    requests (graphs on) and the loop's tokens and host rows pass the demo's check."""
    assert cli.main(["demo", "--device", "cuda", "--dispatch", "device", "--graphs", "both", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["graphs"] for r in rep["runs"]] == [True, "emulate"] and rep["ok"]  # graphs off: the loop emulated
    assert all(r["check"]["ok"] and r["check"]["rows_checked"] > 0 for r in rep["runs"])
