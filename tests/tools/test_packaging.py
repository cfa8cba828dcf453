"""The package as it is imported two ways: from a built wheel and from an editable install
(how the tree runs everywhere, the GPU machine included). Each way, ``cudagraph_rt.kernels``
and ``cudagraph_rt.tools`` resolve to the repository's ``kernels/`` and ``tools/`` (or their
installed copies) through setup.py's ``package_dir`` alone, and nothing else at the
repository root is importable through the package (``cudagraph_rt.tests``,
``cudagraph_rt.setup``, ...); importing the package adds no finder to ``sys.meta_path``.
Every import runs in a fresh interpreter outside the checkout, so this test session's own
imports prove nothing here.

Also: the wheel's contents and metadata (py.typed, the license, dependencies by need:
triton, cuda-python and matplotlib only behind extras), and the extras' message.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import ROOT

MAPPED = {"kernels": "common", "tools": "options"}  # folder -> a module inside it

# Run in the child: which file each mapped name comes from, and how every other name at
# the repository root fares as cudagraph_rt.<name>.
PROBE = r"""
import importlib, json, sys
names = json.loads(sys.argv[1])
import cudagraph_rt
out = {"package": list(cudagraph_rt.__path__), "files": {}, "others": {}}
for folder, mod in json.loads(sys.argv[2]).items():
    for name in (f"cudagraph_rt.{folder}", f"cudagraph_rt.{folder}.{mod}"):
        out["files"][name] = importlib.import_module(name).__file__
for name in names:
    try:
        importlib.import_module(f"cudagraph_rt.{name}")
        out["others"][name] = "imported"
    except ModuleNotFoundError as e:
        out["others"][name] = "ModuleNotFoundError" if e.name == f"cudagraph_rt.{name}" else f"wrong: {e}"
print(json.dumps(out))
"""


def _root_names() -> list[str]:
    """Every entry at the repository root that could name a module, besides the package and
    the two mapped folders: tests, setup, the .ci folder's name without its dot, ..."""
    names = set()
    for p in ROOT.iterdir():
        stem = p.name.lstrip(".").removesuffix(".py")
        if stem.isidentifier() and stem not in ("cudagraph_rt", *MAPPED):
            names.add(stem)
    assert {"tests", "setup"} <= names
    return sorted(names)


def _probe(tmp_path: Path, env: dict, prelude: str = "") -> dict:
    proc = subprocess.run([sys.executable, "-c", prelude + PROBE, json.dumps(_root_names()), json.dumps(MAPPED)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _clean_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, **extra}


def _assert_layout(found: dict, package: Path, mapped_root: Path) -> None:
    assert [Path(p).resolve() for p in found["package"]] == [package.resolve()], found["package"]
    for folder, mod in MAPPED.items():
        where = mapped_root / folder
        assert Path(found["files"][f"cudagraph_rt.{folder}"]).resolve() == (where / "__init__.py").resolve()
        assert Path(found["files"][f"cudagraph_rt.{folder}.{mod}"]).resolve() == (where / f"{mod}.py").resolve()
    leaked = {n: how for n, how in found["others"].items() if how != "ModuleNotFoundError"}
    assert not leaked, f"importable through the package: {leaked}"


# Run in the child: sys.meta_path before and after the package, its public names, the
# kernels and the tools are imported.
META_PROBE = r"""
import importlib, json, sys
before = [repr(f) for f in sys.meta_path]
import cudagraph_rt
cudagraph_rt.GraphRuntime, cudagraph_rt.InputSpec
for name in ("cudagraph_rt.kernels.common", "cudagraph_rt.tools.options", "cudagraph_rt.debug.inspect"):
    importlib.import_module(name)
print(json.dumps({"before": before, "after": [repr(f) for f in sys.meta_path],
                  "kernels": cudagraph_rt.kernels.__file__}))
"""


def test_importing_the_package_adds_no_finder_to_sys_meta_path(tmp_path):
    """kernels/ and tools/ import through the packaging's mapping (here the editable install
    this session runs), not through a finder the package installs on import."""
    proc = subprocess.run([sys.executable, "-c", META_PROBE], cwd=tmp_path, env=_clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["after"] == found["before"], found
    assert Path(found["kernels"]).name == "__init__.py"
    assert not list((ROOT / "cudagraph_rt").glob("_source_tree.py")) + list((ROOT / "cudagraph_rt").glob("_moved.py"))


def _copy_tree(dst: Path) -> Path:
    """The checkout's files (no build outputs), so builds never write into it."""
    skip = shutil.ignore_patterns(".git", "__pycache__", "*.egg-info", "build", "dist", ".hypothesis", "out",
                                  ".pytest_cache")
    shutil.copytree(ROOT, dst, ignore=skip)
    return dst


def _build(src: Path, hook: str, out: Path) -> Path:
    """setuptools' PEP 517 hook ``hook`` (build_wheel / build_editable) run in ``src``."""
    out.mkdir()
    code = f"from setuptools import build_meta as b; print(b.{hook}({str(out)!r}))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return out / proc.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    return _build(_copy_tree(tmp / "src"), "build_wheel", tmp / "dist")


def test_wheel_holds_the_package_only_and_resolves_inside_itself(wheel, tmp_path):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"cudagraph_rt", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, tops
    for must in ("cudagraph_rt/py.typed", "cudagraph_rt/kernels/attention/kernel.py",
                 "cudagraph_rt/tools/sweep/__init__.py",
                 "cudagraph_rt/models/toy.py", "cudagraph_rt/debug/inspect.py", "cudagraph_rt/speculative/runner.py",
                 "cudagraph_rt/tools/bench/compile_child.py", "cudagraph_rt/tools/demo/serve.py"):
        assert must in names, must
    # every module of the tree, at its installed path (a subpackage setup.py misses is caught here)
    tree = {f"cudagraph_rt/{p.relative_to(ROOT / 'cudagraph_rt').as_posix()}" for p in (ROOT / "cudagraph_rt").rglob("*.py")}
    tree |= {f"cudagraph_rt/{p.relative_to(ROOT).as_posix()}" for d in MAPPED for p in (ROOT / d).rglob("*.py")}
    missing = sorted(n for n in tree if "__pycache__" not in n and n not in names)
    assert not missing, f"the wheel misses {missing}"
    assert not [n for n in names if "/tests/" in n or n.endswith("conftest.py")]
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    _assert_layout(_probe(tmp_path, _clean_env(PYTHONPATH=str(site))), site / "cudagraph_rt", site / "cudagraph_rt")


def test_wheel_metadata_needs_only_torch_numpy_rich(wheel):
    meta = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    requires = re.findall(r"^Requires-Dist: (.+)$", text, re.M)
    plain = sorted(re.split(r"[<>=;\[ ]", r)[0].lower() for r in requires if "extra ==" not in r)
    assert plain == ["numpy", "rich", "torch"], requires
    extras = set(re.findall(r"^Provides-Extra: (.+)$", text, re.M))
    assert {"gpu", "plot", "hf", "test", "dev"} <= extras
    by_extra = {e: [r for r in requires if f'extra == "{e}"' in r] for e in extras}
    assert any(r.startswith("cuda-python") for r in by_extra["gpu"])
    assert any(r.startswith("matplotlib") for r in by_extra["plot"])
    assert any(r.startswith("transformers") for r in by_extra["hf"])
    assert any(r.startswith("triton") for r in by_extra["dev"])
    assert re.search(r"^License-Expression: MIT$", text, re.M) or re.search(r"^License: MIT", text, re.M), text[:800]
    assert any(n.endswith("LICENSE") for n in zipfile.ZipFile(wheel).namelist())


def test_editable_install_maps_the_same_folders(tmp_path):
    src = _copy_tree(tmp_path / "src")
    editable = _build(src, "build_editable", tmp_path / "dist")
    site = tmp_path / "site"
    zipfile.ZipFile(editable).extractall(site)
    # This machine may hold another cudagraph_rt (a checkout's path in a .pth, a wheel in
    # site-packages, setuptools' finder of the same module name): the finder under test
    # goes first, as it would be the only one in a fresh venv.
    prelude = f"""
import os, sys
for name in [m for m in sys.modules if m.startswith("__editable___cudagraph_rt")]:
    del sys.modules[name]
sys.path.insert(0, {str(site)!r})  # first: its finder module shadows one of the same name
for pth in [p for p in os.listdir({str(site)!r}) if p.endswith(".pth")]:
    for line in open(os.path.join({str(site)!r}, pth)):
        if line.startswith("import"):
            exec(line)
mine = [f for f in sys.meta_path if getattr(f, "__module__", "").startswith("__editable___cudagraph_rt")][-1]
sys.meta_path.remove(mine)
sys.meta_path.insert(0, mine)
"""
    _assert_layout(_probe(tmp_path, _clean_env(), prelude), src / "cudagraph_rt", src)


def test_extras_message_names_the_extra_and_a_command_that_works_anywhere(monkeypatch):
    from cudagraph_rt import extras

    pyproject = (ROOT / "pyproject.toml").read_text()
    for extra, (module, dist) in extras.EXTRAS.items():
        assert re.search(rf'^{extra} = \[.*"{re.escape(dist)}', pyproject, re.M), (extra, dist)
        msg = extras.message(extra, "this feature")
        assert f'pip install "cudagraph_rt[{extra}]"' in msg and dist in msg and "-e" not in msg.split()
    monkeypatch.setitem(extras.EXTRAS, "nothing", ("no_such_module_xyz", "nothing-dist"))
    assert not extras.available("nothing")
    with pytest.raises(extras.MissingExtraError, match=r'x needs nothing-dist \(the \[nothing\] extra\): '
                                                        r'pip install "cudagraph_rt\[nothing\]"'):
        extras.require("nothing", "x")
    assert extras.available("plot") == (importlib.util.find_spec("matplotlib") is not None)
