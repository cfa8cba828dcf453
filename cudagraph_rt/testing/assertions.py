"""``assert_sweep``: the width sweep as one assertion inside a user's own pytest suite.

Reads ``CGRT_SWEEP_SEED``, ``CGRT_SWEEP_ONLY_STEP`` and ``CGRT_SWEEP_GRAPHS`` from the
environment (when the caller did not pass them), prints the seed first (pytest shows it
with a failure), and on failure raises AssertionError with the summary and a one-line
command that replays the failing step of the same test.
"""
from __future__ import annotations

import os
import shlex
from typing import Any

from ..errors import InputError, expected
from .harness import run_sweep
from .report import SweepReport, mode_flag


def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise InputError(expected(name, "an int", repr(v))) from None


def _pytest_repro(seed: int, step: int | None, graphs: bool | str | None) -> str:
    env = [f"CGRT_SWEEP_SEED={seed}"]
    env += [f"CGRT_SWEEP_ONLY_STEP={step}"] if step is not None else []
    env += [f"CGRT_SWEEP_GRAPHS={mode_flag(graphs)}"] if graphs is not None else []
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    return " ".join(env) + " python -m pytest " + (shlex.quote(test) if test else "<this test>")


def assert_sweep(adapter: Any, **options: Any) -> SweepReport:
    """``run_sweep(adapter, **options)``; AssertionError (summary + reproduction) on any
    mismatch, else the report. Options as for ``run_sweep``."""
    env = {"seed": _env_int("CGRT_SWEEP_SEED"), "only_step": _env_int("CGRT_SWEEP_ONLY_STEP"),
           "graphs": os.environ.get("CGRT_SWEEP_GRAPHS") or None}
    for k, v in env.items():
        if options.get(k) is None and v is not None:
            options[k] = v
    options.setdefault("repro", _pytest_repro)
    options.setdefault("log", print)
    report = run_sweep(adapter, **options)
    if not report.ok:
        raise AssertionError(report.summary())
    return report
