"""Host rows through the runtime, on the CPU path (graphs off) and, marked cuda, on the GPU
with graphs on: all three ways of choosing rows, the ring, and its errors."""
import gc

import pytest
import torch

from cudagraph_rt import (
    CapacityError, DeviceRowIndexError, GraphRuntime, HostRows, InputError, StaleRowsError,
)
from models_for_tests import ChoosingSlotModel, SlotModel, chosen_rows

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
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
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
    m, ref, rt = build(device, "device", ChoosingSlotModel)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
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
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
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
    arena = rt._inputs.arena.clone()
    with pytest.raises(CapacityError, match="ring"):
        rt.step(rows=[1], **m.random_inputs(3))
    assert torch.equal(arena, rt._inputs.arena)  # refused before writing
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
    arena, state = rt._inputs.arena.clone(), m.state.clone()
    if exc is None:
        rt.step(rows=rows, **m.random_inputs(6))
        return
    with pytest.raises(exc, match=msg):
        rt.step(rows=rows, **m.random_inputs(6))
    assert torch.equal(arena, rt._inputs.arena) and torch.equal(state, m.state)


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
