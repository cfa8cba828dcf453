"""Shared test helpers, imported one way: ``from tests.support.<module> import ...``.

``models_for_tests`` (the SlotModel family), ``reliability_harness`` (the Rig of the
reliability tests), ``ring_hooks`` (the host-row ring's private state), ``seeds``,
``planting``, ``feed_rows`` (the staging and echo inputs), ``cli_tables`` (the README's
option tables), ``compile_stand_ins``; the ``compile_*`` scripts here run as child
processes (``SUPPORT / "compile_x.py"``, ``PYTHONPATH=ROOT``).
"""
import os
import subprocess
import sys
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]  # the repository root


def run_compiled(*args: str) -> subprocess.CompletedProcess:
    """``python args...`` in a child whose Triton compiles kernels for real (no
    ``TRITON_INTERPRET``), with this checkout on its path; its output as text."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)


def run_compile_script(name: str) -> subprocess.CompletedProcess:
    """``SUPPORT / name`` through :func:`run_compiled`."""
    return run_compiled(str(SUPPORT / name))
