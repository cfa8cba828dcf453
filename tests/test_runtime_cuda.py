"""GPU tests of the core runtime: replay == graphs off bit for bit, one shared pool,
capture failures reported and recovered from."""
import pytest
import torch

from cudagraph_rt import CaptureError, GraphRuntime, InputError
from tests.support.feed_rows import ECHO, _echo
from tests.support.models_for_tests import SlotModel
from tests.support.seeds import seeded_rng

pytestmark = pytest.mark.cuda

STEPS = list(range(1, 66)) + [96, 97, 130]


def pair(**kw):
    on, off = SlotModel("cuda", seed=3), SlotModel("cuda", seed=3)
    return (on, GraphRuntime(on, on.specs(), graphs=True, **kw),
            off, GraphRuntime(off, off.specs(), graphs=False, device="cuda", **kw))


@pytest.mark.parametrize("source", ["host", "cuda", "mixed"])
def test_replay_equals_graphs_off_bit_for_bit(source):
    m_on, rt_on, m_off, rt_off = pair()
    rt_on.capture()
    gen = torch.Generator().manual_seed(seeded_rng("CGRT_BIT_SEED").randrange(2**31))
    order = [(STEPS * 2)[i] for i in torch.randperm(2 * len(STEPS), generator=gen)]
    for i, T in enumerate(order):
        x = m_on.random_inputs(T, gen=gen)
        if source == "cuda":
            x = {k: v.cuda() for k, v in x.items()}
        elif source == "mixed":  # each input from the host or the device, drawn per step
            x = {k: v.cuda() if torch.rand((), generator=gen) < 0.5 else v for k, v in x.items()}
        a = rt_on.step(**x).outputs
        b = rt_off.step(**x).outputs
        where = (i, T, [k for k, v in x.items() if v.is_cuda])
        assert torch.equal(a["hidden"], b["hidden"]), (where, (a["hidden"] != b["hidden"]).any(-1).nonzero().flatten())
        assert torch.equal(a["tok"], b["tok"]), where
        assert a["hidden"].shape[0] == T
    torch.cuda.synchronize()
    assert torch.equal(m_on.state, m_off.state)
    st = rt_on.stats()
    assert set(st.graph_replays) == set(rt_on.widths) and not st.eager_calls
    assert st.dynamic_calls[96] >= 2 and st.dynamic_calls[65] == 2


def test_matches_unpadded_reference():
    """Graph replay at a padded width equals the step function run at exactly T rows."""
    m, rt, ref, _ = pair()
    for T in [1, 3, 5, 17, 33, 64]:
        x = m.random_inputs(T)
        got = rt.step(**x).outputs["hidden"].clone()
        want = ref({k: v.cuda() for k, v in x.items()})["hidden"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # padding rows wrote only the scratch slot
    torch.testing.assert_close(m.state[:-1], ref.state[:-1], rtol=1e-5, atol=1e-5)


def test_pool_shared_across_widths():
    m = SlotModel("cuda", H=1024, layers=4)
    all_w = GraphRuntime(m, m.specs()).capture().pool_bytes
    one = GraphRuntime(m, m.specs(), widths=(64,)).capture().pool_bytes
    assert one > 0
    assert all_w <= 1.25 * one, (all_w, one)


class SyncsAt8(SlotModel):
    def __call__(self, x):
        out = super().__call__(x)
        if x["tokens"].shape[0] == 8:
            out["hidden"] = out["hidden"] * (out["hidden"].sum().item() > -1e9)  # host sync
        return out


def test_capture_failure_reported_and_recovered():
    m = SyncsAt8("cuda")
    rt = GraphRuntime(m, m.specs())
    with pytest.raises(CaptureError) as ei:
        rt.capture()
    e = ei.value
    assert e.width == 8
    assert "width 8" in str(e)
    assert "item" in str(e) or "_local_scalar_dense" in str(e), str(e)
    assert "test_runtime_cuda.py" in str(e), str(e)  # names the user's line
    assert not torch.cuda.is_current_stream_capturing()
    torch.ones(4, device="cuda").sum().item()  # the context is usable
    # the widths captured before the failure replay
    assert set(rt.graphs_captured) == {64, 32, 16}
    rt.graphs_captured[16].replay()
    torch.cuda.synchronize()

    ref = SlotModel("cuda")
    m2 = SyncsAt8("cuda")
    rt2 = GraphRuntime(m2, m2.specs(), on_capture_error="eager")
    rep = rt2.capture()
    assert [w.width for w in rep.widths if w.error] == [8], [(w.width, w.error) for w in rep.widths]
    for T in [5, 8, 3, 40]:
        x = m2.random_inputs(T)
        got = rt2.step(**x).outputs["hidden"]
        want = ref({k: v.cuda() for k, v in x.items()})["hidden"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert rt2.stats().eager_calls[8] == 2


def test_wrong_device_input_rejected_before_write():
    m = SlotModel("cuda")
    rt = GraphRuntime(m, m.specs())
    rt.capture()
    before = m.state.clone()
    x = m.random_inputs(4)
    x["tokens"] = x["tokens"].to("meta")
    with pytest.raises(InputError, match="tokens"):
        rt.step(**x)
    torch.cuda.synchronize()
    assert torch.equal(before, m.state)


def test_every_host_tensor_form_reaches_the_graph_exactly():
    from tests.test_runtime import _host_forms
    rt = GraphRuntime(_echo, ECHO, dynamic_limit=96)
    rt.capture()
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for T in [1, 3, 8, 37, 64, 80, 130]:
        a, b, forms = _host_forms(T, gen)
        h = torch.randn(T, 2, generator=gen).to(torch.bfloat16)
        hs = {"contiguous": h.clone(), "strided": torch.stack([h, -h], 2)[:, :, 0]}
        for form, (xa, xb) in forms.items():
            xh = hs["strided" if form == "strided" else "contiguous"]
            rt.step(a=torch.arange(90), b=torch.randn(90, 3), h=torch.randn(90, 2).bfloat16())  # stale rows
            out = rt.step(a=xa, b=xb, h=xh).outputs
            assert torch.equal(out["a"].cpu(), a), (T, form)
            assert torch.equal(out["b"].cpu(), torch.as_tensor(xb).detach().float()), (T, form)
            assert torch.equal(out["h"].cpu(), h), (T, form)
            if T <= 64:  # one graph: its padding rows are visible past T in the static outputs
                w = rt.plan(T)[0].width
                full = rt.static_outputs(w)
                assert (full["a"][T:w] == -5).all() and (full["b"][T:w] == 0.25).all()
                assert (full["h"][T:w] == -1.5).all(), (T, form)


def test_handed_host_views_zero_copy_and_stale_ones_refused():
    rt = GraphRuntime(_echo, ECHO)
    rt.capture()
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for T in [5, 2, 9, 1, 9]:
        hv = rt.host_inputs(T)
        assert all(rt.host_inputs(T)[k] is hv[k] for k in hv)  # same objects until the step
        want = {"a": torch.randint(0, 99, (T,), generator=gen), "b": torch.randn(T, 3, generator=gen),
                "h": torch.randn(T, 2, generator=gen).bfloat16()}
        for k in hv:
            hv[k].copy_(want[k])
        out = rt.step(**hv).outputs
        for k in want:
            assert torch.equal(out[k].cpu(), want[k]), (T, k)
        w = rt.plan(T)[0].width
        assert (rt.static_outputs(w)["a"][T:w] == -5).all()
        stale = hv
    # handed views are good for the one step after host_inputs(): later, or cut, refused
    for _ in range(2):  # the stale views' staging arena is next again after the second
        with pytest.raises(InputError, match="expected memory apart"):
            rt.step(**stale)
        rt.step(a=[1], b=[[0.0, 0, 0]], h=torch.zeros(1, 2).bfloat16())
    hv = rt.host_inputs(4)
    with pytest.raises(InputError, match="expected memory apart"):
        rt.step(**{k: v[:2] for k, v in hv.items()})


def test_fed_graphs_queued_ahead_each_read_their_own_rows():
    """Steps issued back to back while the device is busy (each graph burns ~0.3 ms): the
    host runs ahead, and every replay still reads its own step's rows, host or device,
    because the feed is rewritten only after the last replay's copy has left it."""
    burn = torch.randn(1024, 1024, device="cuda") / 32

    def slow_echo(x):
        y = burn
        for _ in range(8):
            y = y @ burn
        keep = (y[0, 0] * 0).to(torch.int64)  # 0, but only once the burn is done
        return {"a": x["a"] * 1 + keep, "b": x["b"] * 1, "h": x["h"] * 1}

    rt = GraphRuntime(slow_echo, ECHO)
    rt.capture()
    assert rt.fed_graphs  # this torch supports fed graphs: the path under test
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    wants, gots = [], []
    torch.cuda.synchronize()
    for i in range(200):
        T = int(torch.randint(1, 65, (1,), generator=gen))
        x = {"a": torch.randint(0, 10**6, (T,), generator=gen), "b": torch.randn(T, 3, generator=gen),
             "h": torch.randn(T, 2, generator=gen).bfloat16()}
        wants.append(x)
        if i % 3 == 1:
            x = dict(x, a=x["a"].cuda())
        if i % 5 in (2, 4):  # filled in place: every input, or some next to a device one
            hv = rt.host_inputs(T)
            for k in hv:
                hv[k].copy_(x[k])
            x = hv if i % 5 == 2 else dict(x, a=x["a"].cuda(), b=hv["b"], h=hv["h"])
        out = rt.step(**x).outputs
        gots.append({k: v.clone() for k, v in out.items()})  # stream-ordered: no sync
    torch.cuda.synchronize()
    for i, (want, got) in enumerate(zip(wants, gots)):
        for k in want:
            assert torch.equal(got[k].cpu(), want[k]), (i, k)


def test_rows_filled_through_host_inputs_but_not_stepped_become_padding():
    """A runner fills host_inputs(8), the step is then made with 5 other rows (a retry
    after a refused step): rows 5..7 the graph reads must be pad values, not those rows."""
    rt = GraphRuntime(_echo, ECHO)
    rt.capture()
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    for T_fill, T in [(8, 5), (64, 33), (2, 1)]:
        hv = rt.host_inputs(T_fill)
        for k, v in hv.items():
            v.copy_(torch.randn(v.shape, generator=gen).to(v.dtype) if v.dtype.is_floating_point
                    else torch.randint(0, 99, v.shape, generator=gen))
        x = {"a": torch.randint(0, 99, (T,), generator=gen), "b": torch.randn(T, 3, generator=gen),
             "h": torch.randn(T, 2, generator=gen).bfloat16()}
        out = rt.step(**x).outputs
        for k in x:
            assert torch.equal(out[k].cpu(), x[k]), (T, k)
        w = rt.plan(T)[0].width
        full = rt.static_outputs(w)
        assert (full["a"][T:w] == -5).all() and (full["b"][T:w] == 0.25).all() and (full["h"][T:w] == -1.5).all()
