"""The package as it is imported three ways: from the source tree (``PYTHONPATH=.``, as on
the GPU machine), from a built wheel and from an editable install. Each way,
``cudagraph_rt.kernels`` and ``cudagraph_rt.tools`` resolve to the repository's
``kernels/`` and ``tools/`` (or their installed copies), and nothing else at the
repository root is importable through the package (``cudagraph_rt.tests``,
``cudagraph_rt.setup``, ...). Every import runs in a fresh interpreter outside the
checkout, so this test session's own imports prove nothing here.

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


def test_source_tree_maps_kernels_and_tools_and_nothing_else(tmp_path):
    found = _probe(tmp_path, _clean_env(PYTHONPATH=str(ROOT)))
    _assert_layout(found, ROOT / "cudagraph_rt", ROOT)


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
                 "cudagraph_rt/models/toy.py", "cudagraph_rt/debug/inspect.py", "cudagraph_rt/spec/runner.py",
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


# Run in the child: each old path of a module that moved into a wing, imported as users
# wrote it, against the module at its new path.
MOVED_PROBE = r"""
import importlib, json, sys, warnings
from cudagraph_rt._moved import MOVED
out = {}
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ns = {}
        exec(f"import {old} as module", ns)  # an import statement, as users write it
        module = ns["module"]
    target = importlib.import_module(new)
    names = [n for n in dir(target) if not n.startswith("__")]
    parent, leaf = old.rsplit(".", 1)
    out[old] = {
        "same_module": module is target and sys.modules[old] is target,
        "attribute": getattr(importlib.import_module(parent), leaf) is target,
        "spec": target.__spec__.name,
        "different": [n for n in names if getattr(module, n) is not getattr(target, n)],
        "from_import": eval(f"__import__({old!r}, fromlist=['x'])") is target,
        "warnings": [(w.category.__name__, str(w.message), w.filename) for w in caught],
        "names": len(names),
    }
print(json.dumps(out))
"""


def test_moved_module_paths_are_the_new_modules_and_warn(tmp_path):
    """The modules that moved into cudagraph_rt.debug and cudagraph_rt.spec still import at
    their old paths for one release: the same module object (so every name, private ones
    and monkeypatches included, is the same), one DeprecationWarning naming the new path,
    attributed to the importing line; and the README lists each as deprecated."""
    from cudagraph_rt._moved import MOVED

    proc = subprocess.run([sys.executable, "-c", MOVED_PROBE], cwd=tmp_path, env=_clean_env(PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = json.loads(proc.stdout.splitlines()[-1])
    assert set(found) == set(MOVED) and len(MOVED) == 7
    for old, new in MOVED.items():
        got = found[old]
        assert got["same_module"] and got["attribute"] and got["from_import"], (old, got)
        assert got["spec"] == new and not got["different"] and got["names"] > 3, (old, got)
        assert [(c, m) for c, m, _ in got["warnings"]] == [
            ("DeprecationWarning", f"{old} moved to {new}; the old path goes in cudagraph_rt 0.2")], (old, got)
        assert got["warnings"][0][2] == "<string>", got["warnings"]  # the importer's line, not importlib's
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), f"{old}: a file at the old path"
    changes = (ROOT / "CHANGELOG.md").read_text()
    deprecated = changes[changes.index("- Deprecated"):].split("\n- ")[0]  # that item only
    for old, new in MOVED.items():
        assert f"`{old}`" in deprecated and f"`{new}`" in changes, old
