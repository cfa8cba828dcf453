"""``GraphRuntime(graphs="emulate")``: the graph path's own code on a CPU (issue 22).

What the mode promises: each width is captured into static output tensors (the same
objects every replay) and every replay overwrites them, as a CUDA graph's replay does;
the feed (unpinned here), its prologue, the short path, handed views and padding run as
with fed graphs; a replay by hand through ``graphs_captured[w]`` re-runs the width; the
results equal graphs off bit for bit at the same width. Marked cuda: the same on a GPU,
where the emulated mode must equal real CUDA graphs bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from cudagraph_rt import CgrtError, GraphRuntime, Graphs, HostRows, InputError, InputSpec
from cudagraph_rt.graphs import as_graphs
from cudagraph_rt.graphs.emulation import EmulatedGraph
from tests.support.models_for_tests import InPlaceArgsModel, SlotModel
from tests.support.seeds import seeded_rng

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(seeded_rng("CGRT_EMULATE_SEED").randrange(2**31))


def pair(graphs_a, graphs_b, device="cpu", **kw):
    """Two runtimes over two copies of one SlotModel (same seed)."""
    out = []
    for g in (graphs_a, graphs_b):
        m = SlotModel(device, seed=9)
        out.append((m, GraphRuntime(m, m.specs(), graphs=g, device=device, **kw)))
    return out


def test_the_mode_is_public_and_says_what_it_is():
    m = SlotModel("cpu")
    rt = GraphRuntime(m, m.specs(), graphs="emulate", device="cpu")
    assert rt.graphs == "emulate" and rt.config.graphs == "emulate"
    rep = rt.capture()
    assert rep.graph_mode == "emulated" and rep.to_json()["graph_mode"] == "emulated"
    assert rep.pool_bytes == 0 and rt.graph_pool is None
    assert rep.step_fn_calls == len(rt.widths) * (rt.warmup + 1)  # warm-up and one capture run each
    assert sorted(rt.graphs_captured) == list(rt.widths)
    assert all(isinstance(g, EmulatedGraph) for g in rt.graphs_captured.values())
    assert rt.fed_graphs and rt.pinned_bytes == 0  # the feed runs, unpinned on a CPU
    rt.step(**m.random_inputs(3, gen=gen()))
    s = rt.stats()
    assert s.graph_mode == "emulated" and dict(s.graph_replays) == {4: 1} and dict(s.eager_calls) == {}
    off = GraphRuntime(m, m.specs(), graphs=False, device="cpu")
    assert off.capture().graph_mode == "off" and off.stats().graph_mode == "off"


@pytest.mark.parametrize("bad", ["yes", "EMULATE", "ON", 2, None, 1.0])
def test_other_graphs_values_are_refused(bad):
    with pytest.raises(InputError, match=r"graphs: expected True, False or 'emulate'") as e:
        GraphRuntime(lambda x: x["a"], {"a": InputSpec()}, graphs=bad, device="cpu")
    assert "Graphs.ON | Graphs.OFF | Graphs.EMULATE" in str(e.value) and "'on' | 'off' | 'emulate'" in str(e.value)


@pytest.mark.parametrize("spellings, back, mode", [((Graphs.OFF, "off", False, 0), False, "off"),
                                                   ((Graphs.EMULATE, "emulate"), "emulate", "emulated")])
def test_each_spelling_of_a_graphs_choice_builds_the_same_runtime(spellings, back, mode):
    """graphs= takes a Graphs member, its value or a bool, resolved in one place (as_graphs);
    rt.graphs reads back as before (False or "emulate") and every spelling steps alike."""
    seed = seeded_rng("CGRT_EMULATE_SEED").randrange(2**31)
    hidden = []
    for g in spellings:
        m = SlotModel("cpu", seed=9)
        rt = GraphRuntime(m, m.specs(), graphs=g, device="cpu")
        assert as_graphs(g) is spellings[0] and (rt.graphs, rt.capture().graph_mode) == (back, mode)
        hidden.append(rt.step(**m.random_inputs(3, gen=torch.Generator().manual_seed(seed))).outputs["hidden"])
    assert all(torch.equal(h, hidden[0]) for h in hidden)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
@pytest.mark.parametrize("on", [Graphs.ON, "on", True])
def test_each_spelling_of_graphs_on_is_refused_on_a_cpu_alike(on):
    with pytest.raises(InputError, match=r"graphs: expected False on a CPU device .*graphs='emulate'"):
        GraphRuntime(lambda x: x["a"], {"a": InputSpec()}, graphs=on, device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_graphs_on_a_cpu_point_at_the_emulation():
    with pytest.raises(InputError, match=r"graphs: expected False on a CPU device .*graphs='emulate'"):
        GraphRuntime(lambda x: x["a"], {"a": InputSpec()}, graphs=True, device="cpu")


def test_a_kept_output_is_overwritten_by_the_next_replay_of_its_width():
    """What the emulation is for: outputs are valid until the next step (README). With
    graphs off each step returns fresh tensors, so code that keeps one past the next step
    still reads its own rows there and the bug stays hidden; emulated, as on a GPU, the
    kept view holds the next step's rows."""
    (m_off, off), (m_emu, emu) = pair(False, "emulate")
    g = gen()
    x1, x2 = m_off.random_inputs(3, gen=g), m_off.random_inputs(4, gen=g)  # both at width 4
    kept_off, kept_emu = off.step(**x1).outputs["hidden"], emu.step(**x1).outputs["hidden"]
    first = kept_off.clone()
    assert torch.equal(kept_emu, first)
    second = emu.step(**x2).outputs["hidden"]
    off.step(**x2)
    assert torch.equal(kept_off, first)  # graphs off: fresh tensors each step
    assert second.data_ptr() == kept_emu.data_ptr()  # the width's static outputs
    assert torch.equal(kept_emu, second[:3]) and not torch.equal(kept_emu, first)


def test_steps_equal_graphs_off_bit_for_bit():
    (m_off, off), (m_emu, emu) = pair(False, "emulate", host_rows=HostRows(source="hidden", mode="host"))
    g = gen()
    for T in [1, 3, 8, 17, 33, 64, 65, 96, 130, 2, 5]:
        x = m_off.random_inputs(T, gen=g)
        rows = torch.randperm(T, generator=g)[:min(T, 9)].tolist()
        a, b = off.step(rows=rows, **x), emu.step(rows=rows, **x)
        assert [s.path for s in a.slices] == [s.path for s in b.slices]
        assert torch.equal(a.outputs["hidden"], b.outputs["hidden"]), T
        assert torch.equal(a.host_rows.rows(), b.host_rows.rows()), T
        a.host_rows.release(), b.host_rows.release()
    assert torch.equal(m_off.state, m_emu.state)


def test_a_replay_by_hand_re_runs_the_width():
    """static_inputs(w), written by hand, then graphs_captured[w].replay(): the width runs
    on those rows and static_outputs(w) hold its outputs, as with CUDA graphs."""
    m, rt = pair(False, "emulate")[1]
    ref = SlotModel("cpu", seed=9)
    rt.capture()
    x = m.random_inputs(8, gen=gen())
    views = rt.static_inputs(8)
    for k, v in x.items():
        views[k].copy_(v)
    out = rt.static_outputs(8)
    with torch.inference_mode():  # capture ran under it: the static outputs are inference tensors
        out["hidden"].fill_(float("nan"))
    rt.graphs_captured[8].replay()
    torch.testing.assert_close(out["hidden"], ref(x)["hidden"], rtol=0, atol=0)
    torch.testing.assert_close(m.state[:-1], ref.state[:-1], rtol=0, atol=0)  # (capture wrote the scratch slot)
    assert rt.stats().steps == 0  # a replay by hand is no step
    with pytest.raises(CgrtError, match=r"an emulated graph cannot be reset .*recapture\(\)"):
        rt.graphs_captured[8].reset()


def test_a_marked_call_inline_in_a_whole_graph_writes_its_arguments_for_the_code_after_it():
    """A whole graph captures a call marked ``cudagraph_rt.eager`` inline, as a plain call:
    what it writes into its arguments (a tensor of a list, a column view by keyword) is
    what the rest of the graph reads, at every replay (the static output poisoned first;
    the reference written out). Pieces: test_pieces.py."""
    m = InPlaceArgsModel()
    rt = GraphRuntime(m, m.specs(), widths=(1, 2, 4, 8), graphs="emulate", device="cpu")
    rt.capture()
    g = gen()
    for T in (3, 8, 1, 6, 3):
        x = m.random_inputs(T, gen=g)["x"]
        with torch.inference_mode():
            rt.static_outputs(rt.plan(T)[0].width)["y"].fill_(float("nan"))
        assert torch.equal(rt.step(x=x).outputs["y"], m.reference(x)), T
    assert dict(rt.stats().width_modes) == {w: "graph" for w in rt.widths}


def test_a_step_function_that_raises_at_capture_is_a_capture_error_or_runs_eagerly():
    class Fails(SlotModel):
        def __call__(self, x):
            if x["tokens"].shape[0] == 16:
                raise ZeroDivisionError("at width 16")
            return super().__call__(x)
    m = Fails("cpu")
    rt = GraphRuntime(m, m.specs(), graphs="emulate", device="cpu")
    with pytest.raises(CgrtError, match=r"width 16: the step function raised during emulated capture: "
                                        r"ZeroDivisionError: at width 16") as ei:
        rt.capture()
    assert ei.value.width == 16 and isinstance(ei.value.cause, ZeroDivisionError)
    rt2 = GraphRuntime(m, m.specs(), graphs="emulate", device="cpu", on_capture_error="eager")
    rep = rt2.capture()
    assert [w.width for w in rep.widths if w.error] == [16] and 16 not in rt2.graphs_captured
    rt2.step(**m.random_inputs(3, gen=gen()))  # other widths replay


def test_close_and_del_free_the_emulated_graphs_at_once():
    import gc
    import weakref
    m = SlotModel("cpu")
    rt = GraphRuntime(m, m.specs(), graphs="emulate", device="cpu",
                      host_rows=HostRows(source="hidden", mode="commit"))
    rt.step(**m.random_inputs(3, gen=gen()))
    refs = [weakref.ref(g) for g in rt.graphs_captured.values()] + [weakref.ref(rt._inputs.arena)]
    gc.disable()
    try:
        del rt
        assert all(r() is None for r in refs), "an emulated graph keeps its runtime alive (a cycle)"
    finally:
        gc.enable()


@pytest.mark.cuda
def test_emulated_graphs_on_cuda_equal_cuda_graphs_bit_for_bit():
    (m_cuda, real), (m_emu, emu) = pair(True, "emulate", device="cuda",
                                        host_rows=HostRows(source="hidden", mode="host"))
    g = gen()
    for T in [1, 3, 8, 33, 64, 80, 130, 5]:
        x = m_cuda.random_inputs(T, gen=g)
        a, b = real.step(rows=[0], **x), emu.step(rows=[0], **x)
        assert torch.equal(a.outputs["hidden"], b.outputs["hidden"]), T
        assert torch.equal(a.host_rows.rows(), b.host_rows.rows()), T
        a.host_rows.release(), b.host_rows.release()
    torch.cuda.synchronize()
    assert torch.equal(m_cuda.state, m_emu.state)
    assert emu.stats().graph_mode == "emulated" and real.stats().graph_mode == "cuda"


# ---- issue 40: after a width fails to capture, later widths get a fresh stream and pool ----
class FailsOnce(SlotModel):
    """SlotModel that raises the first time each width of ``fail`` is captured (on a GPU:
    while the stream captures it; emulated: at its first run, the warm-up), then steps
    as SlotModel (the width runs eagerly). ``streams``: the stream each width was
    captured on (CUDA)."""

    def __init__(self, *a, fail=(), **kw):
        super().__init__(*a, **kw)
        self.fail, self.streams = set(fail), {}

    def __call__(self, x):
        w, cuda = x["tokens"].shape[0], x["tokens"].is_cuda
        # torch.cuda.graphs' own function: the hazard finder, which re-runs a failed width on
        # the caller's stream, answers True through torch.cuda.is_current_stream_capturing
        capturing = cuda and torch.cuda.graphs.is_current_stream_capturing()
        if capturing:
            self.streams[w] = torch.cuda.current_stream().cuda_stream
        if w in self.fail and (capturing or not cuda):
            self.fail.discard(w)
            raise RuntimeError(f"no capture at width {w}")
        return super().__call__(x)


@pytest.mark.parametrize("device, graphs", [("cpu", "emulate"), pytest.param("cuda", True, marks=pytest.mark.cuda)],
                         ids=["emulated", "cuda"])
def test_widths_after_a_failed_capture_get_a_fresh_stream_and_pool(device, graphs):
    """README: a failed capture leaves the context usable; the capturer's docstring: after
    a failed width the stream and pool may be spoiled, so later widths get fresh ones (no
    memory shared with the widths before). The report says which pool each width went
    into; on a GPU the graphs' own pools and the capture streams say the same. Widths 16
    and 4 fail (on_capture_error="eager"); every width then steps as graphs off does."""
    m, ref = FailsOnce(device, seed=4, fail=(16, 4)), SlotModel(device, seed=4)
    rt = GraphRuntime(m, m.specs(), graphs=graphs, device=device, on_capture_error="eager")
    off = GraphRuntime(ref, ref.specs(), graphs=False, device=device)
    rep = rt.capture()
    assert [w.width for w in rep.widths if w.error] == [16, 4], [(w.width, w.error) for w in rep.widths]
    pools = {w.width: w.pool for w in rep.widths}
    assert pools == {64: 0, 32: 0, 16: None, 8: 1, 4: None, 2: 2, 1: 2}, pools
    assert rep.to_json()["widths"][0]["pool"] == 0
    if device == "cuda":
        g = rt.graphs_captured
        assert g[64].pool() == g[32].pool() and g[2].pool() == g[1].pool()
        assert len({g[32].pool(), g[8].pool(), g[2].pool()}) == 3
        s = m.streams  # the failed widths were captured on the stream of the widths before them
        assert s[64] == s[32] == s[16] and s[8] == s[4] and s[2] == s[1]
        assert len({s[16], s[8], s[1]}) == 3
        torch.ones(4, device="cuda").sum().item()  # the context is usable
    g = gen()
    for T in [3, 16, 4, 12, 1, 40, 64, 2, 80]:
        x = m.random_inputs(T, gen=g)
        a, b = rt.step(**x).outputs, off.step(**x).outputs
        assert torch.equal(a["hidden"], b["hidden"]), T
    assert dict(rt.stats().eager_calls) == {16: 2, 4: 2}
    assert torch.equal(m.state[:-1], ref.state[:-1])  # every real slot (padding rows write the last)
