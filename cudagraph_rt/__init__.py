"""cudagraph_rt: capture a step function once per padded width, replay it for any width.

See README.md for the two-minute tour and ARCHITECTURE.md (both at the repository root) for
the layout, one step's data path and the glossary.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from . import _lazy, _source_tree

# kernels/ and tools/ are top-level folders of the repository that install as
# cudagraph_rt.kernels and cudagraph_rt.tools; from a source tree (PYTHONPATH=.) the
# finder maps those two names, and only those (see _source_tree).
_source_tree.install(__path__[0])  # type: ignore[name-defined]

from . import _moved  # noqa: E402

# The modules that moved into the wings (debug/, spec/) stay importable at their old paths
# for one release, with a DeprecationWarning (see _moved).
_moved.install()

__all__ = [
    "GraphRuntime",
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
