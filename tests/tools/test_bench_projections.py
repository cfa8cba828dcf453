"""tools/bench/projections.py's CPU smoke run (--quick): every group, layout and
implementation is timed after its outputs were checked against eager F.linear over the
merged weight, and the JSON holds one row each. (Its figures are the H200's: BENCHMARKS.md.)"""
import json

import pytest

from cudagraph_rt.tools.bench import projections as bench_projections
from tests.support.extras import needs, require


@needs("transformers")
def test_quick_run_checks_and_records_every_case(tmp_path):
    """cuBLAS only (the compiled cases are CompiledRows, tested in test_compiled_step)."""
    out = tmp_path / "proj.json"
    args = ["--quick", "--json", str(out), "--widths", "1,2", "--replays", "1", "--impls", "cublas"]
    assert bench_projections.main(args) == 0
    rec = json.loads(out.read_text())
    got = {(r["group"], r["layout"], r["impl"], r["width"]) for r in rec["rows"]}
    want = {(g, lay, "cublas", m) for m in (1, 2)
            for g, lays in (("qkv", 2), ("o", 1), ("gate_up", 2), ("down", 1), ("head", 1))
            for lay in ("separate", "merged")[2 - lays:]}
    assert got == want
    assert all(r["us"] > 0 and r["floor_us"] > 0 for r in rec["rows"])
    assert rec["compile_s"] == {"cublas": 0.0}


def test_unknown_implementations_are_refused(tmp_path, capsys):
    assert bench_projections.main(["--quick", "--json", str(tmp_path / "x.json"), "--impls", "cublas,magic"]) == 2
    assert "--impls" in capsys.readouterr().err


def test_quick_run_of_the_small_m_kernel_and_its_tuning(tmp_path, capsys):
    """The kernel (interpreted here) timed beside cuBLAS, every case checked against
    F.linear first; --tune times the plan and the candidates and prints its table."""
    from cudagraph_rt.kernels.common import triton_backend

    require("transformers")
    require("triton")
    if triton_backend() != "interpreter":
        pytest.skip("the kernel runs on CPU tensors in the interpreter only (a GPU machine: bash .ci/gpu kernels)")
    out = tmp_path / "proj.json"
    args = ["--quick", "--json", str(out), "--widths", "1", "--replays", "1", "--impls", "cublas,small", "--tune",
            "--candidates", "1"]
    assert bench_projections.main(args) == 0
    rec = json.loads(out.read_text())
    assert {(r["group"], r["layout"]) for r in rec["rows"] if r["impl"] == "small"} == {
        ("qkv", "separate"), ("qkv", "merged"), ("o", "merged"), ("gate_up", "separate"), ("gate_up", "merged"),
        ("down", "merged"), ("head", "merged")}
    tuned = {(t["group"], t["label"]) for t in rec["tune"]}
    assert tuned == {(g, lab) for g in ("qkv", "o", "gate_up", "down") for lab in ("plan", "n16k256")}
    assert all(t["us"] > 0 for t in rec["tune"])
    printed = capsys.readouterr().out
    assert "small     merged    M=1" in printed and "best config" in printed
