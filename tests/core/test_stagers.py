"""The stagers behind one interface (inputs/stager.py): the CPU's, the pinned one and the
feed each offer what ``Stager`` lists (the arena stagers what ``ArenaStager`` adds), every
executor holds the stager its rows go through, and no room outside inputs/ asks whether
the graphs are fed."""
from __future__ import annotations

import ast
import inspect

import pytest
import torch

from cudagraph_rt import GraphRuntime, InputSpec
from cudagraph_rt.inputs import StaticInputs
from cudagraph_rt.inputs.arena import ONE_COPY_BYTES, ArenaLayout
from cudagraph_rt.inputs.feed import Feed
from cudagraph_rt.inputs.stager import ArenaStager, Stager, stagers
from cudagraph_rt.inputs.staging import CpuStaging, PinnedStaging
from tests.support import ROOT
from tests.support.models_for_tests import SlotModel

SPECS = {"a": InputSpec((), torch.int64, -1), "b": InputSpec((3,), torch.float32, 0.5)}


class FakeEvent:
    def synchronize(self):
        pass

    def record(self):
        pass


def _built(feed: bool):
    control = Feed.control_blocks(len(SPECS)) if feed else {}
    layout = ArenaLayout(SPECS, 8, control)
    arena = torch.zeros(layout.nbytes, dtype=torch.uint8)
    full = layout.carve(arena)
    layout.fill_pads(full)
    return stagers(layout, arena, full, torch.device("cpu"), FakeEvent() if feed else None)


def _members(protocol) -> list[str]:
    own = set(vars(protocol)) | set(inspect.get_annotations(protocol))
    return sorted(n for n in own if not n.startswith("_"))


def _params(fn) -> list[str]:
    return [p for p in inspect.signature(fn).parameters if p != "self"]


@pytest.mark.parametrize("cls, protocol", [(CpuStaging, ArenaStager), (PinnedStaging, ArenaStager),
                                           (Feed, Stager)])
def test_each_stager_offers_the_interface_with_its_signatures(cls, protocol):
    """Each class, member by member (stagers() builds PinnedStaging on CUDA only;
    test_staging.py builds one over plain memory, to check its writes on a CPU)."""
    names = _members(Stager) + (_members(ArenaStager) if protocol is ArenaStager else [])
    assert {"write", "wait", "arenas", "next", "prologue", "unfeed", "reset", "pinned"} <= set(names)
    for name in names:
        declared = any(name in inspect.get_annotations(c) for c in cls.__mro__)  # set in __init__
        assert hasattr(cls, name) or declared, (cls.__name__, name)
        want = getattr(protocol, name, None) or getattr(Stager, name, None)
        if inspect.isfunction(want):
            assert _params(getattr(cls, name)) == _params(want), (cls.__name__, name)
    for flag in ("fed", "short_path"):
        assert isinstance(getattr(cls, flag), bool), (cls.__name__, flag)
    assert cls.fed is (cls is Feed) and cls.short_path is (cls is Feed)


def test_the_stagers_built_on_a_cpu_satisfy_the_protocols():
    staging, same = _built(feed=False)
    assert same is staging and isinstance(staging, CpuStaging)
    assert isinstance(staging, ArenaStager) and isinstance(staging, Stager)
    staging, feed = _built(feed=True)
    assert isinstance(staging, CpuStaging) and isinstance(feed, Feed)
    assert isinstance(feed, Stager) and not isinstance(feed, ArenaStager)  # no control writes between steps
    for s in (staging, feed):
        assert 0 <= s.next < len(s.arenas) and s.pinned == []  # plain memory on a CPU
        assert all(a.buf.data_ptr() in {b.data_ptr() for b in s.buffers} for a in s.arenas)
    assert any(b is feed.mirror for b in feed.buffers)  # the feed's device copy is memory inputs must keep apart from


def test_the_arena_stagers_hooks_of_the_graph_path_do_nothing():
    """A graph over the arena stager (graphs not fed) reads the arena as it is: the
    prologue, unfeed and reset it calls unconditionally leave every buffer unchanged."""
    staging, _ = _built(feed=False)
    before = [a.buf.clone() for a in staging.arenas], staging.digest_state()
    staging.prologue(), staging.unfeed(), staging.reset({})
    assert all(torch.equal(a.buf, b) for a, b in zip(staging.arenas, before[0]))
    assert staging.digest_state() == before[1]


def _big_specs() -> dict:
    """One input wide enough that the arena crosses the bus in more than one copy: graphs
    are then not fed (their stager is the arena stager)."""
    return {"x": InputSpec((2048,), torch.float32, 0.0)}


def _double(x):
    return {"y": x["x"] * 2}


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_every_executor_holds_the_stager_its_rows_go_through(graphs):
    m = SlotModel("cpu", seed=3)
    rt = GraphRuntime(m, m.specs(), graphs=graphs, device="cpu")
    rt.capture()
    ins: StaticInputs = rt._inputs
    graph = ins.graph_stager
    assert rt.fed_graphs is (graphs == "emulate") and graph.fed is rt.fed_graphs
    assert isinstance(graph, Feed) if graphs == "emulate" else graph is ins.stager
    for w, ex in rt._by_width.items():
        assert ex.stager is (graph if graphs == "emulate" else ins.stager), (w, type(ex).__name__)
    assert rt._dynamic.stager is ins.stager  # the dynamic path is eager: never the feed
    assert (rt._direct is not None) is (graphs == "emulate")  # the short path needs the feed


def test_host_inputs_hands_out_the_next_steps_stager_rows():
    """A graph step's views are the feed's rows, a dynamic step's the arena stager's."""
    m, m_off = SlotModel("cpu", seed=4), SlotModel("cpu", seed=4)
    rt = GraphRuntime(m, m.specs(), graphs="emulate", device="cpu", max_width=8, dynamic_limit=16)
    off = GraphRuntime(m_off, m_off.specs(), graphs=False, device="cpu", max_width=8, dynamic_limit=16)
    ins = rt._inputs

    def inside(views, stager):
        spans = [(a.buf.data_ptr(), a.buf.data_ptr() + a.buf.numel()) for a in stager.arenas]
        return all(any(lo <= v.data_ptr() < hi for lo, hi in spans) for v in views.values())

    g = torch.Generator().manual_seed(11)
    for T, stager, path in [(3, ins.graph_stager, "graph"), (12, ins.stager, "dynamic"), (8, ins.graph_stager, "graph")]:
        views = rt.host_inputs(T)
        assert inside(views, stager) and not inside(views, ins.stager if stager is ins.graph_stager else
                                                    ins.graph_stager), T
        x = m.random_inputs(T, gen=g)
        for n, t in x.items():
            views[n].copy_(t)
        res = rt.step(**views)
        assert [s.path for s in res.slices] == [path], T
        assert torch.equal(res.outputs["hidden"], off.step(**x).outputs["hidden"]), T
    assert torch.equal(m.state, m_off.state)


def test_a_big_arena_is_not_fed_and_its_graphs_read_the_arena_stager():
    rt = GraphRuntime(_double, _big_specs(), graphs="emulate", device="cpu", max_width=16)
    off = GraphRuntime(_double, _big_specs(), graphs=False, device="cpu", max_width=16)
    ins = rt._inputs
    assert ins.nbytes > ONE_COPY_BYTES
    assert not rt.fed_graphs and ins.graph_stager is ins.stager
    g = torch.Generator().manual_seed(5)
    for T in [3, 16, 1, 7]:
        x = torch.randn(T, 2048, generator=g)
        a, b = rt.step(x=x), off.step(x=x)
        assert [s.path for s in a.slices] == ["graph"] and torch.equal(a.outputs["y"], b.outputs["y"]), T
        views = rt.host_inputs(T)  # the arena stager's rows, good for this one step
        views["x"].copy_(x)
        assert torch.equal(rt.step(**views).outputs["y"], b.outputs["y"]), T
    assert rt._direct is None and sum(rt.stats().graph_replays.values()) == 8


# ------------------------------------------------------------------ the seams, kept
def _fed_reads(tree: ast.AST) -> list[int]:
    """Lines where whether the graphs are fed (``.fed``, ``_fed``, a name ``fed``) decides
    something: the test of an if, a conditional expression, a while, an assert or a
    comprehension's filter, or a short-circuit operand that is not the value itself."""
    def mentions(node) -> bool:
        return any(isinstance(n, ast.Attribute) and n.attr in ("fed", "_fed")
                   or isinstance(n, ast.Name) and n.id in ("fed", "_fed") for n in ast.walk(node))

    lines = []
    for node in ast.walk(tree):
        tests = []
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            tests = [node.test]
        elif isinstance(node, ast.comprehension):
            tests = list(node.ifs)
        elif isinstance(node, ast.BoolOp):
            tests = node.values[:-1]
        lines += [t.lineno for t in tests if mentions(t)]
    return sorted(set(lines))


def test_no_room_outside_inputs_branches_on_whether_graphs_are_fed():
    """The rooms ask the stager they hold (its prologue, its write, its views) instead of
    a boolean: only inputs/ chooses the stagers, once."""
    core = [p for p in sorted((ROOT / "cudagraph_rt").rglob("*.py")) if "inputs" not in p.relative_to(ROOT).parts]
    found = [f"{p.relative_to(ROOT)}:{line}" for p in core for line in _fed_reads(ast.parse(p.read_text()))]
    assert not found, found


def test_the_fed_branch_finder_flags_what_it_should():
    src = """
if self._inputs.fed and x:
    pass
p = inputs.feed_prologue if inputs.fed else None
ok = fed and run()
if self._fed:
    pass
return self._inputs is not None and self._inputs.fed
y = [s for s in ss if s.fed]
"""
    assert _fed_reads(ast.parse(src)) == [2, 4, 5, 6, 9]
