"""The ways in that the docs, CI and the tools themselves name stay true as the tree moves:
every ``cudagraph_rt.tools...`` module they name (``python -m ...``, ``MODULE:FACTORY``)
resolves, one run with ``-m`` has a ``__main__`` block, and every repository file a CI
script or BENCHMARKS.md names exists (README.md, ARCHITECTURE.md and docs/: tests/tools/test_readme.py).
"""
from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

from tests.support import ROOT

DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / ".ci").iterdir())]
TOOLS = sorted((ROOT / "tools").rglob("*.py"))
MODULE = re.compile(r"(-m\s+|[\"']-m[\"'],\s*[\"'])?\b(cudagraph_rt\.tools(?:\.\w+)+)(?::(\w+))?")


def _named() -> dict[tuple[str, str | None], tuple[bool, str]]:
    """(module, attribute or None) -> (named after ``-m``, where): from the docs, the CI
    scripts and the tools' own child-process commands."""
    found = {}
    for path in DOCS + TOOLS:
        for m in MODULE.finditer(path.read_text()):
            key = (m.group(2), m.group(3))
            run = bool(m.group(1)) or found.get(key, (False, ""))[0]
            found[key] = (run, found.get(key, (False, str(path.relative_to(ROOT))))[1])
    return found


NAMED = _named()


def test_the_docs_and_tools_name_their_modules():
    assert len(NAMED) >= 6, NAMED  # the finder found the commands (bench's children, profile_replay, ...)
    runs = {mod for (mod, _), (run, _) in NAMED.items() if run}
    assert {"cudagraph_rt.tools.bench.compile_child", "cudagraph_rt.tools.bench.hf_child",
            "cudagraph_rt.tools.bench.profile_replay"} <= runs, runs


@pytest.mark.parametrize("module,attr", sorted(NAMED, key=str), ids=lambda v: str(v))
def test_a_named_module_resolves_and_runs_with_dash_m(module, attr):
    run, where = NAMED[(module, attr)]
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"{where} names {module}, which does not exist"
    if attr:
        assert hasattr(importlib.import_module(module), attr), f"{where} names {module}:{attr}"
    if run:
        tree = ast.parse(pathlib.Path(spec.origin).read_text())
        mains = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert mains, f"{where} runs python -m {module}, which has no __main__ block"


def test_the_hf_bench_child_is_the_module_its_command_names():
    """``bench.hf``'s child command (a literal) runs: without its arguments it prints its
    usage and exits 2 (a wrong path would be "No module named ...", exit 1)."""
    proc = subprocess.run([sys.executable, "-m", "cudagraph_rt.tools.bench.hf_child"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "usage: python -m cudagraph_rt.tools.bench.hf_child" in proc.stderr, proc.stderr


@pytest.mark.parametrize("doc", [p for p in DOCS if p.name not in ("README.md", "ARCHITECTURE.md") and p.parent.name != "docs"],
                         ids=lambda p: p.name)
def test_files_a_ci_script_or_benchmarks_names_exist(doc):
    refs = set(re.findall(r"\b((?:tests|tools|kernels|cudagraph_rt|\.ci)/[\w/]+\.(?:py|sh))\b", doc.read_text()))
    missing = sorted(r for r in refs if not (ROOT / r).is_file())
    assert not missing, f"{doc.relative_to(ROOT)} names {missing}"
