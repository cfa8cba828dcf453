"""The sweep harness's public names, imported together the first time one is asked for
(``cudagraph_rt.sweep.__getattr__``): its light modules (``plans``) import alone. Every
name here is re-exported (``cudagraph_rt.sweep.__all__`` lists them)."""
from __future__ import annotations

from .adapter import BaseAdapter, HFAdapter, PoolAdapter, SweepAdapter, ToyAdapter
from .assertions import assert_sweep
from .checks import Tolerance
from .graph_modes import resolve_graphs
from .harness import run_sweep
from .plans import Capacity, Chunk, SeqPlan, StepPlan, SweepOptions, SweepPlan, make_plan
from .report import Failure, ModeReport, SweepReport, WidthSummary
