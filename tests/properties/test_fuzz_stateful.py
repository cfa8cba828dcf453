"""Stateful fuzz of GraphRuntime's public API (CPU, graphs off): a hypothesis
RuleBasedStateMachine drives one runtime over a SlotModel, with a reference copy of the
model run unpadded at exactly T rows, through random sequences of

- valid steps of T in 1..140 (one graph slice, dynamic, sliced) with plain tensors, numpy
  arrays, nested lists, strided tensors, big-endian arrays, exact casts, ``host_inputs``
  views (filled then stepped, at once or after other calls, a commit among them),
  ``device_inputs`` views (with a refused call between the fill and the step) and
  ``static_inputs`` views;
- steps whose step function raises (no step counted, no ring slot or commit turn used up,
  handed views used up);
- refused calls: stale, cut or replaced host views, another thread's views, bad inputs
  (dtype, shape, rows, names, zero rows), bad host-row indices, a full ring, stale and
  sliced commits, a device-mode step wider than the default capacity;
- host-row choices per mode (host: rows before the step; device: the step function picks
  the rows whose scale > 0.5; commit: rows after the step), handles held and released,
  commits fresh and stale, ``reset_stats``, ``recapture``; ``close`` at the end;
- a piecewise runtime (``pieces=True`` over MarkedSlotModel: its first line and its state
  write/read run as marked eager calls between three pieces per width; ``"bound"``: the
  state write/read marked with a ``bind``, so replays run the bound callable), graphs off
  or emulated, against the same plain reference.

After every rule: valid steps match the reference (outputs, real KV slots, shipped rows),
every held handle still reads its own step's rows, ``stats()`` equals an independent count,
and every refused call left ``state_digest()`` (and the real KV slots) unchanged. The
model of the ring and of the commit window is kept apart from the runtime's bookkeeping.

Seeds: each run prints the model/input seed it draws; hypothesis prints the failing rule
sequence (and the ``@reproduce_failure`` blob); ``--hypothesis-seed=N`` replays a run.
About 10 s on two CPU cores (300 sequences of up to 40 rules); a failure shrinks in ~20 s.
"""
from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cudagraph_rt import (BusyError, CapacityError, CaptureError, CgrtError, GraphRuntime, HostRows, InputError,
                          StaleRowsError)
from tests.support.ring_hooks import poison_next_slot
from tests.support.models_for_tests import BoundMarkedSlotModel, Boom, MarkedSlotModel, SlotModel, failing
from tests.support.reliability_harness import ScaleChooser, bits, chosen_by_scale, commit_turn


class MarkedChooser(ScaleChooser, MarkedSlotModel):
    """ScaleChooser over MarkedSlotModel (the piecewise runtime's device-mode model)."""

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
TOL = dict(rtol=1e-5, atol=1e-5)
WIDTHS = (1, 2, 4, 8, 16, 32, 64)  # default widths; dynamic limit 96 (rows 96), or 64: sliced
ROWS = 96                          # steps then replay the width-64 graph in several slices
T_ALL = st.one_of(st.integers(1, 64), st.integers(65, 96), st.integers(97, 140))
T_ONE = st.integers(1, ROWS)  # one-slice steps (host_inputs / device_inputs)
# README: host_inputs views are "good for the next step only"; a commit is no step, so
# views handed before a commit are stepped after it (False only to explore past that bug)
COMMIT_KEEPS_VIEWS = True
FORMS = st.sampled_from(["tensor", "numpy", "list", "mixed", "cast", "strided", "big_endian"])


def _rows_at(t) -> tuple:
    """Where handed rows lie and how many: a tensor view or its numpy array alike."""
    if isinstance(t, np.ndarray):
        return t.__array_interface__["data"][0], t.shape
    return t.data_ptr(), tuple(t.shape)




def plan(T: int, rows: int = ROWS) -> list[tuple[str, int, int]]:
    """(path, width, length) of each slice, by the README's rule, stated here again
    (``rows``: the dynamic limit; at the widest width, slices replay that graph)."""
    out, start = [], 0
    while start < T:
        left = T - start
        if left <= WIDTHS[-1]:
            out.append(("graph", next(w for w in WIDTHS if w >= left), left))
            break
        n = min(left, rows)
        out.append(("graph", WIDTHS[-1], n) if n <= WIDTHS[-1] else ("dynamic", n, n))
        start += n
    return out


def in_thread(fn):
    """``fn()`` on another thread; its result, or the exception it raised, raised here."""
    box = []

    def run():
        try:
            box.append((True, fn()))
        except BaseException as e:  # noqa: BLE001 - raised again in the caller
            box.append((False, e))
    t = threading.Thread(target=run)
    t.start()
    t.join()
    ok, v = box[0]
    if not ok:
        raise v
    return v


def as_form(x: dict, form: str, gen: torch.Generator) -> dict:
    if form == "tensor":
        return x
    if form == "numpy":
        return {k: v.numpy().copy() for k, v in x.items()}
    if form == "list":
        return {k: v.tolist() for k, v in x.items()}
    if form == "cast":  # dtypes that hold these values exactly
        return {"tokens": x["tokens"].to(torch.int32), "slot": x["slot"].to(torch.int16),
                "read": x["read"].numpy().astype(np.uint8), "scale": x["scale"].numpy()}
    if form == "strided":  # every other row of a tensor twice as long
        out = {}
        for k, v in x.items():
            w = torch.empty((2 * len(v), *v.shape[1:]), dtype=v.dtype)
            w[::2] = v
            out[k] = w[::2]
        return out
    if form == "big_endian":
        return {k: v.numpy().astype(v.numpy().dtype.newbyteorder(">")) for k, v in x.items()}
    kinds = ["tensor", "numpy", "list", "strided", "big_endian"]
    return {k: as_form({k: v}, kinds[int(torch.randint(0, len(kinds), (1,), generator=gen))], gen)[k]
            for k, v in x.items()}


class RuntimeMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.rt = None

    # -- set-up ----------------------------------------------------------------------------
    @initialize(mode=st.sampled_from([None, "host", "device", "commit"]), depth=st.integers(2, 3),
                seed=st.integers(0, 2**31 - 1), capacity=st.sampled_from([None, 140]),
                graphs=st.sampled_from([False, "emulate"]), rows=st.sampled_from([ROWS, 64]),
                pieces=st.sampled_from([False, True, "bound"]),
                chooser=st.sampled_from([(torch.int32, torch.int32), (torch.int64, torch.int32),
                                         (torch.int32, torch.int64), (torch.int64, torch.int64)]))
    def build(self, mode, depth, seed, capacity, graphs, rows, chooser, pieces):
        print(f"fuzz: mode={mode} depth={depth} capacity={capacity} graphs={graphs} rows={rows} "
              f"chooser={chooser} pieces={pieces} seed={seed}")
        cls = ScaleChooser if mode == "device" else SlotModel
        marked = BoundMarkedSlotModel if pieces == "bound" else MarkedSlotModel  # "bound": eager(bind=) replays
        stepped = (MarkedChooser if mode == "device" else marked) if pieces else cls
        kw = dict(rows_dtype=chooser[0], count_dtype=chooser[1]) if mode == "device" else {}
        self.m = failing(stepped)("cpu", H=16, n_slots=160, seed=seed % 1000, **kw)
        self.ref = cls("cpu", H=16, n_slots=160, seed=seed % 1000, **kw)
        self.gen = torch.Generator().manual_seed(seed)
        self.mode, self.depth, self.rows, self.chooser = mode, depth, rows, chooser
        self.capacity = capacity or rows
        hr = HostRows(source="hidden", mode=mode, depth=depth, capacity=capacity) if mode else None
        self.rt = GraphRuntime(self.m, self.m.specs(), graphs=graphs, device="cpu", host_rows=hr,
                               dynamic_limit=rows, pieces=bool(pieces))
        self.graphs, self.pieces = graphs, pieces
        # the model of what the runtime should have done
        self.counts = dict(steps=0, slices=0, padding=0, commits=0)
        self.eager, self.dynamic, self.replays = Counter(), Counter(), Counter()
        self.next_slot = 0
        self.held: dict[int, tuple] = {}      # ring slot -> (handle, expected rows)
        self.one_slice_steps = 0              # commit-window turns taken
        self.pending: list[tuple] = []        # (result, expected hidden, turn or None)
        self.views = None                     # (views, inputs filled) handed, not stepped yet
        self.stale: list[dict] = []           # views consumed by a step
        self.closed = False
        self.probed = mode is None  # HostRows: the first capture probes the step function
        self.captured = False  # graphs: the first step (or host_inputs) captures every width

    # -- helpers ---------------------------------------------------------------------------
    def inputs(self, T: int) -> dict:
        return self.m.random_inputs(T, gen=self.gen)

    def snapshot(self):
        return self.rt.state_digest(), bits(self.m.state[:-1])

    def assert_unchanged(self, before) -> None:
        digest, state = before
        now = self.rt.state_digest()
        assert not digest.changed(now), f"a refused call changed {digest.changed(now)}"
        assert digest == now or "-" in (digest.ring, digest.snapshots)
        assert torch.equal(state, bits(self.m.state[:-1])), "a refused call changed a real KV slot"

    def refused(self, call, exc, match=None) -> None:
        before = self.snapshot()
        with pytest.raises(exc, match=match):
            call()
        self.assert_unchanged(before)

    def per_path(self, path: str) -> Counter:
        """The counter a slice of ``path`` moves: graph slices replay with emulated graphs
        (a width that raised is counted too: its replay began), else run eagerly."""
        if path == "dynamic":
            return self.dynamic
        return self.replays if self.graphs else self.eager

    def ring_full(self) -> bool:
        return self.next_slot in self.held

    def ref_step(self, x: dict) -> dict:
        specs = self.rt.input_specs
        return self.ref({k: torch.as_tensor(np.array(v) if not isinstance(v, torch.Tensor) else v)
                         .to(specs[k].dtype) for k, v in x.items()})

    def draw_rows(self, T: int, how: str):
        if self.mode != "host" or how == "none":
            return None
        if how == "empty":
            return []
        k = min(T, self.capacity)
        if how == "all":
            return list(range(k))
        n = int(torch.randint(0, k + 1, (1,), generator=self.gen))
        rows = torch.randperm(T, generator=self.gen)[:n]
        return rows.numpy() if n % 2 else rows.tolist()

    def ships(self, rows) -> bool:
        return self.mode == "device" or (self.mode == "host" and rows is not None)

    def expect_refusal(self, T: int, rows):
        """The error a valid-looking step must raise (before anything is written), or None."""
        if self.mode == "device" and len(plan(T, self.rows)) > 1 and self.capacity == self.rows and T > self.rows:
            return CapacityError, r"HostRows\(mode='device'\)"
        if self.ships(rows) and self.ring_full():
            return CapacityError, rf"host-row ring: slot {self.next_slot} still holds"
        return None

    def run_step(self, x: dict, T: int, rows, call, hold: bool) -> None:
        """One valid step (``call()`` runs it), checked against the reference and the model."""
        refusal = self.expect_refusal(T, rows)
        if refusal is not None:
            self.refused(call, *refusal)
            return
        poison_next_slot(self.rt)
        res = call()
        self.probed = self.captured = True
        want = self.ref_step(x)
        assert res.T == T and [(s.path, s.width, s.length) for s in res.slices] == plan(T, self.rows)
        torch.testing.assert_close(res.outputs["hidden"], want["hidden"], **TOL)
        assert torch.equal(res.outputs["tok"], want["tok"]) or torch.allclose(
            res.outputs["hidden"], want["hidden"], **TOL)
        torch.testing.assert_close(self.m.state[:-1], self.ref.state[:-1], **TOL)
        # counters
        self.counts["steps"] += 1
        for path, w, n in plan(T, self.rows):
            self.counts["slices"] += 1
            self.counts["padding"] += w - n
            self.per_path(path)[w] += 1
        # host rows
        if self.ships(rows):
            chosen = chosen_by_scale(x) if self.mode == "device" else [int(i) for i in list(rows)]
            h = res.host_rows
            assert h is not None and h.slot == self.next_slot
            exp = want["hidden"][chosen]
            assert h.indices().tolist() == chosen
            if self.mode == "device":  # the outputs say what was shipped, in the chooser's dtypes
                count, order = res.outputs["accept_count"], res.outputs["accept_rows"]
                assert (order.dtype, count.dtype) == self.chooser
                assert count.tolist() == [len(chosen)] and order[:len(chosen)].tolist() == chosen
            torch.testing.assert_close(h.rows(), exp, **TOL)
            self.next_slot = (self.next_slot + 1) % self.depth
            if hold:
                self.held[h.slot] = (h, exp)
            else:
                h.release()
                with pytest.raises(StaleRowsError):
                    h.rows()
        else:
            assert res.host_rows is None
        if self.mode == "commit":
            turn = commit_turn(self, res)
            self.pending = (self.pending + [(res, want["hidden"].clone(), turn)])[-6:]
        if self.views is not None:  # a step consumes the views handed out before it
            self.stale.append(self.views[0])
            self.views = None

    # -- valid steps -------------------------------------------------------------------------
    @precondition(lambda self: not self.closed)
    @rule(T=T_ALL, form=FORMS, how=st.sampled_from(["none", "some", "all", "empty"]), hold=st.booleans())
    def step_plain(self, T, form, how, hold):
        x = self.inputs(T)
        rows = self.draw_rows(T, how)
        given = as_form(x, form, self.gen)
        kw = {"rows": rows} if rows is not None else {}
        self.run_step(x, T, rows, lambda: self.rt.step(**kw, **given), hold)

    @precondition(lambda self: not self.closed)
    @rule(T=T_ONE, how=st.sampled_from(["none", "some"]), hold=st.booleans(), as_np=st.booleans())
    def host_views_fill_step(self, T, how, hold, as_np):
        T = min(T, self.rows)
        v = self.rt.host_inputs(T, numpy=as_np)
        self.probed = self.captured = True  # host_inputs captures first
        x = self.inputs(T)
        for k, t in x.items():
            (v[k] if as_np else v[k].numpy())[:] = t.numpy()
        self.views = (v, x)
        rows = self.draw_rows(T, how)
        kw = {"rows": rows} if rows is not None else {}
        self.run_step(x, T, rows, lambda: self.rt.step(**kw, **v), hold)

    @precondition(lambda self: not self.closed)
    @rule(T=T_ONE, as_np=st.booleans())
    def host_views_fill_only(self, T, as_np):
        """Views handed and filled, stepped by a later rule (other calls may come first)."""
        T = min(T, self.rows)
        if self.views is not None:
            self.stale.append(self.views[0])  # newer views replace them
        v = self.rt.host_inputs(T, numpy=as_np)
        self.probed = self.captured = True
        x = self.inputs(T)
        for k, t in x.items():
            (v[k] if as_np else v[k].numpy())[:] = t.numpy()
        self.views = (v, x)

    @precondition(lambda self: not self.closed and self.views is not None)
    @rule(hold=st.booleans())
    def step_pending_views(self, hold):
        v, x = self.views
        T = len(x["tokens"])
        rows = self.draw_rows(T, "some")
        kw = {"rows": rows} if rows is not None else {}
        self.run_step(x, T, rows, lambda: self.rt.step(**kw, **v), hold)

    @precondition(lambda self: not self.closed)
    @rule(T=T_ONE, refuse_first=st.booleans())
    def device_views_step(self, T, refuse_first):
        T = min(T, self.rows)
        d = self.rt.device_inputs(T)
        x = self.inputs(T)
        for k, t in x.items():
            d[k].copy_(t)
        if refuse_first:  # a refused call in between must not touch the rows written
            bad = self.inputs(T)
            bad["tokens"] = bad["tokens"].double()
            self.refused(lambda: self.rt.step(**bad), InputError, r"tokens: expected dtype")
        self.run_step(x, T, None, lambda: self.rt.step(**d), False)

    @precondition(lambda self: not self.closed)
    @rule(T=T_ALL, how=st.sampled_from(["none", "some"]), views=st.booleans())
    def failing_step(self, T, how, views):
        """The step function raises: the exception propagates unwrapped; no step is counted,
        no ring slot and no commit-window turn is used up; the arena may hold the rows."""
        rows = self.draw_rows(T, how)
        if self.expect_refusal(T, rows) is not None:
            return
        if views and T <= self.rows:
            v = self.rt.host_inputs(T)
            self.probed = self.captured = True
            for k, t in self.inputs(T).items():
                v[k].copy_(t)
        else:
            v, views = as_form(self.inputs(T), "tensor", self.gen), False
        kw = {"rows": rows} if rows is not None else {}
        # the first-use probe raises as it is (no slice ran); a graph capture wraps the step
        # function's error in CaptureError (it ran in warm-up), and nothing ran either
        capture_fails = self.probed and self.graphs and not self.captured
        self.m.fail = True
        try:
            with pytest.raises(CaptureError if capture_fails else Boom):
                self.rt.step(**kw, **v)
        finally:
            self.m.fail = False
        if self.probed and not capture_fails:
            path, w, _ = plan(T, self.rows)[0]
            self.per_path(path)[w] += 1  # the call that raised
        if self.views is not None:  # the arena took the new rows: handed views are used up
            self.stale.append(self.views[0])
            self.views = None
        if views:
            self.stale.append(v)

    @precondition(lambda self: not self.closed)
    @rule(w=st.sampled_from(WIDTHS + (80, 96)))
    def static_views_step(self, w):
        """Rows written through static_inputs(w) (the arena itself), stepped as given."""
        w = min(w, self.rows)
        s = self.rt.static_inputs(w)
        x = self.inputs(w)
        for k, t in x.items():
            s[k].copy_(t)
        self.run_step(x, w, None, lambda: self.rt.step(**s), False)

    # -- threads, and views written after their step (issue 22) ----------------------------------
    @precondition(lambda self: not self.closed)
    @rule(T=T_ALL, hold=st.booleans())
    def other_thread_steps_fresh_rows(self, T, hold):
        """Another thread's step of its own rows: refused (BusyError, nothing written) while
        views handed to this thread are not stepped (it would use them up while their owner
        may still write them); else a valid step like any other."""
        x = self.inputs(T)
        call = lambda: in_thread(lambda: self.rt.step(**x))  # noqa: E731
        if self.views is not None:
            self.refused(call, BusyError, r"handed the next step's rows to another thread")
            return
        self.run_step(x, T, None, call, hold)

    @precondition(lambda self: not self.closed and self.views is None)
    @rule(T=T_ONE)
    def views_of_a_thread_that_ended(self, T):
        """A thread asks for views and ends without stepping them: they block no one."""
        T = min(T, self.rows)
        in_thread(lambda: self.rt.host_inputs(T))
        self.probed = self.captured = True

    @precondition(lambda self: not self.closed and self.views is None and bool(self.stale))
    @rule(i=st.integers(0, 5))
    def late_write_into_stepped_views(self, i):
        """Views written after their step (a bug the runtime cannot see: the memory is the
        next step's staging) with rows of live slots: later steps' padding rows must still
        run the pads (the real KV slots are checked after every step)."""
        v = self.stale[i % len(self.stale)]
        n = len(v["tokens"])
        for k, t in self.inputs(n).items():
            (v[k] if isinstance(v[k], np.ndarray) else v[k].numpy())[:] = t.numpy()

    # -- refused calls --------------------------------------------------------------------------
    @precondition(lambda self: not self.closed and bool(self.stale))
    @rule(i=st.integers(0, 5))
    def stale_views_refused(self, i):
        v = self.stale[i % len(self.stale)]
        if self.views is not None and all(_rows_at(v[k]) == _rows_at(self.views[0][k]) for k in v):
            return  # host_inputs(T) hands the same rows out again for the same T (views or arrays): live
        # (re-handed to another thread since, one that ended: refused as that thread's views)
        self.refused(lambda: self.rt.step(**v), InputError,
                     r"expected memory apart from the runtime's static|expected views host_inputs\(\) handed to this")

    @precondition(lambda self: not self.closed and self.views is not None)
    @rule()
    def cut_views_refused(self):
        v, x = self.views
        if len(x["tokens"]) < 2:
            return
        cut = {k: t[:-1] for k, t in v.items()}
        self.refused(lambda: self.rt.step(**cut), InputError, r"expected memory apart from the runtime's static")

    @precondition(lambda self: not self.closed and self.views is not None)
    @rule(which=st.sampled_from(["busy", "step"]))
    def other_thread_refused(self, which):
        v, _ = self.views
        box = []

        def run():
            try:
                self.rt.host_inputs(1) if which == "busy" else self.rt.step(**v)
            except Exception as e:  # noqa: BLE001 - examined below
                box.append(e)
        before = self.snapshot()
        t = threading.Thread(target=run)
        t.start()
        t.join()
        assert len(box) == 1 and isinstance(box[0], BusyError if which == "busy" else InputError), box
        self.assert_unchanged(before)

    @precondition(lambda self: not self.closed)
    @rule(T=T_ALL, kind=st.sampled_from(["float_tokens", "missing", "extra", "row_mismatch", "zero_rows",
                                         "bad_shape", "nan_list", "complex", "strings", "big_int"]))
    def bad_inputs_refused(self, T, kind):
        x = self.inputs(T)
        if kind == "float_tokens":
            x["tokens"] = x["tokens"].double() + 0.5
        elif kind == "missing":
            del x["read"]
        elif kind == "extra":
            x["temperature"] = torch.ones(T)
        elif kind == "row_mismatch":
            x["scale"] = torch.rand(T + 1, 1)
        elif kind == "zero_rows":
            x = {k: v[:0] for k, v in x.items()}
        elif kind == "bad_shape":
            x["scale"] = x["scale"].reshape(T)
        elif kind == "nan_list":
            x["slot"] = [float("nan")] * T
        elif kind == "complex":
            x["scale"] = x["scale"].to(torch.complex64)
        elif kind == "strings":
            x["read"] = np.array(["a"] * T)
        elif kind == "big_int":
            x["tokens"] = [2**70] * T
        self.refused(lambda: self.rt.step(**x), InputError)

    @precondition(lambda self: not self.closed)
    @rule(T=T_ALL, kind=st.sampled_from(["oob", "neg", "dup", "cap", "float", "2d", "not_host"]))
    def bad_rows_refused(self, T, kind):
        x = self.inputs(T)
        if self.mode != "host" or kind == "not_host":
            if self.mode == "host":
                return
            self.refused(lambda: self.rt.step(rows=[0], **x), InputError, r"rows: expected None unless")
            return
        rows = {"oob": [T], "neg": [-1], "dup": [0, 0] if T > 1 else [1], "cap": list(range(self.capacity + 1)),
                "float": [0.0], "2d": [[0]]}[kind]
        exc = CapacityError if kind == "cap" else InputError
        self.refused(lambda: self.rt.step(rows=rows, **x), exc, r"rows")

    # -- handles and commits ----------------------------------------------------------------------
    @precondition(lambda self: not self.closed and bool(self.held))
    @rule(i=st.integers(0, 5))
    def release(self, i):
        slot = sorted(self.held)[i % len(self.held)]
        h, exp = self.held.pop(slot)
        torch.testing.assert_close(h.rows(), exp, **TOL)
        h.release()
        with pytest.raises(StaleRowsError):
            h.rows()

    @precondition(lambda self: not self.closed and self.mode == "commit" and bool(self.pending))
    @rule(i=st.integers(0, 5), stride=st.integers(1, 4), hold=st.booleans(),
          views=st.sampled_from([None, "fill", "fill_step"]), T=T_ONE, as_np=st.booleans())
    def commit(self, i, stride, hold, views, T, as_np):
        """A commit, optionally between filling the next step's host views and stepping
        them (a commit-mode runner's order: fill step k+1, commit step k, step k+1)."""
        if views is not None:
            self.host_views_fill_only(T, as_np)
        self._commit(i, stride, hold)
        if views == "fill_step" and self.views is not None:
            self.step_pending_views(hold=False)

    def _commit(self, i, stride, hold):
        res, hidden, turn = self.pending[i % len(self.pending)]
        rows = list(range(0, res.T, stride))[:self.capacity]
        if turn is None:
            self.refused(lambda: self.rt.commit(res, rows), CapacityError, r"result: expected a one-slice step")
            return
        if self.one_slice_steps - turn > self.depth:
            self.refused(lambda: self.rt.commit(res, rows), StaleRowsError, r"snapshot of that step was reused")
            return
        if self.ring_full():
            self.refused(lambda: self.rt.commit(res, rows), CapacityError, r"host-row ring")
            return
        poison_next_slot(self.rt)
        h = self.rt.commit(res, rows)
        self.counts["commits"] += 1
        if self.views is not None and not COMMIT_KEEPS_VIEWS:  # exploration only
            self.stale.append(self.views[0])
            self.views = None
        exp = hidden[rows]
        assert h.slot == self.next_slot
        torch.testing.assert_close(h.rows(), exp, **TOL)
        assert h.indices().tolist() == rows
        self.next_slot = (self.next_slot + 1) % self.depth
        if hold:
            self.held[h.slot] = (h, exp)
        else:
            h.release()

    @precondition(lambda self: not self.closed and self.mode not in (None, "commit"))
    @rule()
    def commit_without_commit_mode_refused(self):
        self.refused(lambda: self.rt.commit(object(), [0]), InputError, r"commit\(\)")

    # -- lifecycle ------------------------------------------------------------------------------
    @precondition(lambda self: not self.closed)
    @rule()
    def reset_stats(self):
        self.rt.reset_stats()
        self.counts = dict(steps=0, slices=0, padding=0, commits=0)
        self.eager, self.dynamic, self.replays = Counter(), Counter(), Counter()

    @precondition(lambda self: not self.closed)
    @rule()
    def recapture(self):
        """Capture writes padding rows only: no KV slot, no ring slot, no counter moves. With
        graphs (emulated here) it resets the staging and the feed, dropping handed views
        (README: recapture() drops the views host_inputs() handed out before it), and its
        gathers write the spare ring slot and spare snapshot, which no handle or commit reads
        (held handles and pending commits are checked against their own rows later)."""
        digest, state = self.snapshot()
        self.rt.recapture()
        self.probed = self.captured = True
        now = self.rt.state_digest()
        allowed = {"staging", "ring", "snapshots"} if self.graphs else set()
        assert set(digest.changed(now)) <= allowed, f"recapture changed {digest.changed(now)}"
        assert torch.equal(state, bits(self.m.state[:-1]))
        if self.graphs and self.views is not None:
            self.stale.append(self.views[0])
            self.views = None

    # -- after every rule -----------------------------------------------------------------------
    @invariant()
    def counters_match(self):
        if self.rt is None or self.closed:
            return
        s = self.rt.stats()
        assert (s.steps, s.slices, s.padding_rows, s.commits) == (
            self.counts["steps"], self.counts["slices"], self.counts["padding"], self.counts["commits"])
        assert dict(s.eager_calls) == +self.eager and dict(s.dynamic_calls) == +self.dynamic
        assert dict(s.graph_replays) == +self.replays
        assert s.graph_mode == ("emulated" if self.graphs else "off")
        mode = ("pieces" if self.pieces else "graph") if self.graphs and self.captured else "eager"
        assert dict(s.width_modes) == {w: mode for w in WIDTHS}

    @invariant()
    def held_handles_read_their_own_rows(self):
        if self.rt is None:
            return
        for h, exp in self.held.values():
            torch.testing.assert_close(h.rows(), exp, **TOL)

    def teardown(self):
        if self.rt is None:
            return
        self.rt.close()
        self.closed = True
        x = self.inputs(3)
        for call in (lambda: self.rt.step(**x), lambda: self.rt.host_inputs(3), lambda: self.rt.device_inputs(3),
                     self.rt.state_digest, self.rt.capture, self.rt.recapture, lambda: self.rt.static_inputs(4)):
            with pytest.raises(CgrtError):
                call()
        if self.mode == "commit" and self.pending:
            with pytest.raises(CgrtError):
                self.rt.commit(self.pending[-1][0], [0])
        self.rt.close()  # twice: no error


TestRuntimeFuzz = RuntimeMachine.TestCase
TestRuntimeFuzz.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])


# ======================================================================================
# The runner's submit (issue 22): a refused submit leaves the queue as it was
# ======================================================================================
class RunnerMachine(RuleBasedStateMachine):
    """``SpecRunner`` on the tiny toy, graphs off or emulated (the runner then fills feed
    views with ``host_inputs(numpy=True)`` and replays graphs), through random submits of
    batches mixing good and bad requests, and runs cut into pieces. A refused submit must
    queue nothing (the uids it would have taken stay free); every finished sequence equals
    greedy decoding; a drafter with a smaller k than the runner's is refused up front."""

    @initialize(graphs=st.sampled_from([False, "emulate"]), k=st.integers(0, 3), lanes=st.integers(1, 2),
                drafter=st.sampled_from(["host", "device", "device_short"]), seed=st.integers(0, 2**31 - 1))
    def build(self, graphs, k, lanes, drafter, seed):
        from cudagraph_rt.speculative.device_drafter import DeviceDrafter
        from cudagraph_rt.speculative.runner import SpecRunner, ToyDrafter
        print(f"runner fuzz: graphs={graphs} k={k} lanes={lanes} drafter={drafter} seed={seed}")
        RUNNER_MODEL.reset_cache()
        if drafter == "host":
            d = ToyDrafter(RUNNER_MODEL, 0.6, seed)
        else:
            dk = max(k - 1, 1) if drafter == "device_short" else max(k, 1)
            d = DeviceDrafter(RUNNER_MODEL, 0.6, seed, k=dk, depth=lanes + 1, graphs=graphs)
            if dk < k:  # refused before any step launched
                with pytest.raises(InputError, match=r"drafter.k: expected >= the runner's k"):
                    SpecRunner(RUNNER_MODEL, d, k=k, lanes=lanes, slots=4, graphs=graphs)
                assert d.rt.stats().steps == 0
                k = dk
        self.runner = SpecRunner(RUNNER_MODEL, d, k=k, lanes=lanes, slots=4, chunk=8, graphs=graphs)
        self.gen = np.random.default_rng(seed)
        self.queued: dict[int, tuple] = {}  # uid -> request, every request accepted so far
        self.next_uid = 0

    def request(self, kind: str):
        from cudagraph_rt.speculative.runner import Request
        L, V = RUNNER_MODEL.config.max_len, RUNNER_MODEL.config.vocab
        n = int(self.gen.integers(1, 8))
        prompt = tuple(int(t) for t in self.gen.integers(0, V, n))
        return {"good": Request(prompt, int(self.gen.integers(1, 6))), "zero": Request(prompt, 0),
                "float": Request(prompt, 2.5), "bool": Request(prompt, True), "long": Request(prompt, L - n + 2),  # one past max_len
                "token": Request(prompt + (V,), 2), "empty": Request((), 2)}[kind]

    @rule(kinds=st.lists(st.sampled_from(["good"] * 4 + ["zero", "float", "bool", "long", "token", "empty"]),
                         min_size=1, max_size=4))
    def submit(self, kinds):
        reqs = [self.request(k) for k in kinds]
        waiting = list(self.runner.waiting)
        if all(k == "good" for k in kinds):
            uids = self.runner.submit(reqs)
            assert uids == list(range(self.next_uid, self.next_uid + len(reqs)))
            self.queued.update(zip(uids, reqs))
            self.next_uid += len(reqs)
            return
        with pytest.raises(InputError, match=r"requests\[\d+\]"):
            self.runner.submit(reqs)
        assert list(self.runner.waiting) == waiting, "a refused submit changed the queue"

    @rule(steps=st.sampled_from([1, 2, None]))
    def run(self, steps):
        self.runner.run(max_steps=steps)
        self.check_finished()

    def check_finished(self):
        for s in self.runner.finished:
            r = self.queued[s.uid]
            assert s.generated == RUNNER_MODEL.greedy_generate(list(r.prompt), r.max_new), s.uid

    def teardown(self):
        if not hasattr(self, "runner"):
            return
        self.runner.run()
        self.check_finished()
        assert sorted(s.uid for s in self.runner.finished) == sorted(self.queued)


def _runner_model():
    from cudagraph_rt.models import ToyConfig, ToyDecoder
    return ToyDecoder(ToyConfig.tiny(max_len=32, max_seqs=4), "cpu")


RUNNER_MODEL = _runner_model()
TestRunnerSubmitFuzz = RunnerMachine.TestCase
TestRunnerSubmitFuzz.settings = settings(
    max_examples=25, stateful_step_count=8, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink])
