"""Find what in a step function cannot be captured, and look inside captured CUDA graphs.

Two halves, one module:

* :func:`find_capture_hazards` runs a step function once, eagerly, under a
  ``TorchFunctionMode`` (what the user called: ``.item()``, ``bool(t)``, ``.to(...)``)
  and a ``TorchDispatchMode`` (the aten ops underneath, including those issued from
  inside torch) and names the user's source line of everything that breaks a capture or
  is frozen by it. It runs on the CPU too (see "simulated device" below).
* :func:`graph_nodes`, :func:`diff_nodes`, :func:`to_dot` and :func:`inspect_runtime`
  read a graph kept with ``torch.cuda.CUDAGraph(keep_graph=True)`` through
  ``cuda.bindings.driver``. They need CUDA: without it they raise :class:`NeedsCudaError`
  (``graph_nodes``) or return a report whose ``available`` is False (``inspect_runtime``).

Simulated device. With CPU inputs the finder treats the inputs as "the device" (the
step would run on CUDA with them there) and tags tensors as device or host tensors as
they flow: outputs of ops that read a device tensor are device tensors; ``device=``
arguments that name the device (``"cuda"``, or a ``torch.device`` object such as
``x.device``) make device tensors, and calls naming CUDA are redirected to the CPU so the
function still runs; the *string* ``"cpu"`` and factory calls without ``device=`` make
host tensors. ``pin_memory=True`` is dropped (and flagged) where no accelerator exists.
With CUDA inputs nothing is simulated: device means ``tensor.device``.
"""
from __future__ import annotations

import dataclasses
import linecache
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from .errors import CgrtError

__all__ = [
    "HAZARD_KINDS", "Hazard", "find_capture_hazards", "explain_capture_failure",
    "NeedsCudaError", "GraphInspectError", "GraphNode", "graph_nodes", "node_counts",
    "short_kernel_name",
    "NodeDiff", "diff_nodes", "to_dot", "OutputDiff", "compare_outputs", "WidthReport", "InspectReport",
    "inspect_runtime",
]

# --------------------------------------------------------------------------------------
# Capture-hazard finder
# --------------------------------------------------------------------------------------
HOST_SYNC = "host_sync"                  # the host waits for a device value
BRANCH = "data_dependent_branch"         # a Python branch reads a device value
CPU_TENSOR = "cpu_tensor"                # host data read by the device: frozen at capture
PINNED = "pinned_alloc"                  # page-locked allocation inside the step
RNG = "rng"                              # random numbers: replay != graphs-off run
ERROR = "error"                          # the function raised during the eager run
HAZARD_KINDS = (HOST_SYNC, BRANCH, CPU_TENSOR, PINNED, RNG, ERROR)

_MESSAGES = {
    HOST_SYNC: "reads a device value on the host: a synchronisation, illegal while capturing",
    BRANCH: "Python branch on a device value: a host sync, and only the branch taken at "
            "capture is recorded",
    CPU_TENSOR: "host data read by a device op: copied (with a host sync) or baked into the "
                "graph at capture; later changes to it are not seen on replay",
    PINNED: "allocates pinned host memory inside the step (cudaHostAlloc cannot be captured); "
            "allocate it once outside",
    RNG: "draws random numbers: graph replays and graphs-off runs differ, and a non-default "
         "torch.Generator must be registered with CUDAGraph.register_generator_state",
}


@dataclass(frozen=True)
class Hazard:
    """One thing in a step function that cannot live in a CUDA graph or is frozen by it.

    ``kind`` is one of :data:`HAZARD_KINDS`; ``op`` the call or aten op that showed it
    (``"Tensor.item"``, ``"aten.nonzero"``); ``filename``/``lineno``/``line`` the first
    frame outside torch and outside cudagraph_rt's own machinery (``"<unknown>"``, 0 when
    the whole stack is library code).
    """

    kind: str
    op: str
    filename: str
    lineno: int
    line: str
    message: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _library_roots() -> tuple[tuple[str, ...], tuple[str, ...], str, tuple[str, ...]]:
    """(user roots inside the library, library roots, stdlib, site-packages roots)."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    lib = [os.path.dirname(os.path.abspath(torch.__file__)), pkg]
    lib += [os.path.join(p, "kernels") for p in sys.modules[__package__].__path__]
    paths = sysconfig.get_paths()
    site = tuple(os.path.abspath(paths[k]) + os.sep for k in ("purelib", "platlib"))
    return ((os.path.join(pkg, "models") + os.sep,), tuple(d + os.sep for d in lib),
            os.path.abspath(paths["stdlib"]) + os.sep, site)


_USER_IN_LIB, _LIB, _STDLIB, _SITE = _library_roots()


def _is_library(filename: str) -> bool:
    """Frames a hazard is not attributed to: torch, cudagraph_rt's machinery (its embedded
    models count as user code), the stdlib (site-packages may live under it: not skipped)."""
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    if path.startswith(_USER_IN_LIB):
        return False
    if path.startswith(_LIB):
        return True
    return path.startswith(_STDLIB) and not path.startswith(_SITE)


def _user_location(frames: Iterator[tuple[str, int]]) -> tuple[str, int]:
    for filename, lineno in frames:
        if not _is_library(filename):
            return filename, lineno
    return "<unknown>", 0


def _stack() -> Iterator[tuple[str, int]]:
    f = sys._getframe(1)
    while f is not None:
        yield f.f_code.co_filename, f.f_lineno
        f = f.f_back


# Tags of host tensors made during the step: from Python values only (a literal), or
# anything else on the host (a .cpu() result). Simulating, untagged tensors are device
# tensors: the inputs, parameters and buffers, and everything computed from them.
_LIT, _HOST = "lit", "host"

# aten ops (overload packet names) whose result size or value needs the host to read data
_SYNC_OPS = frozenset({
    "_local_scalar_dense", "is_nonzero", "item", "nonzero", "argwhere", "masked_select",
    "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "equal", "bincount",
})
_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
_RNG_OPS = frozenset({
    "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
    "bernoulli", "bernoulli_", "multinomial", "normal", "normal_", "uniform_",
    "exponential_", "geometric_", "cauchy_", "log_normal_", "random_", "native_dropout",
    "_fused_dropout", "poisson", "binomial", "_standard_gamma", "_sample_dirichlet",
    "rrelu_with_noise", "rrelu_with_noise_",
})
_LIFT_OPS = frozenset({"lift_fresh", "lift_fresh_copy"})

_T = torch.Tensor
_BRANCH_FUNCS = frozenset({_T.__bool__, torch.is_nonzero})
_READ_FUNCS = frozenset({_T.item, _T.tolist, _T.numpy, _T.__int__, _T.__float__,
                         _T.__index__, _T.__complex__, torch.equal, torch.allclose})
_DATA_FUNCS = frozenset({torch.tensor, torch.as_tensor, torch.asarray})


def _has_accelerator() -> bool:
    acc = getattr(torch, "accelerator", None)
    return bool(acc.is_available()) if acc is not None else torch.cuda.is_available()


def _name(func) -> str:
    if isinstance(func, torch._ops.OpOverload):
        return f"aten.{func.overloadpacket.__name__}"
    qual = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
    if qual.startswith("TensorBase."):
        return "Tensor." + qual[len("TensorBase."):]
    if qual.startswith("_VariableFunctionsClass."):
        return "torch." + qual[len("_VariableFunctionsClass."):]
    return qual


class _Tracker:
    """State shared by the two modes for one eager run (never outlives the call)."""

    def __init__(self, simulate: bool, target: torch.device):
        self.simulate, self.target, self.can_pin = simulate, target, _has_accelerator()
        self.tags = WeakIdKeyDictionary()
        self.quiet = 0            # >0 while a call already reported runs its aten ops
        self.found: dict[tuple, Hazard] = {}

    def is_dev(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if self.simulate:
            return self.tags.get(t) is None
        return t.device.type == self.target.type

    def tag(self, obj, tag: str | None) -> None:
        for t in tree_leaves(obj):
            if isinstance(t, torch.Tensor):
                if tag is None:
                    self.tags.pop(t, None)
                else:
                    self.tags[t] = tag

    def add(self, kind: str, op: str, message: str | None = None, where=None) -> None:
        if self.quiet and where is None:
            return
        filename, lineno = where or _user_location(_stack())
        key = (kind, op, filename, lineno)
        if key not in self.found:
            line = linecache.getline(filename, lineno).strip() if lineno else ""
            self.found[key] = Hazard(kind, op, filename, lineno, line, message or _MESSAGES[kind])

    def device_is_dev(self, d) -> bool | None:
        """Does a ``device=`` value name the step's device? None if it is not a device."""
        if d is None or not isinstance(d, (str, torch.device, int)):
            return None
        if isinstance(d, int):
            return True                     # an ordinal: an accelerator
        if self.simulate and isinstance(d, str) and torch.device(d).type == "cpu":
            return False                    # the literal "cpu" means the host
        if self.simulate and torch.device(d).type == "cpu":
            return True                     # torch.device('cpu') objects are x.device
        return torch.device(d).type == self.target.type


class _FunctionMode(TorchFunctionMode):
    """Sees what the user called, before any dispatch: tells ``bool(t)`` from ``.item()``,
    sees ``.cpu()``/``.tolist()`` on CPU tensors (no aten op runs), and redirects CUDA
    device arguments when simulating."""

    def __init__(self, tr: _Tracker):
        super().__init__()
        self.tr = tr

    def __torch_function__(self, func, types, args=(), kwargs=None):
        tr, kwargs, name = self.tr, dict(kwargs or {}), _name(func)
        self_t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        found: list[tuple[str, str, str | None]] = []     # (kind, op, message)
        if func in _BRANCH_FUNCS and tr.is_dev(self_t):
            found.append((BRANCH, name, None))
        elif func in _READ_FUNCS and any(tr.is_dev(a) for a in args[:2]):
            found.append((HOST_SYNC, name, None))

        pin = func is _T.pin_memory or bool(kwargs.get("pin_memory"))
        if pin:
            found.append((PINNED, name if func is _T.pin_memory else f"{name}(pin_memory=True)", None))
            if not tr.can_pin:                 # no pinned allocator here: run on unpinned
                kwargs["pin_memory"] = False

        # Where does the result live? dest: True device, False host, None not a move.
        dest = tr.device_is_dev(kwargs.get("device"))
        if func is _T.to:
            dest = self._to_dest(args[1:], kwargs)
        elif func is _T.cuda:
            dest = True
        elif func in (_T.cpu, _T.pin_memory):
            dest = False
        copy_msg = ("copies host data to the device inside the step (a blocking copy while "
                    "capturing; the values are frozen): build it outside or on the device")
        if func in _DATA_FUNCS and dest and not isinstance(self_t, torch.Tensor):
            found.append((CPU_TENSOR, name, copy_msg))
        elif func is _T.new_tensor and (dest or (dest is None and tr.is_dev(self_t))):
            found.append((CPU_TENSOR, name, copy_msg))
            dest = True
        elif func in (_T.to, _T.cuda, _T.cpu) and dest is not None and self_t is not None:
            if tr.is_dev(self_t) and not dest:
                found.append((HOST_SYNC, name, None))
            elif dest and not tr.is_dev(self_t):
                found.append((CPU_TENSOR, name, copy_msg))
        for kind, op, message in found:
            tr.add(kind, op, message)

        if tr.simulate and dest is not None:
            args, kwargs = self._redirect(func, args, kwargs)
        if (func is _T.cuda and tr.simulate) or (func is _T.pin_memory and not tr.can_pin):
            call = self_t.clone         # what the move would give, on the CPU
        else:
            call = lambda: func(*args, **kwargs)  # noqa: E731
        factory = not any(isinstance(t, torch.Tensor) for t in tree_leaves((args, kwargs)))
        return self._run(call, dest, self_t, quiet=bool(found), factory=factory)

    def _to_dest(self, rest, kwargs) -> bool | None:
        for a in list(rest) + [kwargs.get("device"), kwargs.get("other")]:
            if isinstance(a, torch.Tensor):
                return self.tr.is_dev(a)
            d = self.tr.device_is_dev(a)
            if d is not None:
                return d
        return None

    def _redirect(self, func, args, kwargs):
        """Simulating: every device argument names the CPU so the call still runs there."""
        if "device" in kwargs:
            kwargs["device"] = "cpu"
        if func is _T.to:   # drop ordinals (.to(0)), keep dtype/bools, devices -> "cpu"
            args = args[:1] + tuple("cpu" if isinstance(a, (str, torch.device)) else a
                                    for a in args[1:] if isinstance(a, bool) or not isinstance(a, int))
        return args, kwargs

    def _run(self, call, dest, self_t, quiet: bool, factory: bool):
        tr = self.tr
        tr.quiet += quiet
        try:
            out = call()
        finally:
            tr.quiet -= quiet
        if tr.simulate:
            if dest is not None and isinstance(out, torch.Tensor) and out is self_t:
                out = out.clone()           # a real move gives a new tensor
            if dest:
                tr.tag(out, None)
            elif dest is False or factory:  # no device named: made on the host
                tr.tag(out, _LIT if factory else _HOST)
        return out


class _DispatchMode(TorchDispatchMode):
    """Sees every aten op, also those issued from inside torch (dropout's bernoulli_,
    an index with a boolean mask), and propagates device/host tags."""

    def __init__(self, tr: _Tracker):
        super().__init__()
        self.tr = tr

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tr, kwargs = self.tr, dict(kwargs or {})
        name, op = func.overloadpacket.__name__, _name(func)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        dev = [t for t in tensors if tr.is_dev(t)]
        host = [t for t in tensors if not tr.is_dev(t)]

        if name == "_pin_memory" or kwargs.get("pin_memory"):
            tr.add(PINNED, op)
            if not tr.can_pin:
                if name == "_pin_memory":
                    return args[0].clone()
                kwargs["pin_memory"] = False
        if name in _RNG_OPS:
            tr.add(RNG, op)
        if dev and name in _SYNC_OPS:
            tr.add(HOST_SYNC, op)
        elif dev and name == "repeat_interleave" and kwargs.get("output_size") is None \
                and func._overloadname != "self_int":
            tr.add(HOST_SYNC, op, "repeat_interleave with tensor repeats and no output_size: "
                   "the result size depends on the data")
        elif dev and name in _INDEX_OPS and self._bool_index(name, args, kwargs):
            tr.add(HOST_SYNC, op, "boolean-mask indexing: the result size depends on the data "
                   "(a nonzero on the device); use torch.where or masked_fill")
        if name == "copy_" and len(args) >= 2:
            dst, src = args[0], args[1]
            if tr.is_dev(dst) and not tr.is_dev(src):
                tr.add(CPU_TENSOR, op, "copies a host tensor into a device tensor inside the "
                       "step: the copy reads host memory at replay (or syncs while capturing)")
            elif tr.is_dev(src) and not tr.is_dev(dst):
                non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking"))
                if not (non_blocking and not tr.simulate and dst.is_pinned()):
                    tr.add(HOST_SYNC, op, "copies a device tensor to pageable host memory: a "
                           "host sync (non_blocking into pinned memory is the capturable form)")
        elif name == "_to_copy" and not tr.simulate and tensors:
            to_dev = tr.device_is_dev(kwargs.get("device"))
            if to_dev is False and dev:
                tr.add(HOST_SYNC, op)
            elif to_dev and not dev:
                tr.add(CPU_TENSOR, op)
        elif dev and host:
            for t in host:
                if t.dim() == 0 and tr.tags.get(t) == _LIT:
                    continue        # made from a Python number in this step: already frozen
                tr.add(CPU_TENSOR, op, "a 0-dim CPU tensor's value is read at capture and "
                       "baked into the graph" if t.dim() == 0 else None)

        out = func(*args, **kwargs)
        if name in _LIFT_OPS or (not tensors and not tr.simulate):
            tr.tag(out, _LIT)       # built from Python values during the step
        elif name == "copy_" or dev:
            return out              # a copy keeps its destination; device in, device out
        elif tensors:
            tr.tag(out, _LIT if all(tr.tags.get(t) == _LIT for t in tensors) else _HOST)
        # Simulating, ops without tensor inputs stay device tensors here (torch's own
        # factories use device=x.device); the function mode tags the user's as host.
        return out

    def _bool_index(self, name, args, kwargs) -> bool:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        mask = [i for i in indices if i is not None and i.dtype in (torch.bool, torch.uint8)]
        if not mask:
            return False
        if name == "index":
            return True
        # x[mask] = scalar: torch turns it into masked_fill (no sync) when the value is one
        # host element and nothing accumulates.
        value = args[2] if len(args) > 2 else kwargs.get("values")
        accumulate = bool(args[3] if len(args) > 3 else kwargs.get("accumulate", False))
        return not (len(indices) == 1 and not accumulate and isinstance(value, torch.Tensor)
                    and value.numel() == 1 and not self.tr.is_dev(value))


def find_capture_hazards(fn: Callable, *args, device=None, **kwargs) -> tuple[Hazard, ...]:
    """Run ``fn(*args, **kwargs)`` once, eagerly, and list what would break or be frozen
    by a CUDA-graph capture, each with the user's file and line.

    ``device``: the device the step will run on. With CUDA tensors among the inputs it is
    their device; with CPU inputs (any machine) the inputs stand for device tensors and
    calls naming ``device`` (default ``"cuda"``) run on the CPU instead (module docstring).

    Kinds: ``host_sync`` (``.item()``, ``.cpu()``, ``.tolist()``, ``int(t)``, ``nonzero``,
    ``masked_select``, ``unique``, boolean-mask indexing, ``equal``, device-to-pageable
    copies), ``data_dependent_branch`` (``bool(t)``, ``if t.sum() > 0``), ``cpu_tensor``
    (a host tensor read by a device op or copied to the device; 0-dim tensors made from
    Python numbers inside the step are fine), ``pinned_alloc``, ``rng``, and ``error``
    when ``fn`` raised (the run stops there; hazards found before it are kept).
    Deduplicated by (kind, op, filename, lineno), in order of first sight.

    Cannot see: work that bypasses torch (Triton/ctypes launches, ``torch.cuda.synchronize()``,
    stream/event waits, host-side Python state), branches on Python values, ops in code
    paths not taken on this run, and dynamic shapes that do not sync. ``fn`` really runs:
    its side effects (KV writes, counters) happen once.
    """
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    real = next((t.device for t in leaves if t.device.type not in ("cpu", "meta")), None)
    if real is not None:
        tr = _Tracker(simulate=False, target=torch.device(device) if device else real)
    else:
        target = torch.device(device) if device is not None else torch.device("cuda")
        tr = _Tracker(simulate=True, target=target if target.type != "cpu" else torch.device("cuda"))
    try:
        with _DispatchMode(tr), _FunctionMode(tr):
            fn(*args, **kwargs)
    except Exception as exc:  # report it as a hazard at the user's line; keep the rest
        frames = [(f.filename, f.lineno) for f in reversed(traceback.extract_tb(exc.__traceback__))]
        first_line = (str(exc).splitlines() or [""])[0]
        tr.add(ERROR, type(exc).__name__, f"{type(exc).__name__}: {first_line}",
               where=_user_location(iter(frames)))
    return tuple(tr.found.values())


def explain_capture_failure(fn: Callable, inputs: Mapping[str, Any], *, width: int | None = None,
                            device=None) -> str:
    """Run the hazard finder on ``fn(inputs)`` (a step function and its static inputs for
    one width) and format one line per hazard: ``width N: <op> at file:line: <source>``,
    each followed by an indented ``kind: message`` line. ``width`` defaults to the leading
    dimension of the first tensor input. Never raises for what ``fn`` does (an exception
    becomes an ``error`` hazard)."""
    if width is None:
        first = next((t for t in tree_leaves(dict(inputs)) if isinstance(t, torch.Tensor)
                      and t.dim() > 0), None)
        width = first.shape[0] if first is not None else None
    hazards = find_capture_hazards(fn, dict(inputs), device=device)
    tag = f"width {width}" if width is not None else "step"
    if not hazards:
        return (f"{tag}: the eager hazard finder saw nothing (the cause bypasses torch: "
                f"a raw kernel launch, a synchronize, or a code path taken only while capturing)")
    lines = []
    for h in hazards:
        lines.append(f"{tag}: {h.op} at {h.filename}:{h.lineno}: {h.line}")
        lines.append(f"    {h.kind}: {h.message}")
    return "\n".join(lines)


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
        raise NeedsCudaError(f"graph introspection needs cuda-python (cuda.bindings): {exc}") from exc
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
    ptr = int(host_ptr) if memtype == T.CU_MEMORYTYPE_HOST else int(dev_ptr)
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
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


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
            label = f"memcpy {n.direction} {_fmt_bytes(n.bytes)}" + (f" ({n.host_memory})" if n.host_memory else "")
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


# --------------------------------------------------------------------------------------
# A whole runtime
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OutputDiff:
    """Graphs on vs graphs off for one output leaf (``path`` like ``"tokens"`` or ``"[0]"``).
    ``first_row``: first row (leading index) that differs at all, None if bit-identical."""

    path: str
    max_abs: float
    max_rel: float
    first_row: int | None
    note: str = ""

    @property
    def equal(self) -> bool:
        return self.first_row is None and not self.note

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "equal": self.equal}


@dataclass(frozen=True)
class WidthReport:
    """Everything known about one captured width. Times in seconds (replay: median of
    event-timed replays); None where the runtime did not say or the step was not run."""

    width: int
    capture_s: float | None = None
    instantiate_s: float | None = None
    replay_s: float | None = None
    pool_bytes: int | None = None
    counts: dict[str, int] = field(default_factory=dict)
    static_inputs: dict[str, int] = field(default_factory=dict)   # name -> data_ptr
    hazards: tuple[Hazard, ...] = ()
    diffs: tuple[OutputDiff, ...] = ()
    error: str | None = None
    nodes: tuple[GraphNode, ...] = field(default=(), repr=False)

    @property
    def kernels(self) -> tuple[GraphNode, ...]:
        return tuple(n for n in self.nodes if n.type == "kernel")

    @property
    def copies(self) -> tuple[GraphNode, ...]:
        return tuple(n for n in self.nodes if n.type in ("memcpy", "memset"))

    @property
    def node_hazards(self) -> tuple[GraphNode, ...]:
        return tuple(n for n in self.nodes if n.hazard)

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "nodes"}
        d["hazards"] = [h.to_json() for h in self.hazards]
        d["diffs"] = [x.to_json() for x in self.diffs]
        d["kernels"] = [k.to_json() for k in self.kernels]
        d["copies"] = [c.to_json() for c in self.copies]
        d["node_hazards"] = [n.to_json() for n in self.node_hazards]
        return d


@dataclass(frozen=True)
class InspectReport:
    """Per-width facts of one runtime, plus what changes between neighbouring widths.

    ``available`` is False (``reason`` says why, e.g. "needs CUDA") when graphs could not
    be read; the hazard lists are still filled where the step function could be run.
    """

    available: bool
    reason: str
    device: str
    widths: tuple[WidthReport, ...]
    width_diffs: tuple[tuple[int, int, NodeDiff], ...] = ()

    @property
    def ok(self) -> bool:
        """Readable, no hazard, no graph hazard, graphs on == graphs off, no error."""
        return self.available and not any(
            w.hazards or w.node_hazards or w.error or not all(d.equal for d in w.diffs)
            for w in self.widths)

    def to_json(self) -> dict:
        return {"available": self.available, "reason": self.reason, "device": self.device,
                "ok": self.ok, "widths": [w.to_json() for w in self.widths],
                "width_diffs": [{"a": a, "b": b, **d.to_json()} for a, b, d in self.width_diffs]}


def _capture_facts(report, width: int) -> dict:
    """capture_s / instantiate_s / pool_bytes / error of one width from ``rt.capture_report``
    (a CaptureReport: ``.widths`` holds WidthCapture entries; a mapping width -> entry
    works too). For kept graphs the runtime instantiates inside the timed capture, so
    capture_s includes instantiation and instantiate_s stays None unless reported."""
    entries = getattr(report, "widths", None) or ()
    if isinstance(entries, Mapping):
        entry = entries.get(width)
    else:
        entry = next((e for e in entries if getattr(e, "width", None) == width), None)
    get = (lambda k: entry.get(k)) if isinstance(entry, Mapping) else (lambda k: getattr(entry, k, None))
    return {k: get(k) for k in ("capture_s", "instantiate_s", "pool_bytes", "error")}


def _graphs(rt) -> Mapping[int, Any]:
    graphs = getattr(rt, "graphs_captured", None)
    return graphs if graphs is not None else (getattr(rt, "graphs", None) or {})


def _leaves(obj, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path or "out", obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}[{i}]")


def _compare(path: str, a: torch.Tensor, b: torch.Tensor) -> OutputDiff:
    if a.shape != b.shape:
        return OutputDiff(path, float("inf"), float("inf"), 0, f"shape {tuple(a.shape)} vs {tuple(b.shape)}")
    a, b = a.detach().double(), b.detach().double()
    neq = (a != b) & ~(a.isnan() & b.isnan())
    if not bool(neq.any()):
        return OutputDiff(path, 0.0, 0.0, None)
    diff = torch.where(neq, (a - b).abs().nan_to_num(nan=float("inf")), torch.zeros_like(a))
    rel = torch.where(neq, diff / b.abs().clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    rel = rel.nan_to_num(nan=float("inf"))   # NaN on one side only
    rows = neq.reshape(neq.shape[0], -1).any(1) if neq.dim() else neq.reshape(1)
    return OutputDiff(path, float(diff.max()), float(rel.max()), int(rows.nonzero()[0, 0]))


def _replay_seconds(graph, replays: int) -> float:
    graph.replay()                       # instantiates a kept graph on first use
    torch.cuda.synchronize()
    times = []
    for _ in range(max(1, replays)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def inspect_runtime(rt, *, widths=None, replays: int = 20, reference=None,
                    inputs: Callable[[int], Mapping[str, Any]] | None = None,
                    hazards: bool = True, on_width: Callable[[int], None] | None = None) -> InspectReport:
    """Gather per-width facts of a GraphRuntime: capture time and pool bytes (as
    ``rt.capture_report`` gives them), replay time (CUDA events, median of ``replays``),
    node counts, kernel and memcpy/memset nodes, static input addresses, hazards found by
    :func:`find_capture_hazards` on ``rt.step_fn(rt.static_inputs(w))``, and graphs on
    vs off per output.

    ``rt`` must have been built with ``keep_graphs=True`` and captured. ``reference``: a
    graphs-off runtime computing the same function with the same state (build both from
    one seeded factory), or a zero-argument callable returning one; ``inputs(T)`` gives
    step inputs of T rows. Both are needed for the on/off comparison, which runs
    ``rt.step`` and ``reference.step`` once per width with T = width. ``on_width(w)`` is
    called before each width (a progress bar).

    Side effects: replays each graph ``replays + 1`` times on its current static inputs
    and runs the step eagerly once per width for the hazard finder (both rewrite what the
    last step wrote, e.g. its KV cells; results of earlier steps become invalid). Never
    raises for a width: its ``error`` says what failed. Without CUDA, or without
    captured graphs, the report has ``available=False`` and only the hazards.
    """
    graphs = _graphs(rt)
    widths = tuple(sorted(widths if widths is not None else (graphs or getattr(rt, "widths", ()))))
    device = str(getattr(rt, "device", "?"))
    reason = ""
    if not torch.cuda.is_available():
        reason = "needs CUDA: torch.cuda.is_available() is False"
    elif not graphs:
        reason = "no captured graphs: build the runtime with graphs=True, keep_graphs=True and call capture()"
    if reason:
        return InspectReport(False, reason, device, tuple(
            WidthReport(w, hazards=_step_hazards(rt, w) if hazards else ()) for w in widths))
    ref = reference() if callable(reference) and not hasattr(reference, "step") else reference
    reports, all_nodes = [], {}
    for w in widths:
        if on_width is not None:
            on_width(w)
        facts = _capture_facts(getattr(rt, "capture_report", None), w)
        error = facts.pop("error")
        try:
            if w not in graphs:
                raise GraphInspectError(error or f"width {w} has no captured graph")
            nodes = all_nodes[w] = graph_nodes(graphs[w])
            wr = WidthReport(
                w, **facts, replay_s=_replay_seconds(graphs[w], replays), counts=node_counts(nodes),
                static_inputs={k: v.data_ptr() for k, v in rt.static_inputs(w).items()},
                hazards=_step_hazards(rt, w) if hazards else (),
                diffs=_on_off(rt, ref, inputs, w) if ref is not None and inputs else (),
                nodes=nodes)
        except Exception as exc:   # one width's failure must not hide the others
            wr = WidthReport(w, **facts, error=f"{type(exc).__name__}: {exc}")
        reports.append(wr)
    ws = sorted(all_nodes)
    pairs = tuple((a, b, diff_nodes(all_nodes[a], all_nodes[b])) for a, b in zip(ws, ws[1:]))
    return InspectReport(True, "", device, tuple(reports), pairs)


def _step_hazards(rt, width: int) -> tuple[Hazard, ...]:
    try:
        return find_capture_hazards(rt.step_fn, dict(rt.static_inputs(width)))
    except Exception as exc:   # no static inputs (an unfinished runtime): say so
        return (Hazard(ERROR, type(exc).__name__, "<runtime>", 0, "", f"could not run the step: {exc}"),)


def _on_off(rt, ref, inputs, width: int) -> tuple[OutputDiff, ...]:
    step_in = dict(inputs(width))
    on = {p: t.clone() for p, t in _leaves(rt.step(**step_in).outputs)}  # views die next step
    return compare_outputs(on, ref.step(**step_in).outputs)


def compare_outputs(on, off) -> tuple[OutputDiff, ...]:
    """Compare two step outputs of the same structure (Tensor, or dict/tuple/list of them)
    leaf by leaf: max abs and rel difference, first differing row (NaN == NaN). A leaf
    present in one only, or of another shape, is reported with a ``note``."""
    a, b = dict(_leaves(on)), dict(_leaves(off))
    diffs = [_compare(p, a[p], b[p]) for p in a if p in b]
    diffs += [OutputDiff(p, float("inf"), float("inf"), 0, "missing in one run")
              for p in sorted(a.keys() ^ b.keys())]
    return tuple(diffs)
