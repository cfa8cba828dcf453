"""Planting a bug in the library for a test: replace one function the way an edit of its
source would, so that every caller sees the mutant.

A plain ``monkeypatch.setattr(module, name, f)`` misses the modules that imported the
function by name (``from .widths import plan_step``): they keep the original, the bug is
not planted, and the test that should catch it proves nothing. ``plant`` patches the
defining module and every loaded ``cudagraph_rt`` module that holds the same object,
and says how many it patched (a test asserts it patched something that runs).
Lifetime: the patches are undone by ``monkeypatch`` at the end of the test.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import pytest


def plant(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str, mutant: Any) -> list[str]:
    """Replace ``module.name`` by ``mutant`` in ``module`` and wherever it was imported
    under ``cudagraph_rt``; returns the names of the modules patched. AttributeError when
    ``module`` has no ``name`` (a renamed function fails the test, never skips it)."""
    original = getattr(module, name)
    patched = []
    for mod_name, mod in list(sys.modules.items()):
        if not (mod_name == "cudagraph_rt" or mod_name.startswith("cudagraph_rt.")) or mod is None:
            continue
        for attr, value in list(vars(mod).items()):
            if value is original:
                monkeypatch.setattr(mod, attr, mutant)
                patched.append(f"{mod_name}.{attr}")
    assert f"{module.__name__}.{name}" in patched, f"{module.__name__}.{name} was not patched"
    return patched


def plan_one_width_wider(monkeypatch: pytest.MonkeyPatch) -> None:
    """``widths.plan_step`` itself pads a one-graph step to the next wider width than the
    narrowest that holds T (planted in the function under test, which the sweep must not
    take its expectations from)."""
    import cudagraph_rt.widths as widths_mod
    from cudagraph_rt import Slice

    original = widths_mod.plan_step

    def mutant(T, widths, limit, slicing=True):
        out = original(T, widths, limit, slicing)
        s = out[-1]
        if s.path == "graph" and s.width != widths[-1]:
            out = out[:-1] + (Slice("graph", widths[widths.index(s.width) + 1], s.start, s.length),)
        return out
    plant(monkeypatch, widths_mod, "plan_step", mutant)


def no_whole_plan_past(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """A tripwire, not a bug: from here on, building the whole plan of a step of more than
    ``rows`` rows (``widths.plan_step``, through any Planner) fails the test at once with
    AssertionError, instead of planning a T whose plan may not fit in memory."""
    import cudagraph_rt.widths as widths_mod

    original = widths_mod.plan_step

    def tripwire(T, *a, **kw):
        if type(T) is int and T > rows:
            raise AssertionError(f"planned a step of {T} rows whole")
        return original(T, *a, **kw)
    plant(monkeypatch, widths_mod, "plan_step", tripwire)
