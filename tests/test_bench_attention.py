"""`python -m cudagraph_rt.tools.bench.attention --quick` runs end to end on the CPU (the
kernels in the interpreter) and writes every section, each kernel result checked against
SDPA by the bench itself."""
import json

from cudagraph_rt.tools.bench.attention import main


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
    tried = res["candidates"][0]["tried"]
    assert {t["knob"] for t in tried} >= {"default", "splits", "rows", "block_size"}
    assert all(t["status"] == "ok" for t in tried), tried
    assert "cell attention, 16-layer loop" in capsys.readouterr().out
