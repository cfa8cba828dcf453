"""The short path of a step on the GPU: a random mix of input forms and widths gives what
the step read, row for row, whichever path took it, with the counters of the plan; graphs
that draw random numbers keep torch's replay (new numbers each step), the others launch
their executable directly."""
import numpy as np
import pytest
import torch

from cudagraph_rt import GraphRuntime, InputError, InputSpec
from tests.support.seeds import seeded_rng
from tests.support.feed_rows import ECHO, _echo

pytestmark = pytest.mark.cuda

FORMS = ["tensors", "tensors", "views", "arrays", "numpy", "cuda", "mixed", "strided", "half-handed"]


def _rows(T, gen):
    return {"a": torch.randint(0, 10**6, (T,), generator=gen), "b": torch.randn(T, 3, generator=gen),
            "h": torch.randn(T, 2, generator=gen).bfloat16()}


def _inputs(rt, form, x):
    """``x`` passed to the step as ``form``."""
    T = x["a"].shape[0]
    if form in ("views", "arrays", "half-handed"):
        handed = rt.host_inputs(T, numpy=form == "arrays")
        for k, v in handed.items():
            if isinstance(v, np.ndarray):
                v[:] = x[k].numpy()
            else:
                v.copy_(x[k])
        return handed if form != "half-handed" else dict(handed, a=x["a"].cuda())
    if form == "numpy":
        return {"a": x["a"].numpy(), "b": x["b"].numpy(), "h": x["h"]}
    if form == "cuda":
        return {k: v.cuda() for k, v in x.items()}
    if form == "mixed":
        return dict(x, b=x["b"].cuda())
    if form == "strided":
        return dict(x, b=torch.stack([x["b"], x["b"]], 2)[:, :, 0])
    return x


def test_every_form_and_width_reads_its_own_rows_with_the_plans_counters():
    rng = seeded_rng("CGRT_DIRECT_SEED", torch_too=True)
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    rt = GraphRuntime(_echo, ECHO, dynamic_limit=96)
    rt.capture()
    assert rt._direct is not None  # fed graphs, no HostRows: the short path is there
    rt._direct = spy = _Spy(rt._direct)
    want_replays, want_dyn, want_pad, steps = {}, {}, 0, 0
    for i in range(300):
        T = rng.choice([rng.randint(1, 64), rng.randint(1, 8), rng.randint(65, 96), 130])
        form = rng.choice(FORMS)
        if T > 64 and form in ("views", "arrays", "half-handed"):
            form = "tensors"
        x = _rows(T, gen)
        with torch.inference_mode():  # poison every graph's outputs
            for w in rt.widths:
                rt.static_outputs(w)["a"].fill_(-7)
        res = rt.step(**_inputs(rt, form, x))
        assert res.T == T and res.slices == rt.plan(T) and res.host_rows is None
        out = res.outputs
        for k in x:
            assert torch.equal(out[k].cpu(), x[k]), (i, T, form, k)
        plan = rt.plan(T)
        for s in plan:
            if s.path == "graph":
                want_replays[s.width] = want_replays.get(s.width, 0) + 1
            else:
                want_dyn[s.length] = want_dyn.get(s.length, 0) + 1
            want_pad += s.padding
        steps += 1
        if len(plan) == 1 and plan[0].path == "graph":
            w = plan[0].width
            full = rt.static_outputs(w)
            assert (full["a"][T:w] == -5).all() and (full["h"][T:w] == -1.5).all(), (i, T, form)
    st = rt.stats()
    assert st.steps == steps and dict(st.graph_replays) == want_replays and dict(st.dynamic_calls) == want_dyn
    assert st.padding_rows == want_pad and not st.eager_calls
    assert sum(spy.took) > 20 and not all(spy.took)  # both paths ran (about 1 step in 5 takes the short one)
    assert all(e.launch.raw for e in rt._by_width.values())  # echo draws no random numbers


class _Spy:
    """The runtime's DirectStep, noting whether it took each step."""

    def __init__(self, direct):
        self.direct, self.took = direct, []

    def __call__(self, inputs):
        res = self.direct(inputs)
        self.took.append(res is not None)
        return res

    def runs(self, T):
        return self.direct.runs(T)


def test_a_graph_drawing_random_numbers_keeps_torchs_replay():
    specs = {"a": InputSpec((), torch.float32, 0.0)}
    rt = GraphRuntime(lambda x: {"r": torch.rand(x["a"].shape[0], device="cuda") + x["a"]}, specs, widths=(1, 4))
    rt.capture()
    x = torch.zeros(3)
    draws = [rt.step(a=x).outputs["r"].clone() for _ in range(4)]
    assert all(not torch.equal(draws[0], d) for d in draws[1:])  # new numbers each step, as eagerly
    assert all(0 <= float(d.min()) and float(d.max()) < 1 for d in draws)
    assert rt._by_width[4].launch.raw is False
    echo = GraphRuntime(_echo, ECHO, widths=(1, 4))
    echo.step(a=[1], b=[[0.0, 1, 2]], h=torch.zeros(1, 2).bfloat16())
    assert echo._by_width[1].launch.raw is True


def test_numpy_views_from_host_inputs_kept_past_their_step_are_refused():
    rt = GraphRuntime(_echo, ECHO)
    rt.capture()
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    arrs = rt.host_inputs(5, numpy=True)
    assert isinstance(arrs["h"], torch.Tensor)  # bfloat16: numpy has no such dtype
    x = _rows(5, gen)
    arrs["a"][:], arrs["b"][:] = x["a"].numpy(), x["b"].numpy()
    arrs["h"].copy_(x["h"])
    out = rt.step(**arrs).outputs
    assert all(torch.equal(out[k].cpu(), x[k]) for k in x)
    with pytest.raises(InputError, match="expected memory apart"):
        rt.step(**arrs)


def test_a_launch_from_another_current_device_goes_through_replay(monkeypatch):
    """cudaGraphLaunch on stream 0 would take the current device's default stream: when the
    current device is not the graph's, the launch enters it through torch's replay()."""
    rt = GraphRuntime(_echo, ECHO, widths=(1, 4))
    x = {"a": [3], "b": [[0.5, 1, 2]], "h": torch.ones(1, 2).bfloat16()}
    rt.step(**x)
    launch = rt._by_width[1].launch
    assert launch.raw
    replays = []
    real = launch.graph.replay
    monkeypatch.setattr(launch, "graph", type("G", (), {"replay": lambda self: (replays.append(1), real())})())
    here = torch.cuda.current_device()
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: here + 1)
    out = rt.step(a=[7], b=[[1.0, 2, 3]], h=torch.zeros(1, 2).bfloat16()).outputs
    monkeypatch.undo()
    assert replays == [1] and int(out["a"][0]) == 7


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_del_frees_the_graphs_without_the_garbage_collector(steps):
    """A graph left to the cyclic collector may be freed in the middle of a later capture,
    which that capture does not survive ("operation not permitted when stream is
    capturing"): dropping the runtime frees its graphs at once, launched or not."""
    import gc
    import weakref
    gc.collect()
    gc.disable()
    try:
        rt = GraphRuntime(_echo, ECHO, widths=(1, 4))
        rt.capture()
        for _ in range(steps):
            rt.step(a=[1], b=[[0.0, 1, 2]], h=torch.zeros(1, 2).bfloat16())
            rt.step(**rt.host_inputs(3, numpy=True))
        refs = [weakref.ref(g) for g in rt.graphs_captured.values()]
        del rt
        assert all(r() is None for r in refs)
    finally:
        gc.enable()
