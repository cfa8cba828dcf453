"""Everything about making and replaying graphs: the user's choice (:class:`Graphs`, here),
the backends that carry it out (``backends``, ``emulation``), capturing a width whole or in
pieces (``capture``, ``piece_capture``, ``hygiene``), replaying it (``launch``, ``pieces``)
and what each width runs as (``policy``).

This module imports no torch (the command line reads it before torch loads).
"""
from __future__ import annotations

import enum
from typing import Any

from ..errors import InputError, expected

__all__ = ["Graphs", "as_graphs"]


class Graphs(enum.Enum):
    """How a GraphRuntime runs its widths (``GraphRuntime(graphs=...)``), as vLLM's
    ``CUDAGraphMode``:

    - ``ON``: one CUDA graph per width (a CUDA device);
    - ``OFF``: every width runs eagerly over the same static buffers and plan;
    - ``EMULATE``: the graph path's own code run eagerly (any device, a CPU included).

    Every ``graphs=`` argument takes a member, its value (``"on"``, ``"off"``,
    ``"emulate"``) or a bool as shorthand (True = ON, False = OFF); :func:`as_graphs`
    resolves them."""

    ON = "on"
    OFF = "off"
    EMULATE = "emulate"


CHOICES = ("True, False or 'emulate' (or a Graphs member: Graphs.ON | Graphs.OFF | Graphs.EMULATE, or its value: "
           "'on' | 'off' | 'emulate')")


def as_graphs(graphs: Any, name: str = "graphs") -> Graphs:
    """The :class:`Graphs` member a ``graphs=`` argument means: a member, its value string or
    a bool (0 and 1 too). InputError naming ``name`` and listing the choices otherwise."""
    if isinstance(graphs, Graphs):
        return graphs
    if isinstance(graphs, str):
        for member in Graphs:
            if graphs == member.value:
                return member
    elif type(graphs) is bool or (type(graphs) is int and graphs in (0, 1)):
        return Graphs.ON if graphs else Graphs.OFF
    raise InputError(expected(name, CHOICES, repr(graphs)))
