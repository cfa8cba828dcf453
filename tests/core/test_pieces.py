"""Piecewise graphs (issue 26): calls marked ``cudagraph_rt.eager`` run between graphs.

CPU tests run graphs off and emulated (``graphs="emulate"``: each emulated piece re-runs
its part of the step into the capture's tensors); the cuda ones run real CUDA graphs in
pieces. Every comparison is against a plain runtime (graphs off, or a whole graph) over a
copy of the same model, or against an eager reference computed here, bit for bit at the
same width. Random inputs come from a printed seed (CGRT_PIECES_SEED=<n> replays one).
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch

import cudagraph_rt
from cudagraph_rt import CaptureError, CgrtError, GraphRuntime, HostRows, InputError, InputSpec
from cudagraph_rt.debug.hazards import find_capture_hazards
from cudagraph_rt.debug.inspect import inspect_runtime
from cudagraph_rt.graphs.emulation import EmulatedPieces
from cudagraph_rt.graphs.pieces import EagerCall, PieceLaunch, PiecewiseGraph
from cudagraph_rt.pieces import is_marked
from cudagraph_rt.sweep.checks import check_pad_rows
from tests.support.extras import require
from tests.support.models_for_tests import InPlaceArgsModel, MarkedSlotModel, SlotModel
from tests.support.reliability_harness import ScaleChooser, chosen_by_scale
from tests.support.seeds import seeded_rng

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
LAYOUT = ("piece 1", "eager _scaled_rows", "piece 2", "eager _state_rw", "piece 3")
T_ALL = [1, 3, 8, 17, 33, 64, 65, 96, 130, 2, 5, 16]  # one graph, dynamic, sliced


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(seeded_rng("CGRT_PIECES_SEED").randrange(2**31))


def plain_off(device="cpu", **kw):
    """The reference: plain SlotModel (no marked call), graphs off, the same padded widths
    (an unpadded call may round its matmuls otherwise)."""
    m = SlotModel(device, seed=11)
    return m, GraphRuntime(m, m.specs(), graphs=False, device=device, **kw)


def runtimes(*modes, cls=MarkedSlotModel, device="cpu", **kw):
    """(model, runtime) per (graphs, pieces) mode, each over its own copy of one model."""
    out = []
    for graphs, pieces in modes:
        m = cls(device, seed=11)
        out.append((m, GraphRuntime(m, m.specs(), graphs=graphs, pieces=pieces, device=device, **kw)))
    return out


# -- the marker ----------------------------------------------------------------------------
def test_a_marked_call_is_a_plain_call_where_no_width_is_in_pieces():
    calls = []

    @cudagraph_rt.eager
    def double(x):
        calls.append(1)
        return 2 * x

    assert is_marked(double) and not is_marked(lambda x: x) and double.__name__ == "double"
    assert torch.equal(double(torch.ones(2)), torch.full((2,), 2.0)) and calls == [1]
    with pytest.raises(InputError, match=r"eager\(fn\): expected a callable, got int"):
        cudagraph_rt.eager(3)


@pytest.mark.parametrize("kw,msg", [
    (dict(pieces=(3,)), r"pieces: expected True, False or widths of the runtime \(\(1, 2, 4\)\), got \(3,\)"),
    (dict(pieces="yes"), r"pieces: expected True, False or widths"),
    (dict(pieces=(True,)), r"pieces: expected True, False or widths"),
    (dict(on_capture_error="piece"), r"on_capture_error: expected 'raise', 'eager' or 'pieces', got 'piece'"),
    (dict(step_values=3), r"step_values: expected a callable \(rows, width\) -> values, or None, got int"),
])
def test_bad_piece_arguments_are_refused(kw, msg):
    with pytest.raises(InputError, match=msg):
        GraphRuntime(lambda x: x["a"], {"a": InputSpec()}, widths=(1, 2, 4), graphs="emulate", device="cpu", **kw)


# -- pieces equal whole graphs equal graphs off ---------------------------------------------
def test_pieces_equal_a_whole_graph_and_graphs_off_bit_for_bit():
    """MarkedSlotModel in pieces (emulated), as one whole graph (emulated) and graphs off,
    against plain SlotModel graphs off: the same outputs and state, bit for bit, for steps
    of one graph, dynamic and sliced. The static outputs and the eager call's fresh output
    buffer are poisoned before each step: the replay must write them."""
    (m_p, pw), (m_w, wh), (m_o, off) = runtimes(("emulate", True), ("emulate", False), (False, False))
    plain, ref = plain_off()
    g = gen()
    for T in T_ALL:
        x = plain.random_inputs(T, gen=g)
        for w, graph in pw.graphs_captured.items():
            with torch.inference_mode():
                pw.static_outputs(w)["hidden"].fill_(float("nan"))
                graph.calls[0].out.fill_(float("nan"))  # _scaled_rows returns a fresh tensor: copied here
        want = ref.step(**x).outputs["hidden"].clone()
        for rt in (pw, wh, off):
            got = rt.step(**x).outputs["hidden"]
            assert torch.equal(got, want), (T, rt.stats().width_modes)
    for m in (m_p, m_w, m_o):
        assert torch.equal(m.state, plain.state)
    rep = pw.capture_report
    assert [(w.width, w.mode, w.pieces, w.eager_calls, w.error) for w in rep.widths] == [
        (w, "pieces", 3, ("_scaled_rows", "_state_rw"), None) for w in sorted(pw.widths, reverse=True)]
    assert rep.to_json()["widths"][0]["mode"] == "pieces"
    assert dict(pw.stats().width_modes) == {w: "pieces" for w in pw.widths}
    assert dict(wh.stats().width_modes) == {w: "graph" for w in wh.widths}
    assert dict(off.stats().width_modes) == {w: "eager" for w in off.widths}
    assert pw.stats().graph_replays == wh.stats().graph_replays and sum(pw.stats().graph_replays.values()) > 0
    assert all(isinstance(g, EmulatedPieces) and g.layout == LAYOUT for g in pw.graphs_captured.values())


def test_only_the_widths_named_are_captured_in_pieces():
    ((m, rt),) = runtimes(("emulate", (1, 4)))
    rt.capture()
    assert dict(rt.stats().width_modes) == {1: "pieces", 2: "graph", 4: "pieces", 8: "graph", 16: "graph",
                                            32: "graph", 64: "graph"}
    assert {w.width: w.pieces for w in rt.capture_report.widths} == {1: 3, 2: 1, 4: 3, 8: 1, 16: 1, 32: 1, 64: 1}


def test_padding_rows_are_padded_and_write_only_the_scratch_slot():
    """A piecewise step of T rows at width N: the static rows [T, N) hold the pads after
    the step (the feed's prologue in piece 1) and the padding rows wrote only the scratch
    slot (every real slot equals the unpadded reference's)."""
    ((m, rt),) = runtimes(("emulate", True))
    plain, ref = plain_off()
    g = gen()
    for T in (3, 5, 9, 17, 33):
        x = plain.random_inputs(T, gen=g)
        res = rt.step(**x)
        ref.step(**x)
        assert check_pad_rows(rt, res.slices[-1]) is None
        assert torch.equal(m.state[:-1], plain.state[:-1]), T


def test_recapture_and_close_drop_the_pieces():
    ((m, rt),) = runtimes(("emulate", True))
    x = m.random_inputs(3, gen=gen())
    first = rt.step(**x).outputs["hidden"].clone()
    old = rt.graphs_captured[4]
    rt.recapture()
    assert rt.graphs_captured[4] is not old and torch.equal(rt.step(**x).outputs["hidden"], first)
    refs = [weakref.ref(g) for g in rt.graphs_captured.values()]
    gc.disable()
    try:
        del rt, old
        assert all(r() is None for r in refs), "a piecewise graph keeps its runtime alive (a cycle)"
    finally:
        gc.enable()


def test_a_replay_by_hand_runs_the_pieces_and_the_calls():
    ((m, rt),) = runtimes(("emulate", True))
    rt.capture()
    plain, ref = plain_off()
    x = plain.random_inputs(8, gen=gen())
    views = rt.static_inputs(8)
    for k, v in x.items():
        views[k].copy_(v)
    out = rt.static_outputs(8)
    with torch.inference_mode():
        out["hidden"].fill_(float("nan"))
    rt.graphs_captured[8].replay()
    assert torch.equal(out["hidden"], ref.step(**x).outputs["hidden"])
    with pytest.raises(CgrtError, match=r"cannot be reset"):
        rt.graphs_captured[8].reset()


# -- the toy and a transformers model ------------------------------------------------------
def _toy_steps(model, rt, g, steps=8):
    """Steps of 1..3 sequences with chunks of 1..9 rows (prefill, then decode)."""
    outs, pos = [], {s: 0 for s in range(3)}
    for i in range(steps):
        rows = []
        for s in range(1 + i % 3):
            n = 1 + int(torch.randint(0, 9, (1,), generator=g)) if pos[s] < 20 else 1
            rows += [(s, pos[s] + j) for j in range(n)]
            pos[s] += n
        toks = torch.randint(0, model.config.vocab, (len(rows),), generator=g)
        res = rt.step(tokens=toks, positions=[p for _, p in rows], seq_ids=[s for s, _ in rows],
                      cells=[model.cell_for(s, p) for s, p in rows], want=[1] * len(rows))
        outs.append({k: v.clone() for k, v in res.outputs.items()})
    return outs


def test_the_toy_with_its_attention_in_pieces_equals_the_captured_toy():
    from cudagraph_rt.models import ToyDecoder
    seed = seeded_rng("CGRT_PIECES_SEED").randrange(2**31)
    runs = []
    for attention, graphs, pieces in (("cells", False, False), ("cells", "emulate", False),
                                      ("eager-piece", "emulate", True), ("eager-piece", False, False)):
        m = ToyDecoder(attention=attention)
        rt = GraphRuntime(m.step, m.inputs(), graphs=graphs, pieces=pieces, device="cpu", widths=(1, 2, 4, 8, 16, 32))
        runs.append(_toy_steps(m, rt, torch.Generator().manual_seed(seed)))
        if pieces:
            assert {w.pieces for w in rt.capture_report.widths} == {m.config.layers + 1}
            assert set(rt.capture_report.widths[0].eager_calls) == {"eager_pool_attend"}
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a["hidden"], b["hidden"]) and torch.equal(a["tokens"], b["tokens"])


def test_sweep_passes_the_toy_in_pieces_emulated_and_off():
    from cudagraph_rt.sweep import ToyAdapter, run_sweep
    for graphs in ("emulate", "off"):
        rep = run_sweep(ToyAdapter(device="cpu", attention="eager-piece", pieces=True, widths=(1, 2, 4, 8)),
                        graphs=graphs, repeats=1, extras=(12,))
        assert rep.ok, rep.summary()
    assert "--attention eager-piece --pieces" in rep.rerun


def test_a_transformers_model_in_pieces_equals_its_whole_graph():
    require("transformers")
    from cudagraph_rt.models import hf
    seed = seeded_rng("CGRT_PIECES_SEED").randrange(2**31)
    base = hf.build("qwen2", "tiny")  # a sliding layer and a full one
    runs = []
    for attention, graphs, pieces in (("cells", "emulate", False), ("eager-piece", "emulate", True),
                                      ("cells", False, False)):
        m = hf.HFDecoder(base.model, max_seqs=4, max_len=64, attention=attention)
        rt = GraphRuntime(m.step, m.inputs(), graphs=graphs, pieces=pieces, device="cpu", widths=(1, 2, 4, 8, 16))
        runs.append(_toy_steps(m, rt, torch.Generator().manual_seed(seed)))
        if pieces:
            assert rt.capture_report.widths[0].pieces == 3  # two layers
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a["hidden"], b["hidden"]) and torch.equal(a["tokens"], b["tokens"])


@pytest.mark.parametrize("attention", ["eager-piece", "varlen"])
def test_sweep_passes_a_transformers_model_in_pieces(attention):
    require("transformers")
    from cudagraph_rt.sweep import HFAdapter, run_sweep
    adapter = HFAdapter("llama", "tiny", device="cpu", widths=(1, 2, 4, 8), attention=attention, pieces=True)
    for graphs in ("emulate", "off"):
        rep = run_sweep(adapter, graphs=graphs, repeats=1, extras=(12,))
        assert rep.ok, rep.summary()


# -- host rows through a piecewise width ---------------------------------------------------
class MarkedChooser(ScaleChooser, MarkedSlotModel):
    """ScaleChooser over MarkedSlotModel: the device chooses rows, in the last piece."""


@pytest.mark.parametrize("mode", ["host", "device", "commit"])
def test_host_rows_go_through_the_gather_of_the_last_piece(mode):
    cls = MarkedChooser if mode == "device" else MarkedSlotModel
    hr = HostRows(source="hidden", mode=mode, depth=2)
    (m_p, pw), (m_o, off) = runtimes(("emulate", True), (False, False), cls=cls, host_rows=hr)
    g = gen()
    for T in (3, 8, 1, 17, 6):
        x = m_o.random_inputs(T, gen=g)
        rows = torch.randperm(T, generator=g)[:max(1, T // 2)].tolist() if mode == "host" else None
        kw = {"rows": rows} if rows is not None else {}
        a, b = off.step(**kw, **x), pw.step(**kw, **x)
        assert torch.equal(a.outputs["hidden"], b.outputs["hidden"])
        if mode == "commit":
            pick = list(range(0, T, 2))
            ha, hb = off.commit(a, pick), pw.commit(b, pick)
        else:
            ha, hb = a.host_rows, b.host_rows
            pick = rows if mode == "host" else chosen_by_scale(x)
        assert torch.equal(hb.rows(), a.outputs["hidden"][pick]) and torch.equal(ha.rows(), hb.rows())
        assert hb.indices().tolist() == pick
        ha.release(), hb.release()
    assert dict(pw.stats().width_modes) == {w: "pieces" for w in pw.widths}


# -- per-step host values ------------------------------------------------------------------
class HostIntModel:
    """A step whose marked call needs a per-step host int: it sums each row's first
    ``max_len`` columns of a table, where ``max_len`` (the largest ``length`` of the slice's
    real rows) comes from ``step_values()`` and is used as a slice bound, a shape. A stale
    (capture-time) value would sum the wrong columns."""

    def __init__(self, device="cpu", cols=40):
        self.table = torch.arange(cols, dtype=torch.float32, device=device)
        self.seen: list[tuple[int, int]] = []

    def specs(self):
        return {"length": InputSpec((), torch.int64, 0), "x": InputSpec((), torch.float32, 0.0)}

    def values(self, rows, width):
        n = int(rows["length"].max()) if len(rows["length"]) else 1
        self.seen.append((len(rows["length"]), width))
        return {"max_len": n}

    def __call__(self, x):
        h = x["x"] * 2
        return {"y": self._head_sum(x["length"]) + h}

    @cudagraph_rt.eager
    def _head_sum(self, length):
        n = cudagraph_rt.step_values()["max_len"]
        cols = self.table[:n]  # a per-step shape
        return torch.where(torch.arange(n, device=length.device)[None, :] < length[:, None], cols, 0.0).sum(1)

    def reference(self, length, x):
        return torch.stack([self.table[:int(n)].sum() for n in length]) + 2 * x


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_a_per_step_host_int_reaches_the_marked_call_of_every_step(graphs):
    """The int changes every step (and every slice of a sliced step) and each step's output
    is what that step's own int gives: never the capture's."""
    m = HostIntModel()
    rt = GraphRuntime(m, m.specs(), widths=(1, 2, 4, 8), graphs=graphs, pieces=True, step_values=m.values,
                      device="cpu", dynamic_limit=12)
    rt.capture()
    g = gen()
    for T in (3, 1, 8, 5, 11, 20, 2):
        length = torch.randint(0, 40, (T,), generator=g)
        x = torch.rand(T, generator=g)
        m.seen.clear()
        got = rt.step(length=length, x=x).outputs["y"]
        torch.testing.assert_close(got, m.reference(length, x), rtol=0, atol=1e-4)
        assert m.seen == [(s.length, s.width) for s in rt.plan(T)]  # once per slice, its own rows


def test_step_values_read_while_a_whole_graph_captures_is_refused_or_goes_to_pieces():
    m = HostIntModel()
    whole = GraphRuntime(m, m.specs(), widths=(1, 2), graphs="emulate", step_values=m.values, device="cpu")
    with pytest.raises(CaptureError, match=r"width 2: step_values\(\) was read while a graph captures") as ei:
        whole.capture()
    assert ei.value.width == 2
    auto = GraphRuntime(m, m.specs(), widths=(1, 2), graphs="emulate", step_values=m.values, device="cpu",
                        on_capture_error="pieces")
    rep = auto.capture()
    assert [(w.mode, "step_values() was read" in (w.error or "")) for w in rep.widths] == [("pieces", True)] * 2
    length, x = torch.tensor([7, 30]), torch.tensor([0.5, 1.5])
    torch.testing.assert_close(auto.step(length=length, x=x).outputs["y"], m.reference(length, x), rtol=0, atol=1e-4)


def test_step_values_outside_a_step_or_without_a_function_is_an_error():
    with pytest.raises(CgrtError, match=r"step_values\(\): no step of a runtime built with step_values"):
        cudagraph_rt.step_values()
    m = HostIntModel()
    rt = GraphRuntime(m, m.specs(), widths=(1, 2), graphs=False, device="cpu")  # no step_values=
    with pytest.raises(CgrtError, match=r"step_values\(\): no step"):
        rt.step(length=[1], x=[0.0])


def test_a_per_step_int_passed_as_an_argument_is_caught_at_an_emulated_replay():
    """A CUDA graph in pieces replays each marked call with its capture's arguments; the
    emulation refuses a constant that changed instead of replaying a stale one."""
    table = torch.arange(20.0)

    @cudagraph_rt.eager
    def head(x, n):
        return x + table[:n].sum()

    def step(x):
        n = int(x["n"].max())  # a host read in the piece: frozen at capture
        return {"y": head(x["x"], n)}

    rt = GraphRuntime(step, {"x": InputSpec((), torch.float32, 0.0), "n": InputSpec((), torch.int64, 1)},
                      widths=(1, 2), graphs="emulate", pieces=True, device="cpu")
    rt.capture()
    with pytest.raises(CgrtError, match=r"marked call 1 \(.*head\): argument 1 is 5 at this replay, 1 at capture"):
        rt.step(x=[1.0], n=[5])


def test_a_step_that_takes_another_path_than_at_capture_is_caught_at_an_emulated_replay():
    flag = [False]

    @cudagraph_rt.eager
    def one(x):
        return x + 1

    def step(x):
        y = one(x["x"])
        return {"y": one(y) if flag[0] else y}

    rt = GraphRuntime(step, {"x": InputSpec((), torch.float32, 0.0)}, widths=(1,), graphs="emulate", pieces=True,
                      device="cpu")
    rt.capture()
    flag[0] = True
    with pytest.raises(CgrtError, match=r"width 1: marked call 2 at this replay is one more marked call"):
        rt.step(x=[1.0])


# -- what a marked call writes into its arguments and returns (issue 35) ----------------------
@pytest.mark.parametrize("graphs,pieces", [(False, False), ("emulate", True)], ids=["graphs-off", "emulated"])
def test_what_a_marked_call_writes_into_its_arguments_reaches_the_code_after_it(graphs, pieces):
    """A CUDA replay in pieces runs the recorded call on the capture's own tensors, and the
    next piece reads those tensors: a write into an argument (a tensor of a list argument,
    overwritten or added to; a column view passed by keyword) is what the code after the
    call reads. The emulation ran the call on the capture's tensors while the code after it
    read the re-run's own, never written ([1, 1, 1] for [3, 5, 7]). Every step against the
    reference written out: one graph, dynamic and sliced steps. (A whole graph, where the
    call runs inline: test_emulated_graphs.py.)"""
    m = InPlaceArgsModel()
    rt = GraphRuntime(m, m.specs(), widths=(1, 2, 4, 8), dynamic_limit=12, graphs=graphs, pieces=pieces,
                      device="cpu")
    g = gen()
    for T in (3, 1, 8, 5, 11, 20, 2, 3):
        x = m.random_inputs(T, gen=g)["x"]
        assert torch.equal(rt.step(x=x).outputs["y"], m.reference(x)), (T, rt.plan(T))
    if pieces:
        assert dict(rt.stats().width_modes) == {w: "pieces" for w in rt.widths}
        assert {w.eager_calls for w in rt.capture_report.widths} == {("_fill_in_place",)}


def test_an_expanded_argument_made_by_the_step_is_copied_at_an_emulated_replay():
    """An argument made with ``expand()`` (its rows share memory) is copied into the
    capture's at an emulated replay through the memory it really has (a plain ``copy_``
    into it raised a raw RuntimeError at every step); a CUDA replay just runs the call on it."""
    @cudagraph_rt.eager
    def add_column_sums(x, mask):
        return x + mask.sum(0)

    def step(v):
        x = v["x"]
        return {"y": add_column_sums(x, (x * 2)[None, :].expand(3, -1))}

    rt = GraphRuntime(step, {"x": InputSpec((), torch.float32, 0.0)}, widths=(1, 2, 4), graphs="emulate",
                      pieces=True, device="cpu")
    g = gen()
    for T in (3, 4, 1, 3):
        x = torch.randint(-50, 50, (T,), generator=g).to(torch.float32)
        assert torch.equal(rt.step(x=x).outputs["y"], x * 7), T


def test_a_sparse_argument_passes_the_capture_check_of_a_marked_calls_arguments():
    """The arguments' check at record reads shapes and strides: a sparse tensor has no
    strides (its ``stride()`` raises), and a capture in pieces must not fail on it."""
    sparse = torch.eye(4).to_sparse()

    @cudagraph_rt.eager
    def add_total(x, s):
        return x + torch.sparse.sum(s)

    rt = GraphRuntime(lambda v: {"y": add_total(v["x"], sparse)}, {"x": InputSpec((), torch.float32, 0.0)},
                      widths=(1, 2), graphs="emulate", pieces=True, device="cpu")
    x = torch.tensor([1.0, -2.0])
    assert torch.equal(rt.step(x=x).outputs["y"], x + 4)
    assert {w.mode for w in rt.capture_report.widths} == {"pieces"}


@cudagraph_rt.eager
def _replaces_an_entry(x, box):
    box[0] = x * 3


@cudagraph_rt.eager
def _appends(x, box):
    box.append(x * 3)


@cudagraph_rt.eager
def _adds_a_key(x, box):
    box["new"] = x * 3


@cudagraph_rt.eager
def _reshapes(x, out):
    out.unsqueeze_(0)
    out.copy_(x[None] * 3)


@cudagraph_rt.eager
def _reallocates(x, out):
    out.set_(x * 3)


ARG_CHANGES = [  # (marked call, its container argument, where the new value is read, message)
    (_replaces_an_entry, list, lambda box, out: box[0], r"replaced argument 1 \(a Tensor\) by another object"),
    (_appends, list, lambda box, out: box[-1], r"changed the structure of its arguments"),
    (_adds_a_key, dict, lambda box, out: box["new"], r"changed the structure of its arguments"),
    (_reshapes, None, lambda box, out: out[0], r"changed argument 1 in place: shape \(4,\) stride \(1,\)"),
    (_reallocates, None, lambda box, out: out, r"changed argument 1 in place: .*other memory"),
]


@pytest.mark.parametrize("call,box,read,msg", ARG_CHANGES, ids=[c[0].__name__.strip("_") for c in ARG_CHANGES])
def test_a_marked_call_that_replaces_or_reshapes_an_argument_is_refused_at_capture(call, box, read, msg):
    """What a replay cannot honour, on either path: the recorded call replaces an entry of
    a list or dict it was given (or adds one), or changes a tensor argument's shape or
    memory in place; the code after it (the next piece) keeps reading what it read at
    capture. Refused when the width is captured in pieces (CaptureError naming the width
    and the call); graphs off and a whole graph (the call inline) run it as written."""
    def step(v):
        x = v["x"]
        b = [x * 1] if box is list else ({"old": x * 1} if box is dict else None)
        out = x * 1
        call(x, b if box is not None else out)
        return {"y": read(b, out) + 1}

    specs = {"x": InputSpec((), torch.float32, 0.0)}
    for graphs, pieces in ((False, False), ("emulate", False)):
        rt = GraphRuntime(step, specs, widths=(1, 2, 4), graphs=graphs, pieces=pieces, device="cpu")
        x = torch.tensor([1.0, -2.0, 5.0])
        assert torch.equal(rt.step(x=x).outputs["y"], x * 3 + 1)
    rt = GraphRuntime(step, specs, widths=(1, 2, 4), graphs="emulate", pieces=True, device="cpu")
    with pytest.raises(CaptureError, match=r"width 4: marked call 1 \(.*" + call.__name__ + r"\) " + msg) as ei:
        rt.capture()
    assert ei.value.width == 4 and "return the new value" in str(ei.value) and not rt.graphs_captured
    eager = GraphRuntime(step, specs, widths=(1, 2, 4), graphs="emulate", pieces=True, device="cpu",
                         on_capture_error="eager")
    assert {w.mode for w in eager.capture().widths} == {"eager"}
    x = torch.tensor([4.0, 0.5])
    assert torch.equal(eager.step(x=x).outputs["y"], x * 3 + 1)


@cudagraph_rt.eager
def _rows_and_their_sum(x):
    return x * 1, cudagraph_rt.step_values()  # an int of this slice's rows


@cudagraph_rt.eager
def _rows_and_a_host_read(x):
    return x * 1, float(x.sum())  # a host sync: allowed in a marked call


@cudagraph_rt.eager
def _rows_and_a_list(x):
    return {"rows": x * 1, "n": [x.shape[0]]}


@pytest.mark.parametrize("call,read,what", [
    (_rows_and_their_sum, lambda out: out[0] + out[1], "int"),
    (_rows_and_a_host_read, lambda out: out[0] + out[1], "float"),
    (_rows_and_a_list, lambda out: out["rows"] + out["n"][0], "int"),
], ids=["step-values-int", "host-read-float", "int-in-a-list"])
def test_a_marked_call_that_returns_a_host_value_is_refused_at_capture(call, read, what):
    """A non-tensor output of a marked call: the code after the call is a graph at every
    replay, which keeps the value it had at capture (graphs on and emulated gave [3, 6]
    where graphs off gave [6, 9]). It cannot be made live (a graph cannot take a new host
    value: it may be a shape, a kernel argument, a branch taken), so it is refused at
    capture, naming the width, the call and the output; a per-step host value belongs in
    ``step_values()``, read by the call that needs it. Graphs off, or the widths run
    eagerly after the refusal, use the live value."""
    specs = {"x": InputSpec((), torch.float32, 0.0)}
    values = lambda rows, width: int(rows["x"].sum())  # noqa: E731

    def step(v):
        return {"y": read(call(v["x"]))}

    def want(x):
        return x + (x.shape[0] if call is _rows_and_a_list else x.sum())

    steps = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 3.0]), torch.tensor([4.0])]
    off = GraphRuntime(step, specs, widths=(1, 2), graphs=False, device="cpu", step_values=values)
    for x in steps:
        assert torch.equal(off.step(x=x).outputs["y"], want(x))
    rt = GraphRuntime(step, specs, widths=(1, 2), graphs="emulate", pieces=True, device="cpu", step_values=values)
    with pytest.raises(CaptureError, match=r"width 2: marked call 1 \(.*" + call.__name__ + r"\) returned " + what +
                       r" as output 1 .*step_values\(\)") as ei:
        rt.capture()
    assert ei.value.width == 2 and not rt.graphs_captured
    eager = GraphRuntime(step, specs, widths=(1, 2), graphs="emulate", pieces=True, device="cpu", step_values=values,
                         on_capture_error="eager")
    assert {w.mode for w in eager.capture().widths} == {"eager"}
    for x in steps:
        assert torch.equal(eager.step(x=x).outputs["y"], want(x))


def test_a_marked_call_may_return_none_beside_its_tensors():
    @cudagraph_rt.eager
    def scaled(x):
        return x * 2, None

    rt = GraphRuntime(lambda v: {"y": scaled(v["x"])[0] + 1}, {"x": InputSpec((), torch.float32, 0.0)},
                      widths=(1, 2), graphs="emulate", pieces=True, device="cpu")
    for x in (torch.tensor([1.0, 2.0]), torch.tensor([-3.0])):
        assert torch.equal(rt.step(x=x).outputs["y"], x * 2 + 1)
    assert {w.mode for w in rt.capture_report.widths} == {"pieces"}


# -- capture failures, contained -----------------------------------------------------------
class FailsInPiece2(MarkedSlotModel):
    """Raises after its first marked call, before the second (in piece 2), at width 16,
    while ``broken``."""

    broken = True

    def __call__(self, x):
        from tests.support.models_for_tests import _scaled_rows
        if not (self.broken and x["tokens"].shape[0] == 16):
            return super().__call__(x)
        _scaled_rows(self.emb, x["tokens"], x["scale"])
        raise ZeroDivisionError("in piece 2 at width 16")


def test_a_capture_failure_in_piece_2_names_the_width_and_the_piece():
    m = FailsInPiece2("cpu", seed=11)
    rt = GraphRuntime(m, m.specs(), graphs="emulate", pieces=True, device="cpu")
    with pytest.raises(CaptureError, match=r"width 16, piece 2: the step function raised during emulated capture: "
                                           r"ZeroDivisionError: in piece 2 at width 16") as ei:
        rt.capture()
    assert (ei.value.width, ei.value.piece) == (16, 2) and isinstance(ei.value.cause, ZeroDivisionError)
    kept = dict(rt.graphs_captured)
    assert sorted(kept) == [32, 64]  # captured before it: kept
    m.broken = False  # the cause fixed: the next capture takes the widths left, the others stay
    rt.capture()
    assert sorted(rt.graphs_captured) == list(rt.widths) and all(rt.graphs_captured[w] is kept[w] for w in kept)
    plain, ref = plain_off()
    g = gen()
    for T in (40, 16, 3):
        x = plain.random_inputs(T, gen=g)
        assert torch.equal(rt.step(**x).outputs["hidden"], ref.step(**x).outputs["hidden"]), T


def test_a_width_whose_pieces_fail_runs_eagerly_and_its_steps_stay_right():
    m = FailsInPiece2("cpu", seed=11)
    rt = GraphRuntime(m, m.specs(), graphs="emulate", pieces=True, device="cpu", on_capture_error="eager")
    rep = rt.capture()
    modes = {w.width: w.mode for w in rep.widths}
    assert modes == {w: "eager" if w == 16 else "pieces" for w in rt.widths}
    assert next(w for w in rep.widths if w.width == 16).error.startswith("width 16, piece 2: ")
    assert dict(rt.stats().width_modes)[16] == "eager"
    m.broken = False
    plain, ref = plain_off()
    g = gen()
    for T in (12, 3, 16, 9, 33):
        x = plain.random_inputs(T, gen=g)
        assert torch.equal(rt.step(**x).outputs["hidden"], ref.step(**x).outputs["hidden"]), T
    assert dict(rt.stats().eager_calls) == {16: 3} and dict(rt.stats().graph_replays) == {4: 1, 64: 1}


def test_a_failing_marked_call_at_capture_is_named():
    @cudagraph_rt.eager
    def bad(x):
        if x.shape[0] == 2:
            raise KeyError("no")
        return x + 1

    rt = GraphRuntime(lambda x: {"y": bad(x["x"])}, {"x": InputSpec((), torch.float32, 0.0)}, widths=(1, 2),
                      graphs="emulate", pieces=True, device="cpu")
    with pytest.raises(CaptureError, match=r"width 2: marked call 1 \(.*bad\) raised: KeyError: 'no'"):
        rt.capture()


# -- the hazard finder and inspect ---------------------------------------------------------
def test_the_hazard_finder_skips_marked_calls():
    def syncs(x):
        return x * float(x.sum())  # a host sync

    marked = cudagraph_rt.eager(syncs)
    x = {"x": torch.ones(4)}
    plain = find_capture_hazards(lambda v: syncs(v["x"]) + 1, x)
    assert [h.kind for h in plain] == ["host_sync"]
    assert find_capture_hazards(lambda v: marked(v["x"]) + 1, x) == ()
    # outside the marked call, a sync is still seen
    found = find_capture_hazards(lambda v: marked(v["x"]) + float(v["x"].max()), x)
    assert [h.kind for h in found] == ["host_sync"] and "float(v[\"x\"].max())" in found[0].line


def test_the_hazard_finder_flags_step_values_read_outside_a_marked_call():
    m = HostIntModel()

    def reads_outside(x):
        n = cudagraph_rt.step_values()["max_len"]
        return {"y": x["x"] * n}

    rt = GraphRuntime(reads_outside, m.specs(), widths=(1, 2), graphs="emulate", step_values=m.values, device="cpu",
                      on_capture_error="eager")
    rt.capture()
    hz = rt.explain_capture(2)
    assert [h.kind for h in hz] == ["error"] and "step_values() was read while a graph captures" in hz[0].message
    assert "step_values()" in hz[0].line
    ok = GraphRuntime(m, m.specs(), widths=(1, 2), graphs="emulate", step_values=m.values, pieces=True, device="cpu")
    ok.capture()
    assert ok.explain_capture(2) == ()
    assert [w.hazards for w in inspect_runtime(ok).widths] == [(), ()]  # inspect gives the pads' values too


def test_inspect_lists_the_pieces_and_the_calls_between_them():
    ((m, rt),) = runtimes(("emulate", True), widths=(1, 2, 4))
    rt.capture()
    rep = inspect_runtime(rt)
    assert [w.layout for w in rep.widths] == [LAYOUT] * 3
    assert list(rep.to_json()["widths"][0]["layout"]) == list(LAYOUT)
    ((m2, whole),) = runtimes(("emulate", False), widths=(1, 2))
    whole.capture()
    assert [w.layout for w in inspect_runtime(whole).widths] == [(), ()]


def test_the_cuda_capture_of_pieces_in_order_with_stand_in_graphs(monkeypatch):
    """``piece_capture.capture_pieces``'s order of work, on a CPU, with stand-in graphs that
    log what is done to them: each piece begins after the cuBLAS workspaces are released
    (its own workspace then lives in the pool), ends before its marked call, and is
    replayed before the call runs (the call reads what the piece wrote, never
    uninitialised pool memory); the last piece is not replayed. A failure while piece 2
    captures names it and resets the stream state. The real thing: the cuda tests."""
    import contextlib

    import cudagraph_rt.graphs.piece_capture as pc
    from tests.support.models_for_tests import _scaled_rows
    log = []

    class Graph:
        made = 0

        def __init__(self, keep_graph=False):
            Graph.made += 1
            self.i = Graph.made

        def capture_begin(self, pool=None, capture_error_mode="global"):
            log.append(("begin", self.i, pool, capture_error_mode))

        def capture_end(self):
            log.append(("end", self.i))

        def instantiate(self):
            log.append(("instantiate", self.i))

        def replay(self):
            log.append(("replay", self.i))

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: None)
    monkeypatch.setattr(pc, "release_blas_workspaces", lambda: log.append(("blas",)))
    monkeypatch.setattr(pc, "reset_after_failure", lambda *a: log.append(("reset",)))
    monkeypatch.setattr(pc, "_warm_up", lambda w, run, side, n: [run() for _ in range(n)])
    m = MarkedSlotModel("cpu", seed=1)
    x = m.random_inputs(4, gen=gen())
    graph, out, _, _ = pc.capture_pieces(4, lambda: m(x), pool=(0, 7), stream=None, warmup=1, keep_graph=True)
    piece = lambda i: [("blas",), ("begin", i, (0, 7), "thread_local"), ("end", i), ("instantiate", i)]  # noqa: E731
    assert log == piece(1) + [("replay", 1)] + piece(2) + [("replay", 2)] + piece(3) + [("blas",)]
    assert [g.i for g in graph.pieces] == [1, 2, 3] and graph.layout == LAYOUT and out["hidden"].shape == (4, 32)

    class Fails(MarkedSlotModel):
        def __call__(self, x):
            _scaled_rows(self.emb, x["tokens"], x["scale"])
            raise RuntimeError("operation not permitted when stream is capturing")

    log.clear()
    f = Fails("cpu", seed=1)
    with pytest.raises(CaptureError, match=r"width 4, piece 2: capture failed: RuntimeError: operation not permitted"
                                           r"(.|\n)*what cannot be captured:\n  hazard") as ei:
        pc.capture_pieces(4, lambda: f(x), pool=(0, 7), stream=None, warmup=0, keep_graph=False,
                          explain=lambda: ("hazard",))
    assert ei.value.piece == 2 and log[-2:] == [("blas",), ("reset",)]


# -- CUDA ------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_pieces_equal_a_whole_graph_and_graphs_off_bit_for_bit():
    (m_p, pw), (m_w, wh), (m_o, off) = runtimes((True, True), (True, False), (False, False), device="cuda",
                                                keep_graphs=True)
    g = gen()
    for T in T_ALL:
        x = m_o.random_inputs(T, gen=g)
        for w, graph in pw.graphs_captured.items():
            with torch.inference_mode():  # capture ran under it: the static tensors are inference tensors
                pw.static_outputs(w)["hidden"].fill_(float("nan"))
                graph.calls[0].out.fill_(float("nan"))
        want = off.step(**x).outputs["hidden"].clone()
        assert torch.equal(pw.step(**x).outputs["hidden"], want), T
        assert torch.equal(wh.step(**x).outputs["hidden"], want), T
    assert torch.equal(m_p.state, m_o.state) and torch.equal(m_w.state, m_o.state)
    assert all(len(gr.pieces) == 3 and gr.layout == LAYOUT for gr in pw.graphs_captured.values())
    assert pw.capture_report.pool_bytes > 0
    rep = inspect_runtime(pw, widths=(4, 8), replays=3)
    assert rep.available and [w.layout for w in rep.widths] == [LAYOUT, LAYOUT]
    assert all(w.counts.get("kernel", 0) > 0 and w.replay_s > 0 for w in rep.widths)


@pytest.mark.cuda
def test_cuda_a_host_sync_in_piece_2_is_named_and_contained():
    class Syncs(MarkedSlotModel):
        def __call__(self, x):
            from tests.support.models_for_tests import _scaled_rows
            h = _scaled_rows(self.emb, x["tokens"], x["scale"])
            if float(h.sum()) > 1e30:  # a host sync in piece 2
                h = h * 0
            return super().__call__(x)

    m = Syncs("cuda", seed=11)
    rt = GraphRuntime(m, m.specs(), graphs=True, pieces=True, device="cuda", widths=(1, 2))
    with pytest.raises(CaptureError, match=r"width 2, piece 2: capture failed") as ei:
        rt.capture()
    assert ei.value.piece == 2 and any("float(h.sum())" in h.line for h in ei.value.hazards)
    assert not torch.cuda.is_current_stream_capturing()
    ((m2, ok),) = runtimes((True, True), device="cuda", widths=(1, 2))  # the context is still usable
    plain, ref = plain_off("cuda", widths=(1, 2))
    x = plain.random_inputs(2, gen=gen())
    assert torch.equal(ok.step(**x).outputs["hidden"], ref.step(**x).outputs["hidden"])
    auto = GraphRuntime(Syncs("cuda", seed=11), m.specs(), graphs=True, device="cuda", widths=(1, 2),
                        on_capture_error="pieces")
    with pytest.raises(CaptureError, match=r"width 2, piece 2"):
        auto.capture()  # whole failed, then pieces failed too


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["host", "device", "commit"])
def test_cuda_host_rows_through_pieces(mode):
    cls = MarkedChooser if mode == "device" else MarkedSlotModel
    hr = HostRows(source="hidden", mode=mode, depth=2)
    (m_p, pw), (m_o, off) = runtimes((True, True), (False, False), cls=cls, host_rows=hr, device="cuda")
    g = gen()
    for T in (3, 8, 1, 17):
        x = m_o.random_inputs(T, gen=g)
        rows = list(range(0, T, 2)) if mode == "host" else None
        kw = {"rows": rows} if rows is not None else {}
        a, b = off.step(**kw, **x), pw.step(**kw, **x)
        ha, hb = (off.commit(a, [0]), pw.commit(b, [0])) if mode == "commit" else (a.host_rows, b.host_rows)
        assert torch.equal(ha.rows(), hb.rows())
        ha.release(), hb.release()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_varlen_attention_in_pieces_equals_graphs_off(dtype):
    require("transformers")
    from cudagraph_rt.models import hf
    base = hf.build("llama", "tiny", device="cuda", dtype=dtype)
    seed = seeded_rng("CGRT_PIECES_SEED").randrange(2**31)
    runs = []
    for graphs in (True, False):
        m = hf.HFDecoder(base.model, max_seqs=4, max_len=64, attention="varlen")
        rt = GraphRuntime(m.step, m.inputs(), graphs=graphs, pieces=True, step_values=m.step_values,
                          device="cuda", widths=(1, 2, 4, 8, 16))
        runs.append(_toy_steps(m, rt, torch.Generator().manual_seed(seed)))
    for a, b in zip(*runs):
        assert torch.equal(a["hidden"], b["hidden"]) and torch.equal(a["tokens"], b["tokens"])


@pytest.mark.cuda
@pytest.mark.parametrize("attention", ["eager-piece", "varlen"])
def test_cuda_sweep_in_pieces(attention):
    require("transformers")
    from cudagraph_rt.sweep import HFAdapter, ToyAdapter, run_sweep
    rep = run_sweep(HFAdapter("llama", "tiny", device="cuda", attention=attention, pieces=True), graphs="both",
                    repeats=1)
    assert rep.ok, rep.summary()
    if attention == "eager-piece":
        rep = run_sweep(ToyAdapter(device="cuda", attention=attention, pieces=True), graphs="both", repeats=1)
        assert rep.ok, rep.summary()


@pytest.mark.cuda
def test_cuda_what_a_marked_call_writes_into_its_arguments_reaches_the_next_piece():
    """The real thing behind the emulation's promise: the recorded call writes the
    capture's tensors, which the next piece reads (against the reference written out)."""
    m = InPlaceArgsModel("cuda")
    rt = GraphRuntime(m, m.specs(), widths=(1, 2, 4, 8), dynamic_limit=12, graphs=True, pieces=True, device="cuda")
    g = gen()
    for T in (3, 1, 8, 5, 11, 20, 2, 3):
        x = m.random_inputs(T, gen=g)["x"]
        assert torch.equal(rt.step(x=x).outputs["y"].cpu(), m.reference(x)), T
    assert dict(rt.stats().width_modes) == {w: "pieces" for w in rt.widths}


@pytest.mark.cuda
def test_cuda_a_marked_call_that_replaces_an_argument_is_refused():
    """Refused at a real capture in pieces too, and the CUDA context stays usable."""
    specs = {"x": InputSpec((), torch.float32, 0.0)}

    def replaced(v):
        box = [v["x"] * 1]
        _replaces_an_entry(v["x"], box)
        return {"y": box[0] + 1}

    rt = GraphRuntime(replaced, specs, widths=(1, 2), graphs=True, pieces=True, device="cuda")
    with pytest.raises(CaptureError, match=r"width 2: marked call 1 \(.*\) replaced argument 1 \(a Tensor\)"):
        rt.capture()
    assert not torch.cuda.is_current_stream_capturing()
    m = InPlaceArgsModel("cuda")
    ok = GraphRuntime(m, m.specs(), widths=(1, 2), graphs=True, pieces=True, device="cuda")
    x = torch.tensor([2.0, -7.0])
    assert torch.equal(ok.step(x=x).outputs["y"].cpu(), m.reference(x))


@pytest.mark.cuda
def test_cuda_a_marked_call_that_returns_a_host_value_is_refused():
    """A real capture in pieces refuses it too (the call read a tensor on the host: allowed
    in a marked call); the widths then run eagerly with the live value."""
    specs = {"x": InputSpec((), torch.float32, 0.0)}

    def step(v):
        y, s = _rows_and_a_host_read(v["x"])
        return {"y": y + s}

    rt = GraphRuntime(step, specs, widths=(1, 2), graphs=True, pieces=True, device="cuda")
    with pytest.raises(CaptureError, match=r"width 2: marked call 1 \(.*_rows_and_a_host_read\) returned float as "
                                           r"output 1"):
        rt.capture()
    assert not torch.cuda.is_current_stream_capturing()
    eager = GraphRuntime(step, specs, widths=(1, 2), graphs=True, pieces=True, device="cuda", on_capture_error="eager")
    assert {w.mode for w in eager.capture().widths} == {"eager"}
    for x in (torch.tensor([1.0, 2.0]), torch.tensor([3.0, 3.0])):
        assert torch.equal(eager.step(x=x).outputs["y"].cpu(), x + x.sum())


class _Piece:
    """A stand-in for one piece's CUDA graph: logs its replays."""

    def __init__(self, log: list, i: int):
        self.log, self.i = log, i

    def replay(self) -> None:
        self.log.append(f"piece {self.i}")

    __call__ = replay


@pytest.mark.parametrize("writes", ["in place", "returns"])
def test_marked_calls_replay_in_inference_mode_whatever_the_caller(writes):
    """A capture leaves inference tensors (its static outputs and arguments); a step launched
    outside inference mode must still run the marked calls between the pieces and write them
    (on the H200 every real piecewise step failed here while the emulation passed)."""
    with torch.inference_mode():
        x, static = torch.randn(5), torch.full((5,), float("nan"))
    fn = (lambda a, o: o.copy_(a * 2)) if writes == "in place" else (lambda a, o: a * 2)
    call = EagerCall(fn, (x, static), {}, static)
    log = []
    pieces = [_Piece(log, 1), _Piece(log, 2)]
    assert not torch.is_inference_mode_enabled()
    PieceLaunch(pieces, (call,), lambda: log.append("before last"))()
    assert torch.equal(static, x * 2) and log == ["piece 1", "before last", "piece 2"]
    with torch.inference_mode():
        static.fill_(float("nan"))
    log.clear()
    PiecewiseGraph(5, tuple(pieces), (call,)).replay()
    assert torch.equal(static, x * 2) and log == ["piece 1", "piece 2"]
