"""The host-side bookkeeping of staging and the feed, on plain host memory, so that a CPU
run checks what otherwise runs only on a GPU: which rows a narrower step pads, which
words a fed graph's prologue takes from the feed and which it keeps."""
import torch

from cudagraph_rt import InputSpec
from cudagraph_rt.inputs.arena import SRC, ArenaLayout
from cudagraph_rt.inputs.feed import Feed
from cudagraph_rt.inputs.staging import HostArena
from cudagraph_rt.inputs.validate import Prepared

SPECS = {"a": InputSpec((), torch.int64, -5), "b": InputSpec((3,), torch.float32, 0.25),
         "c": InputSpec((2,), torch.bfloat16, -1.5)}


def seeded() -> torch.Generator:
    seed = int(torch.randint(0, 2**31, (1,)))
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def rows(T, gen):
    return {"a": torch.randint(0, 99, (T,), generator=gen), "b": torch.randn(T, 3, generator=gen),
            "c": torch.randn(T, 2, generator=gen).bfloat16()}


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


class FakeEvent:
    def synchronize(self):
        pass

    def record(self):
        pass


def test_the_feed_prologue_takes_fed_inputs_and_keeps_the_others():
    gen = seeded()
    layout = ArenaLayout(SPECS, 8, {"__ctrl__": (4, torch.int32), SRC: (len(SPECS) + 1, torch.bool)})
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
