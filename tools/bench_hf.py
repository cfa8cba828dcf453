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
  spec      speculative decoding through the demo runner at one sequence (k = 4, accept-prob
            0.7) against the same runner with k = 0 (plain greedy through the runtime).
  capture   capture time of all default widths; the shared pool against the widest alone.

``--quick``: a CPU smoke run (tiny config, graphs off, a few tokens, no child processes).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

import torch

from cudagraph_rt import GraphRuntime
from cudagraph_rt.models import hf

HBM_BYTES_PER_S = 4.8e12  # H200 nominal HBM3e bandwidth: the floor's assumption, stated in the report
SEQS = (1, 4, 16)
SPEC_GOAL, EAGER_GOAL, STATIC_GOAL, FLOOR_GOAL = 2.0, 8.0, 1.5, 2.0


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


def step_time_us(model: hf.HFDecoder, rt: GraphRuntime, T: int, repeats: int) -> float:
    """Median per-step time of ``repeats`` back-to-back steps of T decode rows (synchronized
    once per batch of steps), fixed inputs, in microseconds."""
    S = min(T, model.config.max_seqs)
    seqs = [i % S for i in range(T)]
    pos = [model.config.max_len // 2 + i // S for i in range(T)]
    kw = dict(tokens=[1] * T, positions=pos, seq_ids=seqs, cells=[model.cell_for(s, p) for s, p in zip(seqs, pos)],
              want=[1] * T)  # the rows' blocks are taken here, before the timed steps
    for _ in range(3):
        rt.step(**kw)
    times = []
    for _ in range(5):
        _sync(model.device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            rt.step(**kw)
        _sync(model.device)
        times.append((time.perf_counter() - t0) / repeats * 1e6)
    return statistics.median(times)


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
    floor = weight_floor(ctx.model)
    eager_us = step_time_us(ctx.model, ctx.rt, 1, ctx.repeats)
    child = ctx.child("compiled", {"mode": ctx.compile_mode})
    res = {"status": "ok", "floor": floor, "uncompiled_width1_us": eager_us,
           "uncompiled_over_floor": eager_us / floor["floor_us"], "compiled": child}
    if child["status"] == "ok":
        res["compiled_width1_us"] = child["width_us"]["1"]
        res["compiled_over_floor"] = child["width_us"]["1"] / floor["floor_us"]
    return res


def sec_spec(ctx) -> dict:
    """Plain greedy (k=0) through the runner first; its outputs are the plans the spec run's
    ReferenceDrafter follows (so drafts follow the runtime's own rounding). A re-plan (the
    output left the plan on a near-tie) runs an eager generate() inside propose: counted and
    timed, and the speedup is also given without it (a real drafter has no such cost)."""
    from . import demo

    out, plans = {}, None
    reqs = demo.make_requests(ctx.model.config, ctx.spec_sequences, ctx.new, ctx.seed)
    for name, k in (("greedy", 0), ("spec", 4)):
        args = SimpleNamespace(k=k, accept_prob=0.7, seed=ctx.seed, slots=1, lanes=1, chunk=128, rounds=0)
        r = demo.serve(ctx.model, reqs, ctx.graphs, args, plans=plans)
        plans = r.pop("finished_seqs")
        out[name] = {key: r[key] for key in ("tokens", "seconds", "tokens_per_s", "steps", "proposed", "accepted",
                                             "capture_s", "replans", "replan_seconds")}
        out[name]["check_ok"] = r["check"]["ok"]
        out[name]["check"] = r["check"]
        out[name]["near_ties"] = r["check"].get("near_ties", 0)
    sp = out["spec"]
    net = sp["tokens"] / max(sp["seconds"] - sp["replan_seconds"], 1e-9)
    return {"status": "ok", **out, "speedup": sp["tokens_per_s"] / out["greedy"]["tokens_per_s"],
            "speedup_without_replans": net / out["greedy"]["tokens_per_s"],
            "method": f"cgrt demo's runner, {ctx.spec_sequences} requests served one at a time (slots 1, lanes 1), "
                      f"up to {ctx.new} new tokens each; greedy: k=0 first, its outputs the plans of spec: k=4, "
                      "accept-prob 0.7 (ReferenceDrafter); re-plans timed apart"}


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
            "first_capture_s": ctx.first_capture_s,
            "method": "CaptureReport of a fresh runtime over the same model (the process captured once already)"}


# The cheap sections first: the compile children may run into a caller's time limit.
SECTIONS = {"spec": sec_spec, "capture": sec_capture, "greedy": sec_greedy, "compiled": sec_compiled}


# ------------------------------------------------------------------------------ context, children
class _Ctx:
    def __init__(self, args):
        self.family = hf.parse_model(args.model)
        self.quick = bool(args.quick)
        dev = args.device or ("cpu" if self.quick or not torch.cuda.is_available() else "cuda")
        self.size = "tiny" if self.quick else args.size
        self.graphs = dev == "cuda"
        self.seed = args.seed
        self.seqs = (1, 2) if self.quick else SEQS
        self.prompt, self.new = (8, 6) if self.quick else (args.hf_prompt, args.hf_new)
        self.repeats = 5 if self.quick else 50
        self.spec_sequences = 2 if self.quick else 4
        self.compile_mode = args.cgrt_compile_mode
        self.timeout = args.compile_timeout
        self.children = not (self.quick or args.no_compile or not self.graphs)
        max_len = max(256, self.prompt + self.new + 8) if not self.quick else 64
        self.model = hf.build(self.family, self.size, device=dev, seed=self.seed, max_seqs=max(16, max(self.seqs)),
                              max_len=max_len)
        self.rt = GraphRuntime(self.model.step, self.model.inputs(), graphs=self.graphs, device=self.model.device)
        t0 = time.perf_counter()
        self.rt.capture()
        self.first_capture_s = time.perf_counter() - t0
        self.build_args = dict(family=self.family, size=self.size, seed=self.seed, max_seqs=self.model.config.max_seqs,
                               max_len=max_len, prompt=self.prompt, new=self.new, repeats=self.repeats)

    def child(self, kind: str, extra: dict) -> dict:
        """Run ``kind`` in a child process (a crash or a hang cannot take the bench down)."""
        if not self.children:
            return {"status": "skipped", "reason": "no child processes with --quick, --no-compile or on a CPU"}
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "out.json")
            payload = json.dumps({**self.build_args, **extra})
            cmd = [sys.executable, "-m", "cudagraph_rt.tools.bench_hf", "--child", kind, payload, out]
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


def _child(kind: str, payload: str, out: str) -> int:
    a = json.loads(payload)
    dev = torch.device(a.get("device", "cuda"))
    model = hf.build(a["family"], a["size"], device=dev, seed=a["seed"], max_seqs=a["max_seqs"],
                     max_len=a["max_len"])
    if kind == "static":
        per = {}
        for B in a["seqs"]:
            prompts = prompts_for(model, B, a["prompt"], a["seed"] + B)
            first, _ = generate_greedy(model, prompts, a["new"], cache_implementation="static")
            dt, toks = generate_greedy(model, prompts, a["new"], cache_implementation="static")
            per[str(B)] = {"first_s": first, "tok_s": B * a["new"] / dt, "tokens": toks}
        res = {"per_batch": per}
    else:
        model.compile_decoder(a["mode"])
        # Width 1 only: each new width is another compile of 16 layers (tens of seconds); the
        # prefill of the greedy run below goes through as 1-row slices.
        rt = GraphRuntime(model.step, model.inputs(), widths=(1,), graphs=dev.type == "cuda",
                          device=model.device)
        t0 = time.perf_counter()
        rt.capture()
        cap = time.perf_counter() - t0
        res = {"mode": a["mode"], "capture_s_incl_compile": cap,
               "width_us": {"1": step_time_us(model, rt, 1, a["repeats"])}}
        prompts = prompts_for(model, 1, a["prompt"], a["seed"] + 1)
        runtime_greedy(model, rt, prompts, 4)
        dt, _ = runtime_greedy(model, rt, prompts, a["new"])
        res["greedy_1seq_tok_s"] = a["new"] / dt
    with open(out, "w") as f:
        json.dump(res, f)
    return 0


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
    add(f"{many.get('sequences')} seqs: runtime / generate static+compile", v, ">= 1x", v is not None and v >= 1)
    c = r.get("compiled", {})
    comp = (c.get("compiled") or {}).get("greedy_1seq_tok_s")
    for key, name, target in (("eager_tok_s", "generate eager", EAGER_GOAL),
                              ("static_compile_tok_s", "generate static+compile", STATIC_GOAL)):
        base = one.get(key)
        v = comp / base if comp and base else None
        add(f"1 seq: runtime over a compiled step / {name}", v, f">= {target}x", v is not None and v >= target,
            "same prompt; the compiled child's greedy run")
    v = c.get("compiled_over_floor")
    add("compiled step, 1 seq: per-token / weight-read floor", v, f"<= {FLOOR_GOAL}x", v is not None and v <= FLOOR_GOAL)
    s = r.get("spec", {})
    v = s.get("speedup_without_replans")
    add("speculative k=4 p=0.7 / plain greedy (runtime, 1 seq)", v, f">= {SPEC_GOAL}x", v is not None and v >= SPEC_GOAL,
        f"without the stand-in drafter's re-plans ({(s.get('spec') or {}).get('replans')}); "
        f"with them {s.get('speedup') or 0:.2f}x")
    cap = r.get("capture", {})
    v = cap.get("capture_s")
    add("capture of all default widths (s)", v, "< 2 s", v is not None and v < 2)
    v = cap.get("shared_over_widest")
    add("shared pool / widest alone", v, "<= 1.25x", v is not None and v <= 1.25)
    return out


def _print(r: dict) -> None:
    from rich.table import Table

    from .console import make_console

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
            con.print(t)
            ch = sec["static_child"]
            if ch.get("status") != "ok":
                con.print(f"static+compile: {ch.get('status')}: {ch.get('reason') or ch.get('error')}", markup=False)
        elif key == "compiled":
            f = sec["floor"]
            line = (f"per-token at 1 seq: uncompiled {sec['uncompiled_width1_us']:.0f} us "
                    f"({sec['uncompiled_over_floor']:.1f}x floor)")
            if "compiled_width1_us" in sec:
                line += (f", compiled {sec['compiled_width1_us']:.0f} us ({sec['compiled_over_floor']:.1f}x floor; "
                         f"greedy {sec['compiled']['greedy_1seq_tok_s']:.0f} tok/s at 1 seq, capture with compile "
                         f"{sec['compiled']['capture_s_incl_compile']:.0f} s)")
            else:
                ch = sec["compiled"]
                line += f", compiled: {ch.get('status')}: {ch.get('reason') or ch.get('error')}"
            con.print(line + f"; floor {f['floor_us']:.0f} us ({f['weight_bytes'] / 2**30:.2f} GiB at "
                      f"{f['bandwidth_bytes_per_s'] / 1e12:.1f} TB/s; KV pool {f['pool_bytes'] / 2**20:.0f} MiB, "
                      "read only where live)", markup=False)
        elif key == "spec":
            con.print(f"speculative (k=4, p=0.7) {sec['spec']['tokens_per_s']:.0f} tok/s vs plain greedy "
                      f"{sec['greedy']['tokens_per_s']:.0f} tok/s through the runtime: {sec['speedup']:.2f}x "
                      f"({sec['speedup_without_replans']:.2f}x without {sec['spec']['replans']} re-plans, "
                      f"{sec['spec']['replan_seconds']:.2f} s); "
                      f"checks {'ok' if sec['spec']['check_ok'] and sec['greedy']['check_ok'] else 'FAILED'}",
                      markup=False)
            for name in ("greedy", "spec"):
                ch = sec[name]["check"]
                if not ch["ok"]:
                    con.print(f"  {name} check: mismatches {ch['token_mismatches']}, near-ties {ch['near_ties']}, rows "
                              f"{ch['rows_checked']} worst {ch['rows_max_err']:.3g} of tol ({ch['rows_rule']})",
                              markup=False)
        elif key == "capture":
            con.print(f"capture of widths {sec['widths']}: {sec['capture_s']:.2f} s; pool {sec['pool_bytes'] / 2**20:.1f}"
                      f" MiB, widest alone {sec['widest_alone_bytes'] / 2**20:.1f} MiB "
                      f"({sec['shared_over_widest'] or 0:.2f}x)", markup=False)
    t = Table(title="goals")
    for h in ("goal", "value", "target", "status"):
        t.add_column(h)
    for g in r["goals"]:
        t.add_row(g["goal"], "-" if g["value"] is None else f"{g['value']:.2f}", g["target"], g["status"])
    con.print(t)


def run(args: argparse.Namespace) -> int:
    """Every section; ``--json FILE`` writes the figures. Exit 1 when a section failed (or
    with ``--strict`` a goal was missed)."""
    try:
        import transformers
    except ImportError:
        print('cgrt bench: --model hf:... needs transformers: pip install -e ".[hf]"', file=sys.stderr)
        return 2
    ctx = _Ctx(args)
    c = ctx.model.config
    r = {"meta": {"family": ctx.family, "size": ctx.size, "dtype": str(c.dtype).replace("torch.", ""),
                  "layers": c.layers, "hidden": c.hidden, "device": str(ctx.model.device),
                  "device_name": torch.cuda.get_device_name(ctx.model.device) if ctx.graphs else "cpu",
                  "torch": torch.__version__, "transformers": transformers.__version__, "seed": ctx.seed,
                  "prompt": ctx.prompt, "new": ctx.new, "quick": ctx.quick, "argv": sys.argv[1:],
                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}}
    failed = 0
    for key, fn in SECTIONS.items():
        t0 = time.perf_counter()
        try:
            res = fn(ctx)
        except Exception as e:  # noqa: BLE001 - one failed section must not lose the others
            failed += 1
            res = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        res["seconds"] = time.perf_counter() - t0
        r[key] = res
        # Progress and figures so far: a run stopped from outside still leaves what it measured.
        print(f"[{key}] {res.get('status', 'ok')} in {res['seconds']:.1f} s", file=sys.stderr, flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=1, default=str)
    ctx.rt.close()
    r["goals"] = goals(r)
    _print(r)
    for key in SECTIONS:
        if r[key].get("status") == "error":
            print(r[key]["traceback"], file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1, default=str)
    missed = any(g["status"] == "missed" for g in r["goals"])
    return 1 if failed or (args.strict and missed) else 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        sys.exit(_child(sys.argv[2], sys.argv[3], sys.argv[4]))
    print("usage: cgrt bench --model hf:<family> (this module's __main__ is the bench's child process)",
          file=sys.stderr)
    sys.exit(2)
