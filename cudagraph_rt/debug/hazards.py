"""The capture-hazard finder: run a step function once, eagerly, and name the user's
source line of everything that cannot live in a CUDA graph or is frozen by it.
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

from contextlib import contextmanager

import dataclasses
import importlib.util
import linecache
import os
import sys
import sysconfig
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from ..pieces import marked_calls



__all__ = ["HAZARD_KINDS", "Hazard", "find_capture_hazards", "explain_capture_failure"]

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

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} at {self.filename}:{self.lineno}: {self.line} ({self.message})"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _library_roots() -> tuple[tuple[str, ...], tuple[str, ...], str, tuple[str, ...]]:
    """(user roots inside the library, library roots, stdlib, site-packages roots)."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # cudagraph_rt/ (this is debug/)
    lib = [os.path.dirname(os.path.abspath(torch.__file__)), pkg]
    kernels = importlib.util.find_spec("cudagraph_rt.kernels")  # inside pkg when installed, beside it in a tree
    lib += [os.path.abspath(p) for p in (kernels.submodule_search_locations or ())] if kernels else []
    paths = sysconfig.get_paths()
    site = tuple(os.path.abspath(paths[k]) + os.sep for k in ("purelib", "platlib"))
    return ((os.path.join(pkg, "models") + os.sep,), tuple(d + os.sep for d in lib),
            os.path.abspath(paths["stdlib"]) + os.sep, site)


_USER_IN_LIB, _LIB, _STDLIB, _SITE = _library_roots()


def _is_library(filename: str) -> bool:
    """Frames a hazard is not attributed to: torch, cudagraph_rt's machinery (its embedded
    models count as user code), the stdlib (site-packages may live under it: not skipped)."""
    if filename.startswith("<frozen"):
        return True         # importlib/runpy; "<stdin>" and notebook cells are user code
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
        factory = tr.simulate and not any(isinstance(t, torch.Tensor) for t in tree_leaves((args, kwargs)))
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
        self._copies_and_mixes(name, op, args, kwargs, tensors, dev, host)

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

    def _copies_and_mixes(self, name, op, args, kwargs, tensors, dev, host) -> None:
        """Copies between host and device inside the step, and host tensors read by
        device ops (0-dim ones made from Python numbers in this step excepted)."""
        tr = self.tr
        if name == "copy_" and len(args) >= 2:
            dst, src = args[0], args[1]
            if tr.is_dev(dst) and not tr.is_dev(src):
                tr.add(CPU_TENSOR, op, "copies a host tensor into a device tensor inside the "
                       "step: refused while capturing unless the host tensor is pinned, and a "
                       "pinned copy reads whatever that buffer holds at each replay")
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


def _marked_call(tr: _Tracker):
    """How a call marked ``cudagraph_rt.eager`` runs under the finder: for real, reported
    nowhere (it runs outside the graphs and may sync: that is why it is marked)."""
    def run(fn, args, kwargs):
        tr.quiet += 1
        try:
            return fn(*args, **kwargs)
        finally:
            tr.quiet -= 1
    return run


@contextmanager
def _capturing_as_seen_by_code():
    """``torch.cuda.is_current_stream_capturing()`` answers True while the finder runs, so
    code that branches on it (transformers' masking skips a data-dependent check while
    capturing) takes the path capture takes, and only what capture would hit is reported."""
    before = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = before


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

    Calls marked ``cudagraph_rt.eager`` run, and nothing in them is reported. Cannot see:
    work that bypasses torch (Triton/ctypes launches, ``torch.cuda.synchronize()``,
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
        with _DispatchMode(tr), _FunctionMode(tr), _capturing_as_seen_by_code(), marked_calls(_marked_call(tr)):
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
