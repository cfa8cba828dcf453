"""Shared test helpers, imported one way: ``from tests.support.<module> import ...``.

``models_for_tests`` (the SlotModel family), ``reliability_harness`` (the Rig of the
reliability tests), ``ring_hooks`` (the host-row ring's private state), ``seeds``,
``planting``, ``feed_rows`` (the staging and echo inputs), ``cli_tables`` (the README's
option tables), ``compile_stand_ins``; the ``compile_*`` scripts here run as child
processes (``SUPPORT / "compile_x.py"``, ``PYTHONPATH=ROOT``).
"""
from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
ROOT = SUPPORT.parents[1]  # the repository root
