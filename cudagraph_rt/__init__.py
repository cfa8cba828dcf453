"""cudagraph_rt: capture a step function once per padded width, replay it for any width.

See README.md for the two-minute tour and ARCHITECTURE.md (both at the repository root) for
the layout, one step's data path and the glossary.
"""
from __future__ import annotations

import os as _os

# kernels/ and tools/ are top-level folders of the repository that install as
# cudagraph_rt.kernels and cudagraph_rt.tools (setup.py package_dir). Run from a source
# tree (PYTHONPATH=.), let the package find them in the same place. This stays: the GPU
# machine runs the tree with PYTHONPATH=. and can install nothing (an editable install
# would serve everywhere else).
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(_os.path.dirname(__file__), "kernels")) and _os.path.isfile(
    _os.path.join(_root, "kernels", "__init__.py")
):
    __path__.append(_root)  # type: ignore[name-defined]

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
from .runtime import GraphRuntime, RuntimeStats, StepResult  # noqa: E402
from .widths import Slice, default_widths, plan_step  # noqa: E402

__all__ = [
    "GraphRuntime",
    "InputSpec",
    "HostRows",
    "HostRowsHandle",
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
