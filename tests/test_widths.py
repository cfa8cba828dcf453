"""plan_step against a brute-force restatement of the rule, for every T in 1..200."""
import random

import pytest

from cudagraph_rt import CapacityError, InputError, Slice, default_widths, plan_step
from cudagraph_rt.widths import check_widths

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
