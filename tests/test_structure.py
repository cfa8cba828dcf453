"""The core's shape, kept (issue 14): a short facade, short functions, and the host-row
mode read in the host-row code alone. A failure names the file and the line."""
import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORE = [p for p in sorted((ROOT / "cudagraph_rt").rglob("*.py"))
        if not {"models", "testing"} & set(p.relative_to(ROOT / "cudagraph_rt").parts[:-1])]
KERNELS = sorted((ROOT / "kernels").rglob("*.py"))


def test_runtime_is_a_short_facade():
    n = len((ROOT / "cudagraph_rt" / "runtime.py").read_text().splitlines())
    assert n <= 350, f"cudagraph_rt/runtime.py has {n} lines (at most 350)"


def test_no_function_in_the_core_or_kernels_is_over_50_lines():
    long = []
    for p in CORE + KERNELS:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 50:
                    long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
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

