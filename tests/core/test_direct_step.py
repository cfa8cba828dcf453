"""The short path of a step (``DirectStep``) on a CPU: its input check takes exactly what the
general check takes as plain host rows, and its feed write leaves the feed as the general
write does. (The path itself needs fed graphs: the cuda tests at the end of this file.)"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraph_rt import GraphRuntime, InputError, InputSpec
from cudagraph_rt.inputs.arena import ArenaLayout
from cudagraph_rt.inputs.feed import Feed
from cudagraph_rt.inputs.validate import Prepared, Validator
from tests.support.feed_rows import ECHO, SPECS, FakeEvent, _echo, rows
from tests.support.seeds import seeded_rng

FORMS = ["plain", "plain", "plain", "int32", "float64", "strided", "neg", "rows+1", "shape", "numpy", "list",
         "ours", "sparse", "scalar", "grad", "missing", "extra"]


def _form(name: str, t: torch.Tensor, form: str, ours: torch.Tensor):
    spec = SPECS[name]
    if form == "int32" and not t.dtype.is_floating_point:
        return t.to(torch.int32)
    if form == "float64":
        return t.double()
    if form == "strided":
        return torch.stack([t, t], 1)[:, 0]
    if form == "neg":
        return torch._neg_view(-t)
    if form == "rows+1":
        return torch.cat([t, t[:1]])
    if form == "shape":
        return t.reshape(t.shape[0], -1)[:, :1].repeat(1, 4) if spec.shape else t[:, None]
    if form == "numpy" and t.dtype != torch.bfloat16:
        return t.numpy()
    if form == "list" and t.dtype != torch.bfloat16:
        return t.tolist()
    if form == "ours":
        return ours.view(t.dtype)[:t.numel()].view(t.shape)
    if form == "sparse" and t.dim() == 1:
        return t.to_sparse()
    if form == "scalar":
        return t[0]
    if form == "grad" and t.dtype.is_floating_point:
        return t.clone().requires_grad_(True)
    return t


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 9), st.lists(st.sampled_from(FORMS), min_size=3, max_size=3), st.integers(0, 2**31 - 1))
def test_the_short_check_takes_only_what_the_full_check_takes_as_plain_host_rows(T, forms, seed):
    gen = torch.Generator().manual_seed(seed)
    ours = torch.zeros(4096, dtype=torch.uint8)  # stands for a staging arena
    v = Validator(SPECS, torch.device("cpu"), [(ours.data_ptr(), ours.data_ptr() + ours.numel())], [])
    x = {n: _form(n, t, f, ours) for (n, t), f in zip(rows(T, gen).items(), forms)}
    if "missing" in forms:
        x.pop(next(n for n, f in zip(SPECS, forms) if f == "missing"))
    if "extra" in forms:
        x["zz"] = torch.zeros(T)
    short = v.host_rows(x)
    try:
        v.names(x)
        full = v.check(x, lambda name, t: None)  # inside our buffers: refused
    except InputError:
        full = None
    plain = all(f == "plain" or (f == "grad" and SPECS[n].dtype != torch.float32) or
                (f in ("numpy", "list", "int32") and SPECS[n].dtype == torch.bfloat16) or
                (f == "sparse" and SPECS[n].shape)
                for n, f in zip(SPECS, forms))
    if plain:
        assert short is not None, forms
    if short is None:
        return
    assert full is not None, forms  # the short check never takes what the full one refuses
    T_short, ptrs = short
    assert T_short == full.T and not full.zero_copy
    assert ptrs == [full.host_ptrs[n] for n in SPECS]  # each written with one memmove from there
    for n, p in zip(SPECS, ptrs):
        assert full.tensors[n].data_ptr() == p and full.tensors[n].dtype == SPECS[n].dtype


def _feed():
    layout = ArenaLayout(SPECS, 16, Feed.control_blocks(len(SPECS)))
    arena = torch.zeros(layout.nbytes, dtype=torch.uint8)
    full = layout.carve(arena)
    layout.fill_pads(full)
    return Feed(layout, arena, full, FakeEvent(), pinned=False)


@given(st.lists(st.tuples(st.sampled_from(["rows", "handed", "unfeed"]), st.integers(1, 16), st.integers(1, 16)),
                min_size=1, max_size=12), st.integers(0, 2**31 - 1))
@settings(max_examples=150, deadline=None)
def test_the_short_feed_write_leaves_the_feed_as_the_general_write(ops, seed):
    gen = torch.Generator().manual_seed(seed)
    general, short = _feed(), _feed()
    for op, T, handed_T in ops:
        if op == "unfeed":
            general.unfeed(), short.unfeed()
            assert not short.all_host
            continue
        x = rows(T, gen)
        if op == "handed":  # rows [:handed_T] handed out and filled, then T of them stepped
            T = min(T, handed_T)
            x = rows(T, gen)
            for f in (general, short):
                f.host.mark(handed_T)
                for n, t in rows(handed_T, gen).items():
                    f.host.views[n][:handed_T].copy_(t)
                for n, t in x.items():
                    f.host.views[n][:T].copy_(t)
        prep = Prepared(T, x, frozenset(), {n: t.data_ptr() for n, t in x.items()})
        general.write(prep, 0, T, 16, None)
        if short.all_host:
            short.write_rows(None if op == "handed" else [x[n].data_ptr() for n in SPECS], T)
        else:
            short.write(prep, 0, T, 16, None)
        assert short.all_host and general.all_host
        for n, v in general.host.views.items():  # (the bytes between blocks are never read)
            assert torch.equal(v, short.host.views[n]), (op, T, n)
        assert general.host.dirty == short.host.dirty


def test_numpy_host_inputs_are_filled_in_place_and_good_for_one_step():
    specs = {"a": InputSpec((), torch.int64, -5), "b": InputSpec((3,), torch.float32, 0.25)}
    rt = GraphRuntime(lambda x: {"a": x["a"] * 1, "b": x["b"] * 1}, specs, graphs=False, device="cpu")
    gen = np.random.default_rng(int(torch.randint(0, 2**31, (1,))))
    for T in [3, 1, 8, 3]:
        arrs = rt.host_inputs(T, numpy=True)
        assert all(type(a) is np.ndarray and a.shape[0] == T for a in arrs.values())
        assert all(rt.host_inputs(T, numpy=True)[k] is arrs[k] for k in arrs)  # the same objects
        a, b = gen.integers(0, 99, T), gen.standard_normal((T, 3)).astype(np.float32)
        arrs["a"][:], arrs["b"][:] = a, b
        out = rt.step(**arrs).outputs
        assert np.array_equal(out["a"].numpy(), a) and np.array_equal(out["b"].numpy(), b)
        stale = arrs
    with pytest.raises(InputError, match="expected memory apart"):
        rt.step(**stale)  # kept past its step
    before = rt.state_digest()
    for bad in ("yes", 1, None):
        with pytest.raises(InputError, match=r"host_inputs\(numpy=\): expected True or False"):
            rt.host_inputs(2, numpy=bad)
    assert rt.state_digest() == before  # refused before any buffer was handed out or marked
    views, arrs = rt.host_inputs(2), rt.host_inputs(2, numpy=True)
    with pytest.raises(InputError, match="expected memory apart"):
        rt.step(a=views["a"], b=arrs["b"])  # half of each: not what was handed out


def test_an_interrupted_feed_write_turns_the_short_path_off(monkeypatch):
    """A write stopped part-way (KeyboardInterrupt) may leave an input flagged as a device
    one: the short write (which keeps no flags) must not run until a full write is done."""
    from cudagraph_rt.inputs.staging import HostArena
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    feed = _feed()
    x = rows(3, gen)
    real, calls = HostArena.stage, []

    def stage(self, name, *a):
        calls.append(name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, name, *a)

    monkeypatch.setattr(HostArena, "stage", stage)
    with pytest.raises(KeyboardInterrupt):
        feed.write(Prepared(3, x, frozenset(), {n: t.data_ptr() for n, t in x.items()}), 0, 3, 16, None)
    assert not feed.all_host
    monkeypatch.setattr(HostArena, "stage", real)
    feed.write(Prepared(3, x, frozenset(), {n: t.data_ptr() for n, t in x.items()}), 0, 3, 16, None)
    assert feed.all_host


def test_the_step_result_is_the_frozen_dataclass_with_every_field():
    """StepResult's one constructor (cheap: the short path builds one per step) takes every
    field, in order, with the fields' defaults, and builds what a frozen dataclass holds:
    a field added to the class but not to __init__ fails here."""
    import dataclasses
    import inspect

    from cudagraph_rt.results import StepResult
    fields = dataclasses.fields(StepResult)
    params = inspect.signature(StepResult).parameters
    assert list(params) == [f.name for f in fields]
    assert [p.default for p in params.values()] == [inspect.Parameter.empty if f.default is dataclasses.MISSING
                                                    else f.default for f in fields]
    rng = np.random.default_rng()
    values = ({"hidden": torch.from_numpy(rng.standard_normal((3, 4)))}, int(rng.integers(1, 9)), ("slices",),
              object(), (int(rng.integers(0, 4)), int(rng.integers(0, 99))), object())
    a = StepResult(*values)
    assert vars(a) == {f.name: v for f, v in zip(fields, values)}
    assert a == StepResult(*values[:5], object()) and a != StepResult(*values[:4], None, values[5])  # owner: compare=False
    assert vars(StepResult(*values[:3])) == {**vars(a), "host_rows": None, "snapshot": None, "owner": None}
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.T = 0


def test_the_short_path_hands_each_step_its_own_outputs_dict():
    """The outputs dict of a step is the caller's (the tensors in it are the graph's, valid
    until the next step): changing it must not change what later steps of the same T get.
    Emulated graphs: the short path runs on a CPU."""
    from tests.support.models_for_tests import SlotModel
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    m, ref = SlotModel("cpu", seed=5), SlotModel("cpu", seed=5)
    rt = GraphRuntime(m, m.specs(), graphs="emulate", device="cpu")
    rt.capture()
    for _ in range(3):
        x = m.random_inputs(3, gen=gen)
        res = rt.step(**x)
        assert sorted(res.outputs) == ["hidden", "tok"]
        torch.testing.assert_close(res.outputs["hidden"], ref(x)["hidden"], rtol=1e-5, atol=1e-6)
        res.outputs.pop("tok")
        res.outputs["hidden"] = None
    assert dict(rt.stats().graph_replays) == {4: 3}


# ======================================================================================
# GPU (marked cuda; was test_direct_step_cuda.py)
# The short path of a step on the GPU: a random mix of input forms and widths gives what
# the step read, row for row, whichever path took it, with the counters of the plan; graphs
# that draw random numbers keep torch's replay (new numbers each step), the others launch
# their executable directly.
# ======================================================================================
GPU_FORMS = ["tensors", "tensors", "views", "arrays", "numpy", "cuda", "mixed", "strided", "half-handed"]


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


@pytest.mark.cuda
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
        form = rng.choice(GPU_FORMS)
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

    @property
    def stager(self):  # what the runtime hands host rows out of for a short-path step
        return self.direct.stager


@pytest.mark.cuda
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


@pytest.mark.cuda
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


@pytest.mark.cuda
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


@pytest.mark.cuda
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
