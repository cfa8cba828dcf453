"""`RuntimeConfig`: a GraphRuntime's constructor arguments, checked and resolved once."""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import torch

from .checks import as_bool, resolve_device
from .errors import InputError, expected
from .host_rows import HostRows
from .inputs.spec import InputSpec
from .graphs.backends import GraphBackend, backend_for
from .graphs.policy import CapturePolicy
from .widths import check_widths, default_dynamic_limit, default_widths

StepFn = Callable[[Mapping[str, torch.Tensor]], Any]


def _int(name: str, v: Any, lo: int, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise InputError(expected(name, what, repr(v)))
    return v


def _device(device: Any, backend: GraphBackend) -> torch.device:
    """The resolved device ("cuda" -> "cuda:<current>"); InputError for what cannot run
    (the check every constructor shares, then the graph backend's own)."""
    dev = resolve_device(device)
    if dev.type == "cpu":
        backend.check_device(dev)
    return dev


def _specs(inputs: Any) -> Mapping[str, InputSpec]:
    if not isinstance(inputs, Mapping) or not inputs:
        raise InputError(expected("inputs", "a non-empty dict of name -> InputSpec", repr(inputs)))
    for name, spec in inputs.items():
        if not isinstance(name, str) or not name.isidentifier() or name == "rows" or name.startswith("__"):
            raise InputError(expected("inputs", "identifier names other than 'rows'", repr(name)))
        if not isinstance(spec, InputSpec):
            raise InputError(expected(f"inputs[{name!r}]", "an InputSpec", type(spec).__name__))
    return MappingProxyType(dict(inputs))


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything a GraphRuntime is built from, checked: the arguments of
    :class:`~cudagraph_rt.GraphRuntime` (see its docstring), with ``widths``,
    ``dynamic_limit`` and ``device`` resolved. ``rows`` is the arena's rows per input:
    the widest step one slice runs. ``graphs`` reads back as True, False or
    ``"emulate"`` (whatever :class:`~cudagraph_rt.Graphs` spelling was given); ``backend``
    is the object it chose (see ``graphs.backends``);
    ``capture_policy`` what each width tries at capture, from ``pieces`` and
    ``on_capture_error`` (see ``graphs.policy``). Raises InputError naming the argument."""

    step_fn: StepFn
    inputs: Mapping[str, InputSpec]
    widths: tuple[int, ...]
    dynamic_limit: int
    slicing: bool
    graphs: bool | str
    device: torch.device
    dynamic_fn: StepFn | None
    host_rows: HostRows | None
    on_capture_error: str
    warmup: int
    keep_graphs: bool
    watch: Callable[[], Iterable[torch.Tensor]] | None
    backend: GraphBackend
    pieces: Any = False
    step_values: Callable | None = None
    capture_policy: CapturePolicy | None = None

    @property
    def rows(self) -> int:
        return max(self.widths[-1], self.dynamic_limit)

    @classmethod
    def build(cls, step_fn, inputs, *, widths=None, max_width=64, dynamic_limit=None, slicing=True,
              graphs=True, device=None, dynamic_fn=None, host_rows=None, on_capture_error="raise",
              warmup=2, keep_graphs=False, watch=None, pieces=False, step_values=None) -> "RuntimeConfig":
        for name, fn, what in (("step_fn", step_fn, "a callable"), ("dynamic_fn", dynamic_fn, "a callable or None"),
                               ("watch", watch, "a callable returning tensors, or None"),
                               ("step_values", step_values, "a callable (rows, width) -> values, or None")):
            if not callable(fn) and not (fn is None and name != "step_fn"):
                raise InputError(expected(name, what, type(fn).__name__))
        specs = _specs(inputs)
        ws = check_widths(widths) if widths is not None else default_widths(max_width)
        limit = default_dynamic_limit(ws) if dynamic_limit is None else dynamic_limit
        _int("dynamic_limit", limit, ws[-1], f"an int >= the widest graph ({ws[-1]})")
        policy = CapturePolicy.build(pieces, on_capture_error, ws)
        _int("warmup", warmup, 0, "an int >= 0")
        if host_rows is not None and not isinstance(host_rows, HostRows):
            raise InputError(expected("host_rows", "a HostRows or None", type(host_rows).__name__))
        slicing = as_bool("slicing", slicing)
        backend = backend_for(graphs)
        dev = _device(device, backend)
        return cls(step_fn, specs, ws, limit, slicing, backend.value, dev, dynamic_fn, host_rows, on_capture_error,
                   warmup, keep_graphs, watch, backend, pieces, step_values, policy)
