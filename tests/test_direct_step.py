"""The short path of a step (``DirectStep``) on a CPU: its input check takes exactly what the
general check takes as plain host rows, and its feed write leaves the feed as the general
write does. (The path itself needs fed graphs: tests/test_direct_step_cuda.py.)"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraph_rt import GraphRuntime, InputError, InputSpec
from cudagraph_rt.inputs.arena import ArenaLayout
from cudagraph_rt.inputs.feed import Feed
from cudagraph_rt.inputs.validate import Prepared, Validator
from tests.support.feed_rows import SPECS, FakeEvent, rows

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


def test_the_fast_step_result_is_the_dataclass_with_every_field():
    """StepResult.fast (the short path's constructor) takes every field, in order, and builds
    what the frozen __init__ builds: a field added to the class but not to fast fails here."""
    import dataclasses
    import inspect

    from cudagraph_rt.results import StepResult
    fields = [f.name for f in dataclasses.fields(StepResult)]
    assert list(inspect.signature(StepResult.fast).parameters) == fields
    rng = np.random.default_rng()
    values = ({"hidden": torch.from_numpy(rng.standard_normal((3, 4)))}, int(rng.integers(1, 9)), ("slices",),
              object(), (int(rng.integers(0, 4)), int(rng.integers(0, 99))), object())
    a, b = StepResult.fast(*values), StepResult(*values)
    assert type(a) is StepResult and a == b and vars(a) == vars(b)
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
