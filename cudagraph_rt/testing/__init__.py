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
from .adapter import BaseAdapter, HFAdapter, PoolAdapter, SweepAdapter, ToyAdapter
from .assertions import assert_sweep
from .checks import Tolerance
from .harness import resolve_graphs, run_sweep
from .plans import Capacity, Chunk, SeqPlan, StepPlan, SweepOptions, SweepPlan, make_plan
from .report import Failure, ModeReport, SweepReport, WidthSummary

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
