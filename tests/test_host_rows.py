"""Host rows through the runtime, on the CPU path (graphs off) and, marked cuda, on the GPU
with graphs on: all three ways of choosing rows, the ring, and its errors."""
import gc

import pytest
import torch

from cudagraph_rt import (
    CapacityError, DeviceRowIndexError, GraphRuntime, HostRows, InputError, StaleRowsError,
)
from tests.support.models_for_tests import ChoosingSlotModel, SlotModel, chosen_rows
from tests.support.reliability_harness import ScaleChooser

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
