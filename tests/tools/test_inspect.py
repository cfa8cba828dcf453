"""CPU tests of cudagraph_rt.debug.inspect.

The hazard finder: every kind, each reported at the right line. Expected lines come from
``# HAZARD: kind`` markers in the step functions below (read with inspect.getsourcelines),
and a line without a marker must report nothing. The inputs are CPU tensors, so the finder
simulates the device (see the module docstring of cudagraph_rt.debug.inspect).
The CUDA half: answers "needs CUDA" here; the pure helpers run on synthetic nodes. Marked
cuda (at the end): graph_nodes on hand-captured graphs, the DOT text, the finder on CUDA
tensors, inspect_runtime on a tiny runtime.
"""
from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cudagraph_rt import CgrtError
from cudagraph_rt.debug.inspect import (
    HAZARD_KINDS,
    GraphInspectError,
    GraphNode,
    Hazard,
    NeedsCudaError,
    compare_outputs,
    diff_nodes,
    explain_capture_failure,
    find_capture_hazards,
    graph_nodes,
    inspect_runtime,
    node_counts,
    to_dot,
)
from cudagraph_rt.graphs.capture import CaptureReport, WidthCapture
from cudagraph_rt.debug.inspect import _capture_facts
import cudagraph_rt.debug.graph_nodes as graph_nodes_mod
import cudagraph_rt.debug.hazards as hazards_mod
from tests.support.extras import require
from tests.support.models_for_tests import warm_and_capture

_MARK = re.compile(r"#\s*HAZARD:\s*([\w, ]+)")


def marked(*fns) -> set[tuple[str, int]]:
    """(kind, line number) for every '# HAZARD: kind[, kind]' marker in the functions' source."""
    out = set()
    for fn in fns:
        lines, start = inspect.getsourcelines(fn)
        for i, text in enumerate(lines):
            m = _MARK.search(text)
            if m:
                out |= {(k.strip(), start + i) for k in m.group(1).split(",") if k.strip()}
    return out


def found(fn, *args, **kwargs) -> set[tuple[str, int]]:
    hazards = find_capture_hazards(fn, *args, **kwargs)
    for h in hazards:
        assert os.path.samefile(h.filename, __file__), h
        assert h.kind in HAZARD_KINDS and h.line and h.message
    return {(h.kind, h.lineno) for h in hazards}


def inputs():
    return {"x": torch.arange(4, dtype=torch.float32)}


# --- step functions with marked lines -------------------------------------------------
def host_syncs(inp):
    x = inp["x"]
    a = x.sum().item()  # HAZARD: host_sync
    b = x.cpu()  # HAZARD: host_sync
    c = x.tolist()  # HAZARD: host_sync
    d = x.nonzero()  # HAZARD: host_sync
    e = torch.masked_select(x, x > 1)  # HAZARD: host_sync
    f = x[x > 1]  # HAZARD: host_sync
    g = torch.unique(x)  # HAZARD: host_sync
    h = int(x[0])  # HAZARD: host_sync
    i = x.to("cpu")  # HAZARD: host_sync
    j = x.numpy()  # HAZARD: host_sync
    k = x[: x[2].long()]  # HAZARD: host_sync
    out = torch.empty(4)
    out.copy_(x)  # HAZARD: host_sync
    y = x.clone()
    y[x > 1] = 0.0  # masked_fill: no sync
    z = torch.where(x > 1, x, 0.0)
    return a, b, c, d, e, f, g, h, i, j, k, y, z


def branches(inp):
    x = inp["x"]
    if x.sum() > 0:  # HAZARD: data_dependent_branch
        x = x + 1
    while bool(x.max() > 100):  # HAZARD: data_dependent_branch
        x = x - 1
    assert (x >= 0).all()  # HAZARD: data_dependent_branch
    if torch.tensor(True):  # a host literal: nothing on the device is read
        x = x * 1
    return x


def cpu_tensors(inp):
    x = inp["x"]
    a = x + torch.arange(4)  # HAZARD: cpu_tensor
    b = torch.tensor([1.0, 2.0, 3.0, 4.0], device=x.device)  # HAZARD: cpu_tensor
    c = torch.ones(4).to(x.device)  # HAZARD: cpu_tensor
    d = x.new_tensor([0.0, 1.0, 2.0, 3.0])  # HAZARD: cpu_tensor
    e = x.clone()
    e.copy_(torch.zeros(4))  # HAZARD: cpu_tensor
    s = x.sum().cpu()  # HAZARD: host_sync
    f = x * s  # HAZARD: cpu_tensor
    g = x + torch.zeros(4, device=x.device)  # made on the device
    h = x * torch.tensor(2.0)  # a 0-dim literal: frozen anyway, like a Python number
    i = x + torch.full((4,), 3.0, device="cuda")  # the simulated device
    return a, b, c, d, e, f, g, h, i


def pinned(inp):
    x = inp["x"]
    a = torch.empty(4, pin_memory=True)  # HAZARD: pinned_alloc
    b = torch.zeros(4).pin_memory()  # HAZARD: pinned_alloc
    c = torch.empty(4)
    return x + 1, a, b, c


def rng(inp):
    x = inp["x"]
    a = torch.rand(4)  # HAZARD: rng
    b = F.dropout(x, 0.5)  # HAZARD: rng
    c = torch.multinomial(x + 1, 2)  # HAZARD: rng
    d = x.clone().normal_()  # HAZARD: rng
    e = torch.bernoulli(torch.full((4,), 0.5))  # HAZARD: rng
    f = F.dropout(x, 0.5, training=False)
    return a, b, c, d, e, f


def raises(inp):
    x = inp["x"]
    x.max().item()  # HAZARD: host_sync
    raise ValueError("bad step")  # HAZARD: error


def _helper(x):
    return x.nonzero()  # HAZARD: host_sync


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)  # parameters made outside the step are device tensors: fine
        return h[h > 0]  # HAZARD: host_sync


_BLOCK = _Block()   # built outside the step: its initialisation draws random numbers


def nested(inp):
    return _helper(inp["x"]), _BLOCK(inp["x"])


# --- the finder -----------------------------------------------------------------------
@pytest.mark.parametrize("fn", [host_syncs, branches, cpu_tensors, pinned, rng, raises, nested],
                         ids=lambda f: f.__name__)
def test_every_marked_line_and_nothing_else(fn):
    extra = (_helper, _Block.forward) if fn is nested else ()
    assert found(fn, inputs()) == marked(fn, *extra)


def test_every_kind_is_covered():
    kinds = {k for k, _ in marked(host_syncs, branches, cpu_tensors, pinned, rng, raises)}
    assert kinds == set(HAZARD_KINDS)


def test_fields_op_names_and_messages():
    by_line = {h.lineno: h for h in find_capture_hazards(host_syncs, inputs())}
    lines, start = inspect.getsourcelines(host_syncs)
    item = by_line[start + 2]
    assert item.op == "Tensor.item" and item.line == "a = x.sum().item()  # HAZARD: host_sync"
    assert by_line[start + 7].op == "aten.index" and "boolean-mask" in by_line[start + 7].message
    assert by_line[start + 5].op == "aten.nonzero"
    branch = next(h for h in find_capture_hazards(branches, inputs()))
    assert branch.op == "Tensor.__bool__"
    baked = [h for h in find_capture_hazards(cpu_tensors, inputs()) if "0-dim" in h.message]
    assert len(baked) == 1 and baked[0].op == "aten.mul"
    err = find_capture_hazards(raises, inputs())[-1]
    assert err.op == "ValueError" and err.message == "ValueError: bad step"
    with pytest.raises(dataclasses.FrozenInstanceError):
        item.lineno = 0
    assert Hazard(**item.to_json()) == item
    assert str(item).startswith(f"host_sync: Tensor.item at {__file__}:{start + 2}: a = x.sum().item()")


def test_deduplicated_by_kind_op_and_line():
    def step(inp):
        for _ in range(3):
            inp["x"].sum().item()  # HAZARD: host_sync
        v = inp["x"].max().item() + int(inp["x"][0])  # HAZARD: host_sync
        return v

    hazards = find_capture_hazards(step, inputs())
    assert {(h.kind, h.lineno) for h in hazards} == marked(step)
    assert len(hazards) == 3   # one per (kind, op, line): item at two lines, __int__ once


def test_positional_and_keyword_arguments_and_no_mutation_of_inputs():
    def step(x, *, scale):
        return (x * scale).sum().item()  # HAZARD: host_sync

    x = torch.ones(3)
    assert found(step, x, scale=torch.ones(3)) == marked(step)
    assert torch.equal(x, torch.ones(3))


def test_clean_step_reports_nothing():
    def step(inp):
        x = inp["x"]
        mask = x > 1
        y = torch.where(mask, x * 2, x).cumsum(0)
        return y.masked_fill(~mask, 0.0), torch.zeros_like(y), y.new_zeros(2)

    assert find_capture_hazards(step, inputs()) == ()


def test_explain_capture_failure_format():
    def step(inp):
        return inp["x"].nonzero()  # HAZARD: host_sync

    (_, line), = marked(step)
    text = explain_capture_failure(step, inputs())
    first, second = text.splitlines()
    source = 'return inp["x"].nonzero()  # HAZARD: host_sync'
    assert first == f"width 4: aten.nonzero at {__file__}:{line}: {source}"
    assert second.startswith("    host_sync: ")
    assert explain_capture_failure(lambda inp: inp["x"] + 1, inputs(), width=8).startswith(
        "width 8: the eager hazard finder saw nothing")


# --- the CUDA half, on the CPU ----------------------------------------------------------
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")


@no_cuda
def test_graph_nodes_needs_cuda():
    with pytest.raises(NeedsCudaError, match="needs CUDA") as info:
        graph_nodes(object())
    assert isinstance(info.value, CgrtError)


class _StubRuntime:
    """Just the attributes inspect_runtime reads of a GraphRuntime (its public API)."""

    device = torch.device("cpu")
    widths = (1, 2)
    graphs_captured: dict = {}
    capture_report = None

    @staticmethod
    def step_fn(inp):
        return {"y": inp["x"] * 2, "n": inp["x"].sum().item()}

    @staticmethod
    def static_inputs(width):
        return {"x": torch.zeros(width)}


@no_cuda
def test_inspect_runtime_answers_needs_cuda_with_hazards():
    report = inspect_runtime(_StubRuntime())
    assert not report.available and "needs CUDA" in report.reason and not report.ok
    assert [w.width for w in report.widths] == [1, 2]
    assert all([h.op for h in w.hazards] == ["Tensor.item"] for w in report.widths)
    assert report.widths[0].hazards[0].filename == __file__
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["available"] is False and doc["widths"][0]["hazards"][0]["kind"] == "host_sync"


# --- pure helpers on synthetic nodes -------------------------------------------------------
def _k(i, name, grid, deps=()):
    return GraphNode(i, "kernel", name=name, grid=grid, block=(128, 1, 1), shared_bytes=0, deps=deps)


A = (_k(0, "void at::native::add<float>(int)", (1, 1, 1)), _k(1, "gemm", (4, 1, 1), (0,)),
     GraphNode(2, "memcpy", bytes=64, direction="HtoD", host_memory="pinned", deps=(1,)))
B = (_k(0, "void at::native::add<float>(int)", (2, 1, 1)), _k(1, "gemm", (4, 1, 1), (0,)),
     _k(2, "gemm", (8, 1, 1), (1,)), _k(3, "argmax", (1, 1, 1), (2,)),
     GraphNode(4, "memset", bytes=256, value=0, deps=(3,)),
     GraphNode(5, "memcpy", bytes=4096, direction="HtoD", host_memory="pageable",
               hazard="memcpy with pageable host memory", deps=(4,)))


def test_node_counts_and_short_name():
    assert node_counts(B) == {"kernel": 4, "memcpy": 1, "memset": 1}
    assert A[0].short_name == "at::native::add" and A[1].short_name == "gemm"
    assert GraphNode(0, "memset").short_name == "memset"


def test_diff_nodes():
    d = diff_nodes(A, B)
    assert d.added == (("argmax", 1), ("gemm", 1)) and d.removed == ()
    assert d.grid_changes == (("void at::native::add<float>(int)", (1, 1, 1), (2, 1, 1),
                               (128, 1, 1), (128, 1, 1)),)
    assert d.counts_a == {"kernel": 2, "memcpy": 1} and not d.same_kernels
    back = diff_nodes(B, A)
    assert back.removed == d.added and back.added == ()
    assert diff_nodes(A, A).same_kernels and diff_nodes(A, A).grid_changes == ()
    json.dumps(d.to_json())


def test_to_dot():
    text = to_dot(B, title='width "8"')
    assert text.startswith('digraph "width \\"8\\"" {') and text.rstrip().endswith("}")
    assert "n0 -> n1;" in text and "n4 -> n5;" in text and text.count("->") == 5
    assert "at::native::add\\ngrid (2, 1, 1)" in text
    assert "memcpy HtoD 4.0 KiB (pageable)" in text
    assert re.search(r"n5 \[label=.*color=red", text) and not re.search(r"n4 \[label=.*color=red", text)


def test_compare_outputs():
    a = {"tokens": torch.tensor([1, 2, 3]), "h": torch.tensor([[1.0, float("nan")], [2.0, 3.0]])}
    b = {"tokens": torch.tensor([1, 2, 4]), "h": torch.tensor([[1.0, float("nan")], [2.0, 3.5]])}
    diffs = {d.path: d for d in compare_outputs(a, b)}
    assert diffs["tokens"].first_row == 2 and diffs["tokens"].max_abs == 1.0
    assert diffs["h"].first_row == 1 and diffs["h"].max_rel == pytest.approx(0.5 / 3.5)
    assert all(d.equal for d in compare_outputs(a, a))
    odd = compare_outputs((torch.ones(2),), (torch.ones(3),))[0]
    assert odd.path == "[0]" and not odd.equal and "shape" in odd.note


def test_capture_facts_from_the_capture_report():
    report = CaptureReport((WidthCapture(8, 0.1, 0.5, 4096), WidthCapture(4, 0.0, 0.0, 0, error="boom")),
                           0.7, 4096)
    assert _capture_facts(report, 8) == {"capture_s": 0.5, "pool_bytes": 4096,
                                         "error": None}
    assert _capture_facts(report, 4)["error"] == "boom"
    assert _capture_facts(report, 2) == dict.fromkeys(("capture_s", "pool_bytes", "error"))
    assert _capture_facts(SimpleNamespace(widths={2: {"capture_s": 1.0}}), 2)["capture_s"] == 1.0
    assert _capture_facts(None, 4)["capture_s"] is None


# --- graph_nodes against a fake driver (cuda.bindings' calling conventions, no GPU) -------
def fake_driver(edges_cuda13: bool):
    """The calls graph_nodes makes, answering like cuda.bindings.driver for a 4-node graph:
    kernel -> pageable HtoD memcpy -> memset, and a pinned DtoH memcpy after the kernel."""
    require("cuda.bindings")
    import cuda.bindings.driver as real

    ok, bad = real.CUresult.CUDA_SUCCESS, real.CUresult.CUDA_ERROR_INVALID_VALUE
    T, M = real.CUgraphNodeType, real.CUmemorytype
    types = {10: T.CU_GRAPH_NODE_TYPE_KERNEL, 11: T.CU_GRAPH_NODE_TYPE_MEMCPY,
             12: T.CU_GRAPH_NODE_TYPE_MEMSET, 13: T.CU_GRAPH_NODE_TYPE_MEMCPY}
    copies = {
        11: SimpleNamespace(srcMemoryType=M.CU_MEMORYTYPE_HOST, srcHost=0x1000, srcDevice=0,
                            dstMemoryType=M.CU_MEMORYTYPE_DEVICE, dstHost=0, dstDevice=0x9000,
                            WidthInBytes=64, Height=1, Depth=1),
        13: SimpleNamespace(srcMemoryType=M.CU_MEMORYTYPE_UNIFIED, srcHost=0, srcDevice=0x9000,
                            dstMemoryType=M.CU_MEMORYTYPE_UNIFIED, dstHost=0, dstDevice=0x5000,
                            WidthInBytes=32, Height=0, Depth=0)}
    memory = {0x5000: M.CU_MEMORYTYPE_HOST, 0x9000: M.CU_MEMORYTYPE_DEVICE}   # 0x1000: pageable
    src, dst = [10, 11, 10], [11, 12, 13]

    def get_edges(graph, n=0):
        lists = (src[:n], dst[:n]) + (([None] * n,) if edges_cuda13 else ())
        return (ok, *lists, len(src))

    return SimpleNamespace(
        CUresult=real.CUresult, CUgraphNodeType=T, CUmemorytype=M,
        CUpointer_attribute=real.CUpointer_attribute,
        CUgraph=real.CUgraph, cuGetErrorName=lambda e: (ok, e.name.encode()),
        cuGraphGetNodes=lambda g, n=0: (ok, [10, 11, 12, 13][:n], 4),
        cuGraphGetEdges=get_edges,
        cuGraphNodeGetType=lambda node: (ok, types[node]),
        cuGraphKernelNodeGetParams=lambda node: (ok, SimpleNamespace(
            func=7, kern=0, gridDimX=96, gridDimY=1, gridDimZ=1, blockDimX=256, blockDimY=1,
            blockDimZ=1, sharedMemBytes=512)),
        cuFuncGetName=lambda func: (ok, b"_ZN2at6native3addEv"),
        cuGraphMemcpyNodeGetParams=lambda node: (ok, copies[node]),
        cuGraphMemsetNodeGetParams=lambda node: (ok, SimpleNamespace(
            dst=0x9000, elementSize=4, width=100, height=1, pitch=0, value=3)),
        cuPointerGetAttribute=lambda attr, ptr: (
            (ok, False) if attr == real.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_MANAGED
            else (ok, memory[ptr]) if ptr in memory else (bad, None)))


@pytest.mark.parametrize("edges_cuda13", [False, True], ids=["edges-cuda12", "edges-cuda13"])
def test_graph_nodes_with_a_fake_driver(monkeypatch, edges_cuda13):
    monkeypatch.setattr(graph_nodes_mod, "_driver", lambda: fake_driver(edges_cuda13))
    kernel, h2d, memset, d2h = graph_nodes(1234)
    assert (kernel.type, kernel.grid, kernel.block) == ("kernel", (96, 1, 1), (256, 1, 1))
    assert kernel.shared_bytes == 512
    assert kernel.name in ("at::native::add()", "_ZN2at6native3addEv")   # demangled with c++filt
    assert (h2d.direction, h2d.bytes, h2d.host_memory, h2d.deps) == ("HtoD", 64, "pageable", (0,))
    assert "pageable" in h2d.hazard
    assert (memset.type, memset.bytes, memset.value, memset.deps) == ("memset", 400, 3, (1,))
    assert (d2h.direction, d2h.bytes, d2h.host_memory, d2h.hazard) == ("DtoH", 32, "pinned", None)
    assert d2h.deps == (0,)


# --- the command (cgrt inspect), on the CPU ---------------------------------------------
def slot_target(graphs: bool, model_cls=None):
    """A runtime factory as `cgrt inspect --target` expects (see tools/inspect_cmd.py)."""
    from cudagraph_rt import GraphRuntime
    from tests.support.models_for_tests import SlotModel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = (model_cls or SlotModel)(device)
    rt = GraphRuntime(model, model.specs(), graphs=graphs, keep_graphs=graphs, device=device, max_width=4)
    gen = torch.Generator().manual_seed(0)
    return rt, lambda T: model.random_inputs(T, gen=gen)


def _syncing_model():
    from tests.support.models_for_tests import SlotModel

    class Syncing(SlotModel):
        def __call__(self, x):
            out = super().__call__(x)
            self.last = out["hidden"].abs().max().item()  # HAZARD: host_sync
            return out

    return Syncing


def run_cli(*argv, target) -> int:
    from cudagraph_rt.tools import inspect_cmd

    parser = __import__("argparse").ArgumentParser()
    inspect_cmd.add_arguments(parser)
    args = parser.parse_args(list(argv))
    args.target = target
    return inspect_cmd.run(args)


@no_cuda
def test_cli_on_cpu_exits_1_on_hazards_and_0_when_clean(capsys):
    """On a CPU only the hazard finder runs; its verdict is the exit code, so a CPU CI job
    tells "hazard" (1) from "clean" (0); 2 is kept for usage errors."""
    syncing = _syncing_model()
    assert run_cli("--json", target=lambda graphs: slot_target(graphs, syncing)) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["available"] is False and [w["width"] for w in doc["widths"]] == [1, 2, 4]
    (kind, line), = marked(syncing.__call__)
    assert {(h["kind"], h["lineno"]) for w in doc["widths"] for h in w["hazards"]} == {(kind, line)}

    assert run_cli(target=lambda graphs: slot_target(graphs, syncing)) == 1
    text = "".join(capsys.readouterr().out.split())  # rich wraps long paths at the console width
    assert "needsCUDA" in text and f"test_inspect.py:{line}" in text and "widths1,2,4" in text
    assert run_cli(target=slot_target) == 0
    assert "capture hazards: none found" in capsys.readouterr().out


def test_cli_bad_target_exits_2(capsys):
    assert run_cli(target="no_such_module_xyz:factory") == 2
    assert run_cli(target="missing-colon") == 2
    assert "--target" in capsys.readouterr().err


def not_a_runtime(graphs: bool):
    return "a string"


def raising_factory(graphs: bool):
    raise RuntimeError("the model file is missing")


@pytest.mark.parametrize("target, code, want", [
    ("os:getcwd", 2, "--target: expected a factory taking graphs= (factory(graphs: bool); getcwd() does not), "
                     "got 'os:getcwd'"),
    ("os:sep", 2, "--target: expected a callable factory (sep is a str), got 'os:sep'"),
    ("tests.tools.test_inspect:not_a_runtime", 2, "--target: expected a factory returning a GraphRuntime or "
                                                  "(runtime, inputs), got str from not_a_runtime"),
    ("tests.tools.test_inspect:raising_factory", 1, "--target tests.tools.test_inspect:raising_factory: the "
                                                    "target's factory raised RuntimeError: the model file is missing"),
])
def test_a_target_that_is_no_runtime_factory_is_one_line_never_a_traceback(capsys, target, code, want):
    """`cgrt inspect --target os:getcwd` ended in a traceback (TypeError: getcwd() takes no
    keyword arguments). A target that is no factory taking graphs=, or returns no runtime,
    is a usage error; a factory that raises is a failure naming the error; one line each."""
    from cudagraph_rt.cli import main

    assert main(["inspect", "--target", target]) == code
    err = capsys.readouterr().err
    assert err == f"cgrt inspect: {want}\n", err


def test_model_and_target_together_are_a_usage_error(capsys):
    """`--model hf:llama --target ...` ran the model and dropped the target without a word;
    naming the default target explicitly was dropped the same way."""
    from cudagraph_rt.cli import main

    for target in ("tests.tools.test_inspect:slot_target", "cudagraph_rt.tools.inspect_cmd:toy_target"):
        assert main(["inspect", "--model", "hf:llama", "--target", target]) == 2
        err = capsys.readouterr().err
        assert err == f"cgrt inspect: --model: expected toy (the default) with --target {target}, got 'hf:llama'\n"


@pytest.mark.parametrize("model", ["toy", "hf:llama"])
def test_dispatch_device_shows_the_loops_structure(capsys, model):
    """`cgrt inspect --dispatch device`: the device loop built over the model, a SWITCH
    branch per captured width (the narrowest holding a round's rows, widest slots * (k+1)),
    and why its rounds run as they do (on a CPU: emulated)."""
    from cudagraph_rt.cli import main
    from tests.support.extras import available

    if model != "toy" and not available("transformers"):
        pytest.skip("needs transformers")
    assert main(["inspect", "--dispatch", "device", "--model", model, "--launch-rounds", "8", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and doc["rounds_per_launch"] == 8 and doc["k"] == 4
    widths = doc["widths"]
    assert widths[-1] >= doc["slots"] * 5 > widths[-2] and widths == sorted(set(widths))
    lines = doc["outline"]
    assert lines[0].startswith("WHILE") and f"SWITCH(width_index) over {len(widths)} branches" in lines[3]
    assert [int(line.split("width ")[1].split("'")[0]) for line in lines[4:]] == widths
    if not torch.cuda.is_available():
        assert doc["rounds_ran"] == "host" and "emulated" in doc["note"] and "host reads" in lines[2]
    elif doc["rounds_ran"] == "conditional":
        assert "set_handles" in lines[2]


@pytest.mark.parametrize("flag, value", [("--widths", "1,2"), ("--target", "cudagraph_rt.tools.inspect_cmd:toy_target"),
                                         ("--compile", "default"), ("--replays", "7"), ("--no-compare", None)])
def test_dispatch_device_refuses_the_width_graph_flags(capsys, flag, value):
    from cudagraph_rt.cli import main

    assert main(["inspect", "--dispatch", "device", flag, *([value] if value else [])]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"cgrt inspect: {flag}: expected none with --dispatch device") and err.count("\n") == 1
    assert main(["inspect", "--launch-rounds", "4"]) == 2  # the loop's flag without the loop
    assert capsys.readouterr().err.startswith("cgrt inspect: --launch-rounds: expected --dispatch device with it")


def test_dispatch_device_builds_the_size_it_names(capsys, monkeypatch):
    """--size bench builds ToyConfig.bench() (it built the tiny toy and called it bench);
    here a small stand-in for it, told apart by its 2 slots (the bench toy takes minutes on a CPU)."""
    from cudagraph_rt.cli import main
    from cudagraph_rt.models import ToyConfig

    monkeypatch.setattr(ToyConfig, "bench", classmethod(lambda cls, **kw: ToyConfig.tiny(max_seqs=2)))
    assert main(["inspect", "--dispatch", "device", "--size", "bench", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "toy bench" and doc["slots"] == 2 and doc["widths"][-1] == 16


def test_which_frames_count_as_user_code():
    import cudagraph_rt.models.toy as toy
    import cudagraph_rt.runtime as runtime
    import cudagraph_rt.debug.inspect as insp

    assert not hazards_mod._is_library(toy.__file__) and not hazards_mod._is_library(__file__)
    assert hazards_mod._is_library(runtime.__file__) and hazards_mod._is_library(torch.nn.functional.__file__)
    assert hazards_mod._is_library(json.__file__) and not hazards_mod._is_library("<stdin>")
    # the wing's own files and the kernels (beside the package in a source tree) are library too
    import cudagraph_rt.kernels as kernels
    assert hazards_mod._is_library(hazards_mod.__file__) and hazards_mod._is_library(insp.__file__)
    assert hazards_mod._is_library(kernels.__file__)


def _mask_like_transformers(x):
    """transformers' masking skips a data-dependent check while a stream is capturing
    (its is_tracing() includes torch.cuda.is_current_stream_capturing())."""
    if not torch.cuda.is_current_stream_capturing():
        if bool((x < 0).any()):
            return x.clamp(min=0)
    return x * 2


def _always_syncs(x):
    if bool((x < 0).any()):  # taken whatever capture says
        return x.clamp(min=0)
    return x * 2


def test_hazard_finder_runs_the_code_as_capture_sees_it():
    x = torch.randn(8)
    original = torch.cuda.is_current_stream_capturing
    assert find_capture_hazards(_mask_like_transformers, x) == ()
    assert torch.cuda.is_current_stream_capturing is original  # put back after the run
    found = find_capture_hazards(_always_syncs, x)
    assert [h.kind for h in found] == ["data_dependent_branch"]


# ======================================================================================
# GPU (marked cuda, skipped without CUDA; was test_inspect_cuda.py)
# GPU tests of cudagraph_rt.debug.inspect: graph_nodes on small hand-captured graphs (kernel
# names, memcpy direction and host memory kind, memset size and value, edges), the DOT text,
# the hazard finder on real CUDA tensors, and inspect_runtime on a tiny runtime.
# ======================================================================================
def capture(body, pool=None) -> torch.cuda.CUDAGraph:
    """A kept graph of ``body`` (inspection reads its nodes)."""
    return warm_and_capture(body, pool=pool, keep_graph=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_nodes_kernels_pinned_memcpy_memset_edges():
    from cuda.bindings import driver

    pinned = torch.arange(1024, dtype=torch.float32).pin_memory()
    x = torch.empty(1024, device="cuda")
    y = torch.empty(1024, device="cuda")
    z = torch.empty(300, dtype=torch.uint8, device="cuda")

    def body():
        x.copy_(pinned, non_blocking=True)
        y.copy_(x * 2 + 1)
        stream = driver.CUstream(init_value=torch.cuda.current_stream().cuda_stream)
        err, = driver.cuMemsetD8Async(driver.CUdeviceptr(init_value=z.data_ptr()), 7, z.numel(), stream)
        assert err == driver.CUresult.CUDA_SUCCESS

    g = capture(body)
    nodes = graph_nodes(g)
    kinds = {n.type for n in nodes}
    assert {"kernel", "memcpy", "memset"} <= kinds, nodes
    kernels = [n for n in nodes if n.type == "kernel"]
    assert kernels and all(n.name and min(n.grid) >= 1 and min(n.block) >= 1 for n in kernels)
    copy, = [n for n in nodes if n.type == "memcpy" and n.direction == "HtoD"]
    assert (copy.bytes, copy.host_memory, copy.hazard) == (4096, "pinned", None)
    # y.copy_ of a contiguous tensor may be a DtoD memcpy node: no host side, no hazard
    assert all(n.host_memory is None and n.hazard is None
               for n in nodes if n.type == "memcpy" and n.direction == "DtoD")
    memset, = [n for n in nodes if n.type == "memset"]
    assert (memset.bytes, memset.value) == (300, 7)
    assert any(n.deps for n in nodes)          # one stream: a chain of dependencies
    assert all(d < len(nodes) for n in nodes for d in n.deps)

    dot = to_dot(nodes, "hand")
    assert dot.startswith('digraph "hand"') and "->" in dot and kernels[0].short_name in dot
    assert diff_nodes(nodes, nodes).same_kernels

    g.replay()                                   # still replays after inspection
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), pinned * 2 + 1) and bool((z == 7).all())


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pageable_copy_in_a_torch_capture_is_refused_or_flagged():
    pageable = torch.arange(256, dtype=torch.float32)
    dev = torch.empty(256, device="cuda")
    try:
        g = capture(lambda: dev.copy_(pageable, non_blocking=True))
    except RuntimeError as exc:
        # Recent torch refuses ("... unless the CPU tensor is pinned"): such a node can only
        # come from outside torch; the raw-graph test below covers the flag.
        assert "pinned" in str(exc)
        return
    copy, = [n for n in graph_nodes(g) if n.type == "memcpy"]
    assert copy.host_memory == "pageable" and "pageable" in copy.hazard


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_raw_graph_handles_pageable_and_pinned_memcpy():
    from cuda.bindings import runtime as cudart

    host = np.arange(256, dtype=np.float32)                    # pageable
    pinned = torch.arange(256, dtype=torch.float32).pin_memory()
    dev = torch.empty(512, device="cuda")
    err, graph = cudart.cudaGraphCreate(0)
    assert err == cudart.cudaError_t.cudaSuccess
    try:
        h2d = cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        err, first = cudart.cudaGraphAddMemcpyNode1D(graph, None, 0, dev.data_ptr(), host.ctypes.data,
                                                     host.nbytes, h2d)
        assert err == cudart.cudaError_t.cudaSuccess
        err, _ = cudart.cudaGraphAddMemcpyNode1D(graph, [first], 1, dev.data_ptr() + 1024,
                                                 pinned.data_ptr(), 512, h2d)
        assert err == cudart.cudaError_t.cudaSuccess
        nodes = {n.host_memory: n for n in graph_nodes(graph)}
    finally:
        cudart.cudaGraphDestroy(graph)
    a, b = nodes["pageable"], nodes["pinned"]
    assert (a.direction, a.bytes, a.deps) == ("HtoD", 1024, ()) and "pageable" in a.hazard
    assert (b.direction, b.bytes, b.hazard, b.deps) == ("HtoD", 512, None, (a.index,))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_not_kept_is_a_clear_error():
    x = torch.zeros(4, device="cuda")
    g = torch.cuda.CUDAGraph()                 # keep_graph=False
    with torch.cuda.graph(g):
        x.add_(1)
    with pytest.raises(GraphInspectError, match="keep_graph=True"):
        graph_nodes(g)


SCALE = torch.tensor(0.5)                     # a CPU tensor made outside the step


def real_step(inp):
    x = inp["x"]
    a = x * SCALE  # HAZARD: cpu_tensor
    b = x.sum().item()  # HAZARD: host_sync
    if x.sum() > 0:  # HAZARD: data_dependent_branch
        x = x + 1
    c = torch.tensor([1.0], device=x.device)  # HAZARD: cpu_tensor
    d = x.cpu()  # HAZARD: host_sync
    e = torch.ones(4).to(x.device)  # HAZARD: cpu_tensor
    f = torch.rand(4, device=x.device)  # HAZARD: rng
    g = x + torch.zeros(4, device=x.device)
    h = x * torch.tensor(2.0)
    k = torch.empty(4, pin_memory=True)  # HAZARD: pinned_alloc
    k.copy_(x, non_blocking=True)  # into pinned memory: the capturable form
    pageable = torch.empty(4)
    pageable.copy_(x)  # HAZARD: host_sync
    m = x[x > 1]  # HAZARD: host_sync
    return a, b, c, d, e, f, g, h, m


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_finder_on_cuda_tensors():
    lines, start = inspect.getsourcelines(real_step)
    want = {(m.group(1), start + i) for i, t in enumerate(lines)
            for m in [re.search(r"#\s*HAZARD:\s*(\w+)", t)] if m}
    hazards = find_capture_hazards(real_step, {"x": torch.arange(4.0, device="cuda")})
    got = {(h.kind, h.lineno) for h in hazards}
    assert got == want


class TinyRuntime:
    """The attributes of GraphRuntime that inspect_runtime reads, over a two-output step."""

    def __init__(self, graphs: bool, widths=(1, 2, 64)):
        self.device, self.widths = torch.device("cuda"), widths
        self.step_fn = lambda inp: {"y": inp["x"] * 2 + 1, "s": inp["x"].cumsum(0)}
        self._static = {w: {"x": torch.zeros(w, 256, device="cuda")} for w in widths}
        self.graphs_captured, self._out, entries, pool = {}, {}, [], None
        for w in sorted(widths, reverse=True) if graphs else ():
            out = {}
            self.graphs_captured[w] = capture(lambda: out.update(self.step_fn(self._static[w])), pool)
            pool, self._out[w] = self.graphs_captured[w].pool(), out
            entries.append(WidthCapture(w, 0.0, 0.01, 1 << 20))
        self.capture_report = CaptureReport(tuple(entries), 0.03, 1 << 20)

    def static_inputs(self, width):
        return self._static[width]

    def step(self, x):
        static = self._static[x.shape[0]]
        static["x"].copy_(x)
        if self.graphs_captured:
            self.graphs_captured[x.shape[0]].replay()
            return SimpleNamespace(outputs=self._out[x.shape[0]])
        return SimpleNamespace(outputs=self.step_fn(static))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inspect_runtime_on_a_tiny_runtime():
    gen = torch.Generator(device="cuda").manual_seed(0)
    rt = TinyRuntime(graphs=True)
    report = inspect_runtime(rt, replays=5, reference=lambda: TinyRuntime(graphs=False),
                             inputs=lambda T: {"x": torch.randn(T, 256, device="cuda", generator=gen)})
    assert report.available and report.ok, report
    for w in report.widths:
        assert w.error is None and w.replay_s > 0 and w.counts.get("kernel", 0) >= 2
        assert w.capture_s == 0.01 and w.pool_bytes == 1 << 20
        assert w.static_inputs["x"] == rt.static_inputs(w.width)["x"].data_ptr()
        assert {d.path for d in w.diffs} == {"y", "s"} and all(d.equal for d in w.diffs)
    assert [(a, b) for a, b, _ in report.width_diffs] == [(1, 2), (2, 64)]
    assert report.to_json()["widths"][0]["kernels"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_inspect_a_graph_runtime(tmp_path):
    from cudagraph_rt import GraphRuntime
    from tests.support.models_for_tests import SlotModel

    def build(graphs):
        m = SlotModel("cuda")
        return GraphRuntime(m, m.specs(), graphs=graphs, keep_graphs=graphs, device="cuda", max_width=8), m

    (rt, model), (ref, _) = build(True), build(False)
    rt.capture()
    ref.capture()
    gen = torch.Generator().manual_seed(0)
    report = inspect_runtime(rt, replays=3, reference=ref, inputs=lambda T: model.random_inputs(T, gen=gen))
    assert report.available and report.ok, report
    assert [w.width for w in report.widths] == list(rt.widths)
    for w in report.widths:
        assert w.capture_s > 0 and w.pool_bytes is not None and w.counts["kernel"] >= 3
        assert {d.path for d in w.diffs} == {"hidden", "tok"}
    assert len(report.width_diffs) == len(rt.widths) - 1


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cli_on_the_toy_decoder(tmp_path, capsys):
    import argparse
    import json
    import os

    from cudagraph_rt.tools import inspect_cmd

    parser = argparse.ArgumentParser()
    inspect_cmd.add_arguments(parser)
    rc = inspect_cmd.run(parser.parse_args(["--json", "--replays", "3", "--dot", str(tmp_path)]))
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0, json.dumps(doc, indent=1)[:4000]
    assert doc["available"] and all(w["error"] is None and w["diffs"] for w in doc["widths"])
    assert sorted(os.listdir(tmp_path)) == sorted(f"width_{w['width']}.dot" for w in doc["widths"])
    assert inspect_cmd.run(parser.parse_args(["--widths", "1,4", "--replays", "2"])) == 0
    assert "width 1 -> 4" in capsys.readouterr().out
