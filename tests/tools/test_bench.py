"""`cgrt bench --quick` runs end to end on the CPU and writes every section to its JSON;
the torch.compile child-process wrapper reports a crashing, hanging or failing child as
unavailable without raising, and a child's protocol (payload in, results out) works.

No timing assertions: speed goals are checked by the bench itself on the GPU.
"""
import json
import sys

import pytest
import torch

from cudagraph_rt import extras
from cudagraph_rt.cli import main
from cudagraph_rt.models.toy import ToyConfig, ToyDecoder
from cudagraph_rt.tools.bench import compile_setups as bench_compile, report as bench_report
from cudagraph_rt.tools.bench.common import N_SETS, ToyRows

SECTIONS = ("step_time", "mixed_trace", "host_overhead", "memory", "padding", "host_rows", "dispatch")


def test_quick_writes_every_section(tmp_path, capsys):
    path = tmp_path / "bench.json"
    plots = tmp_path / "plots"
    assert main(["bench", "--quick", "--json", str(path), "--plot", str(plots)]) == 2  # checked before the run
    assert "--plot: expected an existing folder" in capsys.readouterr().err and not plots.exists()
    plots.mkdir()
    argv = ["bench", "--quick", "--json", str(path), "--plot", str(plots)]
    if not extras.available("plot"):  # without matplotlib: refused before the run, naming the extra
        assert main(argv) == 2 and 'pip install "cudagraph_rt[plot]"' in capsys.readouterr().err
        argv = argv[:-2]
    assert main(argv) == 0
    data = json.loads(path.read_text())
    assert data["meta"]["quick"] and data["meta"]["device"] == "cpu"
    for key in SECTIONS:
        assert data[key]["status"] in ("ok", "skipped"), (key, data[key])
    st = data["step_time"]
    assert st["status"] == "ok" and [r["width"] for r in st["rows"]] == [1, 2, 4, 8, 16, 32, 64]
    for r in st["rows"]:
        assert r["eager"]["median_us"] > 0 and r["cgrt"]["median_us"] > 0
        assert r["eager"]["n"] == data["meta"]["repeats"]
    setups = st["compile"]["setups"]  # on the CPU: skipped, with the reason, and no child started
    assert [c["setup"] for c in setups] == list(bench_compile.DEFAULT_SETUPS)
    assert all(c["status"] == "skipped" and c["reason"] for c in setups)
    assert st["compile"]["reference"] is None and st["compile"]["reference_note"]
    mt = data["mixed_trace"]
    assert mt["steps"] == data["meta"]["trace_steps"] and sum(mt["T_buckets"].values()) == mt["steps"]
    assert mt["variants"]["cgrt"]["status"] == "ok"
    for v in ("compile_static", "compile_default", "cgrt_compile"):
        assert mt["variants"][v]["status"] == "skipped" and mt["variants"][v]["reason"]
    pad = {s["name"]: s for s in data["padding"]["sets"]}
    assert set(pad) == {"default", "user"}
    for s in pad.values():  # the runtime padded exactly what plan() says
        assert s["padded_rows_counted"] == s["padded_rows"]
    assert pad["user"]["padded_rows"] < pad["default"]["padded_rows"]
    d = data["dispatch"]  # every variant on a CPU (the loop emulated): the same greedy tokens, checked
    assert d["status"] == "ok" and [r["sequences"] for r in d["rows"]] == [1, 2]
    for r in d["rows"]:
        assert r["tokens_equal"] and r["runner_tokens_equal"] and r["checks_ok"] and r["rounds_ran"] == "host"
        assert r["device"]["tokens"] == r["host_rounds"]["tokens"] == r["host_runner"]["tokens"] > 0
    for key in ("host_overhead", "memory", "host_rows"):  # GPU-only, with the reason
        assert data[key]["status"] == "skipped" and data[key]["reason"]
    assert data["goals"] == []  # a CPU's figures are not GPU figures: no goal judged
    assert "not GPU figures" in capsys.readouterr().out
    goals = {g["goal"]: g["status"] for g in bench_report.goals(data)}  # what a GPU run would judge
    assert len(goals) >= 9 and set(goals.values()) <= {"met", "missed", "unclear", "n/a"}
    assert not extras.available("plot") or (plots / "step_time.png").stat().st_size > 0


def test_host_overhead_case_on_a_cpu_runtime_times_host_inputs_in_the_whole_step():
    """Section 3's variants over a real runtime (graphs off, a stand-in for replay()): the
    whole zero-copy call asks host_inputs for fresh views inside itself, fills them and
    steps them; the row has the old keys and the new ones."""
    from cudagraph_rt.cli import build_parser
    from cudagraph_rt.tools.bench import steps as bench_steps
    from cudagraph_rt.tools.bench.context import Context

    ctx = Context(build_parser().parse_args(["bench", "--quick", "--device", "cpu"]))
    try:
        rt, names, w = ctx.runtime, ctx.rows.names, 8
        host = [ctx.rows.host(ctx.rows.rows(w)) for _ in range(N_SETS)]
        variants = bench_steps.overhead_variants(rt, lambda: None, host, names, w)
        log, real = [], rt.host_inputs
        rt.host_inputs = lambda T, **kw: (log.append(("host_inputs", T, kw)), real(T, **kw))[1]
        whole, prep = variants["zero_copy_whole"]
        assert prep is None  # nothing of the whole step is left untimed
        before = rt.stats().steps
        whole(5)
        assert log == [("host_inputs", w, {"numpy": True})] and rt.stats().steps == before + 1
        kw = {"repeats": 3, "warmup": 1, "sync": ctx.sync}
        acc: dict = {}
        medians = [bench_steps._overhead_repeat(variants, kw, acc) for _ in range(2)]
        r = bench_steps.overhead_row(len(names), w, medians, acc)
    finally:
        ctx.close()
    assert r["zero_copy_whole_host"]["n"] == 6 and r["zero_copy_whole_host"]["median_us"] > 0
    assert r["step_overhead_host_us"] is not None and len(r["zero_copy_whole_overhead_host_repeats_us"]) == 2
    assert set(r["zero_copy_whole_over_bare_host"]) == {"median", "min", "max", "repeats"}


def test_sections_pick_and_reject(tmp_path, capsys):
    path = tmp_path / "b.json"
    assert main(["bench", "--quick", "--device", "cpu", "--sections", "5", "--trace-steps", "20",
                 "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["padding"]["status"] == "ok" and data["padding"]["steps"] == 20
    assert all(data[k]["status"] == "not run" for k in SECTIONS if k != "padding")
    assert "cgrt bench: 5. padding ..." in capsys.readouterr().err  # progress: on stderr, one line in a log
    for bad in ("8", "1,x", ""):
        assert main(["bench", "--sections", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("cgrt bench: --sections: expected section numbers") and err.count("\n") == 1


def test_compile_setups_option(tmp_path, capsys):
    path = tmp_path / "b.json"
    assert main(["bench", "--quick", "--sections", "1", "--compile-setups", "cgrt,static", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert [c["setup"] for c in data["step_time"]["compile"]["setups"]] == ["cgrt", "static"]
    assert main(["bench", "--compile-setups", "static,nope"]) == 2
    assert "cgrt bench: --compile-setups: expected setups" in capsys.readouterr().err


# ----------------------------------------------------------------------------- child processes
def _run(code: str, tmp_path, timeout: float = 60):
    out = str(tmp_path / "out.json")
    return bench_compile.run_child([sys.executable, "-c", code], out, timeout=timeout), out


def test_child_abort_is_unavailable_not_fatal(tmp_path):
    code = ("import sys, os, resource; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); print('building'); "
            "print(\"terminate called after throwing an instance of 'c10::AcceleratorError'\", file=sys.stderr); "
            "print('  what():  CUDA error: an illegal memory access was encountered', file=sys.stderr); "
            "sys.stderr.flush(); sys.stdout.flush(); os.abort()")
    run, _ = _run(code, tmp_path)
    assert run.returncode is not None and run.returncode < 0 and not run.timed_out
    rec = bench_compile.summarize_run(bench_compile.SETUPS["static"], run, 60)
    assert rec["status"] == "unavailable" and rec["step_time"] == {} and rec["trace"] is None
    assert "SIGABRT" in rec["reason"] and "illegal memory access" in rec["reason"]
    assert rec["child"]["output_tail"]  # the last lines are kept in the JSON too


def test_child_timeout_is_killed_and_unavailable(tmp_path):
    run, _ = _run("import time; print('compiling', flush=True); time.sleep(60)", tmp_path, timeout=1)
    assert run.timed_out and run.wall_s < 30
    rec = bench_compile.summarize_run(bench_compile.SETUPS["cgrt"], run, 1)
    assert rec["status"] == "unavailable" and "timed out after 1 s" in rec["reason"]


def test_child_partial_results_survive_a_later_crash(tmp_path):
    out = str(tmp_path / "out.json")
    lat = {"median_us": 10.0, "p10_us": 9.0, "p90_us": 11.0, "n": 5}
    data = {"compile": {"seconds": 1.5, "cudagraph_skips": 4, "skip_reasons": ["skipping cudagraphs due to x"]},
            "step_time": {"1": {"latency": lat, "pipelined_us": 8.0}}, "stage": "mixed trace"}
    code = f"import json, os; json.dump({data!r}, open({out!r}, 'w')); raise SystemExit(3)"
    run = bench_compile.run_child([sys.executable, "-c", code], out, timeout=60)
    rec = bench_compile.summarize_run(bench_compile.SETUPS["default"], run, 60)
    assert rec["status"] == "partial" and "exit code 3" in rec["reason"] and "mixed trace" in rec["reason"]
    assert rec["step_time"] == {1: lat} and rec["pipelined_us"] == {1: 8.0} and rec["cudagraph_skips"] == 4
    runs = bench_compile.CompileRuns([rec])
    variant, note = runs.reference("step_time")  # (a) not run: (b) is used, and the note says so
    assert variant == "compile_default" and "WITHOUT CUDA graphs" in note
    assert runs.reference("trace")[0] is None


def test_child_that_cannot_start(tmp_path):
    run = bench_compile.run_child([str(tmp_path / "no-such-program")], str(tmp_path / "o.json"), timeout=5)
    rec = bench_compile.summarize_run(bench_compile.SETUPS["static"], run, 5)
    assert rec["status"] == "unavailable" and "could not start" in rec["reason"]


def test_child_protocol_end_to_end_on_cpu(tmp_path):
    """The real child (python -m cudagraph_rt.tools.bench.compile_child) with the eager control
    setup on the CPU: payload in, every stage's figures out, the bench's timing."""
    cfg = ToyConfig.tiny()
    rows = ToyRows(ToyDecoder(cfg, "cpu"), 0)
    sets = {T: [rows.rows(T) for _ in range(N_SETS)] for T in (1, 8)}
    trace = [rows.rows(T) for T in (1, 3, 8, 1, 2)]
    payload = bench_compile.make_payload(cfg, torch.device("cpu"), (1, 2, 4, 8), seed=0, repeats=3, warmup=1,
                                         trace_passes=1, sets=sets, trace=trace)
    notes = []
    runs = bench_compile.run_setups(("eager",), payload, str(tmp_path), timeout=120, cgrt_mode="default",
                                    note=lambda text, always=False: notes.append(text))
    (rec,) = list(runs)
    assert rec["status"] == "ok", rec["reason"]
    assert set(rec["step_time"]) == {1, 8} and rec["step_time"][8]["n"] == 3
    assert rec["pipelined_us"][1] > 0 and rec["trace"]["status"] == "ok" and rec["trace"]["total_ms"] > 0
    assert rec["tokens_check"] == {"rows": 9, "mismatched": 0, "widths": [1, 8]}
    assert any("step time: width 8" in n for n in notes)  # progress reaches the bench


def test_child_figures_reach_rows_ratios_and_goal(tmp_path, monkeypatch):
    """Records as the children leave them: (a) crashed, (b) ran without CUDA graphs,
    cgrt+compile ran. Section 1-2 rows carry them; compile/cgrt and goal 3 use (b), saying so."""
    from cudagraph_rt.tools.bench.context import Context

    lat = {"median_us": 100.0, "p10_us": 90.0, "p90_us": 110.0, "n": 5}
    widths = (1, 2, 4, 8, 16, 32, 64)
    crashed = bench_compile.ChildRun(-6, False, 3.0, {"compile": {"seconds": 2.0}, "stage": "compile"},
                                     ["terminate called after throwing an instance of 'c10::AcceleratorError'",
                                      "  what():  CUDA error: an illegal memory access was encountered"])

    def ok(skips):
        return bench_compile.ChildRun(0, False, 9.0, {
            "done": True, "compile": {"seconds": 5.0, "cudagraph_skips": skips, "mode": "reduce-overhead",
                                      "skip_reasons": ["skipping cudagraphs due to mutated inputs (4 instances)"]},
            "check": {"rows": 127, "mismatched": 0, "widths": list(widths)},
            "step_time": {str(w): {"latency": lat, "pipelined_us": 50.0} for w in widths},
            "trace": {"status": "ok", "total_ms": 1e6, "mean_step_us": 1.0, "passes_ms": [1e6]}}, [])

    runs = bench_compile.CompileRuns([
        bench_compile.summarize_run(bench_compile.SETUPS["static"], crashed, 240),
        bench_compile.summarize_run(bench_compile.SETUPS["default"], ok(7), 240),
        bench_compile.summarize_run(bench_compile.SETUPS["cgrt"], ok(0), 240)])
    monkeypatch.setattr(Context, "compiled", property(lambda self: runs))
    path = tmp_path / "b.json"
    assert main(["bench", "--quick", "--sections", "1,2", "--trace-steps", "30", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    st, mt = data["step_time"], data["mixed_trace"]
    assert st["compile"]["reference"] == "compile_default" and "WITHOUT CUDA graphs" in st["compile"]["reference_note"]
    assert "SIGABRT" in st["compile"]["reference_note"]
    for r in st["rows"]:
        assert "compile_static" not in r and r["compile_default"] == lat and r["cgrt_compile"] == lat
        assert r["compile_over_cgrt"] == pytest.approx(100.0 / r["cgrt"]["median_us"])
        assert r["pipelined_us"]["cgrt_compile"] == 50.0
    assert mt["variants"]["compile_static"]["status"] == "unavailable"
    assert "SIGABRT" in mt["variants"]["compile_static"]["reason"]
    assert mt["variants"]["compile_default"]["total_ms"] == 1e6 and mt["setup_s"]["compile_default"] == 5.0
    goal = next(g for g in bench_report.goals(data) if g["goal"].startswith("mixed trace vs torch.compile"))
    assert goal["status"] == "met" and "(b) ro-default" in goal["measured"]


def test_interleaved_timing_runs_each_variant_after_its_prepare_in_rotating_order():
    from cudagraph_rt.tools.bench.common import time_interleaved
    log = []
    variants = {name: ((lambda i, n=name: log.append(("call", n, i))),
                       (lambda i, n=name: log.append(("prep", n, i))) if name != "a" else None)
                for name in ("a", "b", "c")}
    out = time_interleaved(variants, repeats=3, warmup=1, sync=lambda: log.append(("sync",)))
    calls = [e for e in log if e[0] == "call"]
    assert len(calls) == 3 * (1 + 3)
    # every timed round calls each variant once, starting one further along each round
    timed = [e[1] for e in calls[3:]]
    assert timed == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    for k, e in enumerate(log):  # a prepare is followed by its own call, never another's
        if e[0] == "prep":
            assert next(x for x in log[k + 1:] if x[0] == "call")[1:] == e[1:]
    assert set(out) == {"a", "b", "c", "_deltas"} and set(out["_deltas"]) == {"b", "c"}
    assert all(out[n]["n"] == 3 for n in "abc")


def _dispatch_row(sequences, rounds_ran, device_tps, rounds_tps, runner_tps, busy, per64, equal=True):
    brief = lambda tps: {"tokens_per_s": tps, "mean_accepted": 2.0, "gpu_busy": busy,  # noqa: E731
                         "loop": {"launches_per_64_tokens": per64}}
    return {"sequences": sequences, "rounds_ran": rounds_ran, "device": brief(device_tps),
            "host_rounds": brief(rounds_tps), "host_runner": brief(runner_tps),
            "device_over_host_rounds": device_tps / rounds_tps, "device_over_host_runner": device_tps / runner_tps,
            "device_over_best_host": device_tps / max(rounds_tps, runner_tps), "tokens_equal": equal,
            "checks_ok": True}


@pytest.mark.parametrize("toy, device_tps, met", [(True, 1600.0, True), (True, 1400.0, False),
                                                  (False, 1250.0, True), (False, 1150.0, False)])
def test_dispatch_goals_judge_the_faster_host_loop_at_one_sequence(toy, device_tps, met):
    """The speed goal divides by the faster of the two host-driven variants (here the runner,
    1000 tok/s, over host rounds at 800), at one sequence only; a loop that ran host-driven
    (no conditional nodes) leaves the device goals unmeasured, never met."""
    from cudagraph_rt.tools.bench.dispatch import goal_values

    sec = {"rows": [_dispatch_row(1, "conditional", device_tps, 800.0, 1000.0, 0.98, 1.5),
                    _dispatch_row(4, "conditional", 10.0, 800.0, 1000.0, 0.5, 9.0)]}
    goals = {name: (value, ok) for name, value, _, ok in goal_values(sec, toy)}
    speed = next(v for k, v in goals.items() if k.startswith("device dispatch / the faster"))
    assert speed == (pytest.approx(device_tps / 1000.0), met)
    assert next(v for k, v in goals.items() if "GPU busy" in k) == (0.98, True)
    assert next(v for k, v in goals.items() if "launches" in k) == (1.5, True)
    host = {"rows": [_dispatch_row(1, "host", device_tps, 800.0, 1000.0, 0.99, 1.0, equal=False)]}
    judged = goal_values(host, toy)
    assert all(value is None and not ok for name, value, _, ok in judged if "tokens equal" not in name)
    assert [ok for name, _, _, ok in judged if "tokens equal" in name] == [False]
