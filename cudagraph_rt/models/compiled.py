"""A model's step body through torch.compile, compiled lazily, once for every width it can.

:class:`CompiledRows` wraps ``fn(*rows)`` whose tensor arguments all carry the step's rows
along dimension 0 (``tokens, positions, seq_ids, cells, want``). It compiles at the first
call (the runtime's warm-up of its first width), not when built, and marks the row
dimension dynamic, so one graph serves every width from 2 up (widths 64, 32, ..., 2 and
the runtime's unpadded dynamic path) and width 1 gets its own graph (torch specialises
sizes 0 and 1): two compiles in all. ``dynamic=False`` compiles each width on its own
instead (to measure what the dynamic dimension costs; each new width is a new compile,
and past torch's recompile limit, 8 by default, torch runs that width eagerly).

The runtime owns the CUDA graphs: modes that bring their own (``reduce-overhead``,
``max-autotune``, or ``options={"triton.cudagraphs": True}``) are refused with
InputError, because their graphs would be captured inside ours and replay stale static
inputs. Use ``default`` or ``max-autotune-no-cudagraphs``.

What stays eager is the caller's business: the model keeps its uncompiled forward for
``reference()`` and ``generate()`` and routes only the step through this object.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
from torch import Tensor

from ..errors import InputError, expected

log = logging.getLogger(__name__)
MODES = ("default", "max-autotune-no-cudagraphs")  # the modes that leave CUDA graphs to the runtime

# What a step compiles with unless ``options`` say otherwise: inductor's horizontal fusion
# (independent kernels of one graph share a launch; a decode step is many small kernels) and
# its programmatic dependent launch (each Triton kernel starts while the one before finishes
# and waits for it; sm_90 and later, inductor checks). H200, the 1B compiled step
# (BENCHMARKS.md runs H and I): combo width 1 1103 -> 1089 us, width 8 1217 -> 1145; PDL with
# our kernels' own 1108 -> 1094 us, width 8 1178 -> 1171.
STEP_OPTIONS = {"combo_kernels": True, "triton.enable_pdl": True}


def inductor_options(mode: str, options: dict | None = None) -> dict:
    """The inductor settings a step compiles with: ``mode``'s, then :data:`STEP_OPTIONS`,
    then ``options`` (each overriding the one before); checked: InputError for an unknown
    mode or one that captures CUDA graphs itself."""
    from torch._inductor import list_mode_options

    merged = None
    if isinstance(mode, str):
        try:
            merged = {**list_mode_options(mode), **STEP_OPTIONS, **(options or {})}
        except RuntimeError:  # torch's "Unrecognized mode"
            pass
    if merged is None:
        raise InputError(expected("mode", " | ".join(MODES), repr(mode)))
    if merged.get("triton.cudagraphs"):
        raise InputError(expected("mode", f"a mode without CUDA graphs ({' | '.join(MODES)}): the runtime "
                                          "captures the graphs", repr(mode) + (f" options {options}" if options else "")))
    return merged


class CompiledRows:
    """``fn(*rows)`` through ``torch.compile``, compiled at its first call.

    ``mode``/``options``: as torch.compile's, checked by :func:`inductor_options` (here,
    before anything is compiled). ``dynamic=True``: every tensor argument's dimension 0 is
    marked dynamic at calls of two rows or more (one graph for all such widths, one for
    width 1); ``False``: one graph per width. ``fullgraph=True`` makes a graph break an
    error at the first call instead of a split graph.

    :attr:`graphs` counts the graphs compiled through this object and :attr:`compile_s`
    the wall time of the calls that compiled (both read by benches and tests). Calls are
    the compiled function's: outputs as ``fn``'s. Not thread-safe (neither is compiling).
    """

    def __init__(self, fn: Callable[..., Any], *, mode: str = "default", dynamic: bool = True,
                 fullgraph: bool = False, options: dict | None = None):
        if not callable(fn):
            raise InputError(expected("fn", "a callable", type(fn).__name__))
        self.fn, self.mode, self.dynamic = fn, mode, bool(dynamic)
        # the mode's settings as options (torch.compile takes one or the other)
        self._kw = dict(options=inductor_options(mode, options), fullgraph=fullgraph,
                        dynamic=None if dynamic else False)
        self._compiled = None
        self.graphs = 0
        self.compile_s = 0.0

    def __call__(self, *rows: Any) -> Any:
        if self._compiled is None:
            log.info("compiling the step's rows (torch.compile, mode %s; this takes a while)", self.mode)
            self._compiled = torch.compile(_own_frame(self.fn), **self._kw)
        if self.dynamic:
            _mark_rows(rows)
        from torch._dynamo.utils import counters

        before, t0 = counters["stats"]["unique_graphs"], time.perf_counter()
        out = self._compiled(*rows)
        new = counters["stats"]["unique_graphs"] - before
        if new:
            self.graphs += new
            self.compile_s += time.perf_counter() - t0
            log.debug("compiled %d graph(s) in %.1f s", new, time.perf_counter() - t0)
        return out


def _own_frame(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` behind a function with its own code object. Dynamo keeps compiled graphs
    (and counts them against its recompile limit, 8) per code object: without this every
    model of one class shares ``_step_rows``'s, a second model of other shapes makes torch
    recompile with those shapes dynamic (weights too: slower kernels for both), and past
    the limit torch runs the step eagerly, with only a log line. The price: a second
    model of the same shapes traces again (inductor's on-disk cache serves its kernels)."""
    def rows(*args):
        return fn(*args)
    rows.__code__ = rows.__code__.replace()  # a new code object, equal in every other way
    return rows


def _mark_rows(rows) -> None:
    """Mark dimension 0 of every tensor argument dynamic: a hint (``maybe_mark_dynamic``),
    so code that must specialise the width still compiles (per width) instead of failing.
    Width 1 is left alone: torch specialises it anyway."""
    tensors = [t for t in rows if isinstance(t, Tensor) and t.dim() > 0]
    if tensors and tensors[0].shape[0] >= 2:
        for t in tensors:
            torch._dynamo.maybe_mark_dynamic(t, 0)


__all__ = ["MODES", "STEP_OPTIONS", "CompiledRows", "inductor_options"]
