"""Host rows through the runtime, on the CPU path (graphs off) and, marked cuda, on the GPU
with graphs on: all three ways of choosing rows, the ring, and its errors."""
import gc
import threading
from collections import OrderedDict, defaultdict
from typing import NamedTuple

import numpy as np
import pytest
import torch

from cudagraph_rt import (
    BusyError, CapacityError, DeviceRowIndexError, GraphRuntime, HostRows, InputError, StaleRowsError,
    StepFunctionError,
)
from tests.support.models_for_tests import ChoosingSlotModel, SlotModel, chosen_rows
from tests.support.planting import no_whole_plan_past
from tests.support.reliability_harness import TOL, Rig, ScaleChooser, refused, warm
from tests.support.ring_hooks import host_ring

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def build(device, mode, model_cls=SlotModel, **hr):
    m, ref = model_cls(device, seed=5), model_cls(device, seed=5)
    rt = GraphRuntime(m, m.specs(), graphs=device == "cuda", device=device,
                      host_rows=HostRows(source="hidden", mode=mode, **hr))
    return m, ref, rt


def fresh_T(gen):
    return [int(t) for t in torch.randint(1, 98, (10,), generator=gen)] + [64, 65, 96, 97, 130]


@pytest.mark.parametrize("device", DEVICES)
def test_host_chosen_rows(device):
    m, ref, rt = build(device, "host")
    gen = seeded()
    for T in fresh_T(gen):
        x = m.random_inputs(T, gen=gen)
        k = int(torch.randint(0, min(T, 96) + 1, (1,), generator=gen))  # capacity: 96
        rows = torch.randperm(T, generator=gen)[:k].tolist()
        res = rt.step(rows=rows, **x)
        want = ref({n: v.to(device) for n, v in x.items()})["hidden"]
        h = res.host_rows
        assert h.count == k
        assert h.rows().device.type == "cpu"
        torch.testing.assert_close(h.rows(), want[rows].cpu(), rtol=1e-5, atol=1e-5)
        assert h.indices().tolist() == rows
        del res, h


@pytest.mark.parametrize("device", DEVICES)
def test_device_chosen_rows(device):
    # capacity for the widest step drawn (130): a device-mode step may accept every row
    m, ref, rt = build(device, "device", ChoosingSlotModel, capacity=130)
    gen = seeded()
    for T in fresh_T(gen):
        x = m.random_inputs(T, gen=gen)
        res = rt.step(**x)
        want = ref({n: v.to(device) for n, v in x.items()})
        rows = chosen_rows(want["tok"])
        h = res.host_rows
        assert h.count == len(rows), T
        assert h.indices().tolist() == rows
        torch.testing.assert_close(h.rows(), want["hidden"][rows].cpu(), rtol=1e-5, atol=1e-5)
        assert int(res.outputs["accept_count"].reshape(-1)[0]) == len(rows)


@pytest.mark.parametrize("device", DEVICES)
def test_commit_after_the_step(device):
    m, ref, rt = build(device, "commit", depth=3)
    gen = seeded()
    pending = []
    for T in [5, 17, 64, 3, 40, 1, 90]:
        x = m.random_inputs(T, gen=gen)
        res = rt.step(**x)
        want = ref({n: v.to(device) for n, v in x.items()})["hidden"]
        pending.append((res, want))
        if len(pending) == 2:  # commit the step before last: a later step ran meanwhile
            old, old_want = pending.pop(0)
            rows = [r for r in range(old.T) if r % 3 == 0]
            h = rt.commit(old, rows)
            torch.testing.assert_close(h.rows(), old_want[rows].cpu(), rtol=1e-5, atol=1e-5)
            del h
    assert rt.stats().commits == 6


def test_commit_too_late_is_stale():
    m, _, rt = build("cpu", "commit", depth=2)
    first = rt.step(**m.random_inputs(4))
    for _ in range(2):
        rt.step(**m.random_inputs(4))
    with pytest.raises(StaleRowsError):
        rt.commit(first, [0])


def test_ring_refuses_to_reuse_an_unreleased_slot():
    m, _, rt = build("cpu", "host", depth=2)
    held = [rt.step(rows=[0], **m.random_inputs(3)) for _ in range(2)]
    before = rt.state_digest()
    with pytest.raises(CapacityError, match="ring"):
        rt.step(rows=[1], **m.random_inputs(3))
    assert rt.state_digest() == before  # refused before writing
    held[0].host_rows.release()
    with pytest.raises(StaleRowsError):
        held[0].host_rows.rows()
    rt.step(rows=[1], **m.random_inputs(3))
    del held
    gc.collect()
    rt.step(rows=[1], **m.random_inputs(3))  # dropped handles free their slots


def test_late_reader_never_sees_a_later_step():
    m, ref, rt = build("cpu", "host", depth=2)
    x = m.random_inputs(6)
    first = rt.step(rows=[0, 5], **x).host_rows
    want = ref(x)["hidden"][[0, 5]]
    for _ in range(5):
        try:
            rt.step(rows=[1], **m.random_inputs(6))
        except CapacityError:
            pass
    torch.testing.assert_close(first.rows(), want)


@pytest.mark.parametrize("rows,exc,msg", [
    ([0, 6], InputError, r"rows: expected indices in \[0, 6\)"),
    ([-1], InputError, "index -1"),
    ([1, 1], InputError, "distinct"),
    ([0.5], InputError, "integer"),
    (torch.tensor([[0]]), InputError, "1-D"),
    ("0", InputError, "rows"),
    (list(range(6)) * 0 + [0, 1, 2, 3, 4, 5], None, None),
])
def test_bad_host_rows(rows, exc, msg):
    m, _, rt = build("cpu", "host", capacity=8)
    rt.step(rows=[0], **m.random_inputs(6))
    before, state = rt.state_digest(), m.state.clone()
    if exc is None:
        rt.step(rows=rows, **m.random_inputs(6))
        return
    with pytest.raises(exc, match=msg):
        rt.step(rows=rows, **m.random_inputs(6))
    assert rt.state_digest() == before and torch.equal(state, m.state)


def test_more_rows_than_capacity():
    m, _, rt = build("cpu", "host", capacity=4)
    with pytest.raises(CapacityError, match="at most 4"):
        rt.step(rows=[0, 1, 2, 3, 4], **m.random_inputs(6))


class BadChooser(SlotModel):
    def __call__(self, x):
        out = super().__call__(x)
        n = out["tok"].shape[0]
        out["accept_rows"] = torch.full((n,), n + 3, dtype=torch.int32, device=out["tok"].device)
        out["accept_count"] = torch.ones(1, dtype=torch.int32, device=out["tok"].device)
        return out


@pytest.mark.parametrize("device", DEVICES)
def test_device_index_out_of_range_flagged(device):
    m, _, rt = build(device, "device", BadChooser)
    res = rt.step(**m.random_inputs(5))
    with pytest.raises(DeviceRowIndexError, match="outside"):
        res.host_rows.rows()


def test_rows_without_host_mode_refused():
    m = SlotModel("cpu")
    rt = GraphRuntime(m, m.specs(), graphs=False, device="cpu")
    with pytest.raises(InputError, match="rows"):
        rt.step(rows=[0], **m.random_inputs(3))


# ---- device-chosen rows: counts and orders a chooser may give (issue 12, R6, R7) --------
class FixedChooser(SlotModel):
    """A chooser that returns ``rows_fn(n)`` and ``count_fn(n)`` at width n."""

    def __init__(self, *a, rows_fn, count_fn, **kw):
        super().__init__(*a, **kw)
        self.rows_fn, self.count_fn = rows_fn, count_fn

    def __call__(self, x):
        out = super().__call__(x)
        n = out["tok"].shape[0]
        out["accept_rows"] = torch.tensor(self.rows_fn(n), dtype=torch.int32)
        out["accept_count"] = torch.tensor([self.count_fn(n)], dtype=torch.int32)
        return out


def chooser_runtime(rows_fn, count_fn, **kw):
    m = FixedChooser("cpu", seed=7, rows_fn=rows_fn, count_fn=count_fn)
    ref = SlotModel("cpu", seed=7)
    rt = GraphRuntime(m, m.specs(), graphs=False, device="cpu",
                      host_rows=HostRows(source="hidden", mode="device", **kw.pop("hr", {})), **kw)
    return m, ref, rt


@pytest.mark.parametrize("T,count", [(3, 5), (4, 5), (3, -1)])
def test_device_count_beyond_the_rows_is_flagged_never_shipped_as_padding(T, count):
    """At T=3 (width 4) a count of 5 used to ship row 3, a padding row."""
    m, _, rt = chooser_runtime(lambda n: list(range(n)), lambda n: count)
    res = rt.step(**m.random_inputs(T, gen=torch.Generator().manual_seed(T)))
    with pytest.raises(DeviceRowIndexError, match=r"accept count was negative or above the rows the step ran"):
        res.host_rows.rows()


def test_device_rows_listed_highest_first_in_a_sliced_step_lose_none():
    """widths (1, 2, 4, 8), T=11: slices of 8 and 3 (width 4). A chooser listing every row
    highest first, padding row included (count = width), used to lose row 8."""
    m, ref, rt = chooser_runtime(lambda n: list(range(n - 1, -1, -1)), lambda n: n,
                                 widths=(1, 2, 4, 8), dynamic_limit=8, hr=dict(capacity=16))
    x = m.random_inputs(11, gen=seeded())
    res = rt.step(**x)
    assert [(s.width, s.length) for s in res.slices] == [(8, 8), (4, 3)]
    h = res.host_rows
    assert h.indices().tolist() == list(range(11))
    torch.testing.assert_close(h.rows(), ref(x)["hidden"], rtol=1e-5, atol=1e-5)
    assert int(res.outputs["accept_count"][0]) == 11


def test_device_count_beyond_a_slices_width_is_flagged_as_a_count():
    m, _, rt = chooser_runtime(lambda n: list(range(n)), lambda n: n + 1,
                               widths=(1, 2, 4, 8), dynamic_limit=8, hr=dict(capacity=16))
    res = rt.step(**m.random_inputs(11, gen=seeded()))
    with pytest.raises(DeviceRowIndexError, match=r"accept count was negative or above"):
        res.host_rows.rows()


def test_device_mode_default_capacity_refuses_wider_steps_up_front():
    """The default capacity is the runtime's rows (96); a sliced step may accept all its
    rows, so a wider step is refused before anything is written, not flagged at read."""
    m, ref, rt = build("cpu", "device", ChoosingSlotModel)
    gen = seeded()
    x = m.random_inputs(5, gen=gen)
    rt.step(**x)
    ref(x)
    before = rt.state_digest()
    with pytest.raises(CapacityError, match=r"step inputs: expected at most 96 rows in HostRows\(mode='device'\).*"
                                            r"got 97 rows"):
        rt.step(**m.random_inputs(97, gen=gen))
    assert rt.state_digest() == before
    x = m.random_inputs(96, gen=gen)
    h = rt.step(**x).host_rows  # the widest step it takes
    want = ref(x)
    rows = chosen_rows(want["tok"])
    assert h.indices().tolist() == rows
    torch.testing.assert_close(h.rows(), want["hidden"][rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_a_step_refused_for_its_size_is_not_planned_whole(monkeypatch, graphs):
    """The refusal above came after the step had planned every slice of its rows (O(T /
    rows) slices: 52 here, millions for a step of 10**8 rows). The first slice (what the
    host-row check needs) is worked out alone; the whole plan waits until the step is
    taken (issue 35)."""
    T = 5000
    m = ChoosingSlotModel("cpu", seed=5, n_slots=T + 64)
    rt = GraphRuntime(m, m.specs(), graphs=graphs, device="cpu", host_rows=HostRows(source="hidden", mode="device"))
    gen = seeded()
    rt.step(**m.random_inputs(5, gen=gen))
    x = m.random_inputs(T, gen=gen)
    before = rt.state_digest()
    no_whole_plan_past(monkeypatch, 96)
    with pytest.raises(CapacityError, match=rf"step inputs: expected at most 96 rows .* got {T} rows"):
        rt.step(**x)
    assert rt.state_digest() == before


def test_device_accepting_more_than_an_explicit_capacity_names_the_capacity():
    m, _, rt = chooser_runtime(lambda n: list(range(n)), lambda n: n, hr=dict(capacity=4))
    res = rt.step(**m.random_inputs(20, gen=seeded()))
    with pytest.raises(DeviceRowIndexError, match=r"accepted more rows than HostRows.capacity \(4\)"):
        res.host_rows.rows()


# ---- commit mode: more indices than the rows block (R8) ---------------------------------
def test_commit_with_more_duplicate_indices_than_rows_is_a_capacity_error():
    m = SlotModel("cpu", seed=2)
    rt = GraphRuntime(m, m.specs(), graphs=False, device="cpu", widths=(1, 2, 4, 8), dynamic_limit=8,
                      host_rows=HostRows(source="hidden", mode="commit", capacity=50, allow_duplicates=True))
    r = rt.step(**m.random_inputs(6, gen=seeded()))
    before = rt.state_digest()
    with pytest.raises(CapacityError, match=r"rows: expected at most 8 indices \(the runtime's rows\), got 40"):
        rt.commit(r, [0] * 40)
    assert rt.state_digest() == before
    assert rt.commit(r, [0] * 8).count == 8  # the window was not used up


def seeded() -> torch.Generator:
    seed = int(torch.randint(0, 2**31, (1,)))
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


# ---- device-chosen rows on the graph path: static outputs overwritten by the next replay --
# (issue 22) Emulated graphs run the graph path's code on a CPU: each replay of a width
# writes the same static output tensors, as a CUDA graph's replay does.
GRAPH_PATHS = [False, "emulate", pytest.param(True, marks=pytest.mark.cuda)]
GRAPH_IDS = ["graphs-off", "emulated", "cuda-graphs"]


def scale_chosen(x) -> list[int]:
    return [i for i, s in enumerate(x["scale"][:, 0].tolist()) if s > 0.5]


@pytest.mark.parametrize("graphs", GRAPH_PATHS, ids=GRAPH_IDS)
@pytest.mark.parametrize("rows_dtype,count_dtype", [(torch.int64, torch.int32), (torch.int32, torch.int64),
                                                    (torch.int64, torch.int64), (torch.int32, torch.int32)],
                         ids=["int64-rows", "int64-count", "int64-both", "int32"])
def test_sliced_device_steps_ship_the_chosen_rows_whatever_the_choosers_dtype(graphs, rows_dtype, count_dtype):
    """widths (1, 2, 4), dynamic_limit 4: a 12-row step is three slices replaying the
    width-4 graph. A slice's record used to keep the graph's own int64 output (``.long()``
    is no copy), which the next slice's replay overwrote: host rows [1, 5, 9, 10] for
    [2, 4, 9, 10] on the H200; int32 and graphs off were right."""
    device = "cuda" if graphs is True else "cpu"
    m = ScaleChooser(device, seed=5, rows_dtype=rows_dtype, count_dtype=count_dtype)
    ref = SlotModel(device, seed=5)
    rt = GraphRuntime(m, m.specs(), widths=(1, 2, 4), dynamic_limit=4, graphs=graphs, device=device,
                      host_rows=HostRows(source="hidden", mode="device", capacity=16))
    gen = seeded()
    for T in [12, 11, 9, 12, 4, 3, 7]:
        x = m.random_inputs(T, gen=gen)
        res = rt.step(**x)
        want = ref({n: v.to(device) for n, v in x.items()})["hidden"]
        chosen = scale_chosen(x)
        h = res.host_rows
        assert h.indices().tolist() == chosen, (T, [(s.width, s.length) for s in res.slices])
        torch.testing.assert_close(h.rows(), want[chosen].cpu(), rtol=1e-5, atol=1e-5)
        count, rows = res.outputs["accept_count"], res.outputs["accept_rows"]
        assert (rows.dtype, count.dtype) == (rows_dtype, count_dtype)
        assert int(count.reshape(-1)[0]) == len(chosen) and rows[:len(chosen)].tolist() == chosen
        h.release()


class AcceptEveryRow(SlotModel):
    """A chooser that breaks the contract: it accepts every row it runs, padding rows
    included, with an int64 count."""

    def __call__(self, x):
        out = super().__call__(x)
        n = out["tok"].shape[0]
        out["accept_rows"] = torch.arange(n, device=out["tok"].device)
        out["accept_count"] = torch.full((1,), n, dtype=torch.int64, device=out["tok"].device)  # no host copy
        return out


@pytest.mark.parametrize("graphs", GRAPH_PATHS, ids=GRAPH_IDS)
def test_device_mode_outputs_say_what_was_shipped_one_slice_or_sliced(graphs):
    """``accept_count`` / ``accept_rows`` of a step are the rows shipped (padding rows
    dropped), in the chooser's dtypes, whether the step ran one slice or several: a
    one-slice step used to hand out the chooser's own count (8 for T=5 at width 8)."""
    device = "cuda" if graphs is True else "cpu"
    m, ref = AcceptEveryRow(device, seed=3), SlotModel(device, seed=3)
    rt = GraphRuntime(m, m.specs(), graphs=graphs, device=device,
                      host_rows=HostRows(source="hidden", mode="device", capacity=256))
    gen = seeded()
    for T in [5, 33, 80, 130, 3]:  # padded, padded, dynamic, sliced (96 + 34), padded again
        x = m.random_inputs(T, gen=gen)
        res = rt.step(**x)
        ref({n: v.to(device) for n, v in x.items()})
        count, rows = res.outputs["accept_count"], res.outputs["accept_rows"]
        assert count.dtype == rows.dtype == torch.int64
        assert count.reshape(-1).tolist() == [T], (T, [(s.width, s.length) for s in res.slices])
        assert rows[:T].tolist() == list(range(T))
        assert res.host_rows.indices().tolist() == list(range(T))
        res.host_rows.release()


# ======================================================================================
# From the bad-input catalogue (issue 7): HostRows' configuration, host-row
# choices, device-chosen rows, commit().
# Each test runs graphs off, then with emulated graphs (rig_graphs); a refused call is
# checked for its error class and message, for nothing written (Rig.snapshot: the static
# arena, the KV state, the host-row ring, the commit snapshots, the counters) and for a
# valid step after it that matches the eager reference (tests.support.reliability_harness.refused).
# ======================================================================================
@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("kw,msg", [
    (dict(mode="both"), r"HostRows.mode: expected 'host', 'device' or 'commit', got 'both'"),
    (dict(depth=1), r"HostRows.depth: expected an int >= 2, got 1"),
    (dict(depth=True), r"HostRows.depth: expected an int >= 2, got True"),
    (dict(depth=2.0), r"HostRows.depth: expected an int >= 2, got 2.0"),
    (dict(capacity=0), r"HostRows.capacity: expected a positive int or None, got 0"),
    (dict(capacity=8.0), r"HostRows.capacity: expected a positive int or None, got 8.0"),
    (dict(capacity=False), r"HostRows.capacity: expected a positive int or None, got False"),
    # issue 35: taken as they came (allow_duplicates="no" allowed duplicates; source=True read output 1)
    (dict(allow_duplicates="no"), r"HostRows.allow_duplicates: expected True or False, got 'no'"),
    (dict(allow_duplicates=1), r"HostRows.allow_duplicates: expected True or False, got 1"),
    (dict(source=True), r"HostRows.source: expected an output's name \(str\) or index \(int\), got True"),
    (dict(rows_output=None), r"HostRows.rows_output: expected an output's name"),
    (dict(count_output=1.0), r"HostRows.count_output: expected an output's name"),
])
def test_bad_host_rows_config(kw, msg):
    with pytest.raises(InputError, match=msg):
        HostRows(**kw)


def test_numpy_bool_allow_duplicates_is_the_plain_bool():
    assert HostRows(allow_duplicates=np.True_) == HostRows(allow_duplicates=True)
    assert type(HostRows(allow_duplicates=np.False_).allow_duplicates) is bool


class RaisesBelow64(SlotModel):
    boom = False

    def __call__(self, x):
        if self.boom and x["tokens"].shape[0] != 64:
            raise ZeroDivisionError("user bug")
        return super().__call__(x)


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_a_failed_step_does_not_use_up_a_ring_turn():
    rig = Rig("host", model_cls=RaisesBelow64, depth=3)
    rig.step(4, rows=[0], hold=True)
    rig.step(4, rows=[1], hold=True)
    rig.m.boom = True
    x = rig.inputs(3)
    with pytest.raises(ZeroDivisionError):
        rig.rt.step(rows=[0], **x)
    rig.m.boom = False
    rig.step(3, rows=[2])  # one of the three slots is free


# ---- host-row choices (rows=)
HOST_ROW_CASES = [
    ("bool tensor", torch.tensor([True, False]), InputError, r"rows: expected integer row indices, got dtype torch.bool"),
    ("float tensor", torch.tensor([0.0, 1.0]), InputError, r"rows: expected integer row indices, got dtype torch.float32"),
    ("numpy float", np.array([0.0]), InputError, r"rows: expected integer row indices, got dtype torch.float64"),
    ("numpy 2-D", np.zeros((1, 2), np.int64), InputError, r"rows: expected a 1-D list of row indices, got shape \(1, 2\)"),
    ("meta tensor", torch.zeros(1, dtype=torch.long, device="meta"), InputError,
     r"rows: expected host row indices \(list, numpy or CPU tensor\), got a tensor on meta"),
    ("set", {0, 1}, InputError, r"rows: expected a list, numpy array or CPU tensor of row indices, got set"),
    ("int", 3, InputError, r"rows: expected a list, numpy array or CPU tensor of row indices, got int"),
    ("generator", (i for i in range(2)), InputError, r"rows: expected a list, numpy array or CPU tensor"),
    ("bools in a list", [True, 1], InputError, r"rows: expected integer row indices, got \[True, 1\]"),
    ("None in a list", [0, None], InputError, r"rows: expected integer row indices"),
    ("index == T", [0, 9], InputError, r"rows: expected indices in \[0, 9\), got index 9"),
    ("int32 tensor below 0", torch.tensor([3, -2], dtype=torch.int32), InputError, r"rows: expected indices in \[0, 9\), got index -2"),
    ("duplicates numpy", np.array([4, 4]), InputError, r"rows: expected distinct indices"),
    ("over capacity", list(range(9)), CapacityError, r"rows: expected at most 8 rows \(HostRows.capacity\), got 9 rows"),
    # issue 22: NotImplementedError / RuntimeError / TypeError before, now named
    ("sparse tensor", torch.tensor([0, 1]).to_sparse(), InputError,
     r"rows: expected a dense tensor of integer row indices, got layout torch.sparse_coo"),
    ("quantized tensor", "quantized", InputError, r"rows: expected a dense tensor of integer row indices, got .*qint8"),
    ("numpy longdouble", np.array([0, 1], np.longdouble), InputError, r"rows: expected integer row indices"),
    ("range past the capacity, not listed", range(10**12), CapacityError,
     r"rows: expected at most 8 rows \(HostRows.capacity\), got 1000000000000 rows"),
]


def _rows(rows):
    if isinstance(rows, str):  # made here: building it at collection would warn there
        return torch.quantize_per_tensor(torch.tensor([0.0, 1.0]), 1.0, 0, torch.qint8)
    return rows


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("name,rows,exc,msg", HOST_ROW_CASES, ids=[c[0] for c in HOST_ROW_CASES])
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_bad_host_row_choices(name, rows, exc, msg):
    rig = Rig("host", capacity=8)
    warm(rig, 2, hold=True)
    x = rig.inputs(9)
    refused(rig, exc, msg, lambda: rig.rt.step(rows=_rows(rows), **x))


NEW_ROW_CASES = [c for c in HOST_ROW_CASES if c[0] in (
    "sparse tensor", "quantized tensor", "numpy longdouble", "range past the capacity, not listed")]


class NotToBeListed(tuple):
    """A tuple of row indices that fails the test if anyone iterates it: a request over
    the capacity must be refused from its length alone (``rows=range(10**7)`` was listed
    first: seconds of host time)."""

    def __iter__(self):
        raise AssertionError("rows over the capacity were iterated before the capacity check")


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("call", ["step", "commit"])
def test_rows_over_the_capacity_are_refused_before_they_are_read(call):
    rig = Rig("host" if call == "step" else "commit", capacity=8)
    res, _ = rig.step(9)
    rows = NotToBeListed(range(9))
    go = (lambda: rig.rt.step(rows=rows, **rig.inputs(9))) if call == "step" else (lambda: rig.rt.commit(res, rows))
    refused(rig, CapacityError, r"rows: expected at most 8 rows \(HostRows.capacity\), got 9 rows", go)


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
@pytest.mark.parametrize("name,rows,exc,msg", NEW_ROW_CASES, ids=[c[0] for c in NEW_ROW_CASES])
def test_bad_commit_rows_of_new_kinds(name, rows, exc, msg):
    rig = Rig("commit", capacity=8)
    res, _ = rig.step(9)
    refused(rig, exc, msg, lambda: rig.rt.commit(res, _rows(rows)))


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("rows", [range(3, 7), np.array([5, 1], np.int16), [np.int64(2), 0], torch.tensor([8, 0])[:1],
                                  torch.arange(9)[::4], [], np.array([6, 2, 0], ">i8"), np.array([3, 8], ">u2"),
                                  [np.uint64(4), np.uint64(1)]])
def test_valid_host_row_kinds(rows):
    rig = Rig("host", capacity=8)
    warm(rig, 1)
    want = list(np.asarray(list(rows) if not isinstance(rows, torch.Tensor) else rows.tolist(), dtype=np.int64))
    res, ref = rig.step(9, rows=rows, hold=True)
    assert res.host_rows.indices().tolist() == want


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("rows", [np.array([0, None]), [0, 2**70], np.array([0, 2**63 + 1], np.uint64)],
                         ids=["numpy object", "huge int", "numpy uint64 beyond int64"])
def test_odd_host_row_types_are_input_errors(rows):
    rig = Rig("host", capacity=8)
    warm(rig, 1)
    x = rig.inputs(9)
    refused(rig, InputError, r"rows: expected", lambda: rig.rt.step(rows=rows, **x))


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("dtype", [np.uint64, np.uint32])
def test_unsigned_host_rows_are_accepted(dtype):
    rig = Rig("host", capacity=8)
    warm(rig, 1)
    rig.step(9, rows=np.array([8, 0, 3], dtype))


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("mode", ["device", "commit", None])
def test_rows_refused_unless_host_mode(mode):
    rig = Rig(mode)
    warm(rig, 2)
    x = rig.inputs(4)
    refused(rig, InputError, r"rows: expected None unless the runtime has HostRows\(mode='host'\), got row indices",
            lambda: rig.rt.step(rows=[0], **x))


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_ring_full_on_a_sliced_step_is_refused_before_any_slice_runs():
    rig = Rig("host", depth=2)
    rig.step(130, rows=[0, 129], hold=True)
    rig.step(5, rows=[1], hold=True)
    calls = rig.rt.stats().slices
    x = rig.inputs(200)
    before = rig.snapshot()
    with pytest.raises(CapacityError, match=r"host-row ring: slot 0 still holds step 1's rows; release\(\) or drop"):
        rig.rt.step(rows=[3], **x)
    rig.assert_unchanged(before)
    assert rig.rt.stats().slices == calls
    rig.check_kept()
    h, _ = rig.kept.pop(0)
    h.release()
    rig.step(200, rows=[0, 199])
    rig.check_kept()


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_device_rows_over_capacity_flagged_not_written_past_the_slot():
    rig = Rig("device", capacity=4)
    warm_x = rig.inputs(20)
    warm_x["scale"][:, 0] = torch.linspace(0.0, 1.0, 20)  # 9 rows > 0.5: over capacity 4
    ring_other = bits_other_slots(rig)
    res = rig.rt.step(**warm_x)
    rig.reference(warm_x)
    with pytest.raises(DeviceRowIndexError, match=r"accepted more rows than HostRows.capacity \(4\)"):
        res.host_rows.rows()
    assert all(torch.equal(a, b) for a, b in zip(ring_other, bits_other_slots(rig, skip=res.host_rows.slot)))
    del res
    gc.collect()
    warm(rig, 3)


def bits_other_slots(rig, skip=None):
    ring = host_ring(rig.rt)
    if ring is None:  # before the first step: the probe has not built it yet
        rig.rt.capture()
        ring = host_ring(rig.rt)
    skip = ring._next if skip is None else skip
    # as bytes: the ring starts uninitialised, and a NaN pattern there is never equal to itself
    return [ring.dst[s].clone().view(torch.uint8) for s in range(ring.depth + 1) if s != skip]


# ---- device-chosen rows: padding rows and out-of-range rows, single slice vs sliced --
class AcceptAll(SlotModel):
    """A chooser that accepts every row it sees, padding rows included (a chooser that
    breaks the contract). A step must never ship a padding row's output."""

    def __call__(self, x):
        out = super().__call__(x)
        n = out["tok"].shape[0]
        out["accept_rows"] = torch.arange(n, dtype=torch.int32)
        out["accept_count"] = torch.tensor([n], dtype=torch.int32)
        return out


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("T", [5, 33, 80, 130, 250])  # padded, unpadded (dynamic) and sliced steps
def test_device_mode_never_ships_padding_rows(T):
    rig = Rig("device", model_cls=AcceptAll, capacity=256)
    x = rig.inputs(T)
    res = rig.rt.step(**x)
    want = rig.reference(x)["hidden"]
    assert res.host_rows.count == T
    assert res.host_rows.indices().tolist() == list(range(T))
    torch.testing.assert_close(res.host_rows.rows(), want.cpu(), **TOL)


class OutOfRange(SlotModel):
    def __call__(self, x):
        out = super().__call__(x)
        n = out["tok"].shape[0]
        out["accept_rows"] = torch.full((n,), n + 3, dtype=torch.int32)
        out["accept_count"] = torch.ones(1, dtype=torch.int32)
        return out


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("T", [5, 80])
def test_device_index_out_of_range_flagged_single_slice(T):
    rig = Rig("device", model_cls=OutOfRange)
    res = rig.rt.step(**rig.inputs(T))
    with pytest.raises(DeviceRowIndexError, match=rf"outside \[0, {T}\)"):
        res.host_rows.rows()


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_device_index_out_of_range_flagged_sliced():
    rig = Rig("device", model_cls=OutOfRange)
    res = rig.rt.step(**rig.inputs(130))
    with pytest.raises(DeviceRowIndexError, match=r"outside \[0, 130\)"):
        res.host_rows.rows()


class TupleChooser(ScaleChooser):
    def __call__(self, x):
        out = super().__call__(x)
        return (out["hidden"], out["accept_rows"], out["accept_count"])


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("T", [5, 40, 130, 250])
def test_tuple_output_device_rows_shipped(T):
    m, ref = TupleChooser("cpu", seed=2), TupleChooser("cpu", seed=2)
    rt = GraphRuntime(m, m.specs(), graphs=False, device="cpu",
                      host_rows=HostRows(source=0, rows_output=1, count_output=2, mode="device", capacity=256))
    x = m.random_inputs(T)
    res = rt.step(**x)
    want = chosen_by_scale_tuple(x)
    assert res.host_rows.indices().tolist() == want
    torch.testing.assert_close(res.host_rows.rows(), ref(x)[0][want], **TOL)


def chosen_by_scale_tuple(x):
    return [i for i, s in enumerate(x["scale"][:, 0].tolist()) if s > 0.5]


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_tuple_output_device_count_of_a_sliced_step():
    m = TupleChooser("cpu", seed=2)
    rt = GraphRuntime(m, m.specs(), graphs=False, device="cpu",
                      host_rows=HostRows(source=0, rows_output=1, count_output=2, mode="device", capacity=256))
    x = m.random_inputs(130)
    res = rt.step(**x)
    want = chosen_by_scale_tuple(x)
    assert int(res.outputs[2].reshape(-1)[0]) == len(want)
    assert res.outputs[1][:len(want)].tolist() == want


# ---- commit()
@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("mode", [None, "host", "device"])
def test_commit_on_a_non_commit_runtime(mode):
    rig = Rig(mode)
    res, _ = rig.step(6)
    refused(rig, InputError, rf"commit\(\): expected a runtime built with HostRows\(mode='commit'\), got mode {mode!r}",
            lambda: rig.rt.commit(res, [0]))


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("obj,got", [(None, "NoneType"), ({"T": 3}, "dict"), ("result", "str")])
def test_commit_of_a_foreign_object(obj, got):
    rig = Rig("commit")
    warm(rig, 2)
    refused(rig, InputError, rf"result: expected a StepResult of this runtime, got {got}", lambda: rig.rt.commit(obj, [0]))


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_commit_of_a_step_result_from_another_runtime():
    a, b = Rig("commit", seed=1), Rig("commit", seed=2)
    ra, _ = a.step(6)
    b.step(6)
    before = b.snapshot()
    with pytest.raises(InputError, match=r"result: expected a StepResult of this runtime"):
        b.rt.commit(ra, [0, 1])
    b.assert_unchanged(before)


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_commit_of_a_sliced_step():
    rig = Rig("commit")
    res, _ = rig.step(130)
    assert res.snapshot is None
    refused(rig, CapacityError, r"result: expected a one-slice step \(sliced steps keep no snapshot\), got a step of 2 slices",
            lambda: rig.rt.commit(res, [0]))


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_stale_commit_writes_nothing():
    rig = Rig("commit", depth=3)
    first, want = rig.step(7)
    rig.step(3)
    rig.step(90)  # dynamic, one slice: takes a snapshot slot too
    rig.step(20)
    refused(rig, StaleRowsError, r"commit: the snapshot of that step was reused by a later step \(commit within 3 steps\)",
            lambda: rig.rt.commit(first, [0]))


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_commit_just_inside_the_window_ships_the_right_rows():
    rig = Rig("commit", depth=3)
    first, want = rig.step(7)
    rig.step(130)  # sliced: keeps no snapshot, so it does not use up the window
    rig.step(3)
    rig.step(64)
    rows = [6, 0, 3]
    h = rig.rt.commit(first, rows)
    torch.testing.assert_close(h.rows(), want["hidden"][rows], **TOL)
    assert h.indices().tolist() == rows
    h2 = rig.rt.commit(first, [1])  # the same step twice: a second handle
    torch.testing.assert_close(h2.rows(), want["hidden"][[1]], **TOL)
    torch.testing.assert_close(h.rows(), want["hidden"][rows], **TOL)


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("rows,exc,msg", [
    ([7], InputError, r"rows: expected indices in \[0, 7\), got index 7"),
    ([1, 1], InputError, r"rows: expected distinct indices"),
    ([-1], InputError, r"rows: expected indices in \[0, 7\), got index -1"),
    (torch.tensor([0.5]), InputError, r"rows: expected integer row indices, got dtype torch.float32"),
    (None, InputError, r"rows: expected a list, numpy array or CPU tensor of row indices, got NoneType"),
    (list(range(7)), CapacityError, r"rows: expected at most 6 rows \(HostRows.capacity\), got 7 rows"),
])
def test_commit_with_bad_rows(rows, exc, msg):
    rig = Rig("commit", capacity=6)
    res, want = rig.step(7)
    refused(rig, exc, msg, lambda: rig.rt.commit(res, rows))
    h = rig.rt.commit(res, [6, 2])
    torch.testing.assert_close(h.rows(), want["hidden"][[6, 2]], **TOL)


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_commit_with_the_ring_full():
    rig = Rig("commit", depth=2)
    a, wa = rig.step(5)
    held = [rig.rt.commit(a, [0]), rig.rt.commit(a, [1, 2])]
    b, wb = rig.step(4)
    refused(rig, CapacityError, r"host-row ring: slot 0 still holds step 1's rows", lambda: rig.rt.commit(b, [0]))
    torch.testing.assert_close(held[0].rows(), wa["hidden"][[0]], **TOL)
    torch.testing.assert_close(held[1].rows(), wa["hidden"][[1, 2]], **TOL)
    held[0].release()
    with pytest.raises(StaleRowsError):
        held[0].rows()
    # slot 0 is free again: a new step's commit gets it
    c = rig.rt.commit(rig.step(3)[0], [2])
    assert c.count == 1


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_commit_from_a_second_thread_is_busy():
    gate, release = threading.Event(), threading.Event()
    rig = Rig("commit")
    res, want = rig.step(6)

    class Slow(SlotModel):
        def __call__(self, x):
            if x["tokens"].shape[0] == 2:
                gate.set()
                release.wait(10)
            return SlotModel.__call__(self, x)
    rig.m.__class__ = Slow
    x = rig.inputs(2)
    t = threading.Thread(target=lambda: rig.rt.step(**x))
    t.start()
    try:
        assert gate.wait(10)
        with pytest.raises(BusyError, match=r"GraphRuntime.commit: another thread is inside step\(\) or commit\(\) of this runtime"):
            rig.rt.commit(res, [0])
    finally:
        release.set()
        t.join()
    rig.reference(x)
    rig.m.__class__ = SlotModel
    h = rig.rt.commit(res, [0, 3])
    torch.testing.assert_close(h.rows(), want["hidden"][[0, 3]], **TOL)


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_duplicate_host_rows_beyond_the_rows_a_step_runs_are_a_capacity_error():
    m, ref = SlotModel("cpu", seed=4), SlotModel("cpu", seed=4)
    rt = GraphRuntime(m, m.specs(), graphs=False, device="cpu",
                      host_rows=HostRows(source="hidden", mode="host", capacity=300, allow_duplicates=True))
    seed = int(torch.randint(0, 2**31, (1,)))
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    rt.step(**m.random_inputs(3, gen=gen))
    ref.state.copy_(m.state)
    for T, n in [(3, 4), (70, 70)]:  # padded to width 4; the dynamic path runs exactly 70
        x = m.random_inputs(T, gen=gen)
        before, state = rt.state_digest(), m.state.clone()
        with pytest.raises(CapacityError, match=rf"rows: expected at most {n} indices in a step that runs {n} rows, "
                                                rf"got {n + 1}"):
            rt.step(rows=[1] * (n + 1), **x)
        assert before == rt.state_digest() and torch.equal(state, m.state)
        h = rt.step(rows=[1] * n, **x).host_rows  # one index per row it runs: fine
        want = ref(x)["hidden"]
        torch.testing.assert_close(h.rows(), want[[1] * n], rtol=1e-5, atol=1e-5)
        h.release()


# ---- the step function's output container, in every mode (issue 35) -------------------
class ChooserOutputs(NamedTuple):
    hidden: torch.Tensor
    tok: torch.Tensor
    accept_rows: torch.Tensor
    accept_count: torch.Tensor


class StepOutputs(NamedTuple):
    hidden: torch.Tensor
    tok: torch.Tensor


FIELDS = ChooserOutputs._fields


def _named(d):
    return ChooserOutputs(**d) if len(d) == 4 else StepOutputs(**d)


# name -> (how the step packs its outputs, (source, rows_output, count_output) keys)
CONTAINERS = {
    "named-tuple-by-index": (_named, (0, 2, 3)),
    "named-tuple-by-field": (_named, FIELDS[:1] + FIELDS[2:]),
    "named-tuple-from-the-end": (_named, (0, -2, -1)),
    "ordered-dict": (lambda d: OrderedDict((k, d[k]) for k in reversed(d)), FIELDS[:1] + FIELDS[2:]),
    "defaultdict": (lambda d: defaultdict(list, d), FIELDS[:1] + FIELDS[2:]),
    "list": (lambda d: list(d.values()), (0, 2, 3)),
    "tuple": (lambda d: tuple(d.values()), (0, 2, 3)),
}


class PackedChooser(ScaleChooser):
    """ScaleChooser whose outputs come in another container than a dict (``pack``); with
    ``chooses`` False, only SlotModel's (host and commit mode: no [1] count)."""

    pack = staticmethod(dict)
    chooses = True

    def __call__(self, x):
        out = super().__call__(x) if self.chooses else SlotModel.__call__(self, x)
        return self.pack(out)


def _field(out, key):
    return getattr(out, key) if isinstance(key, str) and hasattr(out, "_fields") else out[key]


@pytest.mark.parametrize("graphs", GRAPH_PATHS, ids=GRAPH_IDS)
@pytest.mark.parametrize("mode", ["host", "device", "commit"])
@pytest.mark.parametrize("container", list(CONTAINERS))
def test_every_host_row_mode_takes_the_step_functions_output_container(graphs, mode, container):
    """A NamedTuple (keys by index, by field name or from the end), an OrderedDict, a
    defaultdict, a list or a tuple of outputs: every mode ships the right rows, and a step
    hands its outputs out in the container the step function returned, one slice or sliced.
    Device mode rebuilt a tuple with ``type(outputs)(list)``: a raw TypeError at every step
    of a NamedTuple, after the step ran and the arena, ring and counters changed; an
    OrderedDict came back a dict."""
    device = "cuda" if graphs is True else "cpu"
    pack, (source, rows_key, count_key) = CONTAINERS[container]
    m, ref = PackedChooser(device, seed=5), SlotModel(device, seed=5)
    m.pack, m.chooses = pack, mode == "device"
    rt = GraphRuntime(m, m.specs(), widths=(1, 2, 4, 8), dynamic_limit=8, graphs=graphs, device=device,
                      host_rows=HostRows(source=source, mode=mode, rows_output=rows_key, count_output=count_key,
                                         capacity=16))
    rt.capture()
    want_type = type(pack({k: torch.zeros(1) for k in (FIELDS if m.chooses else FIELDS[:2])}))
    gen = seeded()
    for T in [3, 8, 12, 1, 16, 5]:  # one slice, and sliced (8 + 4, 8 + 8)
        x = m.random_inputs(T, gen=gen)
        want = ref({n: v.to(device) for n, v in x.items()})["hidden"]
        rows = torch.randperm(T, generator=gen)[:max(1, T // 2)].tolist() if mode == "host" else None
        res = rt.step(**({"rows": rows} if rows is not None else {}), **x)
        out = res.outputs
        assert type(out) is want_type, (T, type(out))
        torch.testing.assert_close(_field(out, source), want, **TOL)
        if mode == "commit":
            if len(res.slices) > 1:
                continue  # sliced steps keep no snapshot
            rows = list(range(0, T, 2))
            h = rt.commit(res, rows)
        else:
            h = res.host_rows
            if mode == "device":
                rows = scale_chosen(x)
                assert int(_field(out, count_key).reshape(-1)[0]) == len(rows)
                assert _field(out, rows_key)[:len(rows)].tolist() == rows
        assert h.indices().tolist() == rows, (T, [(s.width, s.length) for s in res.slices])
        torch.testing.assert_close(h.rows(), want[rows].cpu(), **TOL)
        h.release()
    assert rt.stats().steps == 6


class Unknown(dict):
    """A dict subclass torch's pytree does not take apart (a leaf to it)."""


class UnknownTuple(tuple):
    """A tuple subclass that is no NamedTuple (a leaf to torch's pytree)."""


@pytest.mark.parametrize("graphs", [False, "emulate"], ids=["graphs-off", "emulated"])
@pytest.mark.parametrize("mode", ["host", "device", "commit"])
@pytest.mark.parametrize("pack,keys", [(Unknown, ("hidden", "accept_rows", "accept_count")),
                                       (lambda d: UnknownTuple(d.values()), (0, 2, 3))],
                         ids=["dict-subclass", "tuple-subclass"])
def test_an_output_container_the_runtime_cannot_take_apart_is_refused_at_capture(graphs, mode, pack, keys):
    """A container torch's pytree does not know: refused at capture by a StepFunctionError
    naming the step function's output and its type, before the ring is built (the digest
    has none), and the same at the next try (device mode raised a raw StopIteration, and
    then, the ring built, skipped the check)."""
    m = PackedChooser("cpu", seed=5)
    m.pack, m.chooses = pack, mode == "device"
    source, rows_key, count_key = keys
    rt = GraphRuntime(m, m.specs(), widths=(1, 2, 4), graphs=graphs, device="cpu",
                      host_rows=HostRows(source=source, mode=mode, rows_output=rows_key, count_output=count_key))
    for _ in range(2):
        with pytest.raises(StepFunctionError, match=r"step_fn output: expected a dict, list or tuple .*, got "
                                                    r"Unknown(Tuple)?"):
            rt.capture()
        assert rt.state_digest().ring == "-" and rt.stats().steps == 0
    plain = GraphRuntime(m, m.specs(), widths=(1, 2, 4), graphs=graphs, device="cpu")  # no HostRows: the same hint
    with pytest.raises(StepFunctionError, match=r"step_fn output leaf 0: expected a tensor, got Unknown(Tuple)? \(a "
                                                r"container torch's pytree does not take apart"):
        plain.step(**m.random_inputs(3, gen=seeded()))
