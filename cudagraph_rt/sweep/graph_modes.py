"""The graph modes a sweep runs, and those of ``cgrt sweep`` and ``cgrt demo``: one value
set for ``run_sweep(graphs=...)``, ``--graphs`` and ``CGRT_SWEEP_GRAPHS``, one meaning each.

- ``auto``: graphs on, then off, where the device is CUDA; elsewhere off alone (a note says
  graphs on was skipped).
- ``on``: CUDA graphs alone; ``both``: on, then off. Both need a CUDA device: elsewhere
  they are refused (InputError naming what can run there).
- ``off``: the same plan, padding and buffers, run eagerly.
- ``emulate``: the graph path's code run eagerly over the same buffers
  (``GraphRuntime(graphs="emulate")``), on any device.

torch is imported only to ask whether CUDA exists, so the CLI reads :data:`GRAPHS` and
:data:`MEANING` before torch loads.
"""
from __future__ import annotations

from typing import Any

from ..errors import InputError, expected
from ..graphs import Graphs, as_graphs

GRAPHS = ("auto", "on", "off", "both", "emulate")
MEANING = ("auto | on | off | both | emulate (default auto: on and off where CUDA exists, else off; both: on "
           "and off; emulate: the graph path's code run eagerly over the same buffers, any device)")
ANYWHERE = ("auto", "off", "emulate")  # the values a device without CUDA runs


def resolve_graphs(graphs: Graphs | str | bool, device: Any, name: str = "graphs") -> tuple[tuple[bool | str, ...], tuple[str, ...]]:
    """The modes to run on ``device``, in order (True: graphs on, False: off, "emulate"),
    and notes (graphs on skipped under ``auto``). ``graphs`` may also be a
    :class:`~cudagraph_rt.Graphs` member or a bool (on / off). InputError naming ``name``: a value not in :data:`GRAPHS`, or one that needs
    CUDA graphs where ``device`` is not CUDA."""
    if isinstance(graphs, (bool, Graphs)):
        graphs = as_graphs(graphs).value
    if graphs not in GRAPHS:
        raise InputError(expected(name, " | ".join(GRAPHS), repr(graphs)))
    if graphs == "emulate":
        return ("emulate",), ()
    cuda = getattr(device, "type", device) == "cuda"
    if graphs == "off":
        return (False,), ()
    if cuda:
        return {"auto": (True, False), "both": (True, False), "on": (True,)}[graphs], ()
    why = _why_no_graphs(device)
    if graphs == "auto":
        return (False,), (f"graphs on: skipped ({why}; CUDA graphs need a GPU) - ran graphs off only",)
    raise InputError(expected(name, f"{' | '.join(ANYWHERE)} here ({why}; CUDA graphs need a GPU)", repr(graphs)))


def mode_name(graphs: Graphs | bool | str) -> str:
    """How a sweep mode reads: graphs on (True), off (False) or emulated ("emulate")."""
    return {Graphs.ON: "graphs on", Graphs.OFF: "graphs off", Graphs.EMULATE: "graphs emulated"}[as_graphs(graphs)]


def mode_flag(graphs: Graphs | bool | str) -> str:
    """The ``--graphs`` value that runs that mode alone: on, off or emulate."""
    return as_graphs(graphs).value


def _why_no_graphs(device: Any) -> str:
    import torch

    return "no CUDA on this machine" if not torch.cuda.is_available() else f"the device is {device}"
