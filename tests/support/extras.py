"""Skips for a missing optional dependency that name the extra bringing it: the README's
promise that, on the ``test``-only install, the tests needing an extra skip and say which.

The module of each extra is cudagraph_rt.extras' own (transformers: ``hf``, matplotlib:
``plot``, cuda.bindings: ``gpu``); triton has no extra of its own (the CUDA builds of
torch bring it; ``dev`` brings it for the CPU, where the kernels run in its interpreter),
nor has pyflakes (``dev``: the structure tests read the code with it).

``needs(module)`` is a skipif mark, ``require(module)`` imports the module or skips the
calling test (``pytest.importorskip`` with the extra named), ``needs_kernel`` marks a test
that runs a Triton kernel (on a CPU: in the interpreter).
"""
from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import pytest

from cudagraph_rt.extras import EXTRAS

EXTRA_OF = {module: extra for extra, (module, _dist) in EXTRAS.items()} | {"triton": "dev", "pyflakes": "dev"}


def available(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing (cuda for cuda.bindings)
        return False


def reason(module: str) -> str:
    """Why a test skips without ``module``: the module and the extra that brings it."""
    extra = EXTRA_OF[module]
    return f'needs {module}, which is not installed (the [{extra}] extra: pip install -e ".[{extra}]")'


def needs(module: str) -> pytest.MarkDecorator:
    """Skip the test (or module, as ``pytestmark``) when ``module`` is not installed."""
    return pytest.mark.skipif(not available(module), reason=reason(module))


def require(module: str) -> ModuleType:
    """``module``, imported; the calling test (or module) skips, naming the extra, when it
    is not installed."""
    if not available(module):
        pytest.skip(reason(module), allow_module_level=True)
    return importlib.import_module(module)


needs_kernel = needs("triton")  # the Triton kernels: compiled on a GPU, interpreted on a CPU


def kernel_skip(condition: bool, why: str) -> pytest.MarkDecorator:
    """``skipif(condition, why)`` for a test of a Triton kernel mode (the interpreter, the
    compiled kernel): when triton is missing, the reason names its extra instead."""
    return pytest.mark.skipif(condition, reason=why if available("triton") else reason("triton"))
