"""Read a captured CUDA graph through cuda.bindings.driver: nodes, kernels, copies,
edges, diffs between widths, Graphviz text. Needs CUDA (else NeedsCudaError)."""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass

import torch

from ..errors import CgrtError


__all__ = ["NeedsCudaError", "GraphInspectError", "GraphNode", "graph_nodes", "node_counts",
           "short_kernel_name", "NodeDiff", "diff_nodes", "to_dot"]

# --------------------------------------------------------------------------------------
# Graph introspection (cuda.bindings.driver)
# --------------------------------------------------------------------------------------
class NeedsCudaError(CgrtError, RuntimeError):
    """Graph introspection was asked for where CUDA (or cuda.bindings) is not available."""


class GraphInspectError(CgrtError, RuntimeError):
    """A graph could not be read: it was not kept (``keep_graph=False``), was reset, or a
    driver call failed (the message names the call and the CUresult)."""


def _driver():
    if not torch.cuda.is_available():
        raise NeedsCudaError("graph introspection needs CUDA: torch.cuda.is_available() is False")
    try:
        from cuda.bindings import driver
    except ImportError as exc:  # pragma: no cover - depends on the install
        from ..extras import message

        raise NeedsCudaError(message("gpu", "graph introspection") + f" ({exc})") from exc
    torch.cuda.init()   # a current context for cuPointerGetAttribute
    return driver


def _ok(drv, result, what: str):
    err, rest = result[0], result[1:]
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        raise GraphInspectError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return rest[0] if len(rest) == 1 else rest


@dataclass(frozen=True)
class GraphNode:
    """One node of a captured graph. ``type``: kernel, memcpy, memset, host, child_graph,
    empty, wait_event, event_record, mem_alloc, mem_free, conditional, ...

    Kernels: ``name`` (demangled when ``c++filt`` is on PATH), ``grid``, ``block``,
    ``shared_bytes``. Memcpy: ``direction`` (``HtoD`` ...), ``bytes``, ``host_memory``
    (``pinned``/``pageable``/``managed`` for the host side). Memset: ``bytes``, ``value``.
    ``deps``: indices of the nodes it waits for. ``hazard``: why this node is a problem
    in a graph (a pageable host copy, a host callback), else None.
    """

    index: int
    type: str
    name: str = ""
    grid: tuple[int, int, int] | None = None
    block: tuple[int, int, int] | None = None
    shared_bytes: int | None = None
    bytes: int | None = None
    direction: str | None = None
    host_memory: str | None = None
    value: int | None = None
    deps: tuple[int, ...] = ()
    hazard: str | None = None

    @property
    def short_name(self) -> str:
        """The kernel's name without return type, template arguments or parameters."""
        return short_kernel_name(self.name) or self.type

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def short_kernel_name(name: str) -> str:
    """``"void at::native::f<float, 4>(int)"`` -> ``"at::native::f"``."""
    name = name[5:] if name.startswith("void ") else name
    return name.split("<", 1)[0].split("(", 1)[0]


def _raw_graph(drv, graph):
    if isinstance(graph, torch.cuda.CUDAGraph):
        try:
            raw = graph.raw_cuda_graph()
        except (RuntimeError, AttributeError) as exc:
            raise GraphInspectError(
                "the graph's cudaGraph_t is not available: capture with "
                "torch.cuda.CUDAGraph(keep_graph=True) (GraphRuntime(keep_graphs=True)) "
                f"and do not reset it ({exc})") from exc
        return drv.CUgraph(init_value=int(raw))
    return drv.CUgraph(init_value=int(graph))   # a raw handle: int, CUgraph or cudaGraph_t


def _mem_kind(drv, memtype, host_ptr, dev_ptr) -> str:
    """'device', 'pinned', 'pageable', 'managed' or 'array' for one side of a memcpy."""
    T = drv.CUmemorytype
    if memtype == T.CU_MEMORYTYPE_ARRAY:
        return "array"
    ptr = int(host_ptr or 0) if memtype == T.CU_MEMORYTYPE_HOST else int(dev_ptr or 0)
    A = drv.CUpointer_attribute
    err, kind = drv.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_MEMORY_TYPE, ptr)
    if err != drv.CUresult.CUDA_SUCCESS:
        # Unknown to CUDA: ordinary malloc'd memory (also under HMM/ATS it is not registered).
        return "pageable" if memtype != T.CU_MEMORYTYPE_DEVICE else "device"
    err, managed = drv.cuPointerGetAttribute(A.CU_POINTER_ATTRIBUTE_IS_MANAGED, ptr)
    if err == drv.CUresult.CUDA_SUCCESS and managed:
        return "managed"
    return "pinned" if int(kind) == int(T.CU_MEMORYTYPE_HOST) else "device"


def _kernel_name(drv, params) -> str:
    func = getattr(params, "func", None)
    if func is not None and int(func):
        err, name = drv.cuFuncGetName(func)
    elif getattr(params, "kern", None) is not None and int(params.kern):
        err, name = drv.cuKernelGetName(params.kern)   # library-managed kernels (CUDA 12+)
    else:
        return ""
    if err != drv.CUresult.CUDA_SUCCESS:
        return ""
    return name.decode() if isinstance(name, bytes) else str(name)


def _demangle(names: list[str]) -> dict[str, str]:
    """Demangle C++ names in one c++filt call; names stay as they are without it."""
    mangled = sorted({n for n in names if n.startswith("_Z")})
    tool = shutil.which("c++filt")
    if not mangled or tool is None:
        return {}
    try:
        out = subprocess.run([tool], input="\n".join(mangled), capture_output=True, text=True,
                             timeout=30, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(zip(mangled, out)) if len(out) == len(mangled) else {}


def _describe(drv, index: int, node, deps: tuple[int, ...]) -> GraphNode:
    T = drv.CUgraphNodeType
    ntype = _ok(drv, drv.cuGraphNodeGetType(node), "cuGraphNodeGetType")
    tname = {T.CU_GRAPH_NODE_TYPE_GRAPH: "child_graph"}.get(
        ntype, ntype.name.removeprefix("CU_GRAPH_NODE_TYPE_").lower())
    base = GraphNode(index=index, type=tname, deps=deps)
    if ntype == T.CU_GRAPH_NODE_TYPE_KERNEL:
        p = _ok(drv, drv.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
        return dataclasses.replace(
            base, name=_kernel_name(drv, p), grid=(p.gridDimX, p.gridDimY, p.gridDimZ),
            block=(p.blockDimX, p.blockDimY, p.blockDimZ), shared_bytes=p.sharedMemBytes)
    if ntype == T.CU_GRAPH_NODE_TYPE_MEMCPY:
        p = _ok(drv, drv.cuGraphMemcpyNodeGetParams(node), "cuGraphMemcpyNodeGetParams")
        src = _mem_kind(drv, p.srcMemoryType, p.srcHost, p.srcDevice)
        dst = _mem_kind(drv, p.dstMemoryType, p.dstHost, p.dstDevice)
        side = lambda k: "D" if k in ("device", "array") else "H"  # noqa: E731
        host = next((k for k in (src, dst) if side(k) == "H"), None)
        hazard = None
        if host == "pageable":
            hazard = ("memcpy with pageable host memory: synchronous for the host, and replay "
                      "reads/writes whatever lies at that address then; use pinned memory")
        nbytes = p.WidthInBytes * max(p.Height, 1) * max(p.Depth, 1)
        return dataclasses.replace(base, bytes=nbytes, direction=f"{side(src)}to{side(dst)}",
                                   host_memory=host, hazard=hazard)
    if ntype == T.CU_GRAPH_NODE_TYPE_MEMSET:
        p = _ok(drv, drv.cuGraphMemsetNodeGetParams(node), "cuGraphMemsetNodeGetParams")
        return dataclasses.replace(base, bytes=p.elementSize * p.width * max(p.height, 1),
                                   value=int(p.value))
    if ntype == T.CU_GRAPH_NODE_TYPE_HOST:
        return dataclasses.replace(base, hazard="host callback: every replay waits for a CPU thread")
    return base


def _edges(drv, graph, index: dict[int, int]) -> dict[int, tuple[int, ...]]:
    """Dependencies per node index. cuGraphGetEdges returns (err, from, to, n) up to CUDA
    12 and (err, from, to, edgeData, n) from CUDA 13: read ``from``/``to`` and the last."""
    res = drv.cuGraphGetEdges(graph, 0)
    count = _ok(drv, res, "cuGraphGetEdges")
    count = count[-1] if isinstance(count, tuple) else count
    if not count:
        return {}
    res = _ok(drv, drv.cuGraphGetEdges(graph, count), "cuGraphGetEdges")
    deps: dict[int, list[int]] = {}
    for a, b in list(zip(res[0], res[1]))[: res[-1]]:
        if int(a) in index and int(b) in index:
            deps.setdefault(index[int(b)], []).append(index[int(a)])
    return {k: tuple(sorted(v)) for k, v in deps.items()}


def graph_nodes(graph) -> tuple[GraphNode, ...]:
    """Describe every node of a captured graph, in the driver's node order.

    ``graph``: a ``torch.cuda.CUDAGraph`` captured with ``keep_graph=True`` (its
    ``raw_cuda_graph()`` handle stays valid after ``instantiate()`` until ``reset()``),
    or a raw ``CUgraph``/``cudaGraph_t``/int handle. Reads only; the graph is unchanged.

    Raises :class:`NeedsCudaError` without CUDA or cuda.bindings, and
    :class:`GraphInspectError` for a graph that was not kept or a failing driver call.
    """
    drv = _driver()
    handle = _raw_graph(drv, graph)
    res = _ok(drv, drv.cuGraphGetNodes(handle, 0), "cuGraphGetNodes")
    count = res[-1]
    raw, count = _ok(drv, drv.cuGraphGetNodes(handle, count), "cuGraphGetNodes")
    raw = list(raw)[:count]
    index = {int(n): i for i, n in enumerate(raw)}
    deps = _edges(drv, handle, index)
    nodes = [_describe(drv, i, n, deps.get(i, ())) for i, n in enumerate(raw)]
    names = _demangle([n.name for n in nodes])
    return tuple(dataclasses.replace(n, name=names.get(n.name, n.name)) for n in nodes)


def node_counts(nodes) -> dict[str, int]:
    """Number of nodes per type, types sorted by name."""
    return dict(sorted(Counter(n.type for n in nodes).items()))


@dataclass(frozen=True)
class NodeDiff:
    """What changes from graph ``a`` to graph ``b`` (two widths of one step).

    ``added``/``removed``: (kernel name, how many more/fewer); ``grid_changes``: (name,
    grid in a, grid in b, block in a, block in b) for the n-th launch of a kernel present
    in both whose launch shape differs; ``counts_a``/``counts_b``: nodes per type.
    """

    added: tuple[tuple[str, int], ...]
    removed: tuple[tuple[str, int], ...]
    grid_changes: tuple[tuple[str, tuple, tuple, tuple, tuple], ...]
    counts_a: dict[str, int]
    counts_b: dict[str, int]

    @property
    def same_kernels(self) -> bool:
        return not self.added and not self.removed

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def diff_nodes(nodes_a, nodes_b) -> NodeDiff:
    """Compare two node lists by kernel name (launches of one kernel are paired in node
    order) — pure, works on any GraphNode sequences."""
    def by_name(nodes):
        out: dict[str, list[GraphNode]] = {}
        for n in nodes:
            if n.type == "kernel":
                out.setdefault(n.name or n.short_name, []).append(n)
        return out
    ka, kb = by_name(nodes_a), by_name(nodes_b)
    added = tuple(sorted((k, len(v) - len(ka.get(k, ()))) for k, v in kb.items()
                         if len(v) > len(ka.get(k, ()))))
    removed = tuple(sorted((k, len(v) - len(kb.get(k, ()))) for k, v in ka.items()
                           if len(v) > len(kb.get(k, ()))))
    changes = tuple((k, x.grid, y.grid, x.block, y.block)
                    for k in sorted(ka.keys() & kb.keys()) for x, y in zip(ka[k], kb[k])
                    if (x.grid, x.block) != (y.grid, y.block))
    return NodeDiff(added, removed, changes, node_counts(nodes_a), node_counts(nodes_b))


def _fmt_bytes(n: int | None) -> str:
    if n is None or n < 1024:
        return "?" if n is None else f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"


def to_dot(nodes, title: str = "graph") -> str:
    """Graphviz text of a node list: one box per node (kernels show short name and grid,
    copies direction/size/host memory), edges from ``deps``, hazards in red."""
    def q(s: str) -> str:   # labels use DOT's own "\\n" line break, so only quotes are escaped
        return '"' + s.replace('"', '\\"') + '"'
    lines = [f"digraph {q(title)} {{", f"  label={q(title)};", "  node [shape=box, fontsize=10];"]
    for n in nodes:
        if n.type == "kernel":
            label = f"{n.short_name}\\ngrid {n.grid} block {n.block}"
        elif n.type == "memcpy":
            label = f"memcpy {n.direction} {_fmt_bytes(n.bytes)}"
            label += f" ({n.host_memory})" if n.host_memory else ""
        elif n.type == "memset":
            label = f"memset {_fmt_bytes(n.bytes)} = {n.value}"
        else:
            label = n.type
        style = ", color=red, fontcolor=red" if n.hazard else ""
        lines.append(f"  n{n.index} [label={q(f'#{n.index} {label}')}{style}];")
    for n in nodes:
        lines.extend(f"  n{d} -> n{n.index};" for d in n.deps)
    lines.append("}")
    return "\n".join(lines) + "\n"
