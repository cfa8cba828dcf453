"""The optional extras and the one message for a missing one.

Only torch, numpy and rich are installed with the package. The code that needs more
imports it through :func:`require`, where it is used, so a missing piece is an
ImportError that names the extra and a command that works from any folder (the installed
package's metadata supplies the extra; an editable install too).
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

# extra -> (module imported, distribution that brings it); pyproject.toml lists the same.
EXTRAS = {
    "hf": ("transformers", "transformers"),
    "plot": ("matplotlib", "matplotlib"),
    "gpu": ("cuda.bindings", "cuda-python"),
    "bench": ("flashinfer", "flashinfer-python"),
}


class MissingExtraError(ImportError):
    """An optional dependency is not installed; the message names its extra."""


def hint(extra: str) -> str:
    """``pip install "cudagraph_rt[EXTRA]"``: installs only what the extra adds to an
    installed cudagraph_rt (wheel or editable)."""
    return f'pip install "cudagraph_rt[{extra}]"'


def message(extra: str, what: str) -> str:
    module, dist = EXTRAS[extra]
    return f"{what} needs {dist} (the [{extra}] extra): {hint(extra)}"


def require(extra: str, what: str) -> ModuleType:
    """Import the extra's module; MissingExtraError naming ``what`` needs it otherwise."""
    module = EXTRAS[extra][0]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(message(extra, what)) from e


def available(extra: str) -> bool:
    """Whether the extra's module can be imported (without importing it)."""
    module = EXTRAS[extra][0]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing (cuda for cuda.bindings)
        return False
