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
