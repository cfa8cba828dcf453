"""Property test (issue 7): random sequences of valid and invalid steps, host-row choices,
handle holds/releases and commits, on the CPU with graphs off and with emulated graphs
(``graphs="emulate"``: the graph path's feed, short path and static outputs, each replay
overwriting them), against the eager reference and an independent model of the host-row
ring and the commit window.

Each invalid call must raise the predicted error class (and name the argument), and leave
the arena, the real KV slots, the ring, the snapshots and the counters byte-identical.
Each valid step must match the reference (the model unpadded at exactly T rows); every
held handle must still read the rows of its own step whatever ran since.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from cudagraph_rt import CapacityError, DeviceRowIndexError, InputError, StaleRowsError
from tests.support.reliability_harness import TOL, Rig, chosen_by_scale, commit_turn

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
DEPTH, CAPACITY = 2, 48
WIDEST, LIMIT = 64, 96

T_ = st.one_of(st.integers(1, 64), st.integers(65, 96), st.integers(97, 220))
STEP = st.tuples(st.just("step"), T_, st.sampled_from(["none", "some", "all_cap", "empty"]), st.booleans())
COMMIT = st.tuples(st.just("commit"), st.just(0), st.integers(0, 5), st.booleans())
OP = st.one_of(  # steps and commits drawn more often than the rest
    STEP, STEP, STEP, COMMIT, COMMIT,
    st.tuples(st.sampled_from(["rows_oob", "rows_neg", "rows_dup", "rows_cap", "float_tokens", "nan_slot",
                               "missing", "extra", "row_mismatch", "zero_rows", "bad_shape", "half_slot",
                               "cut_view", "replaced_view"]),
              T_, st.just(None), st.just(False)),
    st.tuples(st.just("release"), st.just(0), st.integers(0, 5), st.just(False)),
)


class Model:
    """What the runtime should do, kept apart from the runtime's own bookkeeping."""

    def __init__(self, mode):
        self.mode = mode
        self.next_slot = 0
        self.held: dict[int, tuple] = {}      # ring slot -> (handle, expected rows | exception)
        self.one_slice_steps = 0              # commit window: snapshots taken so far
        self.pending: list[tuple] = []        # (result, expected hidden, snapshot number or None)

    def ring_refuses(self) -> bool:
        return self.next_slot in self.held

    def shipped(self, handle, expect) -> None:
        assert handle.slot == self.next_slot
        self.held[self.next_slot] = (handle, expect)
        self.next_slot = (self.next_slot + 1) % DEPTH


def check_handle(handle, expect) -> None:
    if isinstance(expect, type):
        with pytest.raises(expect):
            handle.rows()
    else:
        torch.testing.assert_close(handle.rows(), expect, **TOL)


def invalid_call(rig: Rig, kind: str, T: int):
    """(call, error class, message pattern) of one invalid step."""
    x = rig.inputs(T)
    host = rig.mode == "host"
    rows = None
    if kind.startswith("rows_"):
        if not host:
            return (lambda: rig.rt.step(rows=[0], **x)), InputError, r"rows: expected None unless"
        # rows_cap: one row too many is refused before the indices are looked at
        rows = {"rows_oob": [0, T] if T > 1 else [T], "rows_neg": [-1], "rows_dup": [0, 0],
                "rows_cap": list(range(CAPACITY + 1))}[kind]
        exc, msg = {"rows_oob": (InputError, rf"rows: expected indices in \[0, {T}\), got index {T}"),
                    "rows_neg": (InputError, r"rows: expected indices .* got index -1"),
                    "rows_dup": (InputError, r"rows: expected distinct indices"),
                    "rows_cap": (CapacityError, rf"rows: expected at most {CAPACITY} rows \(HostRows.capacity\), "
                                                rf"got {CAPACITY + 1} rows")}[kind]
        if kind == "rows_dup" and T == 1:
            exc, msg = InputError, r"rows: expected indices in \[0, 1\), got index"
            rows = [0, 1]
        return (lambda: rig.rt.step(rows=rows, **x)), exc, msg
    if kind == "float_tokens":
        x["tokens"] = x["tokens"].double()
        return (lambda: rig.rt.step(**x)), InputError, r"tokens: expected dtype torch.int64"
    if kind == "nan_slot":
        x["slot"] = [float("nan")] * T
        return (lambda: rig.rt.step(**x)), InputError, r"slot: expected dtype torch.int64"
    if kind == "missing":
        del x["read"]
        return (lambda: rig.rt.step(**x)), InputError, r"step inputs: expected exactly .*missing \['read'\]"
    if kind == "extra":
        x["temperature"] = torch.ones(T)
        return (lambda: rig.rt.step(**x)), InputError, r"unexpected \['temperature'\]"
    if kind == "row_mismatch":
        x["scale"] = torch.rand(T + 1, 1)
        return (lambda: rig.rt.step(**x)), InputError, rf"scale: expected {T} rows like 'tokens', got {T + 1} rows"
    if kind == "zero_rows":
        x = {k: v[:0] for k, v in x.items()}
        return (lambda: rig.rt.step(**x)), InputError, r"step inputs: expected at least one row, got 0 rows"
    if kind == "bad_shape":
        x["scale"] = x["scale"].reshape(T)
        return (lambda: rig.rt.step(**x)), InputError, rf"scale: expected shape \(T, 1\), got \({T},\)"
    if kind in ("cut_view", "replaced_view"):  # host_inputs() views: only the unchanged, latest ones
        n = min(max(T, 2), 96)
        v = rig.rt.host_inputs(n)
        for k, t in rig.inputs(n).items():
            v[k].copy_(t)
        if kind == "cut_view":
            v = {k: t[:n - 1] for k, t in v.items()}
        else:
            rig.rt.host_inputs(n - 1)  # hands out newer views: the first ones are stale now
        host = {"rows": [0]} if rig.mode == "host" else {}
        return (lambda: rig.rt.step(**host, **v)), InputError, r"expected memory apart from the runtime's static buffers"
    if kind == "half_slot":
        x["slot"] = x["slot"].to(torch.float16)
        return (lambda: rig.rt.step(**x)), InputError, r"slot: expected dtype torch.int64"
    raise AssertionError(kind)


@pytest.mark.parametrize("graphs", [False, "emulate"], ids=["graphs-off", "emulated"])
@pytest.mark.parametrize("mode", [None, "host", "device", "commit"])
# No shrink phase: a failing sequence is reported as drawn (shrinking 30-op sequences can
# take minutes); hypothesis still prints it and its seed.
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(ops=st.lists(OP, min_size=4, max_size=30), seed=st.integers(0, 2**31 - 1))
def test_random_step_sequences_against_reference(mode, graphs, ops, seed):
    rig = Rig(mode, depth=DEPTH, capacity=CAPACITY, seed=seed % 1000, graphs=graphs,
              gen=torch.Generator().manual_seed(seed))
    model = Model(mode)
    for kind, T, arg, flag in ops:
        if kind == "step":
            x = rig.inputs(T)
            rows = None
            if mode == "host":
                rows = {"none": None, "empty": [],
                        "some": rig.random_rows(T, CAPACITY),
                        "all_cap": list(range(min(T, CAPACITY)))}[arg]
            ships = mode == "device" or rows is not None
            if ships and model.ring_refuses():
                before = rig.snapshot()
                event("step refused: ring full")
                with pytest.raises(CapacityError, match=rf"host-row ring: slot {model.next_slot} still holds"):
                    rig.rt.step(rows=rows, **x) if rows is not None else rig.rt.step(**x)
                rig.assert_unchanged(before)
                continue
            res = rig.rt.step(rows=rows, **x) if rows is not None else rig.rt.step(**x)
            want = rig.reference(x)
            assert res.T == T and sum(s.length for s in res.slices) == T
            torch.testing.assert_close(res.outputs["hidden"], want["hidden"], **TOL)
            rig.check_state()
            if ships:
                chosen = rows if mode == "host" else chosen_by_scale(x)
                expect = DeviceRowIndexError if len(chosen) > CAPACITY else want["hidden"][chosen]
                event(f"{mode} step shipped, {'flagged' if isinstance(expect, type) else 'rows'}, "
                      f"{'sliced' if len(res.slices) > 1 else 'one slice'}")
                check_handle(res.host_rows, expect)
                if not isinstance(expect, type):
                    assert res.host_rows.indices().tolist() == list(chosen)
                model.shipped(res.host_rows, expect)
                if not flag:  # release at once; else hold it
                    res.host_rows.release()
                    del model.held[res.host_rows.slot]
            else:
                assert res.host_rows is None
            if mode == "commit":
                model.pending.append((res, want["hidden"], commit_turn(model, res)))
                model.pending = model.pending[-6:]
        elif kind == "release":
            if model.held:
                slot = sorted(model.held)[arg % len(model.held)]
                h, expect = model.held.pop(slot)
                check_handle(h, expect)  # a late reader sees its own step's rows
                h.release()
                with pytest.raises(StaleRowsError):
                    h.rows()
        elif kind == "commit":
            if mode != "commit" or not model.pending:
                continue
            res, hidden, snap = model.pending[arg % len(model.pending)]
            rows = list(range(0, res.T, 1 + arg))[:CAPACITY]
            before = rig.snapshot()
            if snap is None:
                exc, msg = CapacityError, r"result: expected a one-slice step"
            elif model.one_slice_steps - snap > DEPTH:  # a later step took the same snapshot slot
                exc, msg = StaleRowsError, r"commit: the snapshot of that step was reused"
            elif model.ring_refuses():
                exc, msg = CapacityError, rf"host-row ring: slot {model.next_slot} still holds"
            else:
                event("commit shipped")
                h = rig.rt.commit(res, rows)
                expect = hidden[rows]
                check_handle(h, expect)
                model.shipped(h, expect)
                if not flag:
                    h.release()
                    del model.held[h.slot]
                continue
            event(f"commit refused: {exc.__name__}")
            with pytest.raises(exc, match=msg):
                rig.rt.commit(res, rows)
            rig.assert_unchanged(before)
        else:
            call, exc, msg = invalid_call(rig, kind, T)
            event(f"invalid: {exc.__name__}")
            before = rig.snapshot()
            with pytest.raises(exc, match=msg):
                call()
            rig.assert_unchanged(before)
        for h, expect in model.held.values():
            check_handle(h, expect)
    rig.check_state()
    st_ = rig.rt.stats()
    assert st_.slices >= st_.steps
