"""Public names of a package loaded on first use (PEP 562), so that importing the package
stays cheap: ``cgrt --help`` and a usage error answer before torch is imported.

A package lists its names in ``__all__`` and imports them in a private module (its
``_api``); its ``__getattr__`` hands a public name and that module to :func:`public` and
any other name to :func:`submodule` (the eager package had imported most of them).
"""
from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


def public(namespace: dict[str, Any], name: str, api: ModuleType) -> Any:
    """The public ``name`` of the package whose globals are ``namespace``: all of its
    public names are bound there at the first one, so later lookups are plain."""
    namespace.update({n: getattr(api, n) for n in namespace["__all__"]})
    return namespace[name]


def submodule(package: str, name: str) -> ModuleType:
    """``package``'s submodule ``name``, imported; AttributeError when there is none."""
    if not name.startswith("__"):
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{package}.{name}":  # the submodule exists; an import inside it failed
                raise
    raise AttributeError(f"module {package!r} has no attribute {name!r}")
