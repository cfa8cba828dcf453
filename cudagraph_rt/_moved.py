"""The module paths that moved into the wings (issue 25), importable at the old path for one
more release (removed in 0.2): ``import cudagraph_rt.runner`` gives the module
``cudagraph_rt.spec.runner`` itself, so every name (private ones included) and every
monkeypatch is the same object either way, and warns once (DeprecationWarning) naming
the new path.

A finder on ``sys.meta_path`` rather than a re-export file at each old path: no file at
the old paths means the move is a plain rename in git, so edits made elsewhere to the old
files follow them into the wings at merge.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED = {
    "cudagraph_rt.hazards": "cudagraph_rt.debug.hazards",
    "cudagraph_rt.graph_nodes": "cudagraph_rt.debug.graph_nodes",
    "cudagraph_rt.inspect": "cudagraph_rt.debug.inspect",
    "cudagraph_rt.runner": "cudagraph_rt.spec.runner",
    "cudagraph_rt.drafting": "cudagraph_rt.spec.drafting",
    "cudagraph_rt.device_drafter": "cudagraph_rt.spec.device_drafter",
    "cudagraph_rt.run_timing": "cudagraph_rt.spec.run_timing",
}
REMOVED_IN = "0.2"


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path (imported if it is not yet)."""

    def __init__(self, new: str):
        self.new = new
        self._spec = None

    def create_module(self, spec):
        warnings.warn(f"{spec.name} moved to {self.new}; the old path goes in cudagraph_rt {REMOVED_IN}",
                      DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system stamped the old path's spec on the module: give it its own back
        # (the module is already executed; nothing else to run).
        module.__spec__ = self._spec


class MovedFinder(importlib.abc.MetaPathFinder):
    """Answers the old paths in MOVED and nothing else (``find_spec`` returns None)."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        return None if new is None else importlib.util.spec_from_loader(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        # First: another cudagraph_rt's editable finder (an older checkout, where the old
        # files still exist) must not answer these names for this package.
        sys.meta_path.insert(0, MovedFinder())
