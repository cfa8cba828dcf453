"""Tensor parallelism: the TP toy against the one-device toy, DistributedRuntime on two
ranks (gloo on the CPU here; NCCL with graphs in the cuda tests), the torchrun commands.

Every multi-process test runs its ranks in child processes with a hard timeout and fails
with a message naming the ranks that did not finish (never a hung CI); the process group
itself has a 60 s timeout, so a rank stuck in a collective raises inside its child. Inputs
are fresh random per run; the seed is printed (TP_TEST_SEED=<n> replays one).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import pytest
import torch

from cudagraph_rt import CgrtError, GraphRuntime, HostRows, InputError
from tests.support import ROOT as REPO_ROOT

ROOT = str(REPO_ROOT)
TIMEOUT_S = 120


@pytest.fixture
def seed() -> int:
    s = int(os.environ.get("TP_TEST_SEED", random.SystemRandom().randrange(2**31)))
    print(f"TP_TEST_SEED={s}")
    return s


# ----------------------------------------------------------------------------- launcher
def _entry(fn, rank: int, world: int, init: str, backend: str, q, args) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    try:
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(rank)  # before init_process_group: see distributed.check_rank_device
            dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=60), device_id=torch.device("cuda", rank))
        else:
            dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=60))
        torch.set_num_threads(1)
        q.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        q.put((rank, "error", traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, *args, world: int = 2, backend: str = "gloo", timeout: float = TIMEOUT_S) -> list:
    """``fn(rank, world, *args)`` on ``world`` child processes; their return values in rank
    order. Fails the test with every rank's traceback, or with the ranks still running after
    ``timeout`` seconds (then killed)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        procs = [ctx.Process(target=_entry, args=(fn, r, world, init, backend, q, args), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        got, deadline = {}, time.monotonic() + timeout
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, status, value = q.get(timeout=0.5)
                got[rank] = (status, value)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and q.empty():
                    break
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    missing = [r for r in range(world) if r not in got]
    if missing:
        pytest.fail(f"rank(s) {missing} did not finish within {timeout} s (killed); finished: "
                    f"{ {r: s for r, (s, _) in got.items()} }")
    errors = {r: v for r, (s, v) in got.items() if s != "ok"}
    if errors:
        pytest.fail("\n".join(f"rank {r} raised:\n{tb}" for r, tb in errors.items()))
    return [got[r][1] for r in range(world)]


def _catch(fn):
    """(error class name, message) of what ``fn()`` raised, or ("ok", result)."""
    try:
        return "ok", fn()
    except CgrtError as e:
        return type(e).__name__, str(e)


# ----------------------------------------------------------------------------- workers
def _toy_inputs(models, rng: random.Random, T: int, seq: int = 0, start: int = 0) -> dict:
    """T rows of ``seq`` from ``start``; their cells reserved in the pool of every model of
    ``models`` (one model or several that the same rows step: their allocators, given the
    same calls, must hand out the same cells)."""
    models = models if isinstance(models, tuple) else (models,)
    toks = [rng.randrange(models[0].config.vocab) for _ in range(T)]
    pos = list(range(start, start + T))
    cells = [m.cell_range(seq, start, T) for m in models]
    assert all(c == cells[0] for c in cells), cells
    return dict(tokens=toks, positions=pos, seq_ids=[seq] * T, cells=cells[0], want=[1] * T)


def _w_matches_toy(rank, world, seed, comm):
    """TP decoder (eager reference and runtime steps) against the one-device toy."""
    from cudagraph_rt.distributed import DistributedRuntime
    from cudagraph_rt.models import ToyDecoder
    from cudagraph_rt.models.tp import TPToyDecoder

    rng = random.Random(seed)  # the same on every rank: TP ranks step the same rows
    tp, ref = TPToyDecoder(device="cpu", comm=comm), ToyDecoder(device="cpu")
    toks = [rng.randrange(128) for _ in range(rng.randint(8, 40))]
    g_tp, h_tp = tp.reference(toks)
    g_ref, h_ref = ref.reference(toks)
    out = {"ref_tokens_equal": g_tp.tolist() == g_ref.tolist(), "ref_hidden_err": float((h_tp - h_ref).abs().max())}
    rt = DistributedRuntime(tp.step, tp.inputs(), graphs=False, check_steps=True)
    one = GraphRuntime(ref.step, ref.inputs(), graphs=False)
    toks_ok, err, widths, pos = True, 0.0, [], 0
    for T in [rng.randint(1, 70) for _ in range(6)]:
        if pos + T > 128:
            break
        inp = _toy_inputs((tp, ref), rng, T, start=pos)
        pos += T
        a, b = rt.step(**inp), one.step(**inp)
        toks_ok &= a.outputs["tokens"].tolist() == b.outputs["tokens"].tolist()
        err = max(err, float((a.outputs["hidden"] - b.outputs["hidden"]).abs().max()))
        widths.append(a.slices[0].width)
    out.update(steps_tokens_equal=toks_ok, steps_hidden_err=err, widths=widths)
    return out


def test_tp_decoder_matches_one_device_toy(seed):
    for r in run_ranks(_w_matches_toy, seed, True):
        assert r["ref_tokens_equal"] and r["steps_tokens_equal"], r
        assert r["ref_hidden_err"] < 1e-4 and r["steps_hidden_err"] < 1e-4, r


def test_tp_decoder_without_all_reduce_is_caught(seed):
    """The comparison above can fail: the same split without its all-reduces differs (the
    hidden rows on every rank; the tokens where the rank lacks head 0, the previous-token
    head that the toy's greedy rule reads)."""
    res = run_ranks(_w_matches_toy, seed, False)
    for r in res:
        assert r["ref_hidden_err"] > 0.1 and r["steps_hidden_err"] > 0.1, r
    assert not res[1]["ref_tokens_equal"] and not res[1]["steps_tokens_equal"], res[1]


def _w_rows(rank, world, seed, mode, rows_rank):
    from cudagraph_rt.distributed import DistributedRuntime
    from cudagraph_rt.models import ToyDecoder
    from cudagraph_rt.models.tp import TPToyDecoder

    rng = random.Random(seed)
    tp, ref = TPToyDecoder(device="cpu"), ToyDecoder(device="cpu")
    hr = HostRows(source="hidden", mode=mode)
    verify = mode == "device"
    rt = DistributedRuntime(tp.verify_step if verify else tp.step, tp.inputs(verify), graphs=False,
                            host_rows=hr, rows_rank=rows_rank)
    one = GraphRuntime(ref.verify_step if verify else ref.step, ref.inputs(verify), graphs=False, host_rows=hr)
    T = rng.randint(3, 40)
    inp = _toy_inputs((tp, ref), rng, T)
    want = ref.reference(inp["tokens"])[0].tolist()
    if verify:  # drafts right for a random prefix, then wrong
        k = rng.randint(0, T - 1)
        inp["next_tokens"] = [want[i] if i < k else (want[i] + 1) % 128 for i in range(T - 1)] + [-1]
    rows = sorted(rng.sample(range(T), rng.randint(1, T))) if mode != "device" else None
    a = rt.step(rows=rows if mode == "host" else None, **inp)
    b = one.step(rows=rows if mode == "host" else None, **inp)
    ha, hb = a.host_rows, b.host_rows
    if mode == "commit":
        ha, hb = rt.commit(a, rows), one.commit(b, rows)
    got = {"keys": sorted(a.outputs), "want_keys": sorted(b.outputs), "handle": ha is not None}
    if ha is not None:
        got["indices_equal"] = ha.indices().tolist() == hb.indices().tolist()
        got["n"] = ha.count
        got["err"] = float((ha.rows() - hb.rows()).abs().max()) if ha.count else 0.0
    return got


ROWS_CASES = [(mode, rows_rank) for mode in ("host", "device", "commit") for rows_rank in (0, 1, None)]


def _w_rows_all(rank, world, seed):
    return [_w_rows(rank, world, seed + i, mode, rows_rank) for i, (mode, rows_rank) in enumerate(ROWS_CASES)]


def test_host_rows_from_one_rank(seed):
    """Every host-row mode with rows from rank 0, rank 1 or every rank (one launch)."""
    per_rank = run_ranks(_w_rows_all, seed)
    for i, (mode, rows_rank) in enumerate(ROWS_CASES):
        for rank in range(2):
            r, case = per_rank[rank][i], (mode, rows_rank, rank)
            assert r["keys"] == r["want_keys"], (case, r)  # the stand-in output never shows
            ships = rows_rank is None or rank == rows_rank
            assert r["handle"] == ships, (case, r)
            if ships:
                assert r["indices_equal"] and r["n"] >= 1 and r["err"] < 1e-4, (case, r)


def _w_check_steps(rank, world, seed):
    from cudagraph_rt.distributed import DistributedRuntime
    from cudagraph_rt.models import ToyDecoder

    rng = random.Random(seed + rank)
    model = ToyDecoder(device="cpu")
    rt = DistributedRuntime(model.step, model.inputs(), graphs=False, check_steps=True)
    bad = _catch(lambda: rt.step(**_toy_inputs(model, rng, 3 if rank == 0 else 5)))
    good = _catch(lambda: rt.step(**_toy_inputs(model, rng, 4)).T)  # the group is still in step
    return bad, good


def test_check_steps_names_the_ranks(seed):
    for bad, good in run_ranks(_w_check_steps, seed):
        assert bad[0] == "RankMismatchError", bad
        assert "rank 0: T=3 width 4" in bad[1] and "rank 1: T=5 width 8" in bad[1], bad
        assert good == ("ok", 4)


def _agree_width_rig(rank, seed, seen=None):
    """Data-parallel ranks (each its own rows, a whole toy each) with a width-sized
    collective in the step: it only completes if both ranks run the same width. Returns
    the rank's rng, both toys, the agreeing runtime and a one-device runtime of the same
    weights; ``seen`` (a list) collects each step's rows as the step function saw them."""
    import torch.distributed as dist

    from cudagraph_rt.distributed import DistributedRuntime
    from cudagraph_rt.models import ToyDecoder

    rng = random.Random(seed * 7 + rank)
    model, ref = ToyDecoder(device="cpu"), ToyDecoder(device="cpu")

    def step(x):
        if seen is not None:
            seen.append({k: v.tolist() for k, v in x.items()})
        out = model.step(x)
        n = torch.ones(x["tokens"].shape[0])
        dist.all_reduce(n)
        return {**out, "ranks": n}

    rt = DistributedRuntime(step, model.inputs(), graphs=False, agree_width=True)
    return rng, model, ref, rt, GraphRuntime(ref.step, ref.inputs(), graphs=False)


def _w_agree_width(rank, world, seed):
    rng, model, ref, rt, one = _agree_width_rig(rank, seed)
    out, pos = [], 0
    for T in ([1, 3] if rank == 0 else [7, 2]) + [rng.randint(1, 20) for _ in range(3)]:
        inp = _toy_inputs((model, ref), rng, T, seq=rank, start=pos)
        pos += T
        a, b = rt.step(**inp), one.step(**inp)
        out.append((T, a.T, a.slices[0].width, a.outputs["tokens"].tolist() == b.outputs["tokens"].tolist(),
                    tuple(a.outputs["ranks"].shape), float(a.outputs["ranks"].min())))
    return out


def test_agree_width_runs_one_width_on_every_rank(seed):
    r0, r1 = run_ranks(_w_agree_width, seed)
    for (t0, T0, w0, ok0, shape0, n0), (t1, T1, w1, ok1, shape1, n1) in zip(r0, r1):
        assert w0 == w1 == 1 << (max(t0, t1) - 1).bit_length(), (r0, r1)  # the widest rank's width
        assert (T0, T1) == (t0, t1) and shape0 == (t0,) and shape1 == (t1,)  # cut to the rank's own rows
        assert ok0 and ok1 and n0 == n1 == 2.0
    assert r0[0][2] == r1[0][2] == 8 and r0[1][2] == 4  # T 1 and 7 ran width 8; 3 and 2 width 4


def _w_agree_width_pads(rank, world, seed):
    """As _w_agree_width, the step function keeping what it was handed: each step's rows
    as the step function saw them, and the hidden rows beside the one-device toy's."""
    seen = []
    rng, model, ref, rt, one = _agree_width_rig(rank, seed, seen)
    out, pos = [], 0
    for T in ([1, 3, 5] if rank == 0 else [6, 2, 8]):
        inp = _toy_inputs((model, ref), rng, T, seq=rank, start=pos)
        pos += T
        a, b = rt.step(**inp), one.step(**inp)
        err = float((a.outputs["hidden"] - b.outputs["hidden"]).abs().max())
        out.append((T, a.slices[0].width, {k: list(v) for k, v in inp.items()}, seen[-1], err))
    return out


def test_agree_width_pads_every_input_with_its_own_pad_value(seed):
    """The rows a narrower rank adds to reach the agreed width hold each input's declared
    pad (InputSpec.pad: the toy's seq_ids -1 and cells its scratch cell), never some other
    value such as 0 (cell 0 is a live cell of sequence 0, which its padding rows would
    overwrite): the step function sees the rank's own rows, then pad rows; the hidden rows
    equal the one-device toy's on every step, the later steps after a padded one too."""
    from cudagraph_rt.models import ToyDecoder
    specs = ToyDecoder(device="cpu").inputs()
    assert specs["cells"].pad != 0 and specs["seq_ids"].pad != 0  # what the check relies on
    padded = 0
    for steps in run_ranks(_w_agree_width_pads, seed):
        for T, width, given, seen, err in steps:
            assert err <= 1e-5, (T, width, err)
            for name, spec in specs.items():
                assert seen[name][:T] == given[name], (name, T)
                assert seen[name][T:] == [spec.pad] * (width - T), (name, T, width, seen[name])
            padded += width > T
    assert padded == 5  # rank 0 pads every step, rank 1 its first two


def _w_config_mismatch(rank, world):
    from cudagraph_rt.distributed import DistributedRuntime
    from cudagraph_rt.models import ToyDecoder

    model = ToyDecoder(device="cpu")
    widths = (1, 2, 4, 8) if rank == 0 else (1, 2, 4, 16)
    mismatch = _catch(lambda: DistributedRuntime(model.step, model.inputs(), graphs=False, widths=widths))
    broken = _catch(lambda: DistributedRuntime(model.step, model.inputs(), graphs=False,
                                               host_rows="hidden" if rank == 1 else None))
    driver = _catch(lambda: DistributedRuntime(model.step, model.inputs(), graphs=False, inputs_from=0,
                                               rows_rank=1))
    return mismatch, broken, driver


def test_construction_is_agreed():
    (m0, b0, d0), (m1, b1, d1) = run_ranks(_w_config_mismatch)
    for d in (d0, d1):
        assert d[0] == "InputError" and "rows_rank: expected inputs_from (0)" in d[1], d
    for m in (m0, m1):
        assert m[0] == "RankMismatchError" and "widths" in m[1], m
        assert "rank 0 (1, 2, 4, 8)" in m[1] and "rank 1 (1, 2, 4, 16)" in m[1], m
    assert b1[0] == "InputError" and "host_rows" in b1[1]  # the rank with the bad argument: its own error
    assert b0[0] == "RankMismatchError" and "rank(s) 1" in b0[1] and "host_rows" in b0[1], b0


def _w_capture_failure(rank, world, policy):
    from cudagraph_rt.distributed import DistributedRuntime
    from cudagraph_rt.models import ToyDecoder

    model = ToyDecoder(device="cpu")

    def step(x):
        if rank == 1:
            raise RuntimeError("rank 1 cannot run this step")
        return model.step(x)

    rt = DistributedRuntime(step, model.inputs(), graphs=False, host_rows=HostRows(), on_capture_error=policy)
    cap = _catch(lambda: rt.capture() and "captured")
    after = _catch(lambda: rt.step(**_toy_inputs(model, random.Random(0), 2)))
    return cap, after


def test_capture_failure_on_one_rank_fails_every_rank():
    for cap, after in run_ranks(_w_capture_failure, "raise"):
        assert cap[0] == "CaptureError", cap
        assert "capture failed on rank(s) 1" in cap[1] and "rank 1 cannot run this step" in cap[1], cap
        assert after[0] == "CgrtError" and "recapture()" in after[1], after


def _w_explain(rank, world):
    """What a failed capture's explanation does on one rank alone: its collectives must not
    run (the other ranks are warming up another width meanwhile)."""
    import torch.distributed as dist

    from cudagraph_rt.distributed import DistributedRuntime
    from cudagraph_rt.models import ToyDecoder

    model = ToyDecoder(device="cpu")

    def step(x):
        out = model.step(x)
        total = out["hidden"].sum()
        dist.all_reduce(total)
        if torch.cuda.is_current_stream_capturing():
            total.item()  # what made the capture fail
        return out

    rt = DistributedRuntime(step, model.inputs(), graphs=False)
    found = [(h.kind, h.op) for h in rt.explain_capture(4)] if rank == 1 else []
    dist.barrier()  # rank 0 went straight here: a real all-reduce on rank 1 would have met it
    return found, dist.all_reduce is not None


def test_capture_explanation_runs_no_collective():
    assert callable(getattr(GraphRuntime, "explain_capture", None)), "DistributedRuntime overrides explain_capture"
    _, (found, _) = run_ranks(_w_explain, timeout=60)
    assert any(kind == "host_sync" and "item" in op for kind, op in found), found


def test_check_rank_device_refuses_nccl_before_set_device(monkeypatch):
    """The order that hung on the H200 pair: init_process_group("nccl") before
    torch.cuda.set_device(local rank) leaves cuda:0 current on rank 1."""
    from cudagraph_rt import distributed

    class Group:
        bound_device_id = None

    monkeypatch.setattr(distributed.dist, "get_backend", lambda g: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(InputError, match=r"current_device\(\): expected 1 \(LOCAL_RANK\).*set_device.*BEFORE"):
        distributed.check_rank_device(Group(), torch.device("cuda", 0))
    with pytest.raises(InputError, match="a CUDA device with an NCCL process group"):
        distributed.check_rank_device(Group(), torch.device("cpu"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    Group.bound_device_id = torch.device("cuda", 1)
    with pytest.raises(InputError, match="the process group's device cuda:1"):
        distributed.check_rank_device(Group(), torch.device("cuda", 0))
    Group.bound_device_id = torch.device("cuda", 0)
    distributed.check_rank_device(Group(), torch.device("cuda", 0))  # the right order passes


def _w_follow(rank, world, seed, fail):
    from cudagraph_rt.distributed import DistributedRuntime
    from cudagraph_rt.models import ToyDecoder
    from cudagraph_rt.models.tp import TPToyDecoder

    rng = random.Random(seed)
    tp = TPToyDecoder(device="cpu", table_from=0)  # only the driver hands out cells
    rt = DistributedRuntime(tp.step, tp.inputs(), graphs=False, inputs_from=0)
    if rank == 1:
        early = _catch(lambda: rt.step(**_toy_inputs(tp, rng, 2)))
        return early, _catch(rt.follow)
    early = _catch(lambda: rt.step(**_toy_inputs(tp, rng, 2)))  # before capture(): refused
    rt.capture()
    ref = ToyDecoder(device="cpu")
    one, ok, pos = GraphRuntime(ref.step, ref.inputs(), graphs=False), True, 0
    for _ in range(5):
        T = rng.randint(1, 20)
        inp = _toy_inputs((tp, ref), rng, T, start=pos)
        pos += T
        a, b = rt.step(**inp).outputs, one.step(**inp).outputs
        ok &= a["tokens"].tolist() == b["tokens"].tolist() and float((a["hidden"] - b["hidden"]).abs().max()) < 1e-4
    rt.stop_followers("driver broke" if fail else None)
    return early, ok


def test_followers_step_what_the_driver_broadcasts(seed):
    (early0, ok), (early1, follow) = run_ranks(_w_follow, seed, False)
    assert early0[0] == "CgrtError" and "capture() on every rank first" in early0[1]
    assert early1[0] == "CgrtError" and "call follow() here" in early1[1]
    assert ok is True and follow == ("ok", 5)
    _, (_, follow) = run_ranks(_w_follow, seed, True)
    assert follow[0] == "CgrtError" and "driver broke" in follow[1]


# ----------------------------------------------------------------------------- commands
def _torchrun(*argv: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "cudagraph_rt", *argv]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} did not finish within {timeout} s:\n{e.stdout}\n{e.stderr}")


def test_torchrun_demo_tp2_gloo():
    p = _torchrun("demo", "--tp", "2", "--device", "cpu", "--sequences", "6", "--max-new", "16")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "greedy mismatches none" in p.stdout and "tensor-parallel over 2 ranks (gloo)" in p.stdout, p.stdout
    assert p.stdout.count("cgrt demo: toy") == 1  # only rank 0 prints


def test_torchrun_sweep_tp2_gloo(seed):
    p = _torchrun("sweep", "--tp", "2", "--device", "cpu", "--repeats", "1", "--seed", str(seed))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "sweep PASSED: toy tiny float32 TP 2" in p.stdout and f"--seed {seed} --tp 2" in p.stdout, p.stdout
    assert p.stdout.count("sweep PASSED") == 1


def test_tp_without_torchrun_is_refused(capsys):
    from cudagraph_rt import cli

    assert cli.main(["demo", "--tp", "2", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--tp: expected 2 processes started by torchrun" in err and "got WORLD_SIZE=None" in err


def test_torchrun_bench_tp2_quick(tmp_path):
    out = tmp_path / "tp.json"
    p = _torchrun("bench", "--tp", "2", "--quick", "--repeats", "1", "--warmup", "0", "--json", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    import json

    res = json.loads(out.read_text())
    assert [r["T"] for r in res["rows"]] == [1, 2, 4, 8, 16, 32, 64]
    assert all(r["tp_eager"] > 0 and r["tp1_eager"] > 0 and r["allreduce_eager"] > 0 for r in res["rows"])
    assert len(res["capture_s"]["off"]) == 2 and "step time per width" in p.stdout


# ----------------------------------------------------------------------------- two GPUs
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


def _w_cuda_graphs(rank, world, seed):
    from cudagraph_rt.distributed import DistributedRuntime
    from cudagraph_rt.models import ToyConfig, ToyDecoder
    from cudagraph_rt.models.tp import TPToyDecoder

    rng, dev = random.Random(seed), torch.device("cuda", rank)
    out = {}
    for name, cfg in (("tiny", ToyConfig.tiny()), ("bench", ToyConfig.bench())):
        tp, ref = TPToyDecoder(cfg, dev), ToyDecoder(cfg, dev)
        rts = {g: DistributedRuntime(tp.step, tp.inputs(), graphs=g, device=dev, check_steps=True)
               for g in (True, False)}
        one = GraphRuntime(ref.step, ref.inputs(), graphs=True, device=dev)
        cap = rts[True].capture()
        rts[False].capture()
        one.capture()
        same, toks, err = True, True, 0.0
        for T in [rng.randint(1, 64) for _ in range(8)]:
            seq = rng.randrange(8)
            ref.reset_cache()
            inp = {k: torch.tensor(v) for k, v in _toy_inputs(ref, rng, T, seq=seq).items()}
            res = {}
            for g, rt in rts.items():
                tp.reset_cache()  # a fresh pool hands out the same cells
                assert tp.cell_range(seq, 0, T) == inp["cells"].tolist()
                r = rt.step(**inp)
                res[g] = {k: v.clone() for k, v in r.outputs.items()}
            b = one.step(**inp).outputs
            same &= all(torch.equal(res[True][k], res[False][k]) for k in res[True])
            toks &= torch.equal(res[True]["tokens"], b["tokens"])
            err = max(err, float((res[True]["hidden"].float() - b["hidden"].float()).abs().max()))
        out[name] = dict(graphs_equal_eager=same, tokens_equal_toy=toks, hidden_err=err, capture_s=cap.seconds,
                         graphs=len(rts[True].graphs_captured))
    return out


@pytest.mark.cuda
@two_gpus
def test_cuda_tp2_graphs_with_nccl(seed):
    for r in run_ranks(_w_cuda_graphs, seed, backend="nccl", timeout=300):
        for name, tol in (("tiny", 1e-4), ("bench", 0.25)):
            assert r[name]["graphs"] == 7, r
            assert r[name]["graphs_equal_eager"] and r[name]["tokens_equal_toy"], r
            assert r[name]["hidden_err"] < tol, r


def _w_cuda_capture_failure(rank, world):
    from cudagraph_rt.distributed import DistributedRuntime
    from cudagraph_rt.models.tp import TPToyDecoder

    tp = TPToyDecoder(device=torch.device("cuda", rank))

    def step(x):
        out = tp.step(x)
        if rank == 1 and torch.cuda.is_current_stream_capturing():
            out["tokens"].sum().item()  # a host sync: this rank's capture fails
        return out

    rt = DistributedRuntime(step, tp.inputs(), graphs=True)
    kind, msg = _catch(rt.capture)
    return kind, str(msg)[:2000]


@pytest.mark.cuda
@two_gpus
def test_cuda_capture_failure_on_rank_1_fails_both_ranks():
    for kind, msg in run_ranks(_w_cuda_capture_failure, backend="nccl", timeout=300):
        assert kind == "CaptureError" and "capture failed on rank(s) 1" in msg, msg


def _w_cuda_wrong_order(rank, world):
    """init_process_group("nccl") was called, but set_device was not: cuda:0 current on rank 1."""
    from cudagraph_rt.distributed import DistributedRuntime
    from cudagraph_rt.models import ToyDecoder

    torch.cuda.set_device(0)  # undo _entry's set_device: the order the issue saw hang
    model = ToyDecoder(device=torch.device("cuda", 0))
    return _catch(lambda: DistributedRuntime(model.step, model.inputs(), graphs=True, device="cuda:0"))


@pytest.mark.cuda
@two_gpus
def test_cuda_runtime_refuses_device_not_set_before_init():
    r0, r1 = run_ranks(_w_cuda_wrong_order, backend="nccl", timeout=180)
    assert r1[0] == "InputError" and "set_device(local_rank) BEFORE init_process_group" in r1[1], r1
    assert r0[0] == "RankMismatchError" and "construction failed on rank(s) 1" in r0[1], r0


@pytest.mark.cuda
@two_gpus
@pytest.mark.parametrize("graphs", ["on", "off"])
def test_cuda_torchrun_demo_and_sweep_tp2(graphs):
    p = _torchrun("demo", "--tp", "2", "--graphs", graphs, timeout=300)
    assert p.returncode == 0 and "greedy mismatches none" in p.stdout, p.stdout + p.stderr
    p = _torchrun("sweep", "--tp", "2", "--graphs", graphs, "--repeats", "2", timeout=300)
    assert p.returncode == 0 and "sweep PASSED" in p.stdout, p.stdout + p.stderr
