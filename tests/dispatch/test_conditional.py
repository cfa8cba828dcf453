"""The CUDA build of the loop, what a CPU can check (issue 38, item 3): the support check
and its message, the fallback to host-driven rounds, the NVRTC source (compiled where an
NVRTC library exists), and the outer graph's construction against a recording stand-in of
cuda.bindings' driver module. The graph itself runs in ``python -m
cudagraph_rt.dispatch.selftest`` on a GPU."""
from __future__ import annotations

import ctypes
import logging
from types import SimpleNamespace

import numpy as np
import pytest

from cudagraph_rt.dispatch import conditional as cond
from cudagraph_rt.dispatch import support as sup
from cudagraph_rt.dispatch.rounds import HostRounds

OK = dict(cuda=True, driver=12080, bindings="12.9.0", nvrtc="12.9", torch="2.11.0", raw_graph=True)


@pytest.mark.parametrize("change, named", [
    (dict(cuda=False), "a CUDA device"),
    (dict(driver=12040), "CUDA 12.8+ for conditional SWITCH nodes (found CUDA 12.4)"),
    (dict(bindings=None, nvrtc=None), "cuda-python's cuda.bindings"),
    (dict(nvrtc=None), "an NVRTC library"),
    (dict(raw_graph=False, torch="2.4.0"), "raw_cuda_graph() (torch 2.5+; found 2.4.0)"),
])
def test_the_support_check_names_what_is_missing(change, named):
    assert sup.Support(**OK).ok and "driver CUDA 12.8" in sup.Support(**OK).message
    s = sup.Support(**{**OK, **change})
    assert not s.ok
    assert s.message.startswith("device dispatch needs ") and named in s.message
    assert len(s.missing) == 1


def test_torch_graph_detection():
    class Keeps:
        def __init__(self, keep_graph=False):
            pass

        def raw_cuda_graph(self):
            pass

    class Old:
        def __init__(self):
            pass

        def raw_cuda_graph(self):
            pass

    ns = lambda g: SimpleNamespace(cuda=SimpleNamespace(CUDAGraph=g))  # noqa: E731
    assert sup.torch_hands_out_graphs(ns(Keeps))
    assert not sup.torch_hands_out_graphs(ns(Old))
    assert not sup.torch_hands_out_graphs(ns(type("NoRaw", (), {})))


def test_without_conditional_nodes_the_rounds_run_host_driven(monkeypatch, caplog):
    from cudagraph_rt.dispatch.loop import DeviceLoop
    from cudagraph_rt.models import ToyConfig, ToyDecoder
    from cudagraph_rt.speculative.loop_drafter import CoinRounds
    model = ToyDecoder(ToyConfig.tiny(max_len=32, max_seqs=2), "cpu")
    loop = DeviceLoop(model, CoinRounds(model, 0.5), k=1)
    monkeypatch.setattr(sup, "conditional_support", lambda: sup.Support(**{**OK, "driver": 12040}))
    with caplog.at_level(logging.WARNING, logger="cudagraph_rt.dispatch.loop"):
        runner = loop._runner(True, True)
    assert isinstance(runner, HostRounds)
    assert "device dispatch needs a driver of CUDA 12.8+" in caplog.text and "host-driven" in caplog.text


def test_the_set_handles_kernel_compiles_with_nvrtc():
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="needs cuda-python's cuda.bindings (the dev extra)")
    try:
        found = int(nvrtc.nvrtcVersion()[0]) == 0
    except Exception:  # noqa: BLE001 - cuda.bindings raises its own not-found error
        found = False
    if not found:
        pytest.skip("needs an NVRTC library (pip install nvidia-cuda-nvrtc-cu12)")
    ptx = cond.compile_set_handles(nvrtc, "compute_90").decode()
    assert ".entry cgrt_set_handles" in ptx and "cudaGraphSetConditional" in ptx


# ----------------------------------------------------------------- a recording driver module
class _Graph:
    def __init__(self, name):
        self.name, self.nodes = name, []


class _Node:
    def __init__(self, graph, kind, deps, **info):
        self.graph, self.kind, self.deps, self.info = graph, kind, list(deps), info
        graph.nodes.append(self)


class FakeDriver:
    """The calls build_outer and without_events make, recorded; every call succeeds."""

    CU_GRAPH_COND_ASSIGN_DEFAULT = 1
    CUgraphNodeType = SimpleNamespace(CU_GRAPH_NODE_TYPE_CONDITIONAL="conditional",
                                      CU_GRAPH_NODE_TYPE_EVENT_RECORD="event_record",
                                      CU_GRAPH_NODE_TYPE_WAIT_EVENT="wait_event")
    CUgraphConditionalNodeType = SimpleNamespace(CU_GRAPH_COND_TYPE_WHILE="while", CU_GRAPH_COND_TYPE_SWITCH="switch")

    def __init__(self, edge_data=True):
        self.handles, self.edge_data = [], edge_data

    def CUgraphNodeParams(self):
        return SimpleNamespace(type=None, conditional=SimpleNamespace(handle=None, type=None, size=None, ctx=None))

    def CUDA_KERNEL_NODE_PARAMS(self):
        return SimpleNamespace()

    def cuCtxGetCurrent(self):
        return 0, "ctx"

    def cuGraphCreate(self, flags):
        return 0, _Graph("outer")

    def cuGraphConditionalHandleCreate(self, graph, ctx, default, flags):
        self.handles.append(SimpleNamespace(graph=graph, default=default, flags=flags, value=1000 + len(self.handles)))
        return 0, self.handles[-1].value

    def cuGraphAddNode(self, graph, deps, *rest):
        if self.edge_data != (len(rest) == 3):
            raise TypeError("wrong signature for this bindings version")
        p = rest[-1]
        bodies = [_Graph(f"{p.conditional.type}-body{i}") for i in range(p.conditional.size)]
        p.conditional.phGraph_out = bodies
        return 0, _Node(graph, p.type, deps, cond=p.conditional.type, handle=p.conditional.handle,
                        size=p.conditional.size, bodies=bodies)

    def cuGraphAddChildGraphNode(self, graph, deps, n, child):
        assert n == len(deps)
        return 0, _Node(graph, "child", deps, child=child)

    def cuGraphAddKernelNode(self, graph, deps, n, p):
        pointers = np.ctypeslib.as_array((ctypes.c_uint64 * 4).from_address(p.kernelParams))
        args = [ctypes.c_uint64.from_address(int(a)).value for a in pointers]
        return 0, _Node(graph, "kernel", deps, func=p.func, args=args, grid=(p.gridDimX, p.blockDimX))


def test_the_outer_graph_is_a_while_over_plan_setter_and_a_switch_of_the_widths():
    for edge_data in (True, False):  # cuda.bindings 13 and 12
        drv = FakeDriver(edge_data)
        branches = [(f"step{i}", f"commit{i}") for i in range(3)]
        graph, description = cond.build_outer(drv, "kernel", "plan", branches, go=0xA0, width_index=0xB0,
                                              widths=(2, 8, 32))
        (loop,) = graph.nodes
        assert loop.info["cond"] == "while" and loop.info["size"] == 1 and loop.deps == []
        loop_handle = next(h for h in drv.handles if h.value == loop.info["handle"])
        assert loop_handle.graph is graph and loop_handle.default == 1 and loop_handle.flags == 1
        plan, setter, switch = loop.info["bodies"][0].nodes
        assert plan.kind == "child" and plan.info["child"] == "plan" and plan.deps == []
        assert setter.kind == "kernel" and setter.deps == [plan] and setter.info["grid"] == (1, 1)
        assert setter.info["args"] == [loop.info["handle"], switch.info["handle"], 0xA0, 0xB0]
        assert switch.info["cond"] == "switch" and switch.info["size"] == 3 and switch.deps == [setter]
        switch_handle = next(h for h in drv.handles if h.value == switch.info["handle"])
        assert switch_handle.graph is loop.info["bodies"][0]
        for body, (step, commit) in zip(switch.info["bodies"], branches):
            s, c = body.nodes
            assert (s.info["child"], c.info["child"]) == (step, commit) and s.deps == [] and c.deps == [s]
        assert len(description) == 4 + 3 and "SWITCH(width_index) over 3 branches" in description[3]
        assert [line.split(":")[0].strip() for line in description[4:]] == ["branch 0", "branch 1", "branch 2"]
        assert all(f"width {w}'s captured graph (child graph)" in line for w, line in zip((2, 8, 32), description[4:]))


class _EventsDriver:
    """A graph a -> rec -> b, a -> c, for without_events: the record goes, a -> b stays."""

    CUgraphNodeType = FakeDriver.CUgraphNodeType

    def __init__(self):
        self.edges = {("a", "rec"), ("rec", "b"), ("a", "c")}
        self.nodes = {"a": "kernel", "rec": "event_record", "b": "kernel", "c": "memcpy"}

    def cuGraphClone(self, g):
        return 0, "clone"

    def cuGraphGetNodes(self, g, n):
        return (0, list(self.nodes), len(self.nodes)) if n else (0, None, len(self.nodes))

    def cuGraphNodeGetType(self, node):
        return 0, self.nodes[node]

    def cuGraphNodeGetDependencies(self, node, n):
        deps = [a for a, b in sorted(self.edges) if b == node]
        return (0, deps, len(deps)) if n else (0, None, len(deps))

    def cuGraphNodeGetDependentNodes(self, node, n):
        out = [b for a, b in sorted(self.edges) if a == node]
        return (0, out, len(out)) if n else (0, None, len(out))

    def cuGraphDestroyNode(self, node):
        del self.nodes[node]
        self.edges = {e for e in self.edges if node not in e}
        return (0,)

    def cuGraphAddDependencies(self, g, src, dst, edge_data, n):
        self.edges |= set(zip(src, dst))
        return (0,)


def test_event_nodes_are_taken_out_of_a_width_graph_keeping_their_order():
    drv = _EventsDriver()
    assert cond.without_events(drv, "width") == "clone"
    assert drv.nodes == {"a": "kernel", "b": "kernel", "c": "memcpy"}
    assert drv.edges == {("a", "b"), ("a", "c")}


def test_a_failed_call_names_itself():
    with pytest.raises(cond.CudaCallError, match="cuGraphLaunch failed"):
        cond.check((7,), "cuGraphLaunch")
    assert cond.check((0, "x"), "f") == "x" and cond.check((0, "x", 2), "f") == ("x", 2)
