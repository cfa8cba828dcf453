"""cudagraph_rt: capture a step function once per padded width, replay it for any width.

See README.md for the two-minute tour and ARCHITECTURE.md (both at the repository root) for
the layout, one step's data path and the glossary.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

# kernels/ and tools/ are top-level folders of the repository that install as
# cudagraph_rt.kernels and cudagraph_rt.tools: setup.py's package_dir maps them, in a wheel
# and in an editable install alike (run the tree installed: pip install -e .).
from . import _lazy

__all__ = [
    "GraphRuntime",
    "Graphs",
    "InputSpec",
    "HostRows",
    "HostRowsHandle",
    "eager",
    "step_values",
    "StepResult",
    "SamplingParams",
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



def __getattr__(name: str):
    # Importing the package imports no torch (``cgrt --help`` and usage errors answer
    # before torch loads): the public names load together on first use, from _api.
    if name not in __all__:
        return _lazy.submodule(__name__, name)
    from . import _api

    return _lazy.public(globals(), name, _api)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from ._api import *  # noqa: F403 - what type checkers see: the names __getattr__ loads
