"""``cudagraph_rt.kernels`` and ``cudagraph_rt.tools`` when the package runs from a source tree.

The repository keeps ``kernels/`` and ``tools/`` at its top level; an installed wheel has
them inside the package (setup.py ``package_dir``) and an editable install maps them with
setuptools' own finder. Run from the tree with ``PYTHONPATH=.`` (the GPU machine, which can
install nothing), neither exists, so this finder maps exactly those two names to those two
folders. Nothing else at the repository root becomes importable through the package: the
package's ``__path__`` stays its own folder.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

MAPPED = {"cudagraph_rt.kernels": "kernels", "cudagraph_rt.tools": "tools"}


class SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds the two mapped packages under ``root``; every other name is left to the
    other finders (``find_spec`` returns None)."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        folder = MAPPED.get(fullname)
        if folder is None:
            return None
        where = os.path.join(self.root, folder)
        init = os.path.join(where, "__init__.py")
        if not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[where])


def install(package_dir: str) -> None:
    """Add the finder when ``package_dir`` (the package's own folder) sits in a source tree:
    the mapped folders are its siblings and not inside it (an installed wheel)."""
    root = os.path.dirname(package_dir)
    if os.path.isdir(os.path.join(package_dir, "kernels")):
        return
    if not all(os.path.isfile(os.path.join(root, f, "__init__.py")) for f in MAPPED.values()):
        return
    if not any(isinstance(f, SourceTreeFinder) for f in sys.meta_path):
        # First: an editable install of another checkout (its setuptools finder is on
        # sys.meta_path too) must not answer for this tree's kernels and tools.
        sys.meta_path.insert(0, SourceTreeFinder(root))
