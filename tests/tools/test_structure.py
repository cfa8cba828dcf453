"""The core's shape, kept (issues 14, 25): the runtime used through its public names alone,
short functions, and the host-row
mode read in the host-row code alone. A failure names the file and the line."""
import ast
import pathlib
import re

from tests.support import ROOT
from tests.support.extras import needs

CORE = [p for p in sorted((ROOT / "cudagraph_rt").rglob("*.py"))
        if not {"models", "sweep"} & set(p.relative_to(ROOT / "cudagraph_rt").parts[:-1])]
KERNELS = sorted((ROOT / "kernels").rglob("*.py"))


def test_no_function_in_the_core_or_kernels_is_over_50_lines():
    long = []
    for p in CORE + KERNELS:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 50:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, long


def test_no_kernel_file_is_over_500_lines():
    """A kernel's file holds one idea (issue 36: the cell attention's kernel, launchers,
    checks, reference and tuning are files of their own)."""
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in KERNELS if (n := len(p.read_text().splitlines())) > 500]
    assert not long, long


def test_only_the_host_row_code_reads_the_mode_string():
    pattern = re.compile(r"\.mode\s*(==|!=|in\b)|mode\s*(==|!=)\s*[\"'](host|device|commit)[\"']")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in CORE if "host_rows" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


def test_setup_installs_every_package():
    """A wheel (not an editable install) carries only the packages setup.py lists."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    listed = set(ast.literal_eval(next(k.value for k in call.keywords if k.arg == "packages")))
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "cudagraph_rt").rglob("__init__.py")}
    for mapped in ("kernels", "tools"):  # package_dir maps them (and their subpackages) from the top level
        found |= {".".join(("cudagraph_rt", *p.parent.relative_to(ROOT).parts)) for p in (ROOT / mapped).rglob("__init__.py")}
    assert found <= listed, f"setup.py packages miss {sorted(found - listed)}"


# ------------------------------------------------------------------ the import graph
# The installed package: cudagraph_rt/ and the two folders setup.py maps under it.
PACKAGES = {"cudagraph_rt": ROOT / "cudagraph_rt", "cudagraph_rt.kernels": ROOT / "kernels",
            "cudagraph_rt.tools": ROOT / "tools"}


def package_modules(packages: dict = PACKAGES) -> dict[str, pathlib.Path]:
    """Every module of the package by its dotted name (a package by its ``__init__.py``)."""
    mods = {}
    for pkg, folder in packages.items():
        for p in sorted(folder.rglob("*.py")):
            parts = p.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            mods[".".join((pkg, *parts[:-1], *([] if parts[-1] == "__init__" else parts[-1:])))] = p
    return mods


def _import_nodes(tree: ast.AST, lazy: bool):
    """The file's import statements, except those under ``if TYPE_CHECKING:`` (never run);
    with ``lazy`` False, only those that run at import (not inside a function)."""
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        if not lazy and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: pathlib.Path, mods: dict, lazy: bool = True) -> dict[str, int]:
    """The package's modules that importing ``name`` may run, each with the line of the
    first import that does: every ``import`` / ``from ... import`` of the file, at module
    level or (``lazy``) inside a function, which runs too, later. ``from P import n`` is
    the module ``P.n`` when there is one, else ``P``; importing ``a.b.c`` also runs the
    ``__init__`` of each package on the way (``a.b``) that does not already hold this
    module (those are running or done). Dynamic imports (``importlib``) are not seen."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        while target and target not in mods:  # `import a.b.X` where X is a name, not a module
            target = target.rpartition(".")[0]
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            running = name == mod or name.startswith(mod + ".")
            if mod in mods and mod != name and (mod == target or not running):
                found[mod] = min(found.get(mod, line), line)

    for node in _import_nodes(ast.parse(path.read_text()), lazy):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
            continue
        base = node.module or ""
        if node.level:
            up = package.split(".")
            base = ".".join(up[:len(up) - (node.level - 1)] + ([node.module] if node.module else []))
        for alias in node.names:
            add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base, node.lineno)
    return found


def import_graph(packages: dict = PACKAGES, lazy: bool = True) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line}, over the whole package."""
    mods = package_modules(packages)
    return {name: imports_of(name, path, mods, lazy) for name, path in mods.items()}


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                comps.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _cycle_path(graph, comp: list[str]) -> str:
    """One shortest cycle through ``comp``'s first module, each hop with its import's line:
    ``a:12 -> b:3 -> a`` (a's line 12 imports b, b's line 3 imports a)."""
    start, inside = comp[0], set(comp)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for w in sorted(graph[path[-1]]):
            if w == start:
                hops = path + [start]
                return " -> ".join(f"{a}:{graph[a][b]}" for a, b in zip(hops, hops[1:])) + f" -> {start}"
            if w in inside and w not in seen:
                seen.add(w)
                paths.append(path + [w])
    raise AssertionError(f"no cycle through {comp}")


def test_the_import_graph_has_no_cycles():
    """No module of the package, kernels/ or tools/ imports one that imports it back, lazy
    imports inside functions included (issue 25's demo <-> demo_tp circle was one)."""
    graph = import_graph()
    assert len(graph) > 60 and "cudagraph_rt.runtime" in graph["cudagraph_rt._api"], "the graph is not the package's"
    cycles = [_cycle_path(graph, c) for c in _cycles(graph)]
    assert not cycles, "import cycles:\n  " + "\n  ".join(cycles)


def test_the_cycle_finder_sees_lazy_relative_and_package_imports(tmp_path):
    """The finder on a planted package: a lazy relative import, a ``from . import`` of a
    module, a package ``__init__`` run on the way to its module, and a TYPE_CHECKING
    import that must not count (it would close a second cycle)."""
    files = {
        "__init__.py": "",
        "a.py": "import os\ndef f():\n    from .w.x import g\n",
        "w/__init__.py": "from . import y\n",
        "w/x.py": "",
        "w/y.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..b import h\nfrom .. import a\n",
        "b.py": "from .w import x\nfrom p import w\n",
    }
    for rel, text in files.items():
        (tmp_path / "p" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "p" / rel).write_text(text)
    graph = import_graph({"p": tmp_path / "p"})
    assert graph["p.a"] == {"p.w": 3, "p.w.x": 3}  # the package on the way runs its __init__
    assert graph["p.w"] == {"p.w.y": 1} and graph["p.w.y"] == {"p.a": 4}
    assert graph["p.b"] == {"p.w": 1, "p.w.x": 1} and graph["p"] == {}
    assert _cycles(graph) == [["p.a", "p.w", "p.w.y"]]
    assert _cycle_path(graph, ["p.a", "p.w", "p.w.y"]) == "p.a:3 -> p.w:1 -> p.w.y:4 -> p.a"
    assert import_graph({"p": tmp_path / "p"}, lazy=False)["p.a"] == {} and not _cycles(
        import_graph({"p": tmp_path / "p"}, lazy=False))


def test_the_wings_sit_on_the_core():
    """The runner wing (``speculative``, and ``dispatch`` beside it) is imported by the tools alone; the diagnostics wing
    (``debug``) by the tools and, from inside a function only (explain_capture, after a
    failed capture), by the core: importing the core runs neither wing."""
    graph, eager = import_graph(), import_graph(lazy=False)
    in_wing = lambda m, w: m == f"cudagraph_rt.{w}" or m.startswith(f"cudagraph_rt.{w}.")
    user = lambda m: m.startswith("cudagraph_rt.tools")
    # the device dispatcher (issue 38) is a wing of the runner's: it may use speculative, and only
    # the tools and speculative may use it
    bad = [f"{m} imports {t}" for m, ts in graph.items() for t in ts for w in ("speculative", "dispatch")
           if in_wing(t, w) and not (in_wing(m, "speculative") or in_wing(m, "dispatch") or user(m))]
    bad += [f"{m}:{line} imports {t} at import time" for m, ts in eager.items() for t, line in ts.items()
            if in_wing(t, "debug") and not (in_wing(m, "debug") or user(m))]
    assert not bad, bad
    assert "cudagraph_rt.debug.hazards" in graph["cudagraph_rt.runtime"]  # the lazy one, seen


# ------------------------------------------------------------------ GraphRuntime's private members
RUNTIME = ROOT / "cudagraph_rt" / "runtime.py"
# Modules that still read GraphRuntime's private members through ``self`` without being a
# GraphRuntime: each entry says what ends it, and the test fails once it is not needed.
PENDING: dict[str, str] = {}  # module -> why it still reads a private member (none now)


def _own_names(cls: ast.ClassDef) -> set[str]:
    """What a class defines itself: its methods and class attributes, and ``self.x = ...``."""
    names = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for n in cls.body:
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        names |= {t.id for t in targets if isinstance(t, ast.Name)}
    for n in ast.walk(cls):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and ast.unparse(n.value) == "self":
            names.add(n.attr)
    return names


def runtime_privates() -> set[str]:
    """GraphRuntime's private members (``_name``, not dunders), read from its class body
    and every ``self._name = ...`` of its methods in runtime.py."""
    tree = ast.parse(RUNTIME.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GraphRuntime")
    return {n for n in _own_names(cls) if n.startswith("_") and not n.startswith("__")}


RUNTIME_NAME = re.compile(r"(^|\.)_?(rt|runtime|graph_runtime)$")  # receivers that name a runtime


def class_table(sources: list[str]) -> dict[str, tuple[set[str], set[str]]]:
    """Every class of ``sources``: name -> (what it defines itself, its bases' names)."""
    table: dict[str, tuple[set[str], set[str]]] = {}
    for source in sources:
        for n in ast.walk(ast.parse(source)):
            if isinstance(n, ast.ClassDef):
                own, bases = table.get(n.name, (set(), set()))
                table[n.name] = (own | _own_names(n), bases | {ast.unparse(b).rpartition(".")[2] for b in n.bases})
    return table


def _ancestry(name: str, table: dict) -> set[str]:
    """``name`` and the classes of the table it inherits from (by name, transitively)."""
    seen, todo = set(), [name]
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.add(c)
            todo += sorted(table.get(c, (set(), set()))[1])
    return seen


def private_reads(source: str, privates: set[str], table: dict) -> list[tuple[int, str]]:
    """(line, expression) of each access in ``source`` to a private member of a runtime:
    ``X._name`` (or ``getattr(X, "_name")``) where ``_name`` is one of ``privates`` and X
    is not ``self`` of a class that is a GraphRuntime or defines ``_name`` itself (or a
    base of it in ``table`` does); and any ``_name`` on a receiver named like a runtime
    (``rt``, ``self._rt``, ``runner.rt``, ``runtime``)."""
    found = []

    def visit(node, own, is_runtime):
        if isinstance(node, ast.ClassDef):
            line = _ancestry(node.name, table) | {ast.unparse(b).rpartition(".")[2] for b in node.bases}
            own = _own_names(node).union(*(table.get(c, (set(), set()))[0] for c in line))
            is_runtime = "GraphRuntime" in line
        attr = receiver = None
        if isinstance(node, ast.Attribute):
            attr, receiver = node.attr, node.value
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "setattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            attr, receiver = node.args[1].value, node.args[0]
        if attr and attr.startswith("_") and not attr.startswith("__"):
            text = ast.unparse(receiver)
            mine = text == "self" and (is_runtime or attr in own)
            if (attr in privates and not mine) or (RUNTIME_NAME.search(text) and text != "self"):
                found.append((node.lineno, ast.unparse(node)))
        for child in ast.iter_child_nodes(node):
            visit(child, own, is_runtime)

    visit(ast.parse(source), set(), False)
    return found


def test_nothing_outside_runtime_py_reads_a_private_member_of_graph_runtime():
    """Every module of the package, kernels/ and tools/ (runtime.py aside) uses a runtime
    through its public names: no ``rt._inputs``, ``self._rt._lock``, ``getattr(rt,
    "_by_width")``; ``self._name`` only in a GraphRuntime subclass or where the class (or
    one it inherits from) defines ``_name`` itself. The exceptions still pending are
    listed in PENDING."""
    privates, mods = runtime_privates(), package_modules()
    assert {"_inputs", "_lock", "_by_width", "_counters", "_direct"} <= privates, sorted(privates)
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in mods.values()}
    table = class_table([s for rel, s in sources.items() if rel != "cudagraph_rt/runtime.py"])
    assert "GraphRuntime" in _ancestry("DistributedRuntime", table)
    found, pending_seen = [], set()
    for rel, source in sources.items():
        if rel == "cudagraph_rt/runtime.py":
            continue
        reads = private_reads(source, privates, table)
        if rel in PENDING:
            pending_seen |= {rel} if reads else set()
            continue
        found += [f"{rel}:{line}: {expr}" for line, expr in reads]
    assert not found, "private members of GraphRuntime read outside runtime.py:\n  " + "\n  ".join(found)
    stale = sorted(set(PENDING) - pending_seen)
    assert not stale, f"PENDING lists modules that read no private member any more: {stale} (remove them)"


def test_the_private_member_rule_flags_what_it_should():
    privates = {"_inputs", "_lock", "_by_width"}
    source = """
class Tool:
    def __init__(self, rt):
        self._rt = rt
        self._lock = 1              # its own member of the same name: fine
    def run(self, rt, runner, other):
        rt._inputs                  # 1: a runtime's private
        self._rt._lock              # 2
        getattr(rt, "_by_width")    # 3
        runner.rt._anything_new     # 4: any private, on a receiver named like a runtime
        other._inputs               # 5: a known private on any other receiver
        self._lock, rt.widths, other._unrelated, self._rt
class SubTool(Tool):
    def f(self):
        return self._lock           # inherited from Tool: fine
class Mixin:
    def f(self):
        return self._inputs         # 6: not its own, and not a runtime
class Sub(GraphRuntime):
    def f(self):
        return self._inputs, self._lock
class SubSub(Sub):
    def g(self):
        return self._by_width
"""
    got = [expr for _, expr in private_reads(source, privates, class_table([source]))]
    assert got == ["rt._inputs", "self._rt._lock", "getattr(rt, '_by_width')", "runner.rt._anything_new",
                   "other._inputs", "self._inputs"], got


def test_the_step_path_never_asks_whether_there_is_a_host_row_choice():
    """A runtime without HostRows holds NoHostRows, so the step path calls its row choice's
    hooks unconditionally: no ``hr is None`` / ``row_choice is not None`` anywhere in the core."""
    pattern = re.compile(r"\b(hr|row_choice|_row_choice)\s+is\s+(not\s+)?None\b|\bif\s+(not\s+)?(hr|self\._row_choice)\b")
    found = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in CORE
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found
    assert pattern.search("x = hr.ring if hr is not None else None") and pattern.search("if self._row_choice:")


def _undefined_names(paths) -> list[str]:
    """pyflakes' undefined-name findings in ``paths`` (files or folders), as text."""
    from pyflakes import api, messages, reporter

    found = []

    class Keep(reporter.Reporter):
        def __init__(self):
            super().__init__(None, None)

        def flake(self, message):
            if isinstance(message, (messages.UndefinedName, messages.UndefinedLocal)):
                found.append(f"{message.filename}:{message.lineno}: {message.message % message.message_args}")

        def syntaxError(self, filename, msg, lineno, offset, text):  # noqa: N802 - pyflakes' name
            found.append(f"{filename}:{lineno}: syntax error: {msg}")

        def unexpectedError(self, filename, msg):  # noqa: N802
            found.append(f"{filename}: {msg}")

    api.checkRecursive([str(p) for p in paths], Keep())
    return found


@needs("pyflakes")
def test_no_undefined_name_in_code_only_a_gpu_runs():
    """The benches' timed paths, the outer graph and other CUDA branches never run on a CPU:
    a name they use that is defined nowhere would first fail on the H200 (the sampler
    bench's graph and timing helpers were once cut out that way). pyflakes reads every
    module of the package, kernels/, tools/ and tests/."""
    assert not _undefined_names([ROOT / d for d in ("cudagraph_rt", "kernels", "tools", "tests")])


@needs("pyflakes")
def test_the_undefined_name_check_sees_one(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    return _graph(1)\n\n\ndef g(x):\n    return x\n")
    assert [line.split(": ", 1)[1] for line in _undefined_names([tmp_path])] == ["undefined name '_graph'"]
