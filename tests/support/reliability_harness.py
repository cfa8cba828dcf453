"""Shared rig for the reliability tests (issue 7): a runtime over a SlotModel, its eager
reference, byte snapshots of everything a step may write, and a checked valid step.

The reference is the same model (same seed) run unpadded at exactly T rows, as in
tests/core/test_runtime.py::test_stateful_model_graphs_off_matches_unpadded_reference. It is
run for every step the runtime's model ran, so its state (KV slots) tracks the model's
and ``check_state`` can compare every real slot.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cudagraph_rt import GraphRuntime, HostRows, InputSpec
from tests.support.ring_hooks import host_ring, poison_next_slot
from tests.support.models_for_tests import SlotModel

TOL = dict(rtol=1e-5, atol=1e-5)
MODES = [None, "host", "device", "commit"]  # the host-row modes a Rig takes (None: no HostRows)


class ScaleChooser(SlotModel):
    """SlotModel that chooses its accepted rows on the device: the rows whose ``scale`` is
    above 0.5, packed in row order. Padding rows have scale 0 (the pad), so they are never
    chosen: this is the contract a device chooser must keep (see guarantees.md).
    ``rows_dtype`` / ``count_dtype``: the dtypes of its outputs (int32 or int64)."""

    def __init__(self, *a, rows_dtype=torch.int32, count_dtype=torch.int32, **kw):
        super().__init__(*a, **kw)
        self.rows_dtype, self.count_dtype = rows_dtype, count_dtype

    def __call__(self, x):
        out = super().__call__(x)
        keep = (x["scale"][:, 0] > 0.5).to(torch.int32)
        out["accept_rows"] = torch.sort(1 - keep, stable=True).indices.to(self.rows_dtype)
        out["accept_count"] = keep.sum().to(self.count_dtype).reshape(1)
        return out


def chosen_by_scale(x) -> list[int]:
    return [i for i, s in enumerate(x["scale"][:, 0].tolist()) if s > 0.5]


EXTRA_SPECS = {
    "pos": InputSpec((), torch.int32, 0),
    "flag": InputSpec((), torch.bool, False),
    "u8": InputSpec((), torch.uint8, 7),
    "bias": InputSpec((2,), torch.float16, 0.0),
}


def bits(t: torch.Tensor) -> torch.Tensor:
    """A byte copy: compares NaN poison and -0.0 exactly (torch.equal does not)."""
    return t.detach().contiguous().view(-1).view(torch.uint8).clone()


def commit_turn(model, res) -> int | None:
    """The commit-window turn a commit-mode step took: ``model.one_slice_steps`` before it
    (then advanced) for a one-slice step, which must carry a snapshot; None for a sliced
    step, which keeps none and takes no turn (README: "Commit within the window")."""
    if len(res.slices) != 1:
        assert res.snapshot is None
        return None
    assert res.snapshot is not None
    model.one_slice_steps += 1
    return model.one_slice_steps - 1


def fresh_gen() -> torch.Generator:
    """A generator on a fresh seed, printed (pytest shows it for a failing test)."""
    seed = torch.seed() % 2**31
    print(f"generator seed {seed}")
    return torch.Generator().manual_seed(seed)


GRAPHS = [False]  # what a Rig built without ``graphs=`` runs: conftest's ``rig_graphs`` sets it


def default_graphs():
    """The graph mode of the test that runs now (False, or "emulate" under ``rig_graphs``)."""
    return GRAPHS[0]


class Rig:
    """A GraphRuntime over a SlotModel plus its reference. ``mode``: None or a HostRows
    mode. ``graphs``: None takes the test's graph mode (``default_graphs``: graphs off, or
    emulated graphs on a CPU); ``device='cuda'`` with ``graphs=True`` for CUDA graphs."""

    def __init__(self, mode=None, *, device="cpu", graphs=None, depth=3, capacity=None,
                 n_slots=256, extra=False, seed=None, model_cls=None, H=32, gen=None, **kw):
        if graphs is None:
            graphs = default_graphs()
        if seed is None:
            seed = int(torch.randint(0, 1000, (1,)))
            print(f"Rig model seed {seed}")
        cls = model_cls or (ScaleChooser if mode == "device" else SlotModel)
        self.m = cls(device, H=H, n_slots=n_slots, seed=seed)
        self.ref = cls(device, H=H, n_slots=n_slots, seed=seed)
        self.mode, self.device, self.extra = mode, device, extra
        specs = dict(self.m.specs())
        if extra:
            specs.update(EXTRA_SPECS)
        self.specs = specs
        if mode == "device" and capacity is None:
            capacity = 256  # the widest step drawn: the default would refuse steps above 96 rows
        hr = HostRows(source="hidden", mode=mode, depth=depth, capacity=capacity) if mode else None
        self.rt = GraphRuntime(self.m, specs, graphs=graphs, device=device, host_rows=hr, **kw)
        self.gen = gen or fresh_gen()
        self.kept = []  # (handle, expected rows on the host) still held

    # -- inputs ------------------------------------------------------------------------
    def inputs(self, T: int) -> dict:
        x = self.m.random_inputs(T, gen=self.gen)
        if self.extra:
            x["pos"] = torch.randint(-2**31, 2**31 - 1, (T,), generator=self.gen, dtype=torch.int64).to(torch.int32)
            x["flag"] = torch.rand(T, generator=self.gen) > 0.5
            x["u8"] = torch.randint(0, 256, (T,), generator=self.gen).to(torch.uint8)
            x["bias"] = torch.randn(T, 2, generator=self.gen).to(torch.float16)
        return x

    def random_rows(self, T: int, cap: int | None = None) -> list[int]:
        cap = min(T, cap if cap is not None else (self.rt.host_rows_config.capacity or self.rt.config.rows))
        k = int(torch.randint(0, cap + 1, (1,), generator=self.gen))
        return torch.randperm(T, generator=self.gen)[:k].tolist()

    def reference(self, x) -> dict:
        """The reference model, unpadded, on exactly these T rows (cast to the spec dtypes)."""
        out = {}
        for k, v in x.items():
            if isinstance(v, torch.Tensor):
                t = v
            else:
                a = np.array(v)  # a copy: any strides, any numeric dtype
                t = torch.from_numpy(a.astype(np.int64) if a.dtype.kind == "u" else a)
            out[k] = t.to(self.device).to(self.specs[k].dtype)
        return self.ref(out)

    def max_T(self) -> int:
        return 139 if self.rt.slicing else self.rt.config.rows

    # -- snapshots ---------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The runtime's public state digest (arena, staging, ring, snapshots, counters) and
        the bytes of the model's real KV slots (padding rows may write the scratch slot)."""
        return {"runtime": self.rt.state_digest(), "state": bits(self.m.state[:-1])}

    def assert_unchanged(self, before: dict) -> None:
        """Every part of ``before`` is the same (a part built since, such as the host-row
        ring the first step's probe sizes, is new memory, not a write)."""
        after = self.snapshot()
        changed = before["runtime"].changed(after["runtime"])
        assert not changed, f"runtime state changed: {changed}"
        assert torch.equal(before["state"], after["state"]), "real KV slots changed"

    # -- a checked valid step ----------------------------------------------------------
    def poison_next_slot(self) -> None:
        """NaN into the ring slot the next shipping step will use (it is free), so a row the
        gather should have written but did not shows up."""
        poison_next_slot(self.rt)

    def step(self, T: int | None = None, *, rows="random", hold: bool = False, x=None):
        """One valid step, checked against the reference: outputs, host rows (if any),
        every real KV slot. Returns (result, reference outputs)."""
        if T is None:
            T = int(torch.randint(1, self.max_T() + 1, (1,), generator=self.gen))
        x = x if x is not None else self.inputs(T)
        if self.mode == "host" and isinstance(rows, str):
            rows = self.random_rows(T)
        elif self.mode != "host":
            rows = None
        self.poison_next_slot()
        res = self.rt.step(rows=rows, **x) if rows is not None else self.rt.step(**x)
        want = self.reference(x)
        assert res.T == T
        got = res.outputs["hidden"]
        assert got.shape == want["hidden"].shape
        torch.testing.assert_close(got, want["hidden"], **TOL)
        self.check_state()
        if self.mode in ("host", "device"):
            if self.mode == "host":
                want_rows = rows.tolist() if isinstance(rows, (torch.Tensor, np.ndarray)) else list(rows or [])
                want_rows = [int(i) for i in want_rows]
            else:
                want_rows = chosen_by_scale(x)
            if self.mode == "host" and rows is None:
                assert res.host_rows is None
            else:
                h = res.host_rows
                assert h is not None
                exp = want["hidden"][want_rows].cpu()
                if len(want_rows) <= host_ring(self.rt).capacity:
                    assert h.count == len(want_rows)
                    assert h.indices().tolist() == want_rows
                    torch.testing.assert_close(h.rows(), exp, **TOL)
                if hold:
                    self.kept.append((h, exp))
                else:
                    h.release()
        return res, want

    def check_state(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        torch.testing.assert_close(self.m.state[:-1], self.ref.state[:-1], **TOL)

    def check_kept(self) -> None:
        """Every held handle still reads the rows of its own step."""
        for h, exp in self.kept:
            torch.testing.assert_close(h.rows(), exp, **TOL)


def refused(rig: Rig, exc, msg: str, call, *, then_T=None):
    """``call()`` raises ``exc`` matching ``msg``, writes nothing, and the runtime then
    runs a valid step that matches the reference. Held handles still read their rows."""
    before = rig.snapshot()
    with pytest.raises(exc, match=msg) as ei:
        call()
    rig.assert_unchanged(before)
    rig.check_kept()
    rig.step(then_T)
    rig.check_kept()
    return ei.value


def warm(rig: Rig, n: int = 2, hold: bool = False) -> None:
    for T in [int(t) for t in torch.randint(1, rig.max_T() + 1, (n,), generator=rig.gen)]:
        rig.step(T, hold=hold)
