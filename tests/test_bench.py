"""`cgrt bench --quick` runs end to end on the CPU and writes every section to its JSON.

No timing assertions: speed goals are checked by the bench itself on the GPU.
"""
import json

import pytest

from cudagraph_rt.cli import main

SECTIONS = ("step_time", "mixed_trace", "host_overhead", "memory", "padding", "host_rows")


def test_quick_writes_every_section(tmp_path):
    path = tmp_path / "bench.json"
    plots = tmp_path / "plots"
    assert main(["bench", "--quick", "--json", str(path), "--plot", str(plots)]) == 0
    data = json.loads(path.read_text())
    assert data["meta"]["quick"] and data["meta"]["device"] == "cpu"
    for key in SECTIONS:
        assert data[key]["status"] in ("ok", "skipped"), (key, data[key])
    st = data["step_time"]
    assert st["status"] == "ok" and [r["width"] for r in st["rows"]] == [1, 2, 4, 8, 16, 32, 64]
    for r in st["rows"]:
        assert r["eager"]["median_us"] > 0 and r["cgrt"]["median_us"] > 0
        assert r["eager"]["n"] == data["meta"]["repeats"]
    assert st["compile"]["status"] == "unavailable" and st["compile"]["reason"]
    mt = data["mixed_trace"]
    assert mt["steps"] == data["meta"]["trace_steps"] and sum(mt["T_buckets"].values()) == mt["steps"]
    assert mt["variants"]["cgrt"]["status"] == "ok" and mt["variants"]["compile"]["status"] == "unavailable"
    pad = {s["name"]: s for s in data["padding"]["sets"]}
    assert set(pad) == {"default", "user"}
    for s in pad.values():  # the runtime padded exactly what plan() says
        assert s["padded_rows_counted"] == s["padded_rows"]
    assert pad["user"]["padded_rows"] < pad["default"]["padded_rows"]
    for key in ("host_overhead", "memory", "host_rows"):  # GPU-only, with the reason
        assert data[key]["status"] == "skipped" and data[key]["reason"]
    goals = {g["goal"]: g["status"] for g in data["goals"]}
    assert len(goals) >= 7 and set(goals.values()) <= {"met", "missed", "n/a"}
    assert (plots / "step_time.png").stat().st_size > 0


def test_sections_pick_and_reject(tmp_path, capsys):
    path = tmp_path / "b.json"
    assert main(["bench", "--quick", "--device", "cpu", "--sections", "5", "--trace-steps", "20",
                 "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["padding"]["status"] == "ok" and data["padding"]["steps"] == 20
    assert all(data[k]["status"] == "not run" for k in SECTIONS if k != "padding")
    for bad in ("7", "1,x", ""):
        with pytest.raises(SystemExit) as e:
            main(["bench", "--sections", bad])
        assert e.value.code == 2
    assert "section numbers" in capsys.readouterr().err
