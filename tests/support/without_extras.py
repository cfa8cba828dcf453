"""A pytest plugin, ``-p tests.support.without_extras``: the optional modules of the extras
(triton, transformers, matplotlib, cuda.bindings) become unimportable for the session, as
on the README's ``test``-only install, so a test run in a ``dev`` environment shows what
a new user's run shows. ``CGRT_WITHOUT=triton,transformers`` hides those alone.

``sys.modules[name] = None`` is the import system's own "not there": ``import name`` raises
ModuleNotFoundError and ``importlib.util.find_spec(name)`` returns None. It must run before
anything imports them (torch asks whether triton exists when it loads): a ``-p`` plugin
loads before the conftest files.
"""
import os
import sys

HIDDEN = ("triton", "transformers", "matplotlib", "cuda.bindings")

for name in filter(None, os.environ.get("CGRT_WITHOUT", ",".join(HIDDEN)).split(",")):
    if name in sys.modules and sys.modules[name] is not None:
        raise RuntimeError(f"without_extras: {name} was imported before the plugin loaded")
    sys.modules[name] = None
