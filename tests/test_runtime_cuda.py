"""GPU tests of the core runtime: replay == graphs off bit for bit, one shared pool,
capture failures reported and recovered from."""
import pytest
import torch

from cudagraph_rt import CaptureError, GraphRuntime, InputError
from models_for_tests import SlotModel

pytestmark = pytest.mark.cuda

STEPS = list(range(1, 66)) + [96, 97, 130]


def pair(**kw):
    on, off = SlotModel("cuda", seed=3), SlotModel("cuda", seed=3)
    return (on, GraphRuntime(on, on.specs(), graphs=True, **kw),
            off, GraphRuntime(off, off.specs(), graphs=False, device="cuda", **kw))


@pytest.mark.parametrize("source", ["host", "cuda"])
def test_replay_equals_graphs_off_bit_for_bit(source):
    m_on, rt_on, m_off, rt_off = pair()
    rt_on.capture()
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    order = [(STEPS * 2)[i] for i in torch.randperm(2 * len(STEPS), generator=gen)]
    for T in order:
        x = m_on.random_inputs(T, gen=gen)
        if source == "cuda":
            x = {k: v.cuda() for k, v in x.items()}
        a = rt_on.step(**x).outputs
        b = rt_off.step(**x).outputs
        assert torch.equal(a["hidden"], b["hidden"]), T
        assert torch.equal(a["tok"], b["tok"]), T
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
