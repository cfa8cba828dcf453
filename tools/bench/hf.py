"""``cgrt bench --model hf:<family> [--size 1b]``: a transformers model (random weights) through
cudagraph_rt against transformers' own ``generate``, in one run.

Sections (each reported on its own; a failing one is recorded and the rest still run):
  greedy    greedy decoding of ``--hf-prompt`` prompt tokens + ``--hf-new`` new tokens at 1, 4 and
            16 sequences: the runtime (graphs on, prefill then one row per sequence per step,
            tokens fed back on the device) against (a) ``generate()`` eager and (b) ``generate()``
            with a static cache and transformers' automatic compile (a child process; a failure
            or timeout is reported with its error). Tokens/s include prefill; tokens are
            compared with eager's (agreement up to the first near-tie that rounds differently).
  compiled  the runtime capturing a ``torch.compile``d decoder at width 1 (child process; mode
            ``--cgrt-compile-mode``): per-token time at one sequence against the weight-read
            floor (unique parameter bytes / 4.8 TB/s nominal H200 HBM bandwidth), beside the
            uncompiled runtime's.
  spec      speculative decoding through the demo runner at one sequence (k = 4, ``--drafter``:
            the coin test double at accept-prob 0.7 by default, or ngram / head:PATH /
            model:PATH with measured acceptance) against the same runner with k = 0.
  capture   capture time of all default widths; the shared pool against the widest alone.
  pieces    piecewise graphs (tools/bench/pieces.py): the runtime's attention marked eager, in
            pieces against whole graphs and eager; varlen attention (per-step host ints) in
            pieces against eager; T 1-8.
  sampling  the sampler (kernels.sampling) against torch's sort-based top-p sampling at 1 and 64
            rows and the model's vocabulary, side by side, and its share of the width-1 step
            (tools/bench/sampling.py).

``--quick``: a CPU smoke run (tiny config, graphs off, a few tokens, no child processes).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

import torch

from cudagraph_rt import GraphRuntime
from cudagraph_rt.models import hf

from .common import step_time_us

HBM_BYTES_PER_S = 4.8e12  # H200 nominal HBM3e bandwidth: the floor's assumption, stated in the report
SEQS = (1, 4, 16)
SPEC_GOAL, EAGER_GOAL, STATIC_GOAL, STATIC_MANY_GOAL, FLOOR_GOAL = 2.2, 8.0, 2.0, 1.3, 2.0
SPEC_DRAFTER_GOAL = 1.6  # a real drafter (measured acceptance) against plain decoding, issue 37
COMPILE_GOAL_S, CAPTURE_GOAL_S = 60.0, 2.0


# ------------------------------------------------------------------------------ measurements
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def prompts_for(model: hf.HFDecoder, n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab, (n, length), generator=g).tolist()


def runtime_greedy(model: hf.HFDecoder, rt: GraphRuntime, prompts: list[list[int]], new: int) -> tuple[float, list]:
    """Greedy decoding through ``rt``: one prefill step per prompt, then ``new - 1`` steps of
    one row per sequence, each step's tokens fed to the next on the device (no host read
    until the end): every sequence's blocks are reserved first (``cell_range``), so each
    step's cells come from the block table on the device (``pool.device_cells``).
    Returns (seconds, tokens per sequence)."""
    model.reset_cache()
    dev, B, P = model.device, len(prompts), len(prompts[0])
    seq = torch.arange(B, device=dev)
    _sync(dev)
    t0 = time.perf_counter()
    firsts = []
    for s, p in enumerate(prompts):
        res = rt.step(tokens=p, positions=list(range(P)), seq_ids=[s] * P, cells=model.cell_range(s, 0, P),
                      want=[0] * (P - 1) + [1])
        firsts.append(res.outputs["tokens"][-1:].clone())
        if new > 1:
            model.cell_range(s, P, new - 1)  # the decode positions' blocks, before the loop
    cur = torch.cat(firsts)
    out = [cur]
    ones = torch.ones(B, dtype=torch.int64, device=dev)
    for i in range(new - 1):
        pos = torch.full((B,), P + i, dtype=torch.int64, device=dev)
        res = rt.step(tokens=cur, positions=pos, seq_ids=seq, cells=model.pool.device_cells(seq, pos), want=ones)
        cur = res.outputs["tokens"].clone()
        out.append(cur)
    toks = torch.stack(out, 1).cpu()
    dt = time.perf_counter() - t0
    return dt, toks.tolist()


def generate_greedy(model: hf.HFDecoder, prompts: list[list[int]], new: int, **kw) -> tuple[float, list]:
    ids = torch.tensor(prompts, device=model.device)
    args = dict(attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new, pad_token_id=0,
                eos_token_id=None, **kw)
    _sync(model.device)
    t0 = time.perf_counter()
    out = model.model.generate(ids, **args)
    _sync(model.device)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def agreement(a: list[list[int]], b: list[list[int]]) -> int:
    """Tokens equal before the first difference, the minimum over sequences."""
    return min(next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y), min(len(ra), len(rb)))
               for ra, rb in zip(a, b))


def weight_floor(model: hf.HFDecoder) -> dict:
    params = {p.data_ptr(): p.numel() * p.element_size() for p in model.model.parameters()}
    w = sum(params.values())
    return {"weight_bytes": w, "pool_bytes": model.pool.nbytes, "bandwidth_bytes_per_s": HBM_BYTES_PER_S,
            "floor_us": w / HBM_BYTES_PER_S * 1e6,
            "method": "unique parameter bytes (tied embeddings once) / nominal bandwidth; the KV reads are left out "
                      "(the cell attention reads only the live cells)"}


# ------------------------------------------------------------------------------ sections
def sec_greedy(ctx) -> dict:
    rows = []
    for B in ctx.seqs:
        prompts = prompts_for(ctx.model, B, ctx.prompt, ctx.seed + B)
        generate_greedy(ctx.model, prompts, min(4, ctx.new))  # warm-up
        eager_s, eager_toks = generate_greedy(ctx.model, prompts, ctx.new)
        runtime_greedy(ctx.model, ctx.rt, prompts, min(4, ctx.new))  # warm-up
        rt_s, rt_toks = runtime_greedy(ctx.model, ctx.rt, prompts, ctx.new)
        n = B * ctx.new
        rows.append({"sequences": B, "runtime_tok_s": n / rt_s, "eager_tok_s": n / eager_s,
                     "runtime_over_eager": eager_s / rt_s, "agree_with_eager": agreement(rt_toks, eager_toks),
                     "eager_tokens": eager_toks})
    static = ctx.child("static", {"seqs": list(ctx.seqs)})
    for r in rows:
        st = (static.get("per_batch") or {}).get(str(r["sequences"])) if static["status"] == "ok" else None
        if st:
            r["static_compile_tok_s"] = st["tok_s"]
            r["static_compile_first_call_s"] = st["first_s"]
            r["runtime_over_static"] = r["runtime_tok_s"] / st["tok_s"]
            r["static_agree_with_eager"] = agreement(st["tokens"], r["eager_tokens"])
        r.pop("eager_tokens")
    return {"status": "ok", "rows": rows, "static_child": {k: v for k, v in static.items() if k != "per_batch"},
            "method": f"{ctx.prompt}-token random prompts, {ctx.new} new tokens, greedy, no EOS; tokens/s = "
                      "sequences x new / wall time including prefill, after one short warm-up call; runtime: "
                      "graphs on, per-sequence prefill steps then one row per sequence per step, tokens fed back "
                      "on the device; static: generate(cache_implementation='static') with transformers' automatic "
                      "compile, second call timed, in a child process"}


def sec_compiled(ctx) -> dict:
    """The width-1 step of the bench's runtime (compiled, fused projections) against the
    weight-read floor, beside the same weights' step with eager modules (a second
    HFDecoder over the same transformers model, its own pool and runtime)."""
    if not ctx.graphs:  # the floor is a GPU's bandwidth: no figure of a CPU run is held to it
        return {"status": "skipped", "reason": "needs CUDA (the weight-read floor is the H200's HBM bandwidth)"}
    floor = weight_floor(ctx.model)
    steps = {T: step_time_us(ctx.model, ctx.rt, T, ctx.repeats) for T in (1, 8)}
    plain = hf.HFDecoder(ctx.model.model, max_seqs=ctx.model.config.max_seqs, max_len=ctx.model.config.max_len)
    rt = GraphRuntime(plain.step, plain.inputs(), widths=(1,), graphs=True, device=plain.device)
    rt.capture()
    eager_us = step_time_us(plain, rt, 1, ctx.repeats)
    rt.close()
    del rt, plain
    return {"status": "ok", "floor": floor, "compiled": ctx.compiled, "fused": ctx.fused,
            "width1_us": steps[1], "width8_us": steps[8], "width1_over_floor": steps[1] / floor["floor_us"],
            "eager_modules_width1_us": eager_us, "eager_modules_over_floor": eager_us / floor["floor_us"],
            "compile_s": ctx.compile_s, "compiled_graphs": ctx.compiled_graphs,
            "first_capture_s_incl_compile": ctx.first_capture_s,
            "method": "median of 5 batches of back-to-back width-1 (and width-8) decode steps through the bench's "
                      "runtime; eager modules: the same weights without torch.compile, captured at width 1"}


SPEC_PLAN_PASSES = 2  # untimed spec runs whose served tokens become the next run's plans


def sec_spec(ctx) -> dict:
    """Speculative against plain decoding at one sequence (slots 1, lanes 1), on the same
    requests through cgrt demo's runner: plain greedy (k=0) first, then k=4 with the
    ``--drafter``. A real drafter (ngram, head:PATH, model:PATH) is timed as it is, its
    acceptance measured. The coin (the default) is a test double right with probability
    0.7 (ReferenceDrafter), whose truth is the runtime's own served tokens: greedy's outputs
    plan the first of ``SPEC_PLAN_PASSES`` untimed spec runs, each run's outputs plan the
    next, the last plans the timed one (the width-8 verify step rounds unlike the width-1
    greedy step, and on this random model's near-ties the outputs part); a re-plan is
    counted and timed, and the speedup is also given without it."""
    from .. import options
    from ..demo import serve as serving

    kind = getattr(ctx, "drafter", "coin")
    coin = options.is_coin(kind)
    out, plans, passes = {}, None, []
    reqs = serving.make_requests(ctx.model.config, ctx.spec_sequences, ctx.new, ctx.seed)
    # an untimed plain run first, so the timed ones meet no first-time cost; the plain runs
    # keep a drafter that costs nothing per step (prompt lookup observes nothing)
    runs = [("warm", 0), ("greedy", 0)] + ([("plan", 4)] * SPEC_PLAN_PASSES if coin else []) + [("spec", 4)]
    for name, k in runs:
        args = SimpleNamespace(k=k, accept_prob=0.7, seed=ctx.seed, slots=1, lanes=1, chunk=128, rounds=0,
                               drafter=kind if k or coin else "ngram", **getattr(ctx, "sampling", {}))
        r = serving.serve(ctx.model, reqs, ctx.graphs, args, plans=plans if coin else None)
        plans = r.pop("finished_seqs")
        if name == "warm":
            continue
        if name == "plan":
            passes.append({"replans": r["replans"], "accepted": r["accepted"], "proposed": r["proposed"]})
            continue
        # the host phases and GPU busy: the ratio moves with the runner's host time a step
        out[name] = {key: r[key] for key in ("tokens", "seconds", "tokens_per_s", "steps", "proposed", "accepted",
                                             "capture_s", "replans", "replan_seconds", "host_phases_us_per_step",
                                             "device_seconds", "gpu_busy", "mean_accepted",
                                             "acceptance_by_position")}
        out[name]["check_ok"] = r["check"]["ok"]
        out[name]["check"] = r["check"]
        out[name]["near_ties"] = r["check"].get("near_ties", 0)
    sp = out["spec"]
    net = sp["tokens"] / max(sp["seconds"] - sp["replan_seconds"], 1e-9)
    how = (f"k=4, accept-prob 0.7 (ReferenceDrafter, a test double) planned by the last of {SPEC_PLAN_PASSES} untimed "
           "spec runs; re-plans timed apart") if coin else f"k=4, drafter {kind}, acceptance measured"
    return {"status": "ok", **out, "drafter": serving.drafter_label(kind, 0.7),
            "speedup": sp["tokens_per_s"] / out["greedy"]["tokens_per_s"],
            "speedup_without_replans": net / out["greedy"]["tokens_per_s"],
            "draft_acceptance": sp["accepted"] / max(sp["proposed"], 1),
            "mean_accepted": sp["mean_accepted"], "acceptance_by_position": sp["acceptance_by_position"],
            "tokens_per_step": sp["tokens"] / max(sp["steps"], 1), "plan_passes": passes,
            "method": f"cgrt demo's runner, {ctx.spec_sequences} requests served one at a time (slots 1, lanes 1), "
                      f"up to {ctx.new} new tokens each; greedy: k=0 first; spec: {how}"}


def sec_capture(ctx) -> dict:
    if not ctx.graphs:
        return {"status": "skipped", "reason": "needs CUDA (graph pools)"}
    shared = GraphRuntime(ctx.model.step, ctx.model.inputs(), graphs=True, device=ctx.model.device)
    try:
        rep = shared.capture()
        widths, pool, seconds = shared.widths, rep.pool_bytes, rep.seconds
    finally:
        shared.close()
    alone = GraphRuntime(ctx.model.step, ctx.model.inputs(), widths=(widths[-1],), graphs=True,
                         device=ctx.model.device)
    try:
        widest = alone.capture().pool_bytes
    finally:
        alone.close()
    return {"status": "ok", "widths": list(widths), "capture_s": seconds, "pool_bytes": pool,
            "widest_alone_bytes": widest, "shared_over_widest": pool / widest if widest else None,
            "first_capture_s": ctx.first_capture_s, "compile_s": ctx.compile_s, "compiled": ctx.compiled,
            "method": "CaptureReport of a fresh runtime over the same model (the process captured once already; "
                      "a compiled step's graphs were compiled then, so this is capture after compile)"}


def sec_pool(ctx) -> dict:
    from .pool import sec_pool as run_pool
    return run_pool(ctx)


def sec_sampling(ctx) -> dict:
    from .sampling import sec_sampling as run_sampling
    return run_sampling(ctx)


def sec_dispatch(ctx) -> dict:
    from .dispatch import run_section
    return run_section(ctx.model, graphs=ctx.graphs, seed=ctx.seed, sequences=(1, 2) if not ctx.graphs else (1, 4),
                       requests=ctx.spec_sequences, new=ctx.new, near_ties=True)


def sec_pieces(ctx) -> dict:
    from .pieces import sec_pieces as run_pieces
    return run_pieces(ctx)


# The cheap sections first: the static+compile child may run into a caller's time limit.
SECTIONS = {"compiled": sec_compiled, "pool": sec_pool, "spec": sec_spec, "capture": sec_capture,
            "pieces": sec_pieces, "sampling": sec_sampling, "dispatch": sec_dispatch, "greedy": sec_greedy}


# ------------------------------------------------------------------------------ context, children
class _Ctx:
    def __init__(self, args):
        self.family = getattr(args, "family", None) or hf.parse_model(args.model)
        self.path = getattr(args, "model_path", None)  # a local checkpoint folder (--model PATH)
        self.quick = bool(args.quick)
        dev = args.device or ("cpu" if self.quick or not torch.cuda.is_available() else "cuda")
        self.graphs = dev == "cuda"
        light = self.quick or not self.graphs  # a CPU's defaults: about a minute in all
        self.size = "tiny" if self.quick or self.path else (args.size or ("tiny" if light else "1b"))
        self.seed = args.seed
        self.drafter = getattr(args, "drafter", None) or "coin"
        # the spec section's requests sample with these (cgrt demo's flags; default greedy)
        self.sampling = {k: getattr(args, k, d) for k, d in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0),
                                                             ("min_p", 0.0))}
        self.seqs = (1, 2) if light else SEQS
        self.prompt, self.new = (8, 6) if light else (args.hf_prompt, args.hf_new)
        self.repeats = 5 if light else 50
        self.spec_sequences = 2 if light else 4
        self.compile_mode = args.cgrt_compile_mode
        self.timeout = args.compile_timeout
        self.children = not (self.quick or args.no_compile or not self.graphs)
        max_len = max(256, self.prompt + self.new + 8) if not light else 64
        # On CUDA the bench's runtime is what an engine would run: q/k/v and gate/up merged,
        # the step compiled (one dynamic-width graph), captured at every default width.
        self.compiled = self.fused = self.graphs and not args.no_compile
        self.model = hf.build(self.family, self.size, device=dev, seed=self.seed, fuse=self.fused,
                              max_seqs=max(16, max(self.seqs)), max_len=max_len, path=self.path)
        rows = self.model.compile_decoder(self.compile_mode) if self.compiled else None
        self.rt = GraphRuntime(self.model.step, self.model.inputs(), graphs=self.graphs, device=self.model.device)
        t0 = time.perf_counter()
        self.rt.capture()
        self.first_capture_s = time.perf_counter() - t0
        self.compile_s = rows.compile_s if rows is not None else 0.0
        self.compiled_graphs = rows.graphs if rows is not None else 0
        self.build_args = dict(family=self.family, size=self.size, seed=self.seed, max_seqs=self.model.config.max_seqs,
                               max_len=max_len, prompt=self.prompt, new=self.new, repeats=self.repeats,
                               path=self.path)

    def child(self, kind: str, extra: dict) -> dict:
        """Run ``kind`` in a child process (a crash or a hang cannot take the bench down)."""
        if not self.children:
            return {"status": "skipped", "reason": "no child processes with --quick, --no-compile or on a CPU"}
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.json")
            payload = json.dumps({**self.build_args, **extra})
            cmd = [sys.executable, "-m", "cudagraph_rt.tools.bench.hf_child", kind, payload, out]
            t0 = time.perf_counter()
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout)
            except subprocess.TimeoutExpired:
                return {"status": "unavailable", "error": f"timed out after {self.timeout} s", "cmd": " ".join(cmd)}
            wall = time.perf_counter() - t0
            if p.returncode != 0 or not os.path.exists(out):
                tail = (p.stderr or p.stdout or "").strip().splitlines()[-6:]
                return {"status": "unavailable", "error": f"exit {p.returncode}: " + " | ".join(tail), "wall_s": wall}
            with open(out) as f:
                res = json.load(f)
        res.setdefault("status", "ok")
        res["wall_s"] = wall
        return res


# ------------------------------------------------------------------------------ report
def goals(r: dict) -> list[dict]:
    out = []

    def add(name, value, target, ok, why=""):
        out.append({"goal": name, "value": value, "target": target,
                    "status": "n/a" if value is None else ("met" if ok else "missed"), "note": why})

    g = r.get("greedy", {})
    rows = {x["sequences"]: x for x in g.get("rows", [])}
    one, many = rows.get(1, {}), rows.get(max(rows) if rows else 0, {})
    v = one.get("runtime_over_eager")
    add("1 seq: runtime / generate eager", v, f">= {EAGER_GOAL}x", v is not None and v >= EAGER_GOAL)
    v = one.get("runtime_over_static")
    add("1 seq: runtime / generate static+compile", v, f">= {STATIC_GOAL}x", v is not None and v >= STATIC_GOAL)
    v = many.get("runtime_over_static")
    add(f"{many.get('sequences')} seqs: runtime / generate static+compile", v, f">= {STATIC_MANY_GOAL}x",
        v is not None and v >= STATIC_MANY_GOAL)
    c = r.get("compiled", {})
    v = c.get("width1_over_floor")
    add("step, 1 seq: per-token / weight-read floor", v, f"<= {FLOOR_GOAL}x", v is not None and v <= FLOOR_GOAL,
        f"compiled {c.get('compiled')}, fused {c.get('fused')}; stretch 1.6x")
    v = c.get("compile_s") if c.get("compiled") else None
    add("compile of every width (s)", v, f"<= {COMPILE_GOAL_S:.0f} s", v is not None and v <= COMPILE_GOAL_S)
    s = r.get("spec", {})
    v = s.get("speedup_without_replans")
    coin = "test double" in str(s.get("drafter", "test double"))
    name = "speculative k=4 p=0.7 (coin, a test double)" if coin else f"speculative k=4, drafter {s.get('drafter')}"
    goal = SPEC_GOAL if coin else SPEC_DRAFTER_GOAL
    add(f"{name} / plain greedy (runtime, 1 seq)", v, f">= {goal}x", v is not None and v >= goal,
        (f"without the stand-in drafter's re-plans ({(s.get('spec') or {}).get('replans')}); "
         f"with them {s.get('speedup') or 0:.2f}x") if coin else
        f"mean accepted {s.get('mean_accepted') or 0:.2f} of 4, by position "
        + ", ".join(f"{a:.2f}" for a in s.get("acceptance_by_position") or []))
    cap = r.get("capture", {})
    v = cap.get("capture_s")
    add("capture of all default widths, after compile (s)", v, f"<= {CAPTURE_GOAL_S:.0f} s",
        v is not None and v <= CAPTURE_GOAL_S)
    v = cap.get("shared_over_widest")
    add("shared pool / widest alone", v, "<= 1.25x", v is not None and v <= 1.25)
    from .pool import goals as pool_goals
    for name, value, target, ok in pool_goals(r.get("pool", {})):
        add(name, value, target, ok)
    from .pieces import goals as piece_goals
    for name, value, target, ok in piece_goals(r.get("pieces", {})):
        add(name, value, target, ok)
    from .sampling import goals as sampling_goals
    for name, value, target, ok in sampling_goals(r.get("sampling", {})):
        add(name, value, target, ok)
    from .dispatch import goal_values as dispatch_goals
    for name, value, target, ok in dispatch_goals(r.get("dispatch", {}), toy=False):
        add(name, value, target, ok)
    return out


def _print(r: dict) -> None:
    from rich.table import Table

    from ..console import fit, make_console

    con = make_console()
    m = r["meta"]
    con.print(f"cgrt bench: hf:{m['family']} {m['size']} ({m['dtype']}, {m['layers']} layers, hidden {m['hidden']}) "
              f"on {m['device_name']}; torch {m['torch']}, transformers {m['transformers']}", markup=False)
    for key in SECTIONS:
        sec = r.get(key, {})
        if sec.get("status") != "ok":
            con.print(f"{key}: {sec.get('status')}: {sec.get('reason') or sec.get('error', '')}", markup=False,
                      style="yellow")
            continue
        if key == "greedy":
            t = Table(title="greedy decoding, tokens/s")
            for h in ("seqs", "runtime", "generate eager", "x eager", "static+compile", "x static", "agree (eager)"):
                t.add_column(h, justify="right")
            for x in sec["rows"]:
                st = x.get("static_compile_tok_s")
                t.add_row(str(x["sequences"]), f"{x['runtime_tok_s']:.0f}", f"{x['eager_tok_s']:.0f}",
                          f"{x['runtime_over_eager']:.1f}", "-" if st is None else f"{st:.0f}",
                          "-" if st is None else f"{x['runtime_over_static']:.2f}", str(x["agree_with_eager"]))
            con.print(fit(t))
            ch = sec["static_child"]
            if ch.get("status") != "ok":
                con.print(f"static+compile: {ch.get('status')}: {ch.get('reason') or ch.get('error')}", markup=False)
        elif key == "compiled":
            f = sec["floor"]
            how = ("compiled, fused q/k/v and gate/up" if sec["compiled"] else "eager modules")
            con.print(f"step at 1 seq ({how}): width 1 {sec['width1_us']:.0f} us ({sec['width1_over_floor']:.2f}x "
                      f"floor), width 8 {sec['width8_us']:.0f} us; eager modules {sec['eager_modules_width1_us']:.0f}"
                      f" us ({sec['eager_modules_over_floor']:.2f}x); compile {sec['compile_s']:.1f} s "
                      f"({sec['compiled_graphs']} graphs); floor {f['floor_us']:.0f} us "
                      f"({f['weight_bytes'] / 2**30:.2f} GiB at {f['bandwidth_bytes_per_s'] / 1e12:.1f} TB/s)",
                      markup=False)
        elif key == "pool":
            for x in sec["pool_scaling"]:
                con.print(f"pool scaling, width {x['width']}: {x['small_cells']:,} cells {x['small_pool_us']:.0f} us, "
                          f"{x['big_cells']:,} cells {x['big_pool_us']:.0f} us ({x['ratio']:.2f}x)", markup=False)
            for x in sec["context_scaling"]:
                con.print(f"context {x['live']:>6,} cells, width {x['width']}: step {x['step_us']:.0f} us, attention "
                          f"{x['attention_us']:.0f} us = {x['attention_over_floor']:.2f}x its KV floor "
                          f"({x['kv_floor_us']:.0f} us)", markup=False)
        elif key == "spec":
            con.print(f"speculative (k=4, drafter {sec.get('drafter', 'coin')}) {sec['spec']['tokens_per_s']:.0f} tok/s vs plain greedy "
                      f"{sec['greedy']['tokens_per_s']:.0f} tok/s through the runtime: {sec['speedup']:.2f}x "
                      f"({sec['speedup_without_replans']:.2f}x without {sec['spec']['replans']} re-plans, "
                      f"{sec['spec']['replan_seconds']:.2f} s; drafts accepted "
                      f"{sec['draft_acceptance']:.2f}, {sec['tokens_per_step']:.2f} tokens a step; mean accepted "
                      f"{sec.get('mean_accepted', 0.0):.2f}, by position "
                      f"{', '.join(f'{a:.2f}' for a in sec.get('acceptance_by_position') or [])}); "
                      f"checks {'ok' if sec['spec']['check_ok'] and sec['greedy']['check_ok'] else 'FAILED'}",
                      markup=False)
            for name in ("greedy", "spec"):
                ch = sec[name]["check"]
                if not ch["ok"]:
                    con.print(f"  {name} check: mismatches {ch['token_mismatches']}, near-ties {ch['near_ties']}, rows "
                              f"{ch['rows_checked']} worst {ch['rows_max_err']:.3g} of tol ({ch['rows_rule']})",
                              markup=False)
        elif key == "dispatch":
            from .dispatch import table
            con.print(table(sec))
        elif key == "pieces":
            from .pieces import print_section
            print_section(con, sec)
        elif key == "sampling":
            from .sampling import print_section as print_sampling
            print_sampling(con, sec)
        elif key == "capture":
            con.print(f"capture of widths {sec['widths']}: {sec['capture_s']:.2f} s; pool {sec['pool_bytes'] / 2**20:.1f}"
                      f" MiB, widest alone {sec['widest_alone_bytes'] / 2**20:.1f} MiB "
                      f"({sec['shared_over_widest'] or 0:.2f}x)", markup=False)
    if not r["goals"]:
        from ..options import CPU_NOTE

        con.print(CPU_NOTE, markup=False, style="yellow")
        return
    t = Table(title="goals")
    for h in ("goal", "value", "target", "status"):
        t.add_column(h)
    for g in r["goals"]:
        t.add_row(g["goal"], "-" if g["value"] is None else f"{g['value']:.2f}", g["target"], g["status"])
    con.print(fit(t))


def run(args: argparse.Namespace) -> int:
    """Every section; ``--json FILE`` writes the figures. Exit 1 when a section failed (or
    with ``--strict`` a goal was missed)."""
    from cudagraph_rt.extras import MissingExtraError, require

    from .. import options
    from ..progress import Activity

    try:
        transformers = require("hf", "cgrt bench --model hf:...")
    except MissingExtraError as e:
        print(f"cgrt bench: {e}", file=sys.stderr)
        return 2
    with Activity.of("cgrt bench", args) as activity:
        with activity.phase(f"building {args.model} and capturing its widths"):
            ctx = _Ctx(args)
        return _run(args, ctx, transformers, activity)


def _run(args: argparse.Namespace, ctx: _Ctx, transformers, activity) -> int:
    from .. import options

    c = ctx.model.config
    r = {"meta": {"family": ctx.family, "size": ctx.size, "dtype": str(c.dtype).replace("torch.", ""),
                  "layers": c.layers, "hidden": c.hidden, "device": str(ctx.model.device),
                  "device_name": torch.cuda.get_device_name(ctx.model.device) if ctx.graphs else "cpu",
                  "torch": torch.__version__, "transformers": transformers.__version__, "seed": ctx.seed,
                  "prompt": ctx.prompt, "new": ctx.new, "quick": ctx.quick, "argv": sys.argv[1:],
                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}}
    failed = 0
    picked = set(getattr(args, "hf_sections", None) or SECTIONS)
    for key, fn in SECTIONS.items():
        t0 = time.perf_counter()
        if key not in picked:
            r[key] = {"status": "not run", "seconds": 0.0}
            continue
        try:
            with activity.phase(key):
                res = fn(ctx)
        except Exception as e:  # noqa: BLE001 - one failed section must not lose the others
            failed += 1
            res = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        res["seconds"] = time.perf_counter() - t0
        r[key] = res
        # Progress and figures so far: a run stopped from outside still leaves what it measured.
        print(f"[{key}] {res.get('status', 'ok')} in {res['seconds']:.1f} s", file=sys.stderr, flush=True)
        if args.json and not options.json_to_stdout(args):
            options.write_json(args.json, r)
    ctx.rt.close()
    r["goals"] = goals(r) if ctx.graphs else []  # a CPU's figures are not held to GPU goals
    with options.text_to_stderr(args):
        _print(r)
    for key in SECTIONS:
        if r[key].get("status") == "error":
            print(r[key]["traceback"], file=sys.stderr)
    missed = any(g["status"] == "missed" for g in r["goals"])
    rc = 1 if failed or (args.strict and missed) else 0
    r["ok"] = rc == 0  # what the exit code says
    options.write_json(args.json, r)
    return rc
