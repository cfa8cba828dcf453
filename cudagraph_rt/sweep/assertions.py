"""``assert_sweep``: the width sweep as one assertion inside a user's own pytest suite.

Reads ``CGRT_SWEEP_SEED``, ``CGRT_SWEEP_ONLY_STEP`` and ``CGRT_SWEEP_GRAPHS`` from the
environment (when the caller did not pass them), prints the seed first (pytest shows it
with a failure), and on failure raises AssertionError with the summary and a one-line
command that replays the failing step of the same test.

On a CPU it runs on one torch intra-op thread (``CGRT_SWEEP_THREADS=N`` picks another
count) and puts the count back afterwards: a sweep is thousands of tiny steps, which only
lose time to thread hand-offs (on a small shared box 3 to 10 times as long). This entry
point may set it; the library elsewhere never changes process-wide settings.
"""
from __future__ import annotations

import contextlib
import os
import shlex
from typing import Any, Iterator

from ..errors import InputError, expected
from .harness import run_sweep
from .graph_modes import mode_flag
from .report import SweepReport


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
    with _threads(getattr(adapter, "device", None)):  # a malformed adapter: run_sweep says why
        report = run_sweep(adapter, **options)
    if not report.ok:
        raise AssertionError(report.summary())
    return report


@contextlib.contextmanager
def _threads(device: Any) -> Iterator[None]:
    """torch's intra-op threads for the sweep: ``CGRT_SWEEP_THREADS``, else 1 on a CPU
    (unchanged on CUDA), restored afterwards."""
    import torch

    n = _env_int("CGRT_SWEEP_THREADS")
    if n is not None and n < 1:
        raise InputError(expected("CGRT_SWEEP_THREADS", "an int >= 1", repr(n)))
    if n is None and getattr(device, "type", str(device)) == "cpu":
        n = 1
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
