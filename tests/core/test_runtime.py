"""CPU tests of GraphRuntime with graphs off: padding, slicing, stats, structure checks,
and every bad input refused before anything is written. Marked cuda (at the end): replay ==
graphs off bit for bit, one shared pool, capture failures reported and recovered from."""
import re

import numpy as np
import pytest
import torch

from cudagraph_rt import (
    BusyError, CapacityError, CaptureError, GraphRuntime, InputError, InputSpec, StepFunctionError,
)
from tests.support.feed_rows import ECHO, _echo
from tests.support.models_for_tests import SlotModel
from tests.support.reliability_harness import MODES, TOL, Rig, ScaleChooser, warm
from tests.support.seeds import seeded_rng


class Spy:
    """A step function that records (copies of) the inputs it saw."""

    def __init__(self, specs):
        self.specs, self.seen = specs, []

    def __call__(self, x):
        self.seen.append({k: v.clone() for k, v in x.items()})
        return {"y": x["a"].float() * 2, "z": (x["b"].sum(-1),)}


SPECS = {"a": InputSpec((), torch.int64, -5), "b": InputSpec((3,), torch.float32, 0.25)}


def seeded() -> torch.Generator:
    """A generator on a fresh seed, printed (pytest shows it for a failing test)."""
    seed = int(torch.randint(0, 2**31, (1,)))
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def make(graphs=False, **kw):
    spy = Spy(SPECS)
    return spy, GraphRuntime(spy, SPECS, graphs=graphs, device="cpu", **kw)


@pytest.mark.parametrize("graphs", [False, "emulate"], ids=["graphs-off", "emulated"])
def test_padding_rows_filled_and_real_rows_copied(graphs):
    spy, rt = make(graphs)
    rt.step(a=torch.arange(60), b=torch.randn(60, 3))  # leave stale rows behind
    for T in [1, 3, 5, 9, 17, 33, 64]:
        a, b = torch.randint(0, 100, (T,)), torch.randn(T, 3)
        r = rt.step(a=a, b=b)
        seen = spy.seen[-1]
        N = r.slices[0].width
        assert seen["a"].shape[0] == N
        assert torch.equal(seen["a"][:T], a) and torch.equal(seen["b"][:T], b)
        assert (seen["a"][T:] == -5).all() and (seen["b"][T:] == 0.25).all()
        assert torch.equal(r.outputs["y"], a.float() * 2)
        assert torch.equal(r.outputs["z"][0], b.sum(-1))


def test_sliced_step_joins_outputs_and_counts():
    spy, rt = make(dynamic_limit=96)
    T = 200
    a, b = torch.randint(0, 100, (T,)), torch.randn(T, 3)
    r = rt.step(a=a, b=b)
    assert [(s.path, s.width, s.start, s.length) for s in r.slices] == [
        ("dynamic", 96, 0, 96), ("dynamic", 96, 96, 96), ("graph", 8, 192, 8)]
    assert torch.equal(r.outputs["y"], a.float() * 2)
    torch.testing.assert_close(r.outputs["z"][0], b.sum(-1))
    assert [s["a"].shape[0] for s in spy.seen[-3:]] == [96, 96, 8]
    st = rt.stats()
    assert st.steps == 1 and st.slices == 3 and st.padding_rows == 0
    assert dict(st.dynamic_calls) == {96: 2} and dict(st.eager_calls) == {8: 1}


def test_stats_count_widths_and_padding():
    _, rt = make(widths=(1, 2, 3, 4, 8, 24, 64))
    for T in [1, 2, 3, 5, 9, 24, 25, 70]:
        rt.step(a=list(range(T)), b=np.zeros((T, 3), np.float32))
    st = rt.stats()
    assert dict(st.eager_calls) == {1: 1, 2: 1, 3: 1, 8: 1, 24: 2, 64: 1}
    assert dict(st.dynamic_calls) == {70: 1}
    assert st.padding_rows == 3 + 15 + 39


def test_input_kinds_and_safe_casts():
    _, rt = make()
    T = 5
    a = np.arange(T, dtype=np.int32)          # int32 -> int64 widens: fine
    b = [[1.0, 2.0, 3.0]] * T                  # list of floats
    r = rt.step(a=a, b=b)
    assert torch.equal(r.outputs["y"], torch.arange(T).float() * 2)
    nc = torch.randn(3, T).t()                 # non-contiguous: copied correctly
    r = rt.step(a=torch.arange(T)[::1], b=nc)
    torch.testing.assert_close(r.outputs["z"][0], nc.sum(-1))
    ex = torch.tensor([[7.0, 1.0, 0.5]]).expand(T, 3)  # stride-0 rows: copied correctly
    r = rt.step(a=torch.arange(T), b=ex)
    torch.testing.assert_close(r.outputs["z"][0], ex.sum(-1))


def _snapshot(rt, spy):
    return rt.state_digest(), len(spy.seen)


BAD = [
    ("T=0", dict(a=torch.zeros(0, dtype=torch.long), b=torch.zeros(0, 3)), InputError, "at least one row"),
    ("missing", dict(a=torch.zeros(2, dtype=torch.long)), InputError, "missing \\['b'\\]"),
    ("unexpected", dict(a=[1], b=[[0.0] * 3], c=[1]), InputError, "unexpected \\['c'\\]"),
    ("rows disagree", dict(a=[1, 2], b=[[0.0] * 3]), InputError, "b: expected 2 rows"),
    ("row shape", dict(a=[1, 2], b=torch.zeros(2, 4)), InputError, "b: expected shape \\(T, 3\\)"),
    ("no row dim", dict(a=torch.tensor(3), b=torch.zeros(1, 3)), InputError, "a: expected shape"),
    ("unsafe cast", dict(a=torch.tensor([1.5, 2.0]), b=torch.zeros(2, 3)), InputError, "a: expected dtype torch.int64"),
    ("float64", dict(a=[1, 2], b=torch.zeros(2, 3, dtype=torch.float64)), InputError, "b: expected dtype torch.float32"),
    ("nan as int", dict(a=np.array([np.nan, 1.0]), b=torch.zeros(2, 3)), InputError, "a: expected dtype"),
    ("string", dict(a="12", b=torch.zeros(2, 3)), InputError, "a: expected a torch.Tensor"),
    ("ragged", dict(a=[1, 2], b=[[0.0] * 3, [0.0]]), InputError, "b: expected a list"),
    ("object array", dict(a=np.array([1, None]), b=torch.zeros(2, 3)), InputError, "a: expected a numeric array"),
    ("meta device", dict(a=torch.zeros(2, dtype=torch.long, device="meta"), b=torch.zeros(2, 3)), InputError, "a: expected a tensor on cpu"),
    ("complex", dict(a=[1, 2], b=torch.zeros(2, 3, dtype=torch.complex64)), InputError, "b: expected dtype"),
]


@pytest.mark.parametrize("name,inputs,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_write_nothing(name, inputs, exc, msg):
    spy, rt = make()
    rt.step(a=[4, 5, 6], b=torch.randn(3, 3))
    before = _snapshot(rt, spy)
    with pytest.raises(exc, match=msg):
        rt.step(**inputs)
    after = _snapshot(rt, spy)
    assert before == after
    a = torch.randint(0, 9, (7,))
    assert torch.equal(rt.step(a=a, b=torch.zeros(7, 3)).outputs["y"], a.float() * 2)


def test_wide_step_with_slicing_off():
    spy, rt = make(slicing=False, dynamic_limit=80)
    before = _snapshot(rt, spy)
    with pytest.raises(CapacityError, match="at most 80"):
        rt.step(a=list(range(81)), b=torch.zeros(81, 3))
    assert before == _snapshot(rt, spy)


def test_input_overlapping_static_buffers_refused():
    spy, rt = make()
    arena_rows = rt.static_inputs(8)["a"]
    with pytest.raises(InputError, match="overlapping"):
        rt.step(a=arena_rows[1:4], b=torch.zeros(3, 3))
    # the exact rows device_inputs() hands out are the zero-copy path
    v = rt.device_inputs(4)
    v["a"].copy_(torch.tensor([9, 8, 7, 6]))
    v["b"].fill_(1.0)
    r = rt.step(**v)
    assert r.outputs["y"].tolist() == [18.0, 16.0, 14.0, 12.0]


@pytest.mark.parametrize("kw,msg", [
    (dict(widths=(4, 2)), "widths"), (dict(widths=[]), "widths"), (dict(max_width=0), "max_width"),
    (dict(dynamic_limit=32), "dynamic_limit"), (dict(graphs=True), "graphs"),
    (dict(on_capture_error="ignore"), "on_capture_error"), (dict(warmup=-1), "warmup"),
    (dict(device="tpu"), "device"), (dict(host_rows="hidden"), "host_rows"),
])
def test_bad_construction(kw, msg):
    kw.setdefault("graphs", False)
    with pytest.raises(InputError, match=msg):
        GraphRuntime(lambda x: x["a"], SPECS, device=kw.pop("device", "cpu"), **kw)


@pytest.mark.parametrize("spec_kw,msg", [
    (dict(pad=float("nan")), "pad"), (dict(pad=float("inf")), "pad"), (dict(pad=2**40, dtype=torch.int32), "pad"),
    (dict(shape=(0,)), "shape"), (dict(shape=(-1,)), "shape"), (dict(dtype="int64"), "dtype"), (dict(pad="0"), "pad"),
])
def test_bad_input_specs(spec_kw, msg):
    with pytest.raises(InputError, match=msg):
        InputSpec(**spec_kw)


def test_bad_input_names():
    with pytest.raises(InputError, match="inputs"):
        GraphRuntime(lambda x: x, {"rows": InputSpec()}, graphs=False, device="cpu")
    with pytest.raises(InputError, match="InputSpec"):
        GraphRuntime(lambda x: x, {"a": (3,)}, graphs=False, device="cpu")


def test_output_without_width_dim():
    rt = GraphRuntime(lambda x: {"s": x["a"].sum()}, SPECS, graphs=False, device="cpu")
    with pytest.raises(StepFunctionError, match="leading dimension"):
        rt.step(a=[1, 2], b=torch.zeros(2, 3))


def test_output_structure_changes_between_widths():
    def fn(x):
        n = x["a"].shape[0]
        return {"y": x["a"]} if n < 4 else {"y": x["a"], "extra": x["a"]}
    rt = GraphRuntime(fn, SPECS, graphs=False, device="cpu")
    rt.step(a=[1], b=torch.zeros(1, 3))
    with pytest.raises(StepFunctionError, match="same structure"):
        rt.step(a=[1, 2, 3, 4, 5], b=torch.zeros(5, 3))


def test_step_function_that_raises_leaves_runtime_usable():
    calls = {"n": 0}

    def fn(x):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ZeroDivisionError("boom")
        return x["a"] * 3
    rt = GraphRuntime(fn, SPECS, graphs=False, device="cpu")
    rt.step(a=[1], b=torch.zeros(1, 3))
    with pytest.raises(ZeroDivisionError):
        rt.step(a=[1], b=torch.zeros(1, 3))
    assert rt.step(a=[2, 3], b=torch.zeros(2, 3)).outputs.tolist() == [6, 9]


def test_tensor_and_tuple_outputs():
    rt = GraphRuntime(lambda x: x["a"] + 1, SPECS, graphs=False, device="cpu")
    assert rt.step(a=[1, 2, 3], b=torch.zeros(3, 3)).outputs.tolist() == [2, 3, 4]
    rt = GraphRuntime(lambda x: (x["a"], x["b"]), SPECS, graphs=False, device="cpu")
    out = rt.step(a=[1] * 100, b=torch.ones(100, 3)).outputs
    assert isinstance(out, tuple) and out[0].shape == (100,) and out[1].shape == (100, 3)


def test_stateful_model_graphs_off_matches_unpadded_reference():
    m, ref = SlotModel("cpu", seed=1), SlotModel("cpu", seed=1)
    rt = GraphRuntime(m, m.specs(), graphs=False, device="cpu")
    gen = seeded()
    for T in [1, 2, 3, 7, 33, 64, 65, 97, 130]:
        x = m.random_inputs(T, gen=gen)
        got = rt.step(**x).outputs
        want = ref(x)
        torch.testing.assert_close(got["hidden"], want["hidden"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.state[:-1], ref.state[:-1], rtol=1e-5, atol=1e-5)


def test_two_threads_never_interleave():
    import threading

    gate = threading.Event()
    release = threading.Event()

    def fn(x):
        gate.set()
        release.wait(5)
        return x["a"] + 0
    rt = GraphRuntime(fn, SPECS, graphs=False, device="cpu")
    t = threading.Thread(target=lambda: rt.step(a=[1], b=torch.zeros(1, 3)))
    t.start()
    assert gate.wait(5)
    with pytest.raises(BusyError):
        rt.step(a=[2], b=torch.zeros(1, 3))
    # the buffers a step is writing are not handed out meanwhile either
    for what, call in [("host_inputs", lambda: rt.host_inputs(2)), ("device_inputs", lambda: rt.device_inputs(2)),
                       ("static_inputs", lambda: rt.static_inputs(2))]:
        with pytest.raises(BusyError, match=rf"GraphRuntime.{what}: another thread is inside step"):
            call()
    release.set()
    t.join()
    assert rt.step(a=[5], b=torch.zeros(1, 3)).outputs.tolist() == [5]


def _host_forms(T, gen):
    """The same rows as every kind of host tensor a runner may hand over."""
    a = torch.randint(-1000, 1000, (T,), generator=gen)
    b = torch.randn(T, 3, generator=gen)
    big_a = torch.randint(-1000, 1000, (3 * T + 5,), generator=gen)
    big_a[4:4 + 3 * T:3] = a
    wide_b = torch.randn(T + 2, 5, generator=gen)
    wide_b[2:, 1:4] = b
    return a, b, {
        "contiguous": (a.clone(), b.clone()),
        "storage offset": (big_a[4:4 + 3 * T:3].contiguous(), wide_b[2:, 1:4].contiguous()),
        "strided": (big_a[4:4 + 3 * T:3], wide_b[2:, 1:4]),
        "offset slice of a bigger tensor": (torch.cat([a, a])[T:], torch.cat([b, b])[T:]),
        "requires_grad float": (a.clone(), b.clone().requires_grad_()),
        "safe casts": (a.to(torch.int32), b.to(torch.float16)),
        "numpy": (a.numpy().copy(), b.numpy().copy()),
        "lists": (a.tolist(), b.tolist()),
    }


@pytest.mark.parametrize("T", [1, 3, 8, 37, 64, 80, 130])
def test_every_host_tensor_form_reaches_the_step_exactly(T):
    gen = seeded()
    for form, (xa, xb) in _host_forms(T, gen)[2].items():
        spy, rt = make(dynamic_limit=96)
        rt.step(a=torch.arange(90), b=torch.randn(90, 3))  # stale rows left behind
        a = torch.as_tensor(xa).long()
        b = torch.as_tensor(xb).detach().float()
        r = rt.step(a=xa, b=xb)
        seen = torch.cat([s["a"][:sl.length] for s, sl in zip(spy.seen[-len(r.slices):], r.slices)])
        assert torch.equal(seen, a), form
        assert torch.equal(r.outputs["y"], a.float() * 2), form
        torch.testing.assert_close(r.outputs["z"][0], b.sum(-1), rtol=0, atol=1e-5, msg=form)
        last, sl = spy.seen[-1], r.slices[-1]
        assert (last["a"][sl.length:] == -5).all() and (last["b"][sl.length:] == 0.25).all(), form


def test_handed_views_are_recognised_and_fresh_inputs_still_checked():
    spy, rt = make()
    gen = seeded()
    hv = rt.host_inputs(5)
    again = rt.host_inputs(5)
    assert all(again[k] is hv[k] for k in hv)  # the same objects: recognised by identity
    a, b = torch.randint(0, 99, (5,), generator=gen), torch.randn(5, 3, generator=gen)
    hv["a"].copy_(a)
    hv["b"].copy_(b)
    r = rt.step(**hv)
    assert torch.equal(r.outputs["y"], a.float() * 2) and torch.equal(spy.seen[-1]["a"][:5], a)
    assert (spy.seen[-1]["a"][5:] == -5).all()
    # one view swapped for a fresh tensor: the full checks run, the fresh rows are used
    a2 = torch.randint(0, 99, (5,), generator=gen)
    hv = rt.host_inputs(5)
    r = rt.step(a=a2, b=hv["b"])
    assert torch.equal(r.outputs["y"], a2.float() * 2)
    # a handed view cut to fewer rows is not the handed object: refused (its staging rows
    # are not the arena's, and only the unchanged views are taken)
    hv = rt.host_inputs(5)
    with pytest.raises(InputError, match=r"a: expected memory apart from the runtime's static buffers"):
        rt.step(a=hv["a"][:3], b=hv["b"])
    # extra or missing names are refused before the identity check can pass them
    hv = rt.host_inputs(5)
    with pytest.raises(InputError, match="unexpected"):
        rt.step(**hv, c=torch.zeros(5))


def test_host_tensors_that_require_grad_never_join_an_autograd_graph():
    specs = {"a": InputSpec((), torch.int64, 0), "h": InputSpec((2,), torch.bfloat16, -1.5),
             "f": InputSpec((3,), torch.float32, 0.5)}
    rt = GraphRuntime(lambda x: {"h": x["h"] * 1, "f": x["f"] * 1}, specs, graphs=False, device="cpu")
    gen = seeded()
    for T in [3, 7, 2]:
        h = torch.randn(T, 4, generator=gen).bfloat16()[:, ::2].requires_grad_()  # strided: the torch copy
        f = torch.randn(T, 3, generator=gen).requires_grad_()
        out = rt.step(a=torch.zeros(T, dtype=torch.int64), h=h, f=f).outputs
        assert torch.equal(out["h"], h.detach()) and torch.equal(out["f"], f.detach())
        assert not out["h"].requires_grad and not out["f"].requires_grad
    views = rt.static_inputs(8)
    assert not any(v.requires_grad or v.grad_fn is not None for v in views.values())
    assert not any(v.requires_grad for v in rt.static_inputs(64).values())


class Blob(SlotModel):
    """SlotModel with one more input it does not read, wide enough (96 rows of 256 floats)
    that the arena is over one copy's size: no fed graphs (CUDA stages the rows instead)."""

    def specs(self):
        return {**super().specs(), "blob": InputSpec((256,), torch.float32, 0.0)}

    def random_inputs(self, T, device="cpu", gen=None):
        return {**super().random_inputs(T, device, gen), "blob": torch.zeros(T, 256)}


GRAPH_PATHS = ["emulate", pytest.param(True, marks=pytest.mark.cuda)]


@pytest.mark.parametrize("graphs", GRAPH_PATHS, ids=["emulated", "cuda-graphs"])
@pytest.mark.parametrize("cls", [SlotModel, Blob], ids=["fed", "staged"])
def test_padding_rows_run_the_pads_even_after_views_written_past_their_step(graphs, cls):
    """Issue 22: rows written into host_inputs() views after their step (a kept view, or a
    thread filling late) land in staging rows the bookkeeping counts as pads; the fed path
    then ran them as padding rows, which wrote their KV cells. The prologue of every fed
    graph now pads rows [T, width) on the device, and staging pads them on every write."""
    from cudagraph_rt.sweep.checks import check_pad_rows
    device = "cuda" if graphs is True else "cpu"
    m, ref = cls(device, seed=6), cls(device, seed=6)
    rt = GraphRuntime(m, m.specs(), graphs=graphs, device=device)
    gen = seeded()
    v = rt.host_inputs(4)
    assert rt.fed_graphs == (cls is SlotModel)
    for k, t in (x := m.random_inputs(4, gen=gen)).items():
        v[k].copy_(t)
    rt.step(**v)
    ref({k: t.to(device) for k, t in x.items()})
    for i in range(4):  # T=3 at width 4: one padding row per step
        if i == 2:
            for k, t in m.random_inputs(4, gen=gen).items():  # the kept views, written late
                v[k].copy_(t)
        x = m.random_inputs(3, gen=gen)
        res = rt.step(**x)
        want = ref({k: t.to(device) for k, t in x.items()})
        torch.testing.assert_close(res.outputs["hidden"], want["hidden"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.state[:-1], ref.state[:-1], rtol=1e-5, atol=1e-5)
    assert rt.stats().steps == 5 and dict(rt.stats().graph_replays) == {4: 5}
    # last: static_inputs() turns the feed off until the next step (a caller's own rows)
    assert check_pad_rows(rt, res.slices[-1]) is None


# ======================================================================================
# From the bad-input catalogue (issue 7): construction (the runtime, width sets,
# input specs) and the step function's output.
# Each test runs graphs off, then with emulated graphs (rig_graphs); a refused call is
# checked for its error class and message, for nothing written (Rig.snapshot: the static
# arena, the KV state, the host-row ring, the commit snapshots, the counters) and for a
# valid step after it that matches the eager reference (tests.support.reliability_harness.refused).
# ======================================================================================
ONE_INPUT = {"a": InputSpec((), torch.int64, 0)}


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("kw,msg", [
    (dict(step_fn=42), r"step_fn: expected a callable, got int"),
    (dict(dynamic_fn="fn"), r"dynamic_fn: expected a callable or None, got str"),
    (dict(watch=[torch.zeros(1)]), r"watch: expected a callable returning tensors, or None, got list"),
    (dict(inputs={}), r"inputs: expected a non-empty dict"),
    (dict(inputs=[("a", InputSpec())]), r"inputs: expected a non-empty dict"),
    (dict(inputs={"a-b": InputSpec()}), r"inputs: expected identifier names other than 'rows', got 'a-b'"),
    (dict(inputs={"__ctrl__": InputSpec()}), r"inputs: expected identifier names .*'__ctrl__'"),
    (dict(inputs={3: InputSpec()}), r"inputs: expected identifier names"),
    (dict(widths=(1, 2, 2)), r"widths: expected strictly increasing widths"),
    (dict(widths=(1, 2.0)), r"widths: expected positive ints, got 2.0"),
    (dict(widths=np.array([1, 2, 4])), r"widths: expected positive ints, got np.int64\(1\)"),
    (dict(widths=5), r"widths: expected a sequence of positive ints, got 5"),
    (dict(max_width=True), r"max_width: expected a positive int, got True"),
    (dict(max_width="64"), r"max_width: expected a positive int, got '64'"),
    (dict(dynamic_limit=96.0), r"dynamic_limit: expected an int >= the widest graph \(64\), got 96.0"),
    (dict(dynamic_limit=True, widths=(1,)), r"dynamic_limit: expected an int >= the widest graph \(1\), got True"),
    (dict(warmup=1.5), r"warmup: expected an int >= 0, got 1.5"),
    (dict(warmup=True), r"warmup: expected an int >= 0, got True"),
    (dict(slicing="no"), r"slicing: expected True or False, got 'no'"),  # issue 35: taken as slicing on
    (dict(slicing=0), r"slicing: expected True or False, got 0"),
    (dict(on_capture_error=None), r"on_capture_error: expected 'raise', 'eager' or 'pieces', got None"),
    (dict(device=object()), r"device: expected a torch device"),
    (dict(device="meta"), r"device: expected 'cuda' or 'cpu', got meta"),
])
def test_bad_construction_more(kw, msg):
    args = dict(step_fn=lambda x: x["a"], inputs=ONE_INPUT, graphs=False, device="cpu")
    args.update(kw)
    with pytest.raises(InputError, match=msg):
        GraphRuntime(args.pop("step_fn"), args.pop("inputs"), **args)


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_device_without_cuda():
    with pytest.raises(InputError, match=r"device: expected a device this machine has, got cuda \(no CUDA here\)"):
        GraphRuntime(lambda x: x["a"], ONE_INPUT, graphs=False, device="cuda")
    with pytest.raises(InputError, match=r"graphs: expected False on a CPU device"):
        GraphRuntime(lambda x: x["a"], ONE_INPUT, device="cpu")  # graphs defaults to True


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("kw,msg", [
    (dict(shape=(2.5,)), r"InputSpec.shape: expected a tuple of positive ints"),
    (dict(shape=(True,)), r"InputSpec.shape: expected a tuple of positive ints"),
    (dict(shape=(np.int64(3),)), r"InputSpec.shape: expected a tuple of positive ints"),
    (dict(shape="3"), r"InputSpec.shape"),
    (dict(dtype=torch.uint8, pad=-1), r"InputSpec.pad: expected a value in \[0, 255\], got -1"),
    (dict(dtype=torch.int8, pad=200), r"InputSpec.pad: expected a value in \[-128, 127\], got 200"),
    (dict(dtype=torch.int32, pad=1.5), r"InputSpec.pad: expected a finite integer for torch.int32, got 1.5"),
    (dict(pad=1 + 2j), r"InputSpec.pad: expected an int, float or bool"),
    (dict(pad=None), r"InputSpec.pad: expected an int, float or bool, got None"),
    (dict(pad=torch.tensor(0)), r"InputSpec.pad: expected an int, float or bool"),
    (dict(dtype=np.int64), r"InputSpec.dtype: expected a torch.dtype"),
])
def test_bad_input_specs_more(kw, msg):
    with pytest.raises(InputError, match=msg):
        InputSpec(**kw)


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_input_spec_numpy_pad_and_int_shape_are_normalised():
    s = InputSpec(3, torch.float32, np.float32(0.5))
    assert s.shape == (3,) and s.pad == 0.5 and type(s.pad) is float
    assert InputSpec([2, 2], torch.int16, np.int16(-3)).shape == (2, 2)


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_complex_input_spec_is_refused_clearly():
    with pytest.raises(InputError, match=r"InputSpec.dtype"):
        InputSpec((), torch.complex64, 0)


# ---- the step function's output: checked at the first step (probe) or at each width
class Faulty(SlotModel):
    """SlotModel whose output goes wrong on demand: ``fault(x, out)`` may raise or return a
    replacement; ``None`` = behave."""

    fault = None

    def __call__(self, x):
        out = super().__call__(x)
        if self.fault is not None:
            r = self.fault(x, out)
            if r is not None:
                return r
        return out


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("mode,fault,msg", [
    ("host", lambda x, o: o["hidden"], r"step_fn output: expected a dict or tuple when HostRows is used, got Tensor"),
    ("host", lambda x, o: {"tok": o["tok"]},
     r"HostRows.source: expected the step function's output 'hidden', got the outputs \['tok'\] \(a dict\)"),
    ("host", lambda x, o: (o["tok"], o["hidden"]),
     r"HostRows.source: expected the step function's output 'hidden', got the outputs \[0, 1\] \(a tuple\)"),
    ("host", lambda x, o: {"hidden": o["tok"]}, r"HostRows.source: expected an output of shape \[64, H\], got \(64,\)"),
    ("host", lambda x, o: {"hidden": o["hidden"].numpy()}, r"HostRows.source: expected a tensor, got ndarray"),
    ("device", lambda x, o: {**o, "accept_count": o["accept_count"].float()},
     r"HostRows.rows_output/count_output: expected integer \[N\] indices and a \[1\] count"),
    ("device", lambda x, o: {**o, "accept_count": o["accept_rows"]},
     r"HostRows.rows_output/count_output: expected integer"),
    ("device", lambda x, o: {k: v for k, v in o.items() if k != "accept_rows"},
     r"HostRows.rows_output: expected the step function's output 'accept_rows', got the outputs "
     r"\['hidden', 'tok', 'accept_count'\]"),
    ("host", lambda x, o: {**o, "extra": 3}, r"step_fn output leaf \d: expected a tensor, got int"),
])
def test_bad_output_found_at_first_step_then_fixed(mode, fault, msg):
    """The probe (first step) refuses the output before any input row is written; once the
    function is fixed the same runtime works."""
    cls = type("FaultyChooser", (Faulty, ScaleChooser), {}) if mode == "device" else Faulty
    rig = Rig(mode, model_cls=cls)
    rig.m.fault = fault
    before = rig.snapshot()
    x = rig.inputs(5)
    with pytest.raises(StepFunctionError, match=msg):
        rig.rt.step(rows=[0, 1], **x) if mode == "host" else rig.rt.step(**x)
    rig.assert_unchanged(before)  # arena, KV state (only the scratch slot is written)... identical
    rig.m.fault = None
    warm(rig, 3)


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("fault,msg", [
    (lambda x, o: {**o, "hidden": o["hidden"][:4]} if x["tokens"].shape[0] == 8 else None,
     r"step_fn output leaf 0: expected leading dimension 8 \(the step width\), got shape \(4, 32\)"),
    (lambda x, o: {**o, "hidden": o["hidden"].sum()} if x["tokens"].shape[0] == 8 else None,
     r"step_fn output leaf 0: expected leading dimension 8 .*got shape \(\)"),
    (lambda x, o: (o["hidden"], o["tok"]) if x["tokens"].shape[0] == 8 else None,
     r"(?s)step_fn output: expected the same structure at every width .* at width 8"),
    (lambda x, o: {"hidden": o["hidden"], "tok": o["tok"], "more": o["tok"]} if x["tokens"].shape[0] == 8 else None,
     r"(?s)step_fn output: expected the same structure at every width .* at width 8"),
])
def test_output_wrong_at_one_width_only(fault, msg):
    """A width whose output is wrong raises StepFunctionError; the other widths keep
    working. The step function did run before its output was checked (its KV writes
    happened), so the reference runs that step too."""
    rig = Rig(None, model_cls=Faulty)
    warm(rig, 2)
    rig.m.fault = fault
    rig.ref.fault = None
    x = rig.inputs(6)  # width 8
    with pytest.raises(StepFunctionError, match=msg):
        rig.rt.step(**x)
    rig.reference(x)  # the model ran: keep the reference's KV slots in step
    rig.check_state()
    for T in [3, 9, 70, 130]:  # widths 4, 16, dynamic, sliced (96 + 34 at width 64)
        rig.step(T)


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_dynamic_fn_with_another_structure():
    m, ref = SlotModel("cpu", seed=3), SlotModel("cpu", seed=3)

    def dyn(x):
        out = m(x)
        return {"hidden": out["hidden"]}  # drops "tok": not the structure step_fn returns
    rt = GraphRuntime(m, m.specs(), graphs=False, device="cpu", dynamic_fn=dyn)
    x = m.random_inputs(5)
    torch.testing.assert_close(rt.step(**x).outputs["hidden"], ref(x)["hidden"], **TOL)
    x = m.random_inputs(80)
    with pytest.raises(StepFunctionError, match=r"(?s)step_fn output: expected the same structure .* at width 80"):
        rt.step(**x)
    ref(x)
    x = m.random_inputs(40)
    torch.testing.assert_close(rt.step(**x).outputs["hidden"], ref(x)["hidden"], **TOL)
    torch.testing.assert_close(m.state[:-1], ref.state[:-1], **TOL)


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("mode", MODES)
def test_step_function_raising_propagates_unwrapped_and_touches_no_slot(mode):
    """An exception from the step function (before it writes state) reaches the caller as
    is; no KV slot, host slot or snapshot is written and a held handle still reads its own
    rows; the next step matches the reference."""
    cls = type("FaultyChooser", (Faulty, ScaleChooser), {}) if mode == "device" else Faulty

    class Raises(cls):
        def __call__(self, x):
            if self.boom and x["tokens"].shape[0] != 64:  # the probe (width 64) passes
                raise ZeroDivisionError("user bug at width %d" % x["tokens"].shape[0])
            return super().__call__(x)
    Raises.boom = False
    rig = Rig(mode, model_cls=Raises, depth=4)
    warm(rig, 1, hold=mode in ("host", "device"))  # ring slot 0 held
    warm(rig, 1)                                    # slot 1, released
    state, ring = rig.snapshot()["state"], rig.snapshot().get("ring")
    rig.m.boom = True
    x = rig.inputs(3)
    with pytest.raises(ZeroDivisionError, match="user bug at width 4"):
        rig.rt.step(rows=[0], **x) if mode == "host" else rig.rt.step(**x)
    after = rig.snapshot()
    assert torch.equal(after["state"], state)
    if ring is not None:
        assert torch.equal(after["ring"][0], ring[0]) and torch.equal(after["ring"][1], ring[1])
    rig.check_kept()
    rig.m.boom = False
    warm(rig, 1)
    rig.check_kept()
    for h, _ in rig.kept:
        h.release()
    rig.kept.clear()
    warm(rig, 3)


class Reentrant(SlotModel):
    """Calls its own runtime's step from inside the step function (at width 4)."""

    rig = None
    errors: list

    def __call__(self, x):
        if self.rig is not None and x["tokens"].shape[0] == 4:
            try:
                self.rig.rt.step(**self.rig.inputs(2))
            except BusyError as e:
                self.errors.append(e)
        return super().__call__(x)


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_reentrant_step_from_inside_the_step_function_is_busy():
    rig = Rig("host", model_cls=Reentrant)
    warm(rig, 1)
    rig.m.rig, rig.m.errors = rig, []
    rig.step(3)  # the inner call is refused, the outer one completes and matches
    assert len(rig.m.errors) == 1
    assert re.search(r"GraphRuntime.step: another thread is inside step\(\) or commit\(\) of this runtime", str(rig.m.errors[0]))
    rig.m.rig = None
    warm(rig, 2)


# ======================================================================================
# GPU (marked cuda; was test_runtime_cuda.py)
# GPU tests of the core runtime: replay == graphs off bit for bit, one shared pool,
# capture failures reported and recovered from.
# ======================================================================================
STEPS = list(range(1, 66)) + [96, 97, 130]


def pair(**kw):
    on, off = SlotModel("cuda", seed=3), SlotModel("cuda", seed=3)
    return (on, GraphRuntime(on, on.specs(), graphs=True, **kw),
            off, GraphRuntime(off, off.specs(), graphs=False, device="cuda", **kw))


@pytest.mark.cuda
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


@pytest.mark.cuda
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


@pytest.mark.cuda
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


@pytest.mark.cuda
def test_capture_failure_reported_and_recovered():
    m = SyncsAt8("cuda")
    rt = GraphRuntime(m, m.specs())
    with pytest.raises(CaptureError) as ei:
        rt.capture()
    e = ei.value
    assert e.width == 8
    assert "width 8" in str(e)
    assert "item" in str(e) or "_local_scalar_dense" in str(e), str(e)
    assert "test_runtime.py" in str(e), str(e)  # names the user's line
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


@pytest.mark.cuda
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


@pytest.mark.cuda
def test_every_host_tensor_form_reaches_the_graph_exactly():
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


@pytest.mark.cuda
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


@pytest.mark.cuda
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


@pytest.mark.cuda
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
