"""`python -m cudagraph_rt.tools.bench.attention --quick` runs end to end on the CPU (the
kernels in the interpreter) and writes every section, each kernel result checked against
SDPA by the bench itself; the goal table names each goal case with pass or miss."""
import json
import os
import shutil

import pytest
import torch

from cudagraph_rt.tools.bench.attention import FULL, HBM_BYTES_PER_S, Shape, Workload, main
from tests.support import run_compiled
from tests.support.extras import needs_kernel, require


@needs_kernel
def test_quick_writes_every_section(tmp_path, capsys):
    path = tmp_path / "attention.json"
    assert main(["--quick", "--json", str(path)]) == 0
    res = json.loads(path.read_text())
    assert res["meta"]["quick"]
    kernels = [r["kernel"] for r in res["extents"]] + [res["many"]["kernel"]]
    kernels += [k for p in res["pool"] for k in p["kernel"]]
    assert {r["width"] for r in res["extents"]} == {1, 4}
    assert all(k["status"] == "ok" and k["max_err"] < 1e-4 for k in kernels if "max_err" in k), kernels
    assert all("us" in k for k in kernels)
    assert [(b["width"], b["extent"]) for b in res["batch"]] == [(3, 12)]
    assert res["batch"][0]["kernel"]["status"] == "ok" and res["batch"][0]["one_sequence"]["status"] == "ok"
    ceiling = res["ceiling"][0]
    assert ceiling["extent"] == 24 and ceiling["status"] == "ok" and ceiling["us"] > 0
    assert ceiling["floor_us"] == res["extents"][0]["floor_us"]  # the same live bytes as the kernel's extent
    tried = res["candidates"][0]["tried"]
    assert {t["knob"] for t in tried} >= {"default", "splits", "min_chunk", "tile_n"}
    assert all(t["status"] == "ok" and t["max_err"] < 1e-4 for t in tried), tried
    assert {t["plan"]["splits"] for t in tried} >= {1, 3}  # the one-split kernel and the merging one
    out = capsys.readouterr().out
    assert "cell attention, 16-layer loop" in out and "ceiling at 24 cells" in out
    if not torch.cuda.is_available():  # FlashInfer's column: skipped with its reason, never fatal
        assert res["flashinfer"] == {"status": "skipped", "reason": "FlashInfer needs a CUDA device"}
        assert "against FlashInfer: skipped: FlashInfer needs a CUDA device" in out
    goals = out[out.index("== goals"):].splitlines()
    assert any(line.split()[0] == "w4@24" and ("pass" in line or "MISS" in line) for line in goals[2:]), goals


def test_full_run_times_the_goal_cases():
    """The H200 run covers every goal of issue 23 and keeps its candidate list short."""
    names = {c.name for c in FULL.cases}
    assert names == {"w1@8k", "w1@32k", "w8@8k", "w8@32k", "w64@1k"}
    assert sum(len(c.tries) for c in FULL.cases) <= 30
    assert 128 in FULL.extents and {8192, 32768} <= set(FULL.extents)


def test_the_kv_floor_counts_k_and_v_of_every_layer():
    """The floor (module docstring): live K and V bytes of all layers at the nominal HBM
    bandwidth. A floor that counts K only halves it, and every kernel would look twice as
    far from it as it is."""
    for layers, hkv, d, dtype, seqs, extent in [(1, 2, 16, torch.float32, 1, 24), (3, 1, 8, torch.float16, 2, 40)]:
        wl = Workload(Shape(layers, 2 * hkv, hkv, d, dtype), width=2 * seqs, seqs=seqs, extent=extent,
                      max_seqs=seqs, max_len=64, block_size=8, device="cpu")
        itemsize = torch.empty((), dtype=dtype).element_size()
        live_bytes = layers * seqs * extent * hkv * d * itemsize * 2  # K and V
        assert wl.floor_us() == live_bytes / HBM_BYTES_PER_S * 1e6


@needs_kernel
def test_quick_on_a_cpu_sets_the_interpreter_itself_or_says_what_to_set():
    """Started without TRITON_INTERPRET on a machine without a GPU: --quick sets it before
    the kernels are defined (loading the bench's package defines none: it imports no
    torch) and runs. Defined before main() runs, Triton has chosen compiled kernels: the
    bench says so and exits 2, instead of every kernel failing to launch."""
    if torch.cuda.is_available():
        pytest.skip("a GPU machine runs the full bench")
    p = run_compiled("-m", "cudagraph_rt.tools.bench.attention", "--quick", "--sections", "extents")
    assert p.returncode == 0, (p.returncode, p.stderr[-500:])
    early = ("import sys; import cudagraph_rt.kernels.attention; "
             "from cudagraph_rt.tools.bench.attention import main; sys.exit(main(['--quick']))")
    p = run_compiled("-c", early)
    assert p.returncode == 2 and "TRITON_INTERPRET=1" in p.stderr, (p.returncode, p.stderr[-500:])


def test_kernel_versions_times_two_copies_of_the_kernel_side_by_side(tmp_path, monkeypatch, capsys):
    """tools/bench/experiments/kernel_versions.py --quick (the interpreter): the tree's
    kernel against a copy of its own package, loaded as a module of its own, every case
    timed for both and their outputs written and equal; a bad command line exits 2."""
    from cudagraph_rt.kernels import attention as ca
    from cudagraph_rt.kernels.common import triton_backend
    from cudagraph_rt.tools.bench.experiments import kernel_versions as kv

    require("triton")
    if triton_backend() != "interpreter":
        pytest.skip("the --quick run is the interpreter's")
    copy = tmp_path / "attention_copy"
    shutil.copytree(os.path.dirname(ca.__file__), copy, ignore=shutil.ignore_patterns("__pycache__"))
    other = kv.load(str(copy))
    assert other is not ca and other.cell_attention_triton is not ca.cell_attention_triton
    monkeypatch.setenv("OUT", str(tmp_path))
    assert kv.main(["--quick", str(copy)]) == 0
    res = json.loads((tmp_path / "kernel_versions.json").read_text())
    assert len(res) == len(kv.QUICK_CASES)
    for case in res.values():
        assert case["written"] and case["max_diff"] == 0.0, case
        assert len(case["times_us"]["this"]) == len(case["times_us"]["other"]) == 2 and case["other_us"] > 0
    assert "this" in capsys.readouterr().out
    assert kv.main(["--quick"]) == 2


def _cells(table, s, n, bs):
    """Cells of positions 0..n-1 of sequence s, as the pool lays them (KVPool.cell_for)."""
    return [int(table[s, p // bs]) * bs + p % bs for p in range(n)]


def test_flashinfer_pages_are_the_pools_blocks():
    """The FlashInfer baseline's page lists read exactly the cells the cell attention reads:
    per row (decode variants) positions 0..pos of its sequence, per sequence (prefill) its
    whole extent; a page is a block (NHD: [blocks, block_size, Hkv, D])."""
    from cudagraph_rt.tools.bench.flashinfer_baseline import row_pages, sequence_pages

    wl = Workload(Shape(1, 4, 2, 8, torch.float32), width=6, seqs=2, extent=11, max_seqs=3, max_len=16,
                  block_size=4, device=torch.device("cpu"), seed=3)
    indptr, indices, last = row_pages(wl.table, wl.seq, wl.pos, wl.bs)
    for i, (s, p) in enumerate(zip(wl.seq.tolist(), wl.pos.tolist())):
        pages = indices[indptr[i]:indptr[i + 1]].tolist()
        cells = [b * wl.bs + o for b in pages[:-1] for o in range(wl.bs)] + \
                [pages[-1] * wl.bs + o for o in range(int(last[i]))]
        assert cells == _cells(wl.table, s, p + 1, wl.bs), (i, s, p)
    qo, indptr, indices, last = sequence_pages(wl.table, wl.seqs, wl.per, wl.extent, wl.bs)
    assert qo.tolist() == [0, 3, 6]
    for s in range(wl.seqs):
        pages = indices[indptr[s]:indptr[s + 1]].tolist()
        cells = [b * wl.bs + o for b in pages[:-1] for o in range(wl.bs)] + \
                [pages[-1] * wl.bs + o for o in range(int(last[s]))]
        assert cells == _cells(wl.table, s, wl.extent, wl.bs)
