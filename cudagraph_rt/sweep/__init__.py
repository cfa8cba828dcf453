"""Width-sweep test harness: run every step width through a GraphRuntime, in both graph
modes, and check each step against the model's eager reference.

``run_sweep(adapter, ...) -> SweepReport`` for programs, ``assert_sweep(adapter, ...)`` for
a pytest suite, ``cgrt sweep`` on the command line. A model plugs in through the small
adapter protocol (``SweepAdapter``; ``ToyAdapter`` for the embedded toy decoder, ``HFAdapter`` for
transformers causal LMs, both ``PoolAdapter``: models on the paged KV pool).

Modules: plans (which steps and rows), adapter (the protocol and the toy's adapter), checks
(one step against its expectations), harness (the run), report (tables, JSON, plot),
assertions (the pytest helper).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy

__all__ = [
    "run_sweep",
    "assert_sweep",
    "SweepAdapter",
    "BaseAdapter",
    "PoolAdapter",
    "ToyAdapter",
    "HFAdapter",
    "Capacity",
    "Tolerance",
    "SweepOptions",
    "SweepPlan",
    "StepPlan",
    "Chunk",
    "SeqPlan",
    "make_plan",
    "resolve_graphs",
    "SweepReport",
    "ModeReport",
    "WidthSummary",
    "Failure",
]


def __getattr__(name: str):
    # The public names load together on first use (cudagraph_rt._lazy), so the CLI can
    # read SweepOptions' defaults from plans before torch is imported.
    if name not in __all__:
        return _lazy.submodule(__name__, name)
    from . import _api

    return _lazy.public(globals(), name, _api)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from ._api import *  # noqa: F403 - what type checkers see: the names __getattr__ loads
