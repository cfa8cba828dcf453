"""cudagraph_rt: capture a step function once per padded width, replay it for any width.

See README.md for the two-minute tour and ARCHITECTURE.md (both at the repository root) for
the layout, one step's data path and the glossary.
"""
from __future__ import annotations

from . import _source_tree

# kernels/ and tools/ are top-level folders of the repository that install as
# cudagraph_rt.kernels and cudagraph_rt.tools; from a source tree (PYTHONPATH=.) the
# finder maps those two names, and only those (see _source_tree).
_source_tree.install(__path__[0])  # type: ignore[name-defined]

from . import _moved  # noqa: E402

# The modules that moved into the wings (debug/, spec/) stay importable at their old paths
# for one release, with a DeprecationWarning (see _moved).
_moved.install()

from .specs import InputSpec  # noqa: E402
from .capture import CaptureReport, WidthCapture  # noqa: E402
from .digest import StateDigest  # noqa: E402
from .errors import (  # noqa: E402
    BusyError,
    CapacityError,
    CaptureError,
    CgrtError,
    DeviceRowIndexError,
    InputError,
    StaleCaptureError,
    StaleRowsError,
    StepFunctionError,
)
from .host_rows import HostRows, HostRowsHandle  # noqa: E402
from .pieces import eager, step_values  # noqa: E402
from .runtime import GraphRuntime, RuntimeStats, StepResult  # noqa: E402
from .widths import Slice, default_widths, plan_step  # noqa: E402

__all__ = [
    "GraphRuntime",
    "InputSpec",
    "HostRows",
    "HostRowsHandle",
    "eager",
    "step_values",
    "StepResult",
    "RuntimeStats",
    "StateDigest",
    "CaptureReport",
    "WidthCapture",
    "Slice",
    "plan_step",
    "default_widths",
    "BusyError",
    "StaleCaptureError",
    "CapacityError",
    "CaptureError",
    "CgrtError",
    "DeviceRowIndexError",
    "InputError",
    "StaleRowsError",
    "StepFunctionError",
]
__version__ = "0.1.0"
