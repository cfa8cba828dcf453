"""The host-side bookkeeping of staging and the feed, on plain host memory, so that a CPU
run checks what otherwise runs only on a GPU: which rows a narrower step pads, which
words a fed graph's prologue takes from the feed and which it keeps."""
import pytest
import torch

from cudagraph_rt import GraphRuntime
from cudagraph_rt.inputs.arena import ArenaLayout
from cudagraph_rt.inputs.feed import Feed
from cudagraph_rt.inputs.staging import HostArena
from cudagraph_rt.inputs.validate import Prepared
from tests.support.feed_rows import SPECS, FakeEvent, rows
from tests.support.models_for_tests import SlotModel


def seeded() -> torch.Generator:
    seed = int(torch.randint(0, 2**31, (1,)))
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def assert_padded(arena: HostArena, lo: int) -> None:
    for name, spec in SPECS.items():
        assert (arena.views[name][lo:].float() == float(spec.pad)).all(), name


def test_a_narrower_write_pads_the_rows_a_wider_one_left():
    gen = seeded()
    layout = ArenaLayout(SPECS, 16, {"__ctrl__": (4, torch.int32)})
    arena = HostArena(layout, pinned=False)
    for T, strided in [(12, False), (5, True), (9, False), (2, True)]:
        x = rows(T, gen)
        for name, t in x.items():
            src = t if not strided else torch.stack([t, t], 1)[:, 0]  # same rows, strided
            p = src.data_ptr() if src.is_contiguous() else None
            arena.stage(name, src, p, 0, T)
            assert torch.equal(arena.views[name][:T], t), name
        assert_padded(arena, T)
    arena.mark(10)  # rows [:10] handed out to be filled: the next narrower write pads them
    for name in SPECS:
        arena.views[name][:10].fill_(7)
    x = rows(3, gen)
    for name, t in x.items():
        arena.stage(name, t, t.data_ptr(), 0, 3)
    assert_padded(arena, 3)


def test_a_write_from_an_offset_takes_the_right_rows():
    gen = seeded()
    arena = HostArena(ArenaLayout(SPECS, 8, {}), pinned=False)
    x = rows(20, gen)
    for name, t in x.items():
        arena.stage(name, t, t.data_ptr(), 13, 6)
        assert torch.equal(arena.views[name][:6], t[13:19]), name
    assert_padded(arena, 6)


def test_the_feed_prologue_takes_fed_inputs_and_keeps_the_others():
    gen = seeded()
    layout = ArenaLayout(SPECS, 8, {"__ctrl__": (4, torch.int32), **Feed.control_blocks(len(SPECS))})
    arena = torch.zeros(layout.nbytes, dtype=torch.uint8)
    full = layout.carve(arena)
    layout.fill_pads(full)
    feed = Feed(layout, arena, full, FakeEvent(), pinned=False)
    x = rows(5, gen)
    prep = Prepared(5, x, frozenset(), {n: t.data_ptr() for n, t in x.items()})
    feed.write(prep, 0, 5, 8, {"__ctrl__": (3, 1, 2, 5)})
    feed.prologue()
    for name, t in x.items():
        assert torch.equal(full[name][:5], t) and (full[name][5:].float() == float(SPECS[name].pad)).all()
    assert full["__ctrl__"].tolist() == [3, 1, 2, 5]
    # unfed: the arena's input rows stay as written by hand; control blocks still come in
    by_hand = rows(8, gen)
    for name, t in by_hand.items():
        full[name].copy_(t)
    feed.unfeed()
    feed.host.set_control({"__ctrl__": (0, 3, 2, 0)})
    feed.prologue()
    for name, t in by_hand.items():
        assert torch.equal(full[name], t), name
    assert full["__ctrl__"].tolist() == [0, 3, 2, 0]
    # fed again by the next write
    y = rows(2, gen)
    feed.write(Prepared(2, y, frozenset(), {n: t.data_ptr() for n, t in y.items()}), 0, 2, 8, None)
    feed.prologue()
    for name, t in y.items():
        assert torch.equal(full[name][:2], t) and (full[name][2:].float() == float(SPECS[name].pad)).all()


# ---- issue 22: padding rows are the pads whatever the feed or the staging held -----------
def _fed(rows_n=8):
    layout = ArenaLayout(SPECS, rows_n, Feed.control_blocks(len(SPECS)))
    arena = torch.zeros(layout.nbytes, dtype=torch.uint8)
    full = layout.carve(arena)
    layout.fill_pads(full)
    return Feed(layout, arena, full, FakeEvent(), pinned=False), full


def _scribble(views, lo, hi, gen):
    """Rows a caller writes into views after their step: no bookkeeping sees them."""
    for name, t in rows(hi, gen).items():
        views[name][lo:hi].copy_(t[lo:hi])


def test_the_feed_prologue_pads_every_row_from_T_whatever_the_feed_held():
    """Rows written into the feed after their step (views kept past it, or filled late by
    another thread) sit in rows the host bookkeeping counts as pads: the prologue used to
    move them into the arena, where a padding row ran them (and wrote their KV cells)."""
    gen = seeded()
    feed, full = _fed()
    for T, late in [(6, None), (3, None), (3, (3, 7)), (2, (0, 8)), (5, (5, 8))]:
        if late is not None:
            _scribble(feed.host.views, *late, gen)
        x = rows(T, gen)
        feed.write_rows([x[n].data_ptr() for n in SPECS], T)
        feed.prologue()
        for name, t in x.items():
            assert torch.equal(full[name][:T], t), (T, name)
        assert_padded(HostArenaView(full), T)


def test_the_feed_prologue_pads_device_fed_rows_and_none_once_unfed():
    gen = seeded()
    feed, full = _fed()
    x = rows(3, gen)
    feed.write(Prepared(3, x, frozenset(), {n: t.data_ptr() for n, t in x.items()}), 0, 3, 4, None)
    _scribble(feed.host.views, 3, 8, gen)
    feed.prologue()
    assert_padded(HostArenaView(full), 3)
    by_hand = rows(8, gen)  # unfed: a caller's own rows, all 8 of them, stay as written
    for name, t in by_hand.items():
        full[name].copy_(t)
    feed.unfeed()
    feed.prologue()
    for name, t in by_hand.items():
        assert torch.equal(full[name], t), name


def test_staging_pads_the_padding_rows_whatever_its_bookkeeping_says():
    gen = seeded()
    arena = HostArena(ArenaLayout(SPECS, 16, {}), pinned=False)
    for name, t in rows(4, gen).items():
        arena.stage(name, t, t.data_ptr(), 0, 4, 4)
    for name, t in rows(2, gen).items():
        arena.stage(name, t, t.data_ptr(), 0, 2, 4)  # pads rows [2, 4): the bookkeeping says 2 rows
    _scribble(arena.views, 2, 4, gen)  # a late write into rows the bookkeeping calls pads
    for name, t in rows(2, gen).items():
        arena.stage(name, t, t.data_ptr(), 0, 2, 4)
    for name, spec in SPECS.items():
        assert (arena.views[name][2:4].float() == float(spec.pad)).all(), name


class HostArenaView:
    """``assert_padded`` over a dict of views (the arena's), not a HostArena."""

    def __init__(self, views):
        self.views = views


# ---- a sliced step stages every slice from its own rows, whatever path the rows take -------
@pytest.mark.parametrize("graphs", [False, "emulate"], ids=["graphs-off", "emulated"])
@pytest.mark.parametrize("form", ["cast", "strided"])
def test_each_slice_of_a_sliced_step_is_staged_from_its_own_rows(graphs, form):
    """Rows a memmove cannot take (a dtype to cast, strided rows) go through ``put_rows``;
    a sliced step must hand each slice rows [start, start + length) of every input, as the
    memmove path does: the outputs equal one eager call of the step function on all rows."""
    gen = seeded()
    model, ref = SlotModel("cpu", seed=3), SlotModel("cpu", seed=3)
    rt = GraphRuntime(model, model.specs(), widths=(1, 2, 4, 8), dynamic_limit=12, graphs=graphs, device="cpu")
    for T in (29, 13, 24):  # dynamic 12 + dynamic 12 + graph 8 (5 rows); 12 + graph 1; 12 + 12
        x = model.random_inputs(T, gen=gen)
        if form == "cast":  # int32 / float16 values, each exact in the spec's dtype
            given = {k: v.half() if v.is_floating_point() else v.to(torch.int32) for k, v in x.items()}
        else:
            given = {k: torch.stack([v, v], 1)[:, 0] for k, v in x.items()}  # same rows, strided
        exact = {k: v.to(x[k].dtype) for k, v in given.items()}
        res = rt.step(**given)
        assert len(res.slices) > 1, res.slices
        want = ref(exact)["hidden"]
        torch.testing.assert_close(res.outputs["hidden"], want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model.state[:-1], ref.state[:-1], rtol=1e-5, atol=1e-6)


# ---- issue 40: a device input written in place is left alone by the staging's one copy -----
def _pinned_on_the_cpu(rows_n=16):
    """The pinned staging over plain memory (the arena's device is the CPU, so a tensor of
    the arena without a host pointer is a device input, as a CUDA tensor is on a GPU)."""
    from cudagraph_rt.inputs.arena import ONE_COPY_BYTES
    from cudagraph_rt.inputs.staging import PinnedStaging
    layout = ArenaLayout(SPECS, rows_n, {})
    assert layout.nbytes <= ONE_COPY_BYTES  # small: host rows cross in one copy of the whole arena
    arena = torch.zeros(layout.nbytes, dtype=torch.uint8)
    full = layout.carve(arena)
    layout.fill_pads(full)
    return PinnedStaging(layout, arena, full, torch.device("cpu"), pinned=False,
                         events=[FakeEvent(), FakeEvent()]), full


def test_the_one_copy_of_the_staging_leaves_a_device_input_written_in_place_alone():
    """``device_inputs()`` rows written in place on the device, the other inputs from the
    host: the host rows cross in the step's one copy of the staging arena, which holds pad
    values (or an older step's rows) where the device input lies. That copy must not be
    made over the rows written in place (README: "no copy is made, only the padding rows
    are filled"); a device input that is not the arena's own rows is copied after it."""
    gen = seeded()
    staging, full = _pinned_on_the_cpu()
    # earlier steps leave every input's rows in both staging arenas (host rows of "a" too)
    for T in (16, 13):
        x = rows(T, gen)
        staging.write(Prepared(T, x, frozenset(), {n: t.data_ptr() for n, t in x.items()}), 0, T, 16, None)
    for T, W, how in [(5, 8, "in place"), (11, 16, "in place"), (3, 4, "copied"), (7, 8, "in place"), (1, 1, "in place")]:
        x = rows(T, gen)
        if how == "in place":  # the caller's own device op into the arena rows device_inputs() gave
            full["a"][:T].copy_(x["a"])
            a, zero_copy = full["a"][:T], frozenset({"a"})
        else:  # another tensor on the device (strided: no host pointer), copied in
            a, zero_copy = torch.stack([x["a"], x["a"]], 1)[:, 0], frozenset()
        prep = Prepared(T, {"a": a, "b": x["b"], "c": x["c"]}, zero_copy,
                        {"b": x["b"].data_ptr(), "c": x["c"].data_ptr()})
        staging.write(prep, 0, T, W, None)
        for name, t in x.items():
            assert torch.equal(full[name][:T], t), (T, how, name)
            assert (full[name][T:W].float() == float(SPECS[name].pad)).all(), (T, how, name)


@pytest.mark.cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["graphs-off", "graphs-on"])
def test_rows_written_through_device_inputs_survive_the_host_rows_copy_on_cuda(graphs):
    """The promise above on a GPU, through the runtime: rows of one input written with a
    device op into ``device_inputs(T)``, the others passed from the host, reach the step
    function as written. Graphs off every step goes through the pinned staging; with graphs
    the narrow steps go through the feed and the wide ones (dynamic slices) through the
    pinned staging. Host steps before each fill the staging with other rows."""
    from tests.support.feed_rows import ECHO, _echo
    gen = seeded()
    rt = GraphRuntime(_echo, ECHO, widths=(1, 2, 4, 8), dynamic_limit=24, graphs=graphs, device="cuda")

    def host_rows(T):
        return {"a": torch.randint(0, 99, (T,), generator=gen), "b": torch.randn(T, 3, generator=gen),
                "h": torch.randn(T, 2, generator=gen).bfloat16()}

    for T in [5, 20, 8, 13, 3, 24, 1]:
        for _ in range(2):  # both staging arenas hold a full step of other rows
            rt.step(**host_rows(24))
        x = host_rows(T)
        dv = rt.device_inputs(T)
        dv["a"].copy_(x["a"].to("cuda", non_blocking=True))  # the caller's own device op
        out = rt.step(a=dv["a"], b=x["b"], h=x["h"]).outputs
        for name, t in x.items():
            assert torch.equal(out[name].cpu(), t), (T, name)
    rt.close()


# ---- issue 40: rows handed out by host_inputs(T) and filled, then a step of fewer rows ----
def _echo_rows(T, gen):
    return {"a": torch.randint(0, 99, (T,), generator=gen), "b": torch.randn(T, 3, generator=gen),
            "h": torch.randn(T, 2, generator=gen).bfloat16()}


@pytest.mark.parametrize("path", ["short", "general"])
@pytest.mark.parametrize("device, graphs", [
    ("cpu", "emulate"),
    pytest.param("cuda", False, marks=pytest.mark.cuda, id="cuda-graphs-off"),
    pytest.param("cuda", True, marks=pytest.mark.cuda, id="cuda-graphs-on"),
], ids=lambda v: str(v))
def test_rows_filled_through_host_inputs_past_the_steps_T_become_padding(device, graphs, path):
    """A runner fills ``host_inputs(8)`` and then steps 3 other rows (a retry after a
    refused step): rows [3, 8) it filled are padding from that step on, wherever a copy
    could carry them. The pinned staging copies its whole host arena to the device in one
    copy, so the device arena past T must hold the pads (a graph replayed by hand, or a
    wider width, would run those rows: a step that never ran); the feed's rows past T,
    which ``host_inputs`` hands out again, must be the pads as well (its bookkeeping: rows
    past the last step's T are pads). Graphs off on a CPU the host arena only backs the
    views (steps write the arena directly): nothing to see there. ``path``: the steps'
    rows as plain CPU tensors (the short path, with a feed) or strided (the general path)."""
    from tests.support.feed_rows import ECHO, _echo
    gen = seeded()
    rt = GraphRuntime(_echo, ECHO, widths=(1, 2, 4, 8), dynamic_limit=8, graphs=graphs, device=device)
    pads = {name: float(spec.pad) for name, spec in ECHO.items()}
    for T_fill, T in [(8, 3), (8, 5), (6, 1), (7, 2), (8, 4)]:
        hv = rt.host_inputs(T_fill)
        for name, v in _echo_rows(T_fill, gen).items():
            hv[name].copy_(v)  # filled in place, never stepped
        x = _echo_rows(T, gen)
        if path == "general":
            x = {k: torch.stack([v, v], 1)[:, 0] for k, v in x.items()}  # strided: no memmove
        out = rt.step(**x).outputs
        for name, t in x.items():
            assert torch.equal(out[name].cpu(), t), (T_fill, T, name)
        if rt.fed_graphs:  # the feed: the same host rows come back with the next host_inputs
            again = rt.host_inputs(T_fill)
            for name in ECHO:
                assert (again[name][T:].float() == pads[name]).all(), (T_fill, T, name, again[name][T:])
        else:  # the pinned staging: the device arena is its last copy (static_inputs would unfeed a feed)
            arena = rt.static_inputs(8)
            for name in ECHO:
                assert (arena[name][T:].float() == pads[name]).all(), (T_fill, T, name, arena[name][T:])
    rt.close()
