"""plan_step against a brute-force restatement of the rule, for every T in 1..200."""
import random

import pytest

from cudagraph_rt import CapacityError, InputError, Slice, default_widths, plan_step
from cudagraph_rt.widths import check_widths
from tests.support.planting import no_whole_plan_past
from tests.support.reliability_harness import Rig, refused, warm

WIDTH_SETS = [default_widths(64), (1, 2, 3, 4, 8, 24, 64)]


def expected_plan(T, widths, limit):
    """The rule in its plainest words: take the narrowest graph that holds what is left,
    else a dynamic chunk of up to `limit` rows."""
    out, start = [], 0
    while start < T:
        left = T - start
        fits = [w for w in widths if w >= left]
        if fits:
            out.append(("graph", fits[0], start, left))
            start = T
        else:
            n = min(left, limit)
            # a limit no wider than the widest graph leaves no dynamic path: slice on it
            out.append(("graph", n, start, n) if n == widths[-1] else ("dynamic", n, start, n))
            start += n
    return out


@pytest.mark.parametrize("widths", WIDTH_SETS)
@pytest.mark.parametrize("limit", [96, 100, 150])
def test_plan_every_T(widths, limit):
    for T in range(1, 201):
        got = plan_step(T, widths, limit)
        assert [(s.path, s.width, s.start, s.length) for s in got] == expected_plan(T, widths, limit), T
        assert sum(s.length for s in got) == T
        assert all(s.width >= s.length for s in got)
        assert all(s.padding == 0 for s in got if s.path == "dynamic")


def test_issue_example_97():
    assert plan_step(97, default_widths(64), 96) == (
        Slice("dynamic", 96, 0, 96), Slice("graph", 1, 96, 1))


def test_limit_equal_to_widest_slices_on_graphs():
    got = plan_step(130, default_widths(64), 64)
    assert [(s.path, s.width, s.length) for s in got] == [("graph", 64, 64), ("graph", 64, 64), ("graph", 2, 2)]


def test_slicing_off_refuses_wide_steps():
    w = default_widths(64)
    assert len(plan_step(96, w, 96, slicing=False)) == 1
    with pytest.raises(CapacityError, match="T .*at most 96.*97"):
        plan_step(97, w, 96, slicing=False)


@pytest.mark.parametrize("T", [0, -1, 2.0, True, "3", None])
def test_bad_T(T):
    with pytest.raises(InputError, match="T"):
        plan_step(T, default_widths(8), 8)


@pytest.mark.parametrize("bad", [(), (2, 1), (1, 1), (0, 4), (1, 2.5), "12", (1, True)])
def test_bad_width_sets(bad):
    with pytest.raises(InputError, match="widths"):
        check_widths(bad)


def test_default_widths():
    assert default_widths(64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_widths(48) == (1, 2, 4, 8, 16, 32, 48)
    assert default_widths(1) == (1,)
    with pytest.raises(InputError, match="max_width"):
        default_widths(0)


def test_random_width_sets_property():
    seed = random.SystemRandom().randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for _ in range(50):
        ws = tuple(sorted(rng.sample(range(1, 130), rng.randint(1, 8))))
        limit = rng.randint(ws[-1], ws[-1] * 2)
        for T in rng.sample(range(1, 400), 20):
            got = plan_step(T, ws, limit)
            assert [(s.path, s.width, s.start, s.length) for s in got] == expected_plan(T, ws, limit)


# ======================================================================================
# From the bad-input catalogue (issue 7): steps past the widths (slicing, one-slice
# views, width arguments).
# Each test runs graphs off, then with emulated graphs (rig_graphs); a refused call is
# checked for its error class and message, for nothing written (Rig.snapshot: the static
# arena, the KV state, the host-row ring, the commit snapshots, the counters) and for a
# valid step after it that matches the eager reference (tests.support.reliability_harness.refused).
# ======================================================================================
@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_oversized_steps():
    """The biggest step runs sliced and matches; a step over every limit with slicing off is
    refused before writing; host_inputs/device_inputs refuse multi-slice sizes."""
    rig = Rig("host", n_slots=2048, capacity=16)
    warm(rig, 1)
    rig.step(1500, rows=list(range(0, 1500, 100)))
    assert len(rig.rt.plan(1500)) == 16
    refused(rig, CapacityError, r"host_inputs\(T\): expected T <= 96 \(one slice\), got 97", lambda: rig.rt.host_inputs(97))
    refused(rig, CapacityError, r"device_inputs\(T\): expected T <= 96", lambda: rig.rt.device_inputs(10**6))
    refused(rig, InputError, r"T \(rows in the step\): expected a positive int, got 0", lambda: rig.rt.device_inputs(0))
    refused(rig, InputError, r"T \(rows in the step\): expected a positive int, got -4", lambda: rig.rt.plan(-4))
    refused(rig, InputError, r"width: expected one of \(1, 2, 4, 8, 16, 32, 64\) or a dynamic width, got 97",
            lambda: rig.rt.static_inputs(97))
    refused(rig, InputError, r"width: expected one of .*got -1", lambda: rig.rt.static_inputs(-1))
    refused(rig, InputError, r"width: expected one of .*got 3", lambda: rig.rt.static_inputs(3))


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_static_inputs_with_a_non_int_width():
    rig = Rig(None)
    with pytest.raises(InputError, match=r"width: expected"):
        rig.rt.static_inputs("8")


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
def test_slicing_off_refuses_wide_step_in_host_mode_before_the_ring():
    rig = Rig("host", slicing=False)
    warm(rig, 1, hold=True)
    x = rig.inputs(97)
    refused(rig, CapacityError, r"T \(rows in the step\): expected at most 96 with slicing off, got 97",
            lambda: rig.rt.step(rows=[0], **x))


# ======================================================================================
# Huge T (issue 35): a size that is refused anyway is refused before its plan is built.
# plan_step builds one Slice per slice a step runs, O(T / rows): fine for a step that runs
# them (its inputs are O(T) already), not for a call that refuses T.
# ======================================================================================
@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("T", [97, 5000, 2 * 10**6, 10**9, 10**18])
def test_handed_views_refuse_a_huge_T_in_constant_time(monkeypatch, T):
    """host_inputs(T) / device_inputs(T) built T's whole plan before the documented
    CapacityError: T = 2e6 took 2.5 s and 51 MB, T = 1e9 killed the process. What they hand
    out is at most the arena's rows (one slice): T past it is refused without a plan."""
    rig = Rig("host", capacity=16)
    warm(rig, 1)
    no_whole_plan_past(monkeypatch, rig.max_T())  # the valid step after the refusal may be sliced
    for what, call in (("host_inputs", rig.rt.host_inputs), ("device_inputs", rig.rt.device_inputs)):
        refused(rig, CapacityError, rf"^{what}\(T\): expected T <= 96 \(one slice\), got {T}$", lambda: call(T))


@pytest.mark.usefixtures("rig_graphs", "one_thread")  # graphs off, then emulated
@pytest.mark.parametrize("width", [[4], True, 4.0, "4", None, (4,)], ids=repr)
def test_static_outputs_takes_a_captured_int_width(width):
    """static_outputs([4]) raised TypeError ('unhashable type: list'); True and 4.0 found
    the outputs of widths 1 and 4 (dict keys equal to them) under emulated graphs."""
    rig = Rig(None)
    warm(rig, 1)
    refused(rig, InputError, r"^width: expected a captured width", lambda: rig.rt.static_outputs(width))
