"""The loop as one CUDA graph of conditional nodes, built with cuda.bindings (driver API).

    outer:  WHILE(loop)                       loop's value: 1 at each launch, then ``go``
              body: plan -> set_handles -> SWITCH(width)
                        branch i: step_i -> commit_i

``plan`` and each ``commit_i`` are captured by torch (:class:`~.rounds.RoundBody`'s pieces);
``step_i`` is a copy of the runtime's graph of width ``i`` with its event-record nodes taken
out (the feed's event: conditional bodies allow kernels, copies, memsets, child graphs and
conditionals only; the host never waits on that event while the loop runs).
``set_handles`` is a one-thread kernel, compiled at run time by NVRTC, that sets both
nodes' values from ``rows.go`` and ``rows.width_index`` (a value past the last branch runs
none). Requirements and their detection: :mod:`.support`.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from .rounds import EventSpans, outline

SET_HANDLES = r"""
typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle handle,
                                                                      unsigned int value);

extern "C" __global__ void cgrt_set_handles(cudaGraphConditionalHandle loop, cudaGraphConditionalHandle width,
                                            const int* go, const int* width_index) {
    cudaGraphSetConditional(loop, (unsigned int)(*go));
    cudaGraphSetConditional(width, (unsigned int)(*width_index));
}
"""
KERNEL = b"cgrt_set_handles"
POLL_S = 50e-6  # the host's pause between reads of the ring's mirror while a launch runs


class CudaCallError(RuntimeError):
    """A CUDA driver or NVRTC call failed: the call and the error it returned."""


def check(result, what: str):
    """The values of a cuda.bindings call's result tuple; CudaCallError unless it succeeded."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise CudaCallError(f"{what} failed: {err!r}")
    return values[0] if len(values) == 1 else tuple(values)


def compile_set_handles(nvrtc, arch: str | None = None) -> bytes:
    """PTX of :data:`SET_HANDLES` (``arch`` e.g. ``"compute_90"``; None: NVRTC's default)."""
    prog = check(nvrtc.nvrtcCreateProgram(SET_HANDLES.encode(), b"cgrt_set_handles.cu", 0, [], []),
                 "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode()] if arch else []
    try:
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if int(err[0]) != 0:
            size = check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise CudaCallError(f"NVRTC could not compile the set-handles kernel: {log.decode(errors='replace')}")
        ptx = b" " * check(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        check(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
        return ptx
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def load_set_handles(driver, nvrtc, device: torch.device):
    """The set-handles kernel (a CUfunction) for ``device``, compiled and loaded."""
    major, minor = torch.cuda.get_device_capability(device)
    ptx = compile_set_handles(nvrtc, f"compute_{major}{minor}")
    module = check(driver.cuModuleLoadData(np.char.array(ptx).ctypes.data), "cuModuleLoadData")
    return module, check(driver.cuModuleGetFunction(module, KERNEL), "cuModuleGetFunction")


def conditional_params(driver, handle, kind: str, size: int):
    """The node params of a conditional node: ``kind`` "while" or "switch", ``size`` bodies."""
    p = driver.CUgraphNodeParams()
    p.type = driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
    p.conditional.handle = handle
    p.conditional.type = {"while": driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE,
                          "switch": driver.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_SWITCH}[kind]
    p.conditional.size = size
    p.conditional.ctx = check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    return p


def add_node(driver, graph, deps: list, params):
    """cuGraphAddNode across cuda.bindings 12 (no edge data) and 13 (edge data argument)."""
    try:
        return check(driver.cuGraphAddNode(graph, deps, None, len(deps), params), "cuGraphAddNode")
    except TypeError:
        return check(driver.cuGraphAddNode(graph, deps, len(deps), params), "cuGraphAddNode")


def add_conditional(driver, graph, deps: list, handle, kind: str, size: int):
    """A conditional node in ``graph`` after ``deps``; ``(node, [its body graphs])``."""
    params = conditional_params(driver, handle, kind, size)
    node = add_node(driver, graph, deps, params)
    return node, [params.conditional.phGraph_out[i] for i in range(size)]


def _listed(call, *args):
    """A cuda.bindings list query (count first, then the list), as a list."""
    n = check(call(*args, 0), call.__name__)
    n = n[-1] if isinstance(n, tuple) else n
    got = check(call(*args, n), call.__name__) if n else ([],)
    return list(got[0] if isinstance(got, tuple) else got)


def without_events(driver, graph):
    """A clone of ``graph`` with its event-record and event-wait nodes taken out, each
    one's predecessors joined to its successors (the order the event kept)."""
    clone = check(driver.cuGraphClone(graph), "cuGraphClone")
    events = (driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_EVENT_RECORD,
              driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_WAIT_EVENT)
    for node in _listed(driver.cuGraphGetNodes, clone):
        if check(driver.cuGraphNodeGetType(node), "cuGraphNodeGetType") not in events:
            continue
        before = _listed(driver.cuGraphNodeGetDependencies, node)
        after = _listed(driver.cuGraphNodeGetDependentNodes, node)
        check(driver.cuGraphDestroyNode(node), "cuGraphDestroyNode")
        pairs = [(a, b) for a in before for b in after]
        if pairs:
            src, dst = [a for a, _ in pairs], [b for _, b in pairs]
            try:
                check(driver.cuGraphAddDependencies(clone, src, dst, None, len(pairs)), "cuGraphAddDependencies")
            except TypeError:
                check(driver.cuGraphAddDependencies(clone, src, dst, len(pairs)), "cuGraphAddDependencies")
    return clone


def kernel_params(driver, func, args: list[np.ndarray]):
    """A one-thread kernel node's params; ``args`` (one-element numpy arrays) must live
    until the node is added (the driver copies the values then)."""
    p = driver.CUDA_KERNEL_NODE_PARAMS()
    p.func = func
    p.gridDimX = p.gridDimY = p.gridDimZ = p.blockDimX = p.blockDimY = p.blockDimZ = 1
    p.sharedMemBytes = 0
    pointers = np.array([a.ctypes.data for a in args], dtype=np.uint64)
    p.kernelParams = pointers.ctypes.data
    return p, pointers


def build_outer(driver, kernel, plan, branches: list[tuple], go: int, width_index: int, widths=None):
    """The outer graph (module docstring): ``plan`` and each branch's ``(step, commit)``
    as CUgraphs, ``go`` / ``width_index`` the device addresses of the two int32 values,
    ``widths`` the branches' widths (default: their indices, for the description).
    Returns ``(graph, description)``: the graph and what it holds, node by node."""
    graph = check(driver.cuGraphCreate(0), "cuGraphCreate")
    ctx = check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
    loop = check(driver.cuGraphConditionalHandleCreate(graph, ctx, 1, int(driver.CU_GRAPH_COND_ASSIGN_DEFAULT)),
                 "cuGraphConditionalHandleCreate")
    _, (body,) = add_conditional(driver, graph, [], loop, "while", 1)
    plan_node = check(driver.cuGraphAddChildGraphNode(body, [], 0, plan), "cuGraphAddChildGraphNode")
    # the switch's handle exists before the kernel that sets it: make it first, add the node after
    ctx_switch = _SwitchLater(driver, body, graph, len(branches))
    args = [np.array([int(loop)], np.uint64), np.array([int(ctx_switch.handle)], np.uint64),
            np.array([go], np.uint64), np.array([width_index], np.uint64)]
    params, _keep = kernel_params(driver, kernel, args)
    setter = check(driver.cuGraphAddKernelNode(body, [plan_node], 1, params), "cuGraphAddKernelNode")
    bodies = ctx_switch.add(setter)
    for b, (step, commit) in zip(bodies, branches):
        s = check(driver.cuGraphAddChildGraphNode(b, [], 0, step), "cuGraphAddChildGraphNode")
        check(driver.cuGraphAddChildGraphNode(b, [s], 1, commit), "cuGraphAddChildGraphNode")
    return graph, outline(widths or list(range(len(branches))), setter=True)


class _SwitchLater:
    """The SWITCH's handle, made on the body graph (the graph holding the node) before the
    kernel that sets it; the node itself is added after that kernel."""

    def __init__(self, driver, body, outer, branches: int):
        self.driver, self.body, self.outer, self.branches = driver, body, outer, branches
        ctx = check(driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        self.handle = check(driver.cuGraphConditionalHandleCreate(body, ctx, 0, 0), "cuGraphConditionalHandleCreate")

    def add(self, setter) -> list:
        _, bodies = add_conditional(self.driver, self.body, [setter], self.handle, "switch", self.branches)
        return bodies


def capture_piece(fn, pool) -> torch.cuda.CUDAGraph:
    """``fn`` captured by torch, its graph kept (a child graph of the outer one), after one
    warm-up run on a side stream (what the loop's pieces write then is reset per launch)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.inference_mode():
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, pool=pool):
            fn()
    return graph


class ConditionalRounds:
    """The rounds as one launch of the outer graph (the module docstring), over a
    :class:`~.rounds.RoundBody` whose runtime kept its graphs (``keep_graphs=True``).
    ``launches`` counts launches (one per ``run``). Lifetime: the body's runtime and this
    object (the torch graphs of the plan and commits, the module of the kernel)."""

    name = "conditional"

    def __init__(self, body):
        from cuda.bindings import driver, nvrtc
        self.driver, self.body = driver, body
        self.device = body.state.uid.device
        self._module, kernel = load_set_handles(driver, nvrtc, self.device)
        pool = torch.cuda.graph_pool_handle()
        self._plan = capture_piece(body.plan, pool)
        n = len(body.shape.widths)
        self._commits = [capture_piece(lambda i=i: body.commit(i), pool) for i in range(n)]
        raw = lambda g: driver.CUgraph(g.raw_cuda_graph())  # noqa: E731
        steps = [without_events(driver, raw(g)) for g in body.graphs]
        self.graph, self.description = build_outer(driver, kernel, raw(self._plan),
                                                   list(zip(steps, map(raw, self._commits))),
                                                   body.rows.go.data_ptr(), body.rows.width_index.data_ptr(),
                                                   body.shape.widths)
        self._exec = check(driver.cuGraphInstantiate(self.graph, 0), "cuGraphInstantiate")
        self.launches = 0

    def run(self, poll=None) -> float | None:
        """One launch of the outer graph; its device time (events around it). ``poll``:
        called while the launch runs, until it ends (the host reading the ring's mirror)."""
        spans = EventSpans(self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        t = spans.begin()
        check(self.driver.cuGraphLaunch(self._exec, stream), "cuGraphLaunch")
        spans.end(t)
        self.launches += 1
        if poll is not None:
            done = spans.pairs[-1][1]
            while not done.query():
                poll()
                time.sleep(POLL_S)
        return spans.seconds()
