"""Bound replays of marked calls (issue 26): ``cudagraph_rt.eager(fn, bind=...)`` and the
kernels' planned calls (``plan_cell_attention``, ``plan_write_cells``, ``KVPool.bind_attend``).

A piecewise replay runs what ``bind`` made of the recorded arguments instead of ``fn``:
these tests check that the replays really run it, that it reads its tensors' contents at
each call (never a copy taken at bind time), that its results equal the unbound calls'
bit for bit, and that bad input is refused at bind time before anything is written. The
kernels run in the Triton interpreter on a CPU and compiled on a GPU (``cuda`` tests).
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # normally tests/conftest.py's job; must precede triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import cudagraph_rt  # noqa: E402
from cudagraph_rt import CaptureError, GraphRuntime, InputError, InputSpec  # noqa: E402
from cudagraph_rt.kernels import attention as ca  # noqa: E402
from cudagraph_rt.kernels import common  # noqa: E402
from tests.support.extras import kernel_skip  # noqa: E402
from tests.support.seeds import seeded_rng  # noqa: E402

MODE = common.triton_backend()
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
NAN = float("nan")


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(seeded_rng("CGRT_BOUND_SEED").randrange(2**31))


# -- eager(bind=): replays run the bound callable -------------------------------------------
class Counted:
    """A marked ``tripled(x, out)`` (writes ``out`` in place) whose bind counts its calls."""

    def __init__(self, fail_bind: bool = False):
        self.plain = self.bound = self.binds = 0
        me = self

        def bind(x, out):
            me.binds += 1
            if fail_bind:
                raise ZeroDivisionError("bind refused")

            def run():
                me.bound += 1
                return torch.mul(x, 3.0, out=out)
            return run

        @cudagraph_rt.eager(bind=bind)
        def tripled(x, out):
            me.plain += 1
            return torch.mul(x, 3.0, out=out)

        self.fn = tripled

    def step(self, x):
        h = x["x"] + 1.0
        out = torch.empty_like(h)
        return {"y": self.fn(h, out) * 2.0}


def _runtime(c: Counted, graphs, device="cpu", **kw):
    return GraphRuntime(c.step, {"x": InputSpec((), torch.float32, 0.0)}, widths=(1, 4), graphs=graphs,
                        pieces=True, device=device, **kw)


def _check_replays_run_the_bound_call(graphs, device):
    c = Counted()
    rt = _runtime(c, graphs, device)
    rt.capture()
    assert c.binds == 2, "one bind per width, at its capture"
    assert all(call.bound for w in rt.widths for call in rt.graphs_captured[w].calls)
    plain_before, bound_before = c.plain, c.bound
    g = _gen()
    for T in (1, 3, 4, 2):
        x = torch.randn(T, generator=g)
        y = rt.step(x=x.tolist()).outputs["y"].cpu()
        assert torch.equal(y, (x + 1.0) * 3.0 * 2.0), T
    assert c.bound - bound_before == 4, "every replay ran the bound callable"
    # an emulated replay re-runs the step body, whose marked call goes to the recorded call
    # (bound) too; a CUDA replay never runs the body: fn itself is not called again
    assert c.plain == plain_before


def test_replays_run_what_bind_made_of_the_recorded_arguments():
    _check_replays_run_the_bound_call("emulate", "cpu")


@pytest.mark.cuda
@cuda_only
def test_replays_run_what_bind_made_of_the_recorded_arguments_on_cuda():
    _check_replays_run_the_bound_call(True, "cuda")


def test_a_failing_bind_fails_that_pieces_capture():
    c = Counted(fail_bind=True)
    rt = _runtime(c, "emulate")
    with pytest.raises(CaptureError, match=r"^width \d: marked call 1 \(.*tripled\) raised: ZeroDivisionError: "
                                           r"bind refused during emulated capture") as ei:
        rt.capture()
    assert isinstance(ei.value.cause, ZeroDivisionError)


def test_a_marked_call_without_a_capture_ignores_bind():
    c = Counted()
    rt = _runtime(c, False)
    y = rt.step(x=[1.0, 2.0]).outputs["y"]
    assert y.tolist() == [12.0, 18.0] and c.binds == 0 and c.bound == 0 and c.plain == 1


def test_bad_bind_is_refused():
    with pytest.raises(InputError, match=r"eager\(bind=\): expected None or a callable, got int"):
        cudagraph_rt.eager(lambda x: x, bind=3)


# -- the kernels' bound launches ------------------------------------------------------------
def _problem(g, device, rows, *, Hq=4, Hkv=2, D=16, bs=4, S=3, MB=6, dtype=torch.float32):
    blocks = S * MB + 2
    table = torch.randperm(blocks, generator=g)[: S * MB].view(S, MB).int().to(device)
    k = torch.randn(blocks * bs, Hkv, D, generator=g).to(device, dtype)
    v = torch.randn(blocks * bs, Hkv, D, generator=g).to(device, dtype)
    q = torch.randn(len(rows), Hq, D, generator=g).to(device, dtype)
    seq = torch.tensor([s for s, _ in rows], device=device)
    pos = torch.tensor([p for _, p in rows], device=device)
    return q, k, v, table, seq, pos


INTERPRETER_PLAN = ca.AttentionPlan(4, 1, 2, ca.AttentionConfig(tile_n=16, min_chunk=16))  # the merge runs
interpreter_only = kernel_skip(MODE != "interpreter", "the Triton interpreter (a CPU machine)")


def _check_bound_attention(dev, plan, window):
    g = _gen()
    rows = [(0, 9), (-1, 0), (2, 17), (2, 18)]
    q, k, v, table, seq, pos = _problem(g, dev, rows)
    out = torch.full_like(q, NAN)
    planned = ca.plan_cell_attention(q, k, v, table, seq, pos, block_size=4, scale=0.3, out=out, window=window,
                                     plan=plan)
    run = planned.run
    assert out.isnan().all(), "binding launches nothing"
    for rnd in range(3):  # new contents in the same tensors at every call
        q.copy_(torch.randn(q.shape, generator=g).to(dev))
        pos.copy_(torch.tensor([[9, 0, 17, 18], [3, 0, 20, 23], [15, 0, 1, 2]][rnd], device=dev))
        out.fill_(NAN)
        assert run() is out
        want = ca.cell_attention_triton(q, k, v, table, seq, pos, block_size=4, scale=0.3, window=window,
                                        out=torch.full_like(q, NAN), plan=plan)
        assert torch.equal(out, want), rnd
        ref = ca.cell_attention_reference(q, k, v, table, seq, pos, block_size=4, scale=0.3, window=window)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    if dev.type == "cuda":
        assert planned.launch.direct, "after its first call a bound launch goes straight to the compiled launcher"


def _check_shared_scratch(dev, plan):
    """Two bound attentions over one shared scratch (a pool's layers), called in turn:
    each equals its unbound call; the scratch was asked for once per bind."""
    g = _gen()
    asked, bufs = [], {}

    def scratch(lse, part, dtype):
        asked.append((lse, part))
        if not bufs:
            bufs["b"] = (torch.full((4096,), NAN, device=dev), torch.full((65536,), NAN, device=dev, dtype=dtype))
        return bufs["b"]
    probs = [_problem(g, dev, [(0, 21), (1, 13), (-1, 0)]) for _ in range(2)]
    outs = [torch.full_like(p[0], NAN) for p in probs]
    runs = [ca.plan_cell_attention(*p, block_size=4, scale=0.5, out=o, plan=plan, scratch=scratch).run
            for p, o in zip(probs, outs)]
    assert len(asked) == (2 if (plan or ca.plan_attention(3, 4, 2, 16)).splits > 1 else 0)
    for _ in range(2):
        for p, o, run in zip(probs, outs, runs):
            o.fill_(NAN)
            run()
            want = ca.cell_attention_triton(*p, block_size=4, scale=0.5, out=torch.full_like(o, NAN), plan=plan)
            assert torch.equal(o, want)


@interpreter_only
def test_bound_attentions_share_a_scratch(monkeypatch):
    monkeypatch.setattr(common, "CPU_RUNS_KERNELS", True)
    _check_shared_scratch(torch.device("cpu"), INTERPRETER_PLAN)


@pytest.mark.cuda
@cuda_only
def test_bound_attentions_share_a_scratch_on_cuda():
    _check_shared_scratch(torch.device("cuda"), None)


def _check_bound_write(dev):
    g = _gen()
    kc, vc = torch.zeros(40, 2, 16, device=dev), torch.zeros(40, 2, 16, device=dev)
    k, v = torch.empty(3, 2, 16, device=dev), torch.empty(3, 2, 16, device=dev)
    cells = torch.empty(3, dtype=torch.int64, device=dev)
    planned = ca.plan_write_cells(k, v, kc, vc, cells)
    run = planned.run
    assert not kc.any() and not vc.any(), "binding writes nothing"
    wk, wv = kc.clone(), vc.clone()
    for rnd in range(3):
        k.copy_(torch.randn(k.shape, generator=g).to(dev))
        v.copy_(torch.randn(v.shape, generator=g).to(dev))
        cells.copy_(torch.randperm(40, generator=g)[:3].to(dev))
        run()
        ca.write_cells_reference(k, v, wk, wv, cells)
        assert torch.equal(kc, wk) and torch.equal(vc, wv), rnd
    if dev.type == "cuda":
        assert planned.launch.direct


@interpreter_only
@pytest.mark.parametrize("window", [None, 5])
def test_a_bound_attention_equals_the_call_and_reads_its_tensors_each_time(window, monkeypatch):
    monkeypatch.setattr(common, "CPU_RUNS_KERNELS", True)  # the interpreter on a CPU
    _check_bound_attention(torch.device("cpu"), INTERPRETER_PLAN, window)


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("plan", [None, INTERPRETER_PLAN])
@pytest.mark.parametrize("window", [None, 5])
def test_a_bound_attention_equals_the_call_and_reads_its_tensors_each_time_on_cuda(window, plan):
    _check_bound_attention(torch.device("cuda"), plan, window)


@interpreter_only
def test_a_bound_write_equals_the_reference_and_reads_its_tensors_each_time(monkeypatch):
    monkeypatch.setattr(common, "CPU_RUNS_KERNELS", True)
    _check_bound_write(torch.device("cpu"))


@pytest.mark.cuda
@cuda_only
def test_a_bound_write_equals_the_reference_and_reads_its_tensors_each_time_on_cuda():
    _check_bound_write(torch.device("cuda"))


@pytest.mark.parametrize("bad, name", [("out", "out"), ("q", "q"), ("seq", "seq_ids"), ("window", "window")])
def test_bad_input_is_refused_at_bind_time(bad, name):
    q, k, v, table, seq, pos = _problem(_gen(), torch.device("cpu"), [(0, 3), (1, 5)])
    out = torch.full_like(q, NAN)
    kw = dict(block_size=4, scale=0.3, out=out, window=None)
    if bad == "out":
        kw["out"] = None
    elif bad == "q":
        q = q[:, :3]  # 3 query heads over 2 KV heads
    elif bad == "seq":
        seq = seq[:1]
    else:
        kw["window"] = 0
    with pytest.raises(InputError, match=rf"^{name}: expected"):
        ca.plan_cell_attention(q, k, v, table, seq, pos, **kw)
    assert out.isnan().all()
    with pytest.raises(InputError, match=r"^cells: expected"):
        ca.plan_write_cells(k[:2], v[:2], k, v, torch.zeros(3, dtype=torch.int64))


def _pool_attend_is_bound(device, graphs):
    """The toy with its attention marked eager, in pieces: every recorded call is bound
    (KVPool.bind_attend), and the sweep passes it against the eager reference."""
    from cudagraph_rt.models import ToyDecoder
    from cudagraph_rt.sweep import ToyAdapter, run_sweep
    m = ToyDecoder(device=device, attention="eager-piece")
    rt = GraphRuntime(m.step, m.inputs(), graphs=graphs, pieces=True, device=device, widths=(1, 2, 4, 8))
    rt.capture()
    calls = [c for w in rt.widths for c in rt.graphs_captured[w].calls]
    assert len(calls) == 4 * m.config.layers and all(c.bound for c in calls)
    rep = run_sweep(ToyAdapter(device=device, attention="eager-piece", pieces=True, widths=(1, 2, 4, 8)),
                    graphs="on" if graphs is True else graphs, repeats=1, extras=(12,))
    assert rep.ok, rep.summary()


def test_the_toys_marked_attention_replays_bound_emulated():
    _pool_attend_is_bound("cpu", "emulate")


@pytest.mark.cuda
@cuda_only
def test_the_toys_marked_attention_replays_bound_on_cuda():
    _pool_attend_is_bound("cuda", True)
