"""Every code block of README.md and of the pages under docs/, as a reader would use it.

* Each ```python block runs as written in a fresh interpreter (this machine's device: on a
  CPU the blocks run graphs off), then any ``test_*`` function it defines is called, so
  the "from pytest" example really sweeps. Blocks that import an optional extra
  (transformers) are skipped only when that extra is not installed.
* Each ``cgrt ...`` / ``python3 -m cudagraph_rt ...`` command in a ```bash block is parsed
  by the real ``cgrt`` parser: a renamed flag or a deleted tool fails here. Running them is
  the job of the tool tests (test_sweep, test_demo, test_tp, ...) and of CI.
* The Quick start's commands are the ones ``.ci/run`` runs, so CI tries what a new user
  types; on the ``test`` install alone, what needs an extra skips naming it.
* ARCHITECTURE.md's layout names every module of the package; the files README.md,
  ARCHITECTURE.md and docs/*.md point at exist, and so do the targets of their links; the
  README links every page of docs/.

A block's failure names its file and first line (``docs/models.md, line 40``) and shows its
output.
"""
from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

import pytest

from cudagraph_rt.cli import build_parser
from tests.support import ROOT
from tests.support.extras import EXTRA_OF, available, reason

README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))  # the pages the README's front page points to
DOCS = [README, *PAGES]  # every file whose blocks run here
CI = ROOT / ".ci" / "run"

# Runs one block: compiled under its doc's line so a traceback points there, then every
# test_* function it defined, in order.
RUNNER = """
import sys
label, path = sys.argv[1], sys.argv[2]
ns = {"__name__": "__main__"}
exec(compile(open(path).read(), label, "exec"), ns)
for name, fn in list(ns.items()):
    if name.startswith("test_") and callable(fn):
        print(f"calling {name}()", flush=True)
        fn()
"""


@dataclass(frozen=True)
class Block:
    lang: str
    line: int  # first line of the code, 1-based
    section: str  # the "## ..." or "### ..." heading it sits under
    code: str
    doc: str = "README.md"  # the file, relative to the repository root

    @property
    def label(self) -> str:
        return f"{self.doc}, line {self.line}"


def blocks(text: str, doc: str = "README.md") -> list[Block]:
    """The fenced blocks of ``text`` in order (an unclosed fence is an error, not a skip)."""
    out, section, fence = [], "", None
    for i, line in enumerate(text.splitlines(), 1):
        if fence is None:
            m = re.match(r"^###? (.*)$", line)
            if m:
                section = m.group(1).strip()
            m = re.match(r"^```(\w*)\s*$", line)
            if m:
                fence, lang, start, body = True, m.group(1), i + 1, []
        elif line.rstrip() == "```":
            out.append(Block(lang, start, section, "\n".join(body) + "\n", doc))
            fence = None
        else:
            body.append(line)
    assert fence is None, f"{doc}: the block opened at line {start - 1} is never closed"
    return out


ALL = [b for path in DOCS for b in blocks(path.read_text(), str(path.relative_to(ROOT)))]
PYTHON = [b for b in ALL if b.lang == "python"]
BASH = [b for b in ALL if b.lang == "bash"]


def _id(b: Block) -> str:
    return f"{pathlib.PurePath(b.doc).stem}-line{b.line}"


def commands(block: Block) -> list[list[str]]:
    """Each command of a bash block as argv: comments dropped, ``&&`` / ``;`` split."""
    out = []
    for line in block.code.splitlines():
        words = shlex.split(line, comments=True)
        cmd: list[str] = []
        for w in words + ["&&"]:
            if w in ("&&", ";", "||"):
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


def cgrt_argv(cmd: list[str]) -> list[str] | None:
    """The arguments after ``cgrt`` or ``-m cudagraph_rt`` (under torchrun too), else None."""
    if cmd[0] == "cgrt":
        return cmd[1:]
    for i in range(len(cmd) - 1):
        if cmd[i] == "-m" and cmd[i + 1] == "cudagraph_rt":
            return cmd[i + 2:]
    return None


def test_the_readme_has_the_blocks_these_tests_run():
    """The parser below found what the README and docs/ hold (a changed fence style would
    otherwise make every other test here vacuous): the front page's two examples, the pages'
    examples, and commands in both."""
    front = {b.section for b in PYTHON if b.doc == "README.md"}
    assert {"The API in one screen", "`cgrt sweep`, and sweeping your own model from pytest"} <= front, front
    pages = {(b.doc, b.section) for b in PYTHON if b.doc != "README.md"}
    assert {("docs/speculative.md", "Embedding in a host runner"), ("docs/models.md", "The paged KV pool"),
            ("docs/models.md", "Your own transformers model"), ("docs/pieces.md", "Marking a call")} <= pages, pages
    assert len(PAGES) >= 8, PAGES
    for doc in ("README.md", "docs/tensor-parallel.md"):
        assert any(cgrt_argv(c) for b in BASH if b.doc == doc for c in commands(b)), doc


@pytest.mark.parametrize("block", PYTHON, ids=[_id(b) for b in PYTHON])
def test_python_block_runs_as_written(block: Block, tmp_path):
    for mod in EXTRA_OF:
        if re.search(rf"^\s*(from|import) {re.escape(mod)}\b", block.code, re.M) and not available(mod):
            pytest.skip(f"{block.label} {reason(mod)}")
    src = tmp_path / "block.py"
    src.write_text(block.code)
    # One intra-op thread: the blocks' tiny CPU ops only lose time to torch's threads on a
    # small shared box (the adapter block's sweep: 3 s instead of 30; see conftest.one_thread).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    # A fresh interpreter in an empty folder: no state from this test session, no file of
    # the checkout found by accident; the package comes from this checkout.
    proc = subprocess.run([sys.executable, "-c", RUNNER, block.label, str(src)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"{block.label} ({block.section}) failed, exit {proc.returncode}:\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


@pytest.mark.parametrize("block", BASH, ids=[_id(b) for b in BASH])
def test_cgrt_commands_parse(block: Block):
    parser = build_parser()
    for cmd in commands(block):
        argv = cgrt_argv(cmd)
        if argv is None:
            continue
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # argparse prints why on stderr
            pytest.fail(f"{block.label}: `{shlex.join(cmd)}` does not parse (exit {e.code})")
        assert getattr(args, "_module", None), f"{block.label}: `{shlex.join(cmd)}`: no such tool " \
                                               f"({getattr(args, '_unavailable', 'no subcommand')})"


def test_architecture_layout_names_every_module():
    """ARCHITECTURE.md's layout stays true: every module of the package and of tools/
    (models/ and sweep/ are described as a whole) is named there, and every file it
    names exists."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    layout = next(b.code for b in blocks(text) if b.section == "Layout")
    named = set(re.findall(r"[\w]+\.py|[\w]+/", layout))
    missing = []
    for pkg in (ROOT / "cudagraph_rt", ROOT / "tools"):
        for path in sorted(pkg.rglob("*.py")):
            rel = path.relative_to(pkg)
            if rel.parts[0] in ("models", "sweep") or path.name.startswith("__") or "__pycache__" in rel.parts:
                continue
            if path.name not in named or (len(rel.parts) > 1 and f"{rel.parts[0]}/" not in named):
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"ARCHITECTURE.md's layout does not name {missing}"
    files = {"setup.py"} | {p.name for d in ("cudagraph_rt", "kernels", "tools", "tests") for p in (ROOT / d).rglob("*.py")}
    assert not {n for n in named if n.endswith(".py")} - files, "ARCHITECTURE.md names files that do not exist"


LINKED = ["README.md", "ARCHITECTURE.md", *(f"docs/{p.name}" for p in PAGES)]


@pytest.mark.parametrize("doc", LINKED)
def test_files_the_docs_point_at_exist(doc):
    """Every repository file the doc names (``tests/test_x.py``, ``cudagraph_rt/speculative/runner.py``)
    exists, a ``::Name`` after it is a class or function defined there, and every relative
    link (``[api.md](api.md)``, ``[CHANGELOG.md](../CHANGELOG.md)``) reaches a file."""
    text = (ROOT / doc).read_text()
    refs = re.findall(r"\b((?:tests|cudagraph_rt|tools|kernels)/[\w/]+\.py)(?:::(\w+))?", text)
    assert refs or doc != "README.md"
    for path, name in refs:
        assert (ROOT / path).is_file(), f"{doc} names {path}, which does not exist"
        if name:
            assert re.search(rf"^\s*(class|def) {name}\b", (ROOT / path).read_text(), re.M), \
                f"{doc} names {path}::{name}, which is not defined there"
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"\w+:", t)]
    for target in links:
        path = (ROOT / doc).parent / target.split("#")[0]
        assert path.exists(), f"{doc} links {target}, which does not exist"


def test_the_readme_links_every_page_of_docs():
    """The front page is the way in: a page no one links is a page no one reads."""
    text = README.read_text()
    assert PAGES, "docs/ holds no page"
    unlinked = [p.name for p in PAGES if f"](docs/{p.name})" not in text]
    assert not unlinked, f"README.md links no {unlinked}"


def _normalised(cmd: list[str]) -> list[str]:
    """``python3 -m pip install -q X`` and ``pip install X`` are the same command."""
    if cmd[:2] in (["python3", "-m"], ["python", "-m"]) and cmd[2:3] == ["pip"]:
        cmd = cmd[2:]
    return [w for w in cmd if not (cmd[0] == "pip" and w == "-q")]


def test_quick_start_is_what_ci_runs():
    """CI installs and runs what the Quick start tells a new user to (the CPU torch line
    aside: CI keeps a CPU torch on disk)."""
    quick = [c for b in BASH if b.section == "Quick start" for c in commands(b)]
    ci = [_normalised(shlex.split(ln, comments=True)) for ln in CI.read_text().splitlines()]
    ci = [c for c in ci if c]
    assert quick, "the Quick start has no bash block"
    for cmd in quick:
        if "torch" in cmd and "--index-url" in cmd:
            continue  # the CPU-only machine's first step
        assert _normalised(cmd) in ci, f"Quick start runs `{shlex.join(cmd)}`, .ci/run does not"


# The test files whose tests need an extra: the Triton kernels (triton), the transformers
# models (transformers) and the benches of both. CI runs the whole suite on the `test`
# install alone (.ci/run); this runs these files so, in any environment.
NEED_EXTRAS = ["tests/kernels", "tests/tools/test_bench_attention.py", "tests/tools/test_bench_projections.py",
               "tests/tools/test_bench_pieces.py", "tests/models/test_hf.py", "tests/models/test_small_m.py",
               "tests/models/test_fused.py", "tests/models/test_hf_rotary.py"]


def test_the_test_install_skips_what_needs_an_extra_and_names_it():
    """The Quick start's `pip install -e ".[test]"` then `python3 -m pytest -q`: with the
    extras' modules made unimportable (tests/support/without_extras.py, as on that install),
    the tests that need one skip, every such skip names the extra that brings it, and none
    fails (13 did: the kernels' tests and benches ran without triton or transformers)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "tests.support.without_extras",
                           "-p", "no:cacheprovider", *NEED_EXTRAS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    reasons = re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", proc.stdout, re.M)
    missing = [r for r in reasons if any(m in r for m in EXTRA_OF) and "extra" not in r]
    assert not missing, f"skips that name no extra: {missing}"
    named = {m for m in EXTRA_OF if any(reason(m) in r for r in reasons)}
    assert {"triton", "transformers"} <= named, reasons  # the run did hide them
