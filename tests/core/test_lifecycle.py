"""The runtime's life around its steps: what capture runs the step function on, the first
step after rows were written in place, the commit window across a failed step, and the
public state digest. CPU path (graphs off); the GPU side is in test_reliability.py.
"""
import pytest
import torch

from cudagraph_rt import (
    CgrtError, GraphRuntime, HostRows, InputSpec, StaleRowsError, StateDigest, StepFunctionError,
)
from tests.support.models_for_tests import Boom, SlotModel, failing
from tests.support.reliability_harness import MODES, TOL, Rig, warm


def seeded() -> torch.Generator:
    seed = int(torch.randint(0, 2**31, (1,)))
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


class Recorder(SlotModel):
    """SlotModel that keeps a copy of the inputs of every call."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.calls = []

    def __call__(self, x):
        self.calls.append({k: v.clone() for k, v in x.items()})
        return super().__call__(x)


def only_padding(call, specs) -> bool:
    return all(bool((call[k] == s.pad).all()) for k, s in specs.items())


# ---- R9: the first-use probe runs on padding rows, whatever was written in place ---------
@pytest.mark.parametrize("how", ["device_inputs", "static_inputs"])
def test_first_step_after_rows_written_in_place_probes_padding_only(how):
    m, ref = Recorder("cpu", seed=4), SlotModel("cpu", seed=4)
    specs = m.specs()
    rt = GraphRuntime(m, specs, graphs=False, device="cpu", host_rows=HostRows(source="hidden", mode="host"))
    x = m.random_inputs(4, gen=seeded())
    views = rt.device_inputs(4) if how == "device_inputs" else rt.static_inputs(4)
    for k, v in x.items():
        views[k][:4].copy_(v)
    res = rt.step(rows=[0, 2], **(views if how == "device_inputs" else x))
    want = ref(x)
    assert all(only_padding(c, specs) for c in m.calls[:-1]), "capture ran the step function on real rows"
    assert len(m.calls) == rt.capture_report.step_fn_calls + 1
    torch.testing.assert_close(res.outputs["hidden"], want["hidden"])
    torch.testing.assert_close(res.host_rows.rows(), want["hidden"][[0, 2]])
    torch.testing.assert_close(m.state[:-1], ref.state[:-1])  # no real slot written twice


def test_capture_report_counts_the_step_function_calls():
    m = Recorder("cpu", seed=1)
    rt = GraphRuntime(m, m.specs(), graphs=False, device="cpu", host_rows=HostRows(source="hidden"))
    rep = rt.capture()
    assert rep.step_fn_calls == len(m.calls) == 1  # the probe, graphs off
    assert rep.to_json()["step_fn_calls"] == 1
    m2 = Recorder("cpu", seed=1)
    rt2 = GraphRuntime(m2, m2.specs(), graphs=False, device="cpu")
    assert rt2.capture().step_fn_calls == len(m2.calls) == 0


# ---- R10: a failed step does not use up a turn of the commit window ----------------------
@pytest.mark.parametrize("graphs", [False, "emulate"], ids=["graphs-off", "emulated"])
def test_a_failed_step_keeps_the_commit_windows_turn(graphs):
    """Emulated (issue 22, found by the stateful fuzz under the emulation): a graph step
    counted its snapshot as begun before the replay, which CUDA's replay always completes;
    an emulated replay whose step function raises before the gather wrote no snapshot."""
    m, ref = failing(SlotModel)("cpu", seed=6), SlotModel("cpu", seed=6)
    rt = GraphRuntime(m, m.specs(), graphs=graphs, device="cpu",
                      host_rows=HostRows(source="hidden", mode="commit", depth=2))
    gen = seeded()
    x0 = m.random_inputs(5, gen=gen)
    r0 = rt.step(**x0)
    want0 = ref(x0)["hidden"]
    m.fail = True
    with pytest.raises(Boom, match="step function failed"):
        rt.step(**m.random_inputs(3, gen=gen))
    m.fail = False
    x1 = m.random_inputs(7, gen=gen)
    rt.step(**x1)
    ref(x1)
    h = rt.commit(r0, [4, 0, 2])  # one good step since r0: inside the window of 2
    torch.testing.assert_close(h.rows(), want0[[4, 0, 2]])
    h.release()
    rt.step(**m.random_inputs(2, gen=gen))
    with pytest.raises(StaleRowsError):
        rt.commit(r0, [0])  # two good steps since: its snapshot was reused


# ---- the public state digest ---------------------------------------------------------------
def test_state_digest_sees_every_part_a_step_or_commit_writes():
    m = SlotModel("cpu", seed=8)
    rt = GraphRuntime(m, m.specs(), graphs=False, device="cpu",
                      host_rows=HostRows(source="hidden", mode="commit", depth=2))
    gen = seeded()
    d0 = rt.state_digest()
    assert isinstance(d0, StateDigest) and d0 == rt.state_digest()
    r = rt.step(**m.random_inputs(3, gen=gen))
    d1 = rt.state_digest()
    assert set(d0.changed(d1)) == {"arena", "counters"}  # ring and snapshots were built since
    h = rt.commit(r, [1])
    d2 = rt.state_digest()
    assert set(d1.changed(d2)) == {"arena", "ring", "counters"}  # control block, ring slot, commits
    h.release()
    assert d2.changed(rt.state_digest()) == ["ring"]  # a released slot is free again
    rt.host_inputs(2)
    rt.reset_stats()
    assert "counters" in d2.changed(rt.state_digest())


# ---- review findings (restructure, 77a045a..HEAD) --------------------------------------------
def test_capture_with_graphs_off_checks_the_output_structure_as_its_docstring_says():
    """capture()'s docstring: "With graphs off it only checks the step function's output
    structure". Without HostRows it checks nothing (no probe runs): a step function whose
    output lacks the width dimension passes capture() and fails only at the first step.
    (Issue 14 named this; the docstring is unchanged.) Either check it or drop the claim."""
    claims = "checks the step function's output structure" in " ".join(GraphRuntime.capture.__doc__.split())
    rt = GraphRuntime(lambda x: {"h": x["t"].sum().reshape(1)}, {"t": InputSpec((), torch.int64, 0)},
                      graphs=False, device="cpu")
    if claims:
        with pytest.raises(StepFunctionError, match="leading dimension"):
            rt.capture()


@pytest.mark.cuda
def test_state_digest_waits_for_the_device_before_reading_the_ring():
    """state_digest()'s docstring: "Waits for the device first". The old runtime
    synchronized the device (and took the step lock) before hashing; runtime_digest no
    longer does, and it hashes the pinned host ring (``row_choice.digest()``) before the
    arena's ``.cpu()`` copy syncs anything: a digest taken right after a step that is still
    on the device reads the ring before the step's gather lands, so "equal digests before
    and after a refused call" can fail spuriously (or pass on a half-written ring)."""
    from tests.support.ring_hooks import poison_next_slot
    m = SlotModel("cuda", seed=2)
    rt = GraphRuntime(m, m.specs(), graphs=True, device="cuda",
                      host_rows=HostRows(source="hidden", mode="host", depth=2))
    rt.capture()
    x = m.random_inputs(8, gen=seeded())
    poison_next_slot(rt)
    torch.cuda.synchronize()
    torch.cuda._sleep(1 << 30)  # device time queued ahead of the step's replay and gather
    res = rt.step(rows=[1, 5], **x)
    early = rt.state_digest()  # must wait for the step (its gather into the ring) first
    torch.cuda.synchronize()
    late = rt.state_digest()
    assert early == late, f"state_digest read {early.changed(late)} before the device finished"
    res.host_rows.release()
    rt.close()


@pytest.mark.parametrize("how", ["close", "del"])
@pytest.mark.parametrize("mode", [None, "host", "commit"])
def test_close_or_del_frees_the_buffers_without_waiting_for_the_garbage_collector(how, mode):
    """Before the restructure, ``close()`` freed the arena and staging at once and ``del rt``
    freed the whole runtime (graphs, pool, arena, ring) at once, by reference counting. Now
    two reference cycles hold them until a cyclic collection (rare for long-lived
    objects, in gen 2): StaticInputs -> validator -> Validator._owned, a bound method of
    that StaticInputs (inputs/__init__.py); and GraphRuntime -> _by_width / _dynamic ->
    EagerSlice/GraphSlice/DynamicSlice -> ``self._body``, a bound method of the runtime
    (runtime._eager_executors). The GPU memory tests call gc.collect() first, which hides
    it; a serving process that drops a runtime keeps its GPU memory meanwhile."""
    import gc
    import weakref

    from cudagraph_rt.inputs import StaticInputs

    def static_inputs_alive() -> int:
        return sum(1 for o in gc.get_objects() if type(o) is StaticInputs)

    m = SlotModel("cpu", seed=5)
    gc.collect()
    gc.disable()
    try:
        n0 = static_inputs_alive()
        rt = GraphRuntime(m, m.specs(), graphs=False, device="cpu",
                          host_rows=HostRows(source="hidden", mode=mode) if mode else None)
        rt.step(**m.random_inputs(5, gen=seeded()))
        if how == "close":
            rt.close()
            assert static_inputs_alive() == n0, "close() left the arena and staging to the garbage collector"
        else:
            ref = weakref.ref(rt)
            del rt
            assert ref() is None, "del left the runtime (graphs, pool, arena, ring) to the garbage collector"
    finally:
        gc.enable()
        gc.collect()


@pytest.mark.parametrize("mode", ["host", "device", "commit"])
@pytest.mark.parametrize("device, graphs", [
    ("cpu", False), ("cpu", "emulate"), pytest.param("cuda", True, marks=pytest.mark.cuda),
], ids=["graphs-off", "emulated", "cuda"])
def test_close_frees_the_host_row_ring_and_its_snapshots_at_once(device, graphs, mode):
    """README: ``close()`` frees the graphs, their pool, the arena, the pinned staging AND
    the host-row ring at once, by reference counting (no garbage-collector pass). The
    caller still holds the runtime after ``close()``: the ring (its rows and meta), the
    commit snapshots and a device chooser's shipped outputs must not stay with it until
    the runtime itself goes. Every handle is released and dropped first (a handle still
    held keeps its ring readable: that is promised too)."""
    import gc
    import weakref

    from tests.support.reliability_harness import ScaleChooser

    gen = seeded()
    m = (ScaleChooser if mode == "device" else SlotModel)(device, seed=3)
    rt = GraphRuntime(m, m.specs(), graphs=graphs, device=device,
                      host_rows=HostRows(source="hidden", mode=mode, depth=2))
    for T in (5, 3, 8, 2):
        x = m.random_inputs(T, gen=gen)
        res = rt.step(rows=[0, T - 1], **x) if mode == "host" else rt.step(**x)
        handle = rt.commit(res, [T - 1]) if mode == "commit" else res.host_rows
        handle.rows()
        handle.release()
        del res, handle
    hr = rt._row_choice
    held = {"ring rows": hr.ring.dst, "ring meta": hr.ring.meta}
    if mode == "commit":
        held.update({"snapshots": hr.snap, "snapshot meta": hr._snap_meta})
    if mode == "device":
        held.update({"shipped rows": hr._shipped[0], "shipped count": hr._shipped[1]})
    refs = {what: weakref.ref(t) for what, t in held.items()}
    del held, hr
    gc.collect()
    gc.disable()
    try:
        rt.close()
        alive = [what for what, r in refs.items() if r() is not None]
        assert not alive, f"close() left {alive} to the runtime's own end (or the garbage collector)"
    finally:
        gc.enable()


# ---- issue 22: explain_capture off the record, pinned_bytes of what is pinned -------------
@pytest.mark.parametrize("graphs", [False, "emulate"], ids=["graphs-off", "emulated"])
def test_explain_capture_runs_the_step_on_padding_rows_only(graphs):
    """explain_capture(w) (public: a CaptureError runs it, a user may too) ran the step
    function on the arena's current rows: the last step's real rows, whose KV cells it
    wrote again. It runs on a scratch copy of padding rows now."""
    m = Recorder("cpu", seed=2)
    rt = GraphRuntime(m, m.specs(), graphs=graphs, device="cpu")
    d = rt.device_inputs(4)
    for k, v in m.random_inputs(4, gen=seeded()).items():
        d[k].copy_(v)
    rt.step(**d)  # the arena now holds real rows
    arena, state, n = rt.state_digest().arena, m.state.clone(), len(m.calls)
    assert rt.explain_capture(4) == ()
    assert len(m.calls) == n + 1 and only_padding(m.calls[-1], m.specs())
    assert torch.equal(m.state[:-1], state[:-1]), "explain_capture wrote a real KV slot"
    assert rt.state_digest().arena == arena


@pytest.mark.parametrize("graphs", [False, "emulate"], ids=["graphs-off", "emulated"])
@pytest.mark.parametrize("mode", [None, "host", "commit"])
def test_pinned_bytes_count_only_pinned_memory(graphs, mode):
    """On a CPU no buffer is pinned: pinned_bytes used to count the host-row ring there."""
    m = SlotModel("cpu", seed=1)
    rt = GraphRuntime(m, m.specs(), graphs=graphs, device="cpu",
                      host_rows=HostRows(source="hidden", mode=mode) if mode else None)
    rt.step(**m.random_inputs(5, gen=seeded()))
    assert rt.pinned_bytes == 0


# ---- watch(): a tensor the graphs read that moved or changed shape (emulated graphs) ------
@pytest.mark.parametrize("hr", [None, "host"], ids=["short-path", "host-rows"])
@pytest.mark.parametrize("change", ["replaced", "resized-in-place"])
def test_a_watched_tensor_that_moved_or_changed_shape_is_caught_until_recapture(hr, change):
    """Emulated graphs remember the watched tensors at capture as CUDA graphs do: a step
    after one was replaced, or resized in place (the same address, another shape), raises
    StaleCaptureError before anything is written; recapture() takes the new tensor."""
    from cudagraph_rt import StaleCaptureError
    gen = seeded()
    m, ref = SlotModel("cpu", seed=2), SlotModel("cpu", seed=2)
    m.state = torch.zeros(300, m.state.shape[1])[:m.state.shape[0]]  # room to grow in place
    rt = GraphRuntime(m, m.specs(), graphs="emulate", device="cpu", watch=lambda: [m.state, *m.ws],
                      host_rows=HostRows(source="hidden", mode=hr) if hr else None)
    rows = {"rows": [0]} if hr else {}
    x = m.random_inputs(3, gen=gen)
    torch.testing.assert_close(rt.step(**rows, **x).outputs["hidden"], ref(x)["hidden"], rtol=1e-5, atol=1e-6)
    if change == "replaced":
        m.ws[1] = m.ws[1].clone()
    else:  # more slots in the same storage: only the shape tells
        ptr, n = m.state.data_ptr(), m.state.shape[0]
        m.state.resize_(n + 20, m.state.shape[1])
        assert m.state.data_ptr() == ptr
        ref.state = torch.cat([ref.state, torch.zeros(20, ref.state.shape[1])])
    before = rt.state_digest()
    y = m.random_inputs(3, gen=gen)
    with pytest.raises(StaleCaptureError, match=r"moved or changed shape since capture"):
        rt.step(**rows, **y)
    assert rt.state_digest() == before
    rt.recapture()
    torch.testing.assert_close(rt.step(**rows, **y).outputs["hidden"], ref(y)["hidden"], rtol=1e-5, atol=1e-6)


# ======================================================================================
# From the bad-input catalogue (issue 7): a closed runtime, recapture with
# graphs off.
# Each test runs graphs off, then with emulated graphs (rig_graphs); a refused call is
# checked for its error class and message, for nothing written (Rig.snapshot: the static
# arena, the KV state, the host-row ring, the commit snapshots, the counters) and for a
# valid step after it that matches the eager reference (tests.support.reliability_harness.refused).
# ======================================================================================
@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("mode", MODES)
def test_closed_runtime_refuses_steps(mode):
    rig = Rig(mode)
    res, want = rig.step(5, hold=mode in ("host", "device"))
    rig.rt.close()
    rig.rt.close()  # idempotent
    with pytest.raises(CgrtError, match=r"GraphRuntime.step: the runtime was closed"):
        rig.rt.step(**rig.inputs(3))
    rig.check_kept()  # handles keep their ring alive: still readable after close


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_context_manager_closes():
    m = SlotModel("cpu")
    with GraphRuntime(m, m.specs(), graphs=False, device="cpu") as rt:
        rt.step(**m.random_inputs(3))
    with pytest.raises(CgrtError, match="closed"):
        rt.step(**m.random_inputs(3))


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("call", ["capture", "recapture", "device_inputs", "host_inputs", "static_inputs", "commit"])
def test_closed_runtime_refuses_everything_clearly(call):
    rig = Rig("commit")
    res, _ = rig.step(5)
    rig.rt.close()
    fn = {"capture": lambda: rig.rt.capture(), "recapture": lambda: rig.rt.recapture(),
          "device_inputs": lambda: rig.rt.device_inputs(3), "host_inputs": lambda: rig.rt.host_inputs(3),
          "static_inputs": lambda: rig.rt.static_inputs(8), "commit": lambda: rig.rt.commit(res, [0])}[call]
    with pytest.raises(CgrtError, match="closed"):
        fn()


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_recapture_with_graphs_off_keeps_state_and_results():
    rig = Rig("commit")
    res, want = rig.step(9)
    rig.rt.recapture()
    h = rig.rt.commit(res, [8])
    torch.testing.assert_close(h.rows(), want["hidden"][[8]], **TOL)
    warm(rig, 3)
