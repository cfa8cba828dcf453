"""The width-sweep harness: clean runs pass with the seed printed, runtimes broken on
purpose fail with a message that names the problem, the pytest helper runs a second model
defined here, and the `cgrt sweep` command works end to end.

Seeds are fresh every run (printed by the harness; pass one to `cgrt sweep --seed` or set
CGRT_SWEEP_SEED to replay a run). CPU tests pin the toy to the CPU (graphs off) so they
behave the same on a GPU machine.
"""
from __future__ import annotations

import importlib.util
import json
import random
import re
from collections import Counter

import pytest
import torch

from cudagraph_rt import GraphRuntime, InputError, InputSpec
from cudagraph_rt.inputs import StaticInputs
from cudagraph_rt.cli import main
from cudagraph_rt.sweep import (
    Capacity,
    SweepAdapter,
    SweepOptions,
    ToyAdapter,
    assert_sweep,
    make_plan,
    run_sweep,
)
from cudagraph_rt.sweep.checks import rule_slices
from cudagraph_rt.widths import default_widths, plan_step
from tests.support.planting import plan_one_width_wider

QUICK = dict(repeats=1)  # every width once: ~70 steps


@pytest.fixture(autouse=True)
def _single_thread(one_thread):  # see conftest.py
    yield


@pytest.fixture(scope="module")
def toy() -> ToyAdapter:
    return ToyAdapter(device="cpu")


def kinds(report) -> set[str]:
    return {k for m in report.modes for k, _ in m.kinds}


def messages(report) -> str:
    return "\n".join(str(f) for f in report.failures)


# --------------------------------------------------------------------------- bugs, on purpose
class LivePadAdapter(ToyAdapter):
    """(a) The pad of ``cells`` is a live cell (sequence 0, position 0), not the scratch cell."""

    def input_specs(self):
        specs = super().input_specs()
        specs["cells"] = InputSpec(pad=self.model.cell_for(0, 0))
        return specs


class OutputsOnly(ToyAdapter):
    """The toy without its model-state check: only the output comparison can catch a bug."""

    def check_state(self):
        return []


class LivePadOutputsOnly(LivePadAdapter, OutputsOnly):
    """(a) with nothing but the outputs to show it."""


def test_the_state_check_sees_padding_rows_overwrite_a_cell_no_row_of_the_step_writes():
    """check_state's first case, alone: the pad cell is sequence 0's position 0, a live cell
    that no row of the next step writes (it steps positions 4..6 of sequence 0, width 4:
    one padding row). That padding row overwrites the cell's K/V; the check must see it
    (the cell's K/V compared with a copy taken before the step). With the scratch cell as
    the pad (the toy as it is), the same steps are clean. Emulated graphs: padding rows run."""
    from cudagraph_rt.sweep.plans import Chunk, StepPlan
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    vocab = ToyAdapter(device="cpu").config.vocab
    toks = [int(t) for t in torch.randint(1, vocab, (7,), generator=gen)]  # not the pad token 0
    steps = [StepPlan(0, 4, (Chunk(0, 0, 0, tuple(toks[:4]), (False,) * 4),)),
             StepPlan(1, 3, (Chunk(0, 0, 4, tuple(toks[4:]), (False, False, True)),))]
    for adapter, live in [(LivePadAdapter(device="cpu"), True), (ToyAdapter(device="cpu"), False)]:
        rt = adapter.build("emulate")
        got = []
        for st in steps:
            res = rt.step(**adapter.step_inputs(st))
            assert res.slices[-1].width == 4
            got.append(adapter.check_state())
        assert got[0] == []  # step 0: 4 rows at width 4, no padding row
        if live:
            pad = adapter.model.cell_for(0, 0)
            assert len(got[1]) == 1 and f"padding rows wrote live cell(s) {pad} (seq 0, pos 0)" in got[1][0]
            assert "no row of the step writes it, yet its K/V changed" in got[1][0], got[1]
        else:
            assert got[1] == []
        rt.close()


def skip_pad_fill(monkeypatch):
    """(b) StaticInputs.write copies the real rows but leaves rows [length, width) as the
    previous steps left them."""
    write = StaticInputs.write
    monkeypatch.setattr(StaticInputs, "write", lambda self, prep, start, length, width, control=None:
                        write(self, prep, start, length, length, control))


def test_live_pad_cell_is_caught():
    report = run_sweep(LivePadAdapter(device="cpu"), **QUICK)
    assert not report.ok
    assert "model state" in kinds(report)
    text = messages(report)
    # Cell 0 is the pad; which sequence reads it when the check fires depends on which took
    # block 0 after the plan's resets and reuses: the message names it as (seq, pos).
    assert re.search(r"padding rows wrote live cell\(s\) 0 \(seq \d+, pos \d+", text) and "scratch cell" in text
    # The stolen cell also shows in the outputs, without the model-specific check.
    alone = run_sweep(LivePadOutputsOnly(device="cpu"), **QUICK)
    assert not alone.ok and kinds(alone) & {"hidden", "tokens"} and "model state" not in kinds(alone)
    assert "differ from the reference beyond tolerance" in messages(alone) or "eager greedy" in messages(alone)


def test_skipped_pad_fill_is_caught(monkeypatch, toy):
    skip_pad_fill(monkeypatch)
    report = run_sweep(toy, **QUICK)
    assert not report.ok and "pad rows" in kinds(report)
    text = messages(report)
    assert "are not the pad values" in text and "Padding rows were not filled" in text
    # Without the direct check: stale rows of retired sequences rewrite the cells their
    # id's new sequence uses, and the outputs of that sequence go wrong.
    alone = run_sweep(toy, check_pad_rows=False, repeats=3)  # ~1 in 50 sweeps of one repeat miss it
    assert not alone.ok and kinds(alone) <= {"hidden", "tokens"}, alone.summary()
    assert alone.reused_ids > 0


def test_wider_width_is_caught_by_the_slice_check(monkeypatch, toy):
    plan_one_width_wider(monkeypatch)
    report = run_sweep(toy, **QUICK)
    assert not report.ok
    assert kinds(report) == {"slices", "counters"}  # outputs stay right: only the plan shows it
    first = report.failures[0]
    # the first bad step may be a sliced one: "expected [dynamic 96 + graph 1]"
    assert "narrowest captured width" in first.messages[0]
    assert re.search(r"expected \[(dynamic \d+ \+ )?graph \d+[] ]", first.messages[0]), first.messages[0]
    assert "padding_rows" in first.messages[1]
    assert first.repro.startswith(f"cgrt sweep --seed {report.seed} --only-step {first.step} --graphs off")
    # Every step the bug touches fails, no other: the steps whose T has a wider width.
    rt = toy.build(False)
    ran = [w.T for w in report.modes[0].widths]
    touched = {T for T in ran if plan_step(T, rt.widths, rt.dynamic_limit)[-1].path == "graph"
               and plan_step(T, rt.widths, rt.dynamic_limit)[-1].width != rt.widths[-1]}
    assert {w.T for w in report.modes[0].widths if w.mismatches} == touched


def test_only_step_replays_the_history_and_checks_one_step(monkeypatch, toy):
    plan_one_width_wider(monkeypatch)
    full = run_sweep(toy, **QUICK)
    bad = full.failures[-1]
    again = run_sweep(toy, seed=full.seed, only_step=bad.step, **QUICK)
    m = again.modes[0]
    assert (m.steps_run, m.steps_checked, m.failed) == (bad.step + 1, 1, 1)
    assert again.failures[0].messages == bad.messages
    assert "unchecked history steps" in again.summary() or bad.step == 0


class Perturbed(ToyAdapter):
    """Row 0 of every step returns a hidden state off by ``rel`` of its norm (in a fixed
    direction): a small error the sweep's tolerance must see (a stale or stolen KV cell is
    several %, fp32 rounding between the batched and the eager run about 1e-6)."""

    def __init__(self, rel: float):
        super().__init__(device="cpu")
        self.rel = rel

    def build(self, graphs):
        self.model.reset_cache()
        step, rel = self.model.step, self.rel

        def perturbed(x):
            out = step(x)
            h = out["hidden"].clone()
            d = torch.ones_like(h[0]) / h.shape[1] ** 0.5
            h[0] += rel * h[0].norm() * d
            return {**out, "hidden": h}

        return GraphRuntime(perturbed, self.input_specs(), widths=self.widths, graphs=graphs, device=self.device)


def test_sweep_tolerance_sees_a_1e3_relative_error():
    """Pins the hidden-row tolerance from both sides: 1e-3 relative in one row fails every
    step (a tolerance widened a thousandfold would pass it), 1e-6 passes (rounding noise)."""
    bad = run_sweep(Perturbed(1e-3), **QUICK)
    print(f"sweep seed {bad.seed}")
    assert not bad.ok and kinds(bad) == {"hidden"}, bad.summary()
    assert bad.modes[0].failed == bad.modes[0].steps_checked
    assert "hidden: 1 of" in messages(bad) and "row 0 " in messages(bad)
    fine = run_sweep(Perturbed(1e-6), **QUICK)
    print(f"sweep seed {fine.seed}")
    assert fine.ok, fine.summary()


class NonFinite(ToyAdapter):
    """Row 0 of every step returns one NaN or one inf entry in its hidden state (the rest of
    the row and every token right): a runtime that returns such rows is wrong, however
    close the other entries are."""

    def __init__(self, value: float):
        super().__init__(device="cpu")
        self.value = value

    def build(self, graphs):
        self.model.reset_cache()
        step, value = self.model.step, self.value

        def broken(x):
            out = step(x)
            h = out["hidden"].clone()
            h[0, 1] = value
            return {**out, "hidden": h}

        return GraphRuntime(broken, self.input_specs(), widths=self.widths, graphs=graphs, device=self.device)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_hidden_rows_fail_the_sweep(value):
    bad = run_sweep(NonFinite(value), **QUICK)
    assert not bad.ok and kinds(bad) == {"hidden"}, bad.summary()
    assert bad.modes[0].failed == bad.modes[0].steps_checked  # every step: its row 0
    assert "hidden: 1 of" in messages(bad) and "row 0 " in messages(bad)


def test_the_tolerance_counts_a_non_finite_row_as_infinitely_wrong():
    from cudagraph_rt.sweep.checks import Tolerance
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    ref = torch.randn(5, 8, generator=gen)
    got = ref.clone()
    got[1, 3], got[2, 0], got[3, 7] = float("nan"), float("inf"), -float("inf")
    err, bound = Tolerance.for_dtype(torch.float32).errors(got, ref)
    assert (err > bound).tolist() == [False, True, True, True, False]
    assert torch.isinf(err[1:4]).all() and torch.isfinite(bound).all()


class WrongToken(ToyAdapter):
    """Row 0 of every step returns a wrong token (its hidden rows right): the toy's reference
    has no near-ties (no ``clear`` hook), so every such row is a failure."""

    def build(self, graphs):
        self.model.reset_cache()
        step = self.model.step

        def broken(x):
            out = step(x)
            t = out["tokens"].clone()
            t[0] = t[0] + 1  # -1 (no token asked for) becomes 0: wrong too
            return {**out, "tokens": t}

        return GraphRuntime(broken, self.input_specs(), widths=self.widths, graphs=graphs, device=self.device)


def test_a_wrong_token_fails_the_sweep_when_no_margin_is_unclear():
    bad = run_sweep(WrongToken(device="cpu"), **QUICK)
    assert not bad.ok and kinds(bad) == {"tokens"}, bad.summary()
    assert bad.modes[0].failed == bad.modes[0].steps_checked and bad.modes[0].near_ties == 0
    assert "tokens: 1 of" in messages(bad) and "row 0 " in messages(bad)


class NearTiesAt(ToyAdapter):
    """The toy with a ``clear`` hook, as the transformers adapter has: the reference's
    margin at position p is a near-tie where ``unclear(p)``. Its runtime returns a wrong
    token (one more; -1 becomes 0, a token where none is due) on the rows ``corrupt(x)``
    picks, and counts those of real rows in ``planted`` (graphs off: one call a slice)."""

    def __init__(self, unclear, corrupt):
        super().__init__(device="cpu")
        self.unclear, self.corrupt, self.planted = unclear, corrupt, 0

    def clear(self, tokens):
        return torch.tensor([not self.unclear(p) for p in range(len(tokens))])

    def build(self, graphs):
        self.model.reset_cache()
        step = self.model.step

        def broken(x):
            out = step(x)
            bad = self.corrupt(x) & (x["seq_ids"] >= 0)  # padding rows (seq -1) are cut anyway
            self.planted += int(bad.sum())
            return {**out, "tokens": torch.where(bad, out["tokens"] + 1, out["tokens"])}

        return GraphRuntime(broken, self.input_specs(), widths=self.widths, graphs=graphs, device=self.device)


def reported_rows(report) -> int:
    """Rows the token check reported, over every failed step."""
    return sum(int(re.match(r"tokens: (\d+) of", m).group(1))
               for f in report.failures for m in f.messages if m.startswith("tokens:"))


def test_rows_that_want_no_token_are_checked_at_near_ties_and_never_counted_as_ties():
    """A row that wants no token (a prefill row: its next token is the prompt's) must
    return -1 whatever the margin there: an adapter's near-ties excuse a differing token
    only where one was asked for. Every margin unclear here, and every row that wants no
    token returns a token: each such row is a failure, none a near-tie."""
    clean = run_sweep(NearTiesAt(unclear=lambda p: True, corrupt=lambda x: x["want"] < 0), **QUICK)
    assert clean.ok and clean.modes[0].near_ties == 0, clean.summary()  # right tokens: nothing to excuse
    adapter = NearTiesAt(unclear=lambda p: True, corrupt=lambda x: x["want"] == 0)
    bad = run_sweep(adapter, max_details=10**6, **QUICK)
    assert not bad.ok and kinds(bad) == {"tokens"}, bad.summary()
    assert bad.modes[0].near_ties == 0, "rows that want no token were counted as near-ties"
    assert adapter.planted > 0 and reported_rows(bad) == adapter.planted, (reported_rows(bad), adapter.planted)


def test_a_row_that_wants_no_token_hides_no_mismatch_of_one_that_does():
    """Near-ties are per row: the unclear margin of another row of the chunk (a prefill row
    that wants no token, or a row at a near-tie) excuses nothing at a row whose margin is
    clear. Even positions unclear, odd ones clear; every wanted token at an odd position
    is wrong: each is reported, none counted as a near-tie."""
    adapter = NearTiesAt(unclear=lambda p: p % 2 == 0,
                         corrupt=lambda x: (x["want"] == 1) & (x["positions"] % 2 == 1))
    bad = run_sweep(adapter, max_details=10**6, **QUICK)
    assert not bad.ok and kinds(bad) == {"tokens"}, bad.summary()
    assert bad.modes[0].near_ties == 0, "a wrong token at a clear margin was counted as a near-tie"
    assert adapter.planted > 0 and reported_rows(bad) == adapter.planted, (reported_rows(bad), adapter.planted)


@pytest.mark.parametrize("T", [3, 7, 12, 1])
def test_the_pad_check_sees_one_stale_padding_row(toy, T):
    """check_pad_rows reads every padding row the last graph slice read, one padding row too
    (T=3 and 7 pad one row at widths 4 and 8); a step without padding has nothing to check."""
    from cudagraph_rt.sweep.checks import check_pad_rows
    rt = toy.build("emulate")
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    x = {k: torch.full((T,), int(v.pad), dtype=v.dtype) for k, v in rt.input_specs.items()}
    x["tokens"] = torch.randint(0, toy.config.vocab, (T,), generator=gen)
    last = rt.step(**x).slices[-1]
    assert check_pad_rows(rt, last) is None
    if last.padding == 0:
        return
    views = rt.static_inputs(last.width)
    name = list(rt.input_specs)[int(torch.randint(0, len(rt.input_specs), (1,), generator=gen))]
    views[name][last.width - 1] = int(rt.input_specs[name].pad) + 1  # the last padding row, stale
    msg = check_pad_rows(rt, last)
    assert msg is not None and msg.startswith(f"pad rows: static input rows [{T}, {last.width})") and repr(name) in msg
    rt.close()


def test_the_harness_plan_rule_is_plan_steps_rule():
    """The sweep states the plan rule itself (checks.rule_slices) so that a bug in
    plan_step cannot set its own expectations; on correct code the two agree everywhere."""
    sets = [default_widths(64), default_widths(48), (1, 2, 4, 8, 16), (3, 5, 8), (1,), (2, 7, 16), (16,)]
    for ws in sets:
        for limit in sorted({ws[-1], ws[-1] + 1, ws[-1] * 3 // 2, ws[-1] * 2, ws[-1] * 4}):
            for T in range(1, 4 * limit + 2):
                assert rule_slices(T, ws, limit) == plan_step(T, ws, limit), (T, ws, limit)


# --------------------------------------------------------------------------- clean runs
def test_clean_sweep_passes_with_the_seed_printed(capsys, toy):
    report = assert_sweep(toy, **QUICK)
    out = capsys.readouterr().out
    assert report.ok and f"seed {report.seed}" in out and "graphs off" in out
    assert [m.graphs for m in report.modes] == [False]
    assert "graphs on: skipped" in " ".join(report.notes)
    # Every width 1..max+1 and the extras ran `repeats` times, each on the plan_step slices.
    rt = toy.build(False)
    Ts = sorted(set(range(1, rt.widths[-1] + 2)) | set(report.options.extras))
    m = report.modes[0]
    assert [w.T for w in m.widths] == Ts and all(w.steps == 1 for w in m.widths)
    for w in m.widths:
        plan = plan_step(w.T, rt.widths, rt.dynamic_limit)
        assert (w.slices, w.padding_rows) == (len(plan), sum(s.padding for s in plan))
    assert report.reused_ids > 0 and 0 <= m.worst_hidden < 1
    assert "PASSED" in report.summary() and f"CGRT_SWEEP_SEED={report.seed}" in report.rerun


def test_emulated_sweep_runs_the_graph_path_on_a_cpu(toy):
    """graphs="emulate": every graph slice replays (emulated), the counters say so, and the
    reproduction command names the mode (issue 22)."""
    report = run_sweep(toy, graphs="emulate", **QUICK)
    assert report.ok, report.summary()
    assert [m.graphs for m in report.modes] == ["emulate"] and report.notes == ()
    assert "graphs emulated" in report.summary() and "--graphs emulate" in report.rerun
    assert sum(w.steps for w in report.modes[0].widths) == report.modes[0].steps_checked


def test_cli_sweeps_emulated_graphs(capsys):
    assert main(["sweep", "--repeats", "1", "--device", "cpu", "--graphs", "emulate", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and [m["graphs"] for m in out["modes"]] == ["emulate"]


def _cut_at_the_width(monkeypatch):
    """A short-path bug (DirectStep, which only fed graphs take): its outputs cut at the
    graph's width instead of T, so padding rows come back as real rows."""
    from cudagraph_rt import direct_step
    init = direct_step._PerT.__init__

    def cut_wide(self, slices, executor, layout, T):
        init(self, slices, executor, layout, executor.width)
    monkeypatch.setattr(direct_step._PerT, "__init__", cut_wide)


def test_a_short_path_bug_is_caught_under_emulation_and_hidden_with_graphs_off(monkeypatch, toy):
    _cut_at_the_width(monkeypatch)
    assert run_sweep(toy, graphs="off", **QUICK).ok  # graphs off never takes the short path
    bad = run_sweep(toy, graphs="emulate", **QUICK)
    assert not bad.ok and "rows" in kinds(bad), bad.summary()
    assert bad.failures[0].repro.startswith(f"cgrt sweep --seed {bad.seed} --only-step {bad.failures[0].step} "
                                            f"--graphs emulate")


def test_plan_feeds_each_sequence_in_order_and_reuses_ids():
    seed, cap = random.SystemRandom().randrange(2**31), Capacity(max_seqs=5, max_len=40, vocab=50)
    print(f"plan seed {seed}")
    opts = SweepOptions(repeats=2, extras=(60, 70))
    plan = make_plan(seed, 16, opts, cap, lambda prompt, n: [len(prompt) % 50] * n)
    assert Counter(s.T for s in plan.steps) == Counter({T: 2 for T in [*range(1, 18), 60, 70]})
    fed, owner, released = {}, {}, set()
    for step in plan.steps:
        released |= set(step.released)
        seen = set()
        for c in step.chunks:
            assert c.seq not in seen and c.length >= 1
            seen.add(c.seq)
            seq = plan.sequences[c.uid]
            if owner.get(c.seq) != c.uid:  # a new sequence on this id: from position 0,
                # and only after the id was released (unless it is the id's first sequence)
                assert c.start == 0 and (owner.get(c.seq) is None or c.seq in released)
                owner[c.seq] = c.uid
                released.discard(c.seq)
            assert c.start == fed.get(c.uid, 0) and c.start + c.length <= len(seq.tokens) <= cap.max_len
            assert c.tokens == seq.tokens[c.start:c.start + c.length]
            fed[c.uid] = c.start + c.length
        assert sum(c.length for c in step.chunks) == step.T == len(step.tokens) == len(step.positions)
    assert sum(len(s.released) for s in plan.steps) > cap.max_seqs
    assert any(not all(c.want) and any(c.want) for s in plan.steps for c in s.chunks)
    again = make_plan(seed, 16, SweepOptions(repeats=2, extras=(60, 70), only_step=9), cap,
                      lambda prompt, n: [len(prompt) % 50] * n)
    assert again.steps == plan.steps[:10] and again.order == plan.order


def test_bad_arguments_name_what_was_expected(toy):
    cases = [
        (dict(adapter=object()), "adapter: expected an object with name"),
        (dict(repeats=0), "repeats: expected a positive int, got 0"),
        (dict(extras=[5, "x"]), "extras: expected positive ints"),
        (dict(seed=-1), "seed: expected an int >= 0"),
        (dict(graphs="sometimes"), r"graphs: expected auto \| on \| off \| both \| emulate, got 'sometimes'"),
        (dict(graphs="on"), "CUDA graphs need a GPU"),
        (dict(extras=(10**6,)), "step widths: expected at most"),
        (dict(only_step=10**6), "only_step: expected a step index"),
    ]
    for kw, msg in cases:
        adapter = kw.pop("adapter", toy)
        with pytest.raises(InputError, match=msg.replace("(", r"\(")):
            run_sweep(adapter, **kw)

    class WrongContinuation(ToyAdapter):
        def continuation(self, prompt, n):
            return [(t + 1) % self.config.vocab for t in super().continuation(prompt, n)]

    with pytest.raises(InputError, match="adapter.continuation.*expected the reference's greedy tokens"):
        run_sweep(WrongContinuation(device="cpu"), **QUICK)


# --------------------------------------------------------------------------- a second model
class DecayModel:
    """A tiny stateful model, not the toy: h_p = sum over the cells of its sequence at
    positions q <= p of a^(p-q) E[t_q] (attention with fixed decaying weights). Each row
    stores E[t] in its cell with the cell's owner and position, so a row sees what earlier
    steps (and earlier slices of a sliced step) wrote. Cells are laid out position-major
    (``pos * max_seqs + seq``) unlike the toy. Greedy next token = perm[t_p]: E is a scaled
    identity plus noise and a < 1/2, so t_p always dominates h_p."""

    def __init__(self, max_seqs=4, max_len=32, vocab=32, a=0.3, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.max_seqs, self.max_len, self.vocab, self.a = max_seqs, max_len, vocab, a
        self.E = 4 * torch.eye(vocab) + 0.1 * torch.randn(vocab, vocab, generator=g)
        self.P = torch.eye(vocab)[torch.randperm(vocab, generator=g)]  # logits = h @ P
        self.scratch = max_seqs * max_len
        self.emb = torch.zeros(self.scratch + 1, vocab)
        self.owner = torch.full((self.scratch + 1,), -2)
        self.cpos = torch.zeros(self.scratch + 1, dtype=torch.int64)

    def cell(self, seq: int, pos: int) -> int:
        return pos * self.max_seqs + seq

    def specs(self):
        return dict(tokens=InputSpec(pad=0), positions=InputSpec(pad=0), seq_ids=InputSpec(pad=-1),
                    cells=InputSpec(pad=self.scratch), want=InputSpec(pad=0))

    def reset(self):
        self.emb.zero_()
        self.owner.fill_(-2)

    def step(self, x):
        pos, seq, cells = x["positions"], x["seq_ids"], x["cells"]
        self.owner.index_copy_(0, cells, seq)
        self.cpos.index_copy_(0, cells, pos)
        self.emb.index_copy_(0, cells, self.E[x["tokens"]])
        seen = (self.owner[None, :] == seq[:, None]) & (self.cpos[None, :] <= pos[:, None])
        h = torch.where(seen, self.a ** (pos[:, None] - self.cpos[None, :]).clamp_min(0).float(), 0.0) @ self.emb
        tok = (h @ self.P).argmax(-1).masked_fill(x["want"] != 1, -1)
        return {"tokens": tok, "hidden": h}

    def reference(self, tokens):
        p = torch.arange(len(tokens))
        decay = torch.where(p[None, :] <= p[:, None], self.a ** (p[:, None] - p[None, :]).clamp_min(0).float(), 0.0)
        h = decay @ self.E[torch.tensor(list(tokens))]
        return (h @ self.P).argmax(-1), h


class DecayAdapter:
    """The adapter a user writes for their own model: three attributes and three methods
    (no base class needed; BaseAdapter's defaults fill in the optional hooks)."""

    name = "decay model"
    device = torch.device("cpu")

    def __init__(self):
        self.model = DecayModel()
        self.capacity = Capacity(self.model.max_seqs, self.model.max_len, self.model.vocab)

    def build(self, graphs):
        self.model.reset()
        return GraphRuntime(self.model.step, self.model.specs(), widths=(1, 2, 4, 8, 16), dynamic_limit=24,
                            graphs=graphs, device="cpu")

    def step_inputs(self, step):
        cells = [self.model.cell(s, p) for s, p in zip(step.seq_ids, step.positions)]
        return dict(tokens=list(step.tokens), positions=list(step.positions), seq_ids=list(step.seq_ids),
                    cells=cells, want=[int(w) for w in step.want])

    def reference(self, tokens):
        return self.model.reference(tokens)


def test_pytest_helper_runs_a_second_model(capsys):
    assert isinstance(DecayAdapter(), SweepAdapter)
    report = assert_sweep(DecayAdapter(), repeats=2, extras=(24, 33))
    assert report.ok and report.adapter == "decay model" and report.reused_ids > 0
    assert {w.T for w in report.modes[0].widths} == {*range(1, 18), 24, 33}
    sliced = next(w for w in report.modes[0].widths if w.T == 33)
    assert sliced.slices == 2 * len(plan_step(33, (1, 2, 4, 8, 16), 24))
    assert f"seed {report.seed}" in capsys.readouterr().out


def test_pytest_helper_failure_says_how_to_replay(monkeypatch):
    plan_one_width_wider(monkeypatch)
    with pytest.raises(AssertionError) as e:
        assert_sweep(DecayAdapter(), **QUICK, extras=(24,))
    text = str(e.value)
    assert "slices:" in text and "sweep FAILED" in text
    assert "CGRT_SWEEP_SEED=" in text and "CGRT_SWEEP_ONLY_STEP=" in text and "test_sweep.py::" in text


def test_pytest_helper_runs_on_one_thread_on_a_cpu_and_puts_the_count_back(monkeypatch):
    """The README's adapter example under pytest took 118 s where one thread takes 11 s:
    on a CPU assert_sweep runs its steps on one torch thread (CGRT_SWEEP_THREADS=N picks
    another) and puts the count back, also after a failure; run_sweep, a library call,
    leaves the setting alone."""
    seen = []

    class Counting(DecayAdapter):
        def reference(self, tokens):
            seen.append(torch.get_num_threads())
            return super().reference(tokens)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_sweep(Counting(), **QUICK, extras=())
        assert set(seen) == {1} and torch.get_num_threads() == 2
        seen.clear()
        monkeypatch.setenv("CGRT_SWEEP_THREADS", "2")
        assert_sweep(Counting(), **QUICK, extras=())
        assert set(seen) == {2}
        monkeypatch.delenv("CGRT_SWEEP_THREADS")
        seen.clear()
        run_sweep(Counting(), graphs="off", **QUICK, extras=())
        assert set(seen) == {2}
        plan_one_width_wider(monkeypatch)
        with pytest.raises(AssertionError):
            assert_sweep(Counting(), **QUICK, extras=())
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("CGRT_SWEEP_THREADS", "0")
        with pytest.raises(InputError, match=r"CGRT_SWEEP_THREADS: expected an int >= 1, got 0"):
            assert_sweep(Counting(), **QUICK, extras=())
    finally:
        torch.set_num_threads(before)


# --------------------------------------------------------------------------- the command
def test_cli_json(capsys):
    """The command as a user types it: on a GPU machine this runs graphs on and off."""
    assert main(["sweep", "--repeats", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and isinstance(out["seed"], int)
    modes = [True, False] if torch.cuda.is_available() else [False]
    assert [m["graphs"] for m in out["modes"]] == modes
    for m in out["modes"]:
        assert m["failed"] == 0 and all(w["mismatches"] == 0 and w["steps"] == 1 for w in m["widths"])


def test_cli_table_plot_and_bad_flags(capsys, tmp_path):
    png = tmp_path / "sweep.png"
    argv = ["sweep", "--repeats", "1", "--device", "cpu", "--widths", "1,2,4,8", "--extras", "12,13",
            "--plot", str(tmp_path)]
    if importlib.util.find_spec("matplotlib") is None:  # without the plot extra: refused before the run
        assert main(argv) == 2
        assert 'pip install "cudagraph_rt[plot]"' in capsys.readouterr().err
        argv = argv[:-2]
    else:
        assert main(argv) == 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"plot: {png}" in capsys.readouterr().out
        argv[-1] = str(tmp_path / "missing")
        assert main(argv) == 2 and not (tmp_path / "missing").exists()  # never created
        assert "--plot: expected an existing folder" in capsys.readouterr().err
        argv = argv[:-2]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ms/step" in out and "sweep PASSED" in out and "graphs on: skipped" in out
    for argv, msg in [(["--repeats", "0"], "--repeats: expected an int >= 1, got '0'"),
                      (["--widths", "4,x"], "--widths: expected comma-separated positive ints"),
                      (["--plot", str(png)], "--plot: expected an existing folder"),
                      (["--dtype", "int8"], "--dtype: expected float32"),
                      (["--device", "cpu", "--graphs", "on"], "CUDA graphs need a GPU")]:
        assert main(["sweep", *argv]) == 2
        assert msg in capsys.readouterr().err.replace("\n", "")


def test_cli_failure_exit_code_and_reproduction(monkeypatch, capsys):
    plan_one_width_wider(monkeypatch)
    assert main(["sweep", "--repeats", "1", "--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "sweep FAILED" in out and "slices:" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("first failure: "))
    argv = line.removeprefix("first failure: cgrt ").split()
    assert argv[:2] == ["sweep", "--seed"] and "--only-step" in argv
    assert main(argv) == 1  # the printed command replays that failure
    assert "1 steps FAILED" in capsys.readouterr().out


# --------------------------------------------------------------------------- GPU
@pytest.mark.cuda
def test_cuda_sweep_graphs_on_and_off():
    report = run_sweep(ToyAdapter(device="cuda"), graphs="both", **QUICK)
    assert [m.graphs for m in report.modes] == [True, False]
    assert report.ok, report.summary()


@pytest.mark.cuda
def test_cuda_wider_width_is_caught_with_graphs_on(monkeypatch):
    plan_one_width_wider(monkeypatch)
    report = run_sweep(ToyAdapter(device="cuda"), graphs="on", **QUICK)
    assert kinds(report) == {"slices", "counters"} and "graph_replays" in messages(report)


@pytest.mark.cuda
def test_cuda_sweep_emulated_graphs():
    report = run_sweep(ToyAdapter(device="cuda"), graphs="emulate", **QUICK)
    assert [m.graphs for m in report.modes] == ["emulate"]
    assert report.ok, report.summary()


# ======================================================================================
# From the bad-input catalogue (issue 7): the harness's options.
# Each test runs graphs off, then with emulated graphs (rig_graphs); a refused call is
# checked for its error class and message, for nothing written (Rig.snapshot: the static
# arena, the KV state, the host-row ring, the commit snapshots, the counters) and for a
# valid step after it that matches the eager reference (tests.support.reliability_harness.refused).
# ======================================================================================
@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_harness_options_refused():
    from cudagraph_rt.sweep import harness, plans  # a renamed module or class fails here, never skips

    cases = [
        (lambda: plans.SweepOptions(repeats=0), r"repeats: expected a positive int, got 0"),
        (lambda: plans.SweepOptions(repeats=True), r"repeats: expected a positive int, got True"),
        (lambda: plans.SweepOptions(extras=(96, 0)), r"extras: expected positive ints"),
        (lambda: plans.SweepOptions(extras=5), r"extras: expected a sequence of positive ints, got 5"),
        (lambda: plans.SweepOptions(only_step=-1), r"only_step: expected None or a step index >= 0, got -1"),
        (lambda: harness.resolve_graphs("sometimes", torch.device("cpu")),
         r"graphs: expected auto \| on \| off \| both \| emulate, got 'sometimes'"),
    ]
    if not torch.cuda.is_available():
        cases.append((lambda: harness.resolve_graphs("on", torch.device("cpu")),
                      r"graphs: expected auto \| off \| emulate here"))
    for call, msg in cases:
        with pytest.raises(InputError, match=msg):
            call()
