"""Run the mutation campaign: plant each mutation of ``catalogue.py`` in a scratch copy of
the tree and run the CPU suite against it; a mutation the suite lets through ESCAPED.

    python3 tests/mutations/run.py --list
    python3 tests/mutations/run.py                    # every mutation (hours on a small CPU box)
    python3 tests/mutations/run.py --only 3,10-12     # some of them
    python3 tests/mutations/run.py --subset-only      # the concept's own tests only (quick, not a verdict)
    python3 tests/mutations/run.py --json out.json    # the results as JSON too

Per mutation: a fresh copy of the working tree's files (``git ls-files``: tracked and
untracked-not-ignored; never the working tree itself, never .git) in a temp folder, the
one line replaced, then ``pytest -x -q`` on the entry's own test files; when they all pass,
the whole suite (``-x -q``). Caught: some test failed (the first failing test is recorded);
escaped: everything passed. A run past ``--timeout`` counts as caught by a hang and says so
(CI would time out, which is a weak catch: look at it). Bytecode is not written (a mutated
file of the same size within the same second must never load a stale .pyc).

Not a test module (no ``test_`` name: pytest never collects it) and not run in CI.
Exit status: 0 when nothing escaped, 1 when some mutation escaped, 2 on a bad argument or a
catalogue entry that no longer applies.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from tests.mutations.catalogue import CATALOGUE, Mutation  # noqa: E402

_FAILED = re.compile(r"^(FAILED|ERROR) (\S+)")


def locate(root: Path, m: Mutation) -> Path:
    """The entry's file under ``root``; where it moved (tools/ into subpackages, say), the one
    file of the same name under the same top folder. FileNotFoundError otherwise."""
    p = root / m.file
    if p.exists():
        return p
    top, name = Path(m.file).parts[0], Path(m.file).name
    found = [q for q in (root / top).rglob(name) if "__pycache__" not in q.parts]
    if len(found) == 1:
        return found[0]
    raise FileNotFoundError(f"mutation {m.id}: {m.file} is not in the tree ({len(found)} files named {name})")


def target_line(lines: list[str], m: Mutation) -> int:
    """The index of the line to mutate (original compared with indentation stripped);
    ValueError unless it occurs exactly once (after ``anchor``, when one is given)."""
    stripped = [ln.strip() for ln in lines]
    start = 0
    if m.anchor is not None:
        hits = [i for i, s in enumerate(stripped) if s == m.anchor.strip()]
        if len(hits) != 1:
            raise ValueError(f"mutation {m.id}: anchor found {len(hits)} times in {m.file}")
        start = hits[0] + 1
        hits = [i for i in range(start, len(stripped)) if stripped[i] == m.original.strip()][:1]
    else:
        hits = [i for i, s in enumerate(stripped) if s == m.original.strip()]
    if len(hits) != 1:
        raise ValueError(f"mutation {m.id}: original line found {len(hits)} times in {m.file}: {m.original!r}")
    return hits[0]


def mutate_text(text: str, m: Mutation) -> str:
    """``text`` with the entry's line replaced (the original's indentation kept)."""
    lines = text.split("\n")
    i = target_line(lines, m)
    indent = lines[i][:len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = indent + m.mutated.strip()
    return "\n".join(lines)


def tree_files(root: Path) -> dict[str, bytes]:
    """The tree's files (tracked, and untracked but not ignored) and their bytes, read once
    when the campaign starts: edits to the working tree while it runs do not leak into it."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True,
                         capture_output=True).stdout.decode()
    return {f: (root / f).read_bytes() for f in out.split("\0") if f and (root / f).is_file()}


def scratch_copy(files: dict[str, bytes], dest: Path) -> None:
    for f, data in files.items():
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        (dest / f).write_bytes(data)


# The scratch copy is not installed: the interpreters run on it (pytest and every child it
# starts, which inherit PYTHONPATH) map cudagraph_rt.kernels and .tools to the scratch's
# folders, ahead of the editable install's finder (which maps them to the checkout's).
SCRATCH_SITECUSTOMIZE = """
import importlib.abc, importlib.util, os, sys

ROOT = {root!r}
MAPPED = {{"cudagraph_rt.kernels": "kernels", "cudagraph_rt.tools": "tools"}}


class ScratchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        folder = MAPPED.get(fullname)
        if folder is None:
            return None
        where = os.path.join(ROOT, folder)
        return importlib.util.spec_from_file_location(fullname, os.path.join(where, "__init__.py"),
                                                      submodule_search_locations=[where])


sys.meta_path.insert(0, ScratchFinder())
"""


def scratch_site(scratch: Path) -> Path:
    """A folder holding the sitecustomize that maps the scratch's kernels/ and tools/."""
    site = Path(tempfile.mkdtemp(prefix=f"{scratch.name}-site-"))
    (site / "sitecustomize.py").write_text(SCRATCH_SITECUSTOMIZE.format(root=str(scratch)))
    return site


def pytest(scratch: Path, args: list[str], timeout: float) -> tuple[str, str | None, float, str]:
    """(outcome, first failing test, seconds, output tail): outcome passed | failed | timeout."""
    site = scratch_site(scratch)
    try:
        return _pytest(scratch, site, args, timeout)
    finally:
        shutil.rmtree(site, ignore_errors=True)


def _pytest(scratch: Path, site: Path, args: list[str], timeout: float) -> tuple[str, str | None, float, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(scratch)]), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-2000:]
        return "timeout", None, time.perf_counter() - t0, tail.decode(errors="replace") if isinstance(tail, bytes) else tail
    dt = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    first = next((mt.group(2) for ln in out.splitlines() if (mt := _FAILED.match(ln))), None)
    if proc.returncode == 0:
        return "passed", None, dt, out[-2000:]
    if proc.returncode == 5:  # no tests collected: a subset that names nothing is no verdict
        return "passed", None, dt, out[-2000:]
    return "failed", first or f"pytest exit {proc.returncode}", dt, out[-2000:]


def run_one(m: Mutation, files: dict[str, bytes], *, subset_only: bool, suite_only: bool, timeout: float,
            keep: bool) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix=f"cgrt-mutant-{m.id}-"))
    res = {"id": m.id, "area": m.area, "file": m.file, "graph_path": m.graph_path, "runs": []}
    try:
        scratch_copy(files, scratch)
        path = locate(scratch, m)
        path.write_text(mutate_text(path.read_text(), m))
        stages = [] if suite_only else [("subset", list(m.tests))]
        if not subset_only:  # (the catalogue's own check would "catch" every planted line)
            stages.append(("suite", ["--ignore=tests/properties/test_mutation_catalogue.py"]))
        res["status"] = "escaped"
        for stage, args in stages:
            outcome, first, dt, tail = pytest(scratch, args, timeout)
            res["runs"].append({"stage": stage, "outcome": outcome, "seconds": round(dt, 1), "first_failure": first})
            if outcome != "passed":
                res["status"] = "caught" if outcome == "failed" else "caught (timeout)"
                res["caught_by"] = first or f"a hang past {timeout:.0f} s"
                res["stage"] = stage
                res["tail"] = tail
                break
        if subset_only and res["status"] == "escaped":
            res["status"] = "escaped the subset"
    finally:
        if keep:
            res["scratch"] = str(scratch)
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return res


def check_applies(files: dict[str, bytes], chosen: list[Mutation]) -> str | None:
    """The first entry that does not apply to the snapshot ``files``, in words; None when all do."""
    snap = Path(tempfile.mkdtemp(prefix="cgrt-mutants-head-"))
    try:
        scratch_copy(files, snap)
        for m in chosen:
            try:
                target_line(locate(snap, m).read_text().split("\n"), m)
            except (ValueError, FileNotFoundError) as e:
                return str(e)
        return None
    finally:
        shutil.rmtree(snap, ignore_errors=True)


def parse_only(text: str) -> list[int]:
    ids: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        ids += list(range(int(a), int(b) + 1)) if b else [int(a)]
    return ids


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--only", help="ids to run, e.g. 3,10-12 (default: all)")
    ap.add_argument("--subset-only", action="store_true", help="run each entry's own test files only")
    ap.add_argument("--suite-only", action="store_true", help="skip the subset, run the whole suite")
    ap.add_argument("--timeout", type=float, default=2400.0, help="seconds per pytest run (default 2400)")
    ap.add_argument("--json", help="write the results as JSON to this file")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies (their paths are printed)")
    a = ap.parse_args(argv)
    by_id = {m.id: m for m in CATALOGUE}
    try:
        ids = parse_only(a.only) if a.only else list(by_id)
        chosen = [by_id[i] for i in ids]
    except (ValueError, KeyError) as e:
        print(f"run.py: --only: expected ids of the catalogue (1..{max(by_id)}), got {a.only!r} ({e})",
              file=sys.stderr)
        return 2
    if a.list:
        for m in chosen:
            print(f"{m.id:3}  {m.area:26} {m.file:36} {'graph ' if m.graph_path else '      '}{m.why}")
        return 0
    files = tree_files(ROOT)
    problem = check_applies(files, chosen)  # every entry must apply before hours are spent
    if problem:
        print(f"run.py: {problem}", file=sys.stderr)
        return 2
    results = []
    t0 = time.perf_counter()
    for m in chosen:
        r = run_one(m, files, subset_only=a.subset_only, suite_only=a.suite_only, timeout=a.timeout, keep=a.keep)
        results.append(r)
        secs = sum(x["seconds"] for x in r["runs"])
        print(f"{m.id:3} {r['status']:17} {m.area:26} {secs:7.0f} s  {r.get('caught_by', '')}"
              + (f"  [{r['scratch']}]" if a.keep else ""), flush=True)
        if a.json:
            Path(a.json).write_text(json.dumps({"results": results, "seconds": time.perf_counter() - t0}, indent=1))
    escaped = [r for r in results if r["status"].startswith("escaped")]
    print(f"{len(results)} mutations: {len(results) - len(escaped)} caught, {len(escaped)} escaped"
          + (f" ({', '.join(str(r['id']) for r in escaped)})" if escaped else "")
          + f"; {time.perf_counter() - t0:.0f} s")
    return 1 if escaped else 0


if __name__ == "__main__":
    sys.exit(main())
