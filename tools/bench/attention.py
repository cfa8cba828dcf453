"""The cell-attention kernel on Llama-3.2-1B shapes (Hq 32, Hkv 8, D 64, bf16, 16 layers):
device time of the 16-layer loop against the KV-read floor and torch SDPA (issue 23).

    PYTHONPATH=. python3 -m cudagraph_rt.tools.bench.attention --json OUT.json [--budget 60]
    TRITON_INTERPRET=1 PYTHONPATH=. python3 -m cudagraph_rt.tools.bench.attention --quick --json OUT.json  # CPU

Sections (all in the JSON; the tables last on stdout):

* ``extents``: one sequence at 128 / 1k / 8k / 32k live cells, width 1 and width 8 (8 rows
  of the sequence at consecutive positions, a verify step): the kernel (default plan)
  against the floor (live K and V bytes of all layers / 4.8 TB/s) and against SDPA over
  exactly the live cells (contiguous K/V, the best case), each relative to the faster.
* ``many``: width 64 = 64 sequences of one row at 1k cells each, against its floor (and
  SDPA over the 64 contiguous contexts).
* ``batch``: small decode batches, widths 4 and 8 = that many sequences of one row at
  128 and 1k cells each (the steps of an engine serving a few sequences), beside the
  same widths as one sequence's verify rows.
* ``ceiling``: what the floor leaves to a kernel at all: a plain streaming read of the
  same live K and V bytes of each layer, laid out contiguously (no block table, no
  arithmetic), in the same 16-layer loop and timer, at the goal extents (8k, 32k).
* ``pool``: one sequence of 128 live cells in a 4,096-cell and a 262,144-cell pool
  (16 x 256 and 64 x 4,096), widths 1 and 8: the times should match.
* ``flashinfer``: the issue-39 cases against FlashInfer's decode, tensor-core decode and
  prefill wrappers over the same pool (the best of them), in graphs and eager per call;
  skipped, with the reason, where FlashInfer does not import (``flashinfer_baseline.py``).
* ``candidates``: the goal cases (widths 1 and 8 at 8k and 32k, width 64 at 1k), each
  with its default plan and a short list of single changes around it (splits, min
  chunk, tile of cells, warps, stages), then the faster changes together. A config that
  fails to compile or run is reported, not fatal; every result is checked against SDPA.
  Stops at ``--budget`` seconds from the section's start (the rest reported as
  skipped; the defaults always run).

Last on stdout: the goal table (default and best candidate against the floor, goal
<= 2x: pass/miss) and the TUNED_CONFIGS entries of the best candidates.

Timing: each measurement is a CUDA graph of the 16-layer loop (each layer its own K/V,
so L2 cannot hold a long context), replayed with L2 flushed before each replay; the
median of the replays. ``--quick`` runs tiny shapes (1 layer, fp32; the Triton
interpreter without a GPU) in a few seconds, for CI.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch

HBM_BYTES_PER_S = 4.8e12  # H200 nominal HBM3e bandwidth: the floor's assumption
GOAL_X_FLOOR = 2.0  # issue 23: attention device time <= 2x the KV-read floor


@dataclass(frozen=True)
class Shape:
    layers: int
    Hq: int
    Hkv: int
    D: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Case:
    """A goal case and the single changes to its default plan worth timing."""

    name: str
    width: int
    seqs: int
    extent: int
    # (knob, value): splits, min_chunk, tile_n, num_warps, num_stages, chunk_n; "a+b"
    tries: tuple[tuple[str, object], ...]


@dataclass(frozen=True)
class Sizes:
    """What each section runs at."""

    shape: Shape
    extents: tuple[int, ...]
    widths: tuple[int, ...]
    many: tuple[int, int]  # sequences, cells each
    pools: tuple[tuple[int, int], ...]  # (max sequences, max length) per pool
    pool_live: int
    cases: tuple[Case, ...]
    batch: tuple[tuple[int, int], ...] = ((4, 128), (8, 128), (4, 1024), (8, 1024))  # (sequences, cells each)
    ceiling: tuple[int, ...] = (8192, 32768)  # extents of the streaming read
    block_size: int = 16
    pool_widths: tuple[int, ...] = (1, 8)
    reps: int = 15
    splits: int | None = None  # override the default plan's splits (the interpreter is slow)


FULL = Sizes(
    Shape(16, 32, 8, 64, torch.bfloat16), (128, 1024, 8192, 32768), (1, 8), (64, 1024), ((16, 256), (64, 4096)), 128,
    (Case("w1@8k", 1, 1, 8192, (("splits", 16), ("splits", 64), ("min_chunk", 256), ("tile_n", 64), ("chunk_n", 512))),
     Case("w1@32k", 1, 1, 32768, (("splits", 16), ("splits", 64), ("tile_n", 64), ("num_stages", 4))),
     Case("w8@8k", 8, 1, 8192, (("splits", 8), ("splits", 32), ("min_chunk", 128), ("tile_n+num_warps", (128, 4)))),
     Case("w8@32k", 8, 1, 32768, (("splits", 8), ("splits", 32), ("chunk_n", 128), ("chunk_n", 512))),
     Case("w64@1k", 64, 64, 1024, (("splits", 2), ("splits", 4), ("tile_n", 128), ("num_stages", 4)))),
)
QUICK = Sizes(
    Shape(1, 4, 2, 16, torch.float32), (24,), (1, 4), (3, 16), ((2, 16), (4, 64)), 12,
    (Case("w4@24", 4, 1, 24, (("splits", 1), ("splits", 3), ("min_chunk", 16), ("tile_n", 32))),),
    batch=((3, 12),), ceiling=(24,), block_size=4, pool_widths=(1,), reps=1, splits=2,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------
# Workloads and timing
# --------------------------------------------------------------------------------------
def kv_floor_us(shape: Shape, cells: int) -> float:
    """The KV-read floor: the K and V bytes of ``cells`` live cells in every layer at the
    nominal HBM bandwidth, in microseconds."""
    live = cells * shape.Hkv * shape.D * torch.finfo(shape.dtype).bits // 8 * 2
    return live * shape.layers / HBM_BYTES_PER_S * 1e6


class Workload:
    """``layers`` layers of one pool of ``max_seqs`` x ``max_len`` cells (+ the scratch
    block), every block of the table a distinct random block; ``seqs`` sequences of
    ``extent`` live cells, each with ``width // seqs`` rows at its last positions."""

    def __init__(self, shape: Shape, *, width, seqs, extent, max_seqs, max_len, block_size, device, seed=0):
        self.shape, self.bs, self.extent, self.seqs, self.per = shape, block_size, extent, seqs, width // seqs
        gen = torch.Generator(device=device).manual_seed(seed)
        mb = _cdiv(max_len, block_size)
        blocks = max_seqs * mb + 1
        perm = torch.randperm(blocks - 1, generator=torch.Generator().manual_seed(seed))
        self.table = perm.view(max_seqs, mb).int().to(device)
        cells = blocks * block_size
        self.k = torch.empty(shape.layers, cells, shape.Hkv, shape.D, dtype=shape.dtype, device=device)
        self.v = torch.empty_like(self.k)
        for t in (*self.k, *self.v):
            t.normal_(generator=gen)
        rows = [(s, extent - self.per + i) for s in range(seqs) for i in range(self.per)]
        self.seq = torch.tensor([s for s, _ in rows], dtype=torch.int64, device=device)
        self.pos = torch.tensor([p for _, p in rows], dtype=torch.int64, device=device)
        self.q = torch.randn(shape.layers, len(rows), shape.Hq, shape.D, generator=gen, device=device).to(shape.dtype)
        self.out = torch.empty_like(self.q)
        self.scale = shape.D ** -0.5

    def floor_us(self) -> float:
        return kv_floor_us(self.shape, self.seqs * self.extent)

    def kernel_fn(self, ca, plan):
        def run():
            for layer in range(self.shape.layers):
                ca.cell_attention_triton(self.q[layer], self.k[layer], self.v[layer], self.table, self.seq, self.pos,
                                         block_size=self.bs, scale=self.scale, out=self.out[layer], plan=plan)
        return run

    def contiguous(self):
        """Per layer: q as [seqs, Hq, rows, D] and the live K/V as [seqs, Hkv, extent, D]."""
        j = torch.arange(self.extent, device=self.q.device)
        cells = self.table[: self.seqs].long()[:, j // self.bs] * self.bs + j % self.bs  # [seqs, extent]
        k = torch.stack([self.k[i][cells].permute(0, 2, 1, 3).contiguous() for i in range(self.shape.layers)])
        v = torch.stack([self.v[i][cells].permute(0, 2, 1, 3).contiguous() for i in range(self.shape.layers)])
        q = self.q.view(self.shape.layers, self.seqs, self.per, self.shape.Hq, self.shape.D).permute(0, 1, 3, 2, 4)
        return q.contiguous(), k, v

    def kernel_out(self) -> torch.Tensor:
        """The kernel's last output in the contiguous layout: [layers, seqs, Hq, rows, D]."""
        s = self.shape
        return self.out.view(s.layers, self.seqs, self.per, s.Hq, s.D).permute(0, 1, 3, 2, 4).float()


class Timer:
    """Median microseconds of one call of ``fn``: a CUDA graph of it replayed ``reps``
    times, L2 flushed before each replay; on a CPU, wall time of direct calls."""

    def __init__(self, device: torch.device, reps: int):
        self.device, self.reps = device, reps
        self.flush = torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None

    def __call__(self, fn) -> float:
        if self.device.type != "cuda":  # the smoke run: nothing to compile or capture
            times = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return statistics.median(times)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # compiles outside capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        for a, b in zip(starts, ends):
            self.flush.zero_()
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) * 1e3 for a, b in zip(starts, ends))


def sdpa_variants(wl: Workload):
    """The torch baselines over exactly the live cells, contiguous (the best case): SDPA
    with GQA, and SDPA over K/V expanded to the query heads; a lower-right causal bias for
    the rows of a verify step. Yields (name, fn, outs): a call of fn puts its per-layer
    outputs [seqs, Hq, rows, D] in the list outs (no copy: a copy would be timed with it)."""
    import torch.nn.functional as F
    q, k, v = wl.contiguous()
    G, L = wl.shape.Hq // wl.shape.Hkv, wl.shape.layers
    mask = None
    if wl.per > 1:
        from torch.nn.attention.bias import causal_lower_right
        mask = causal_lower_right(wl.per, wl.extent)
    for name, kk, vv, extra in (("sdpa enable_gqa", k, v, dict(enable_gqa=True)),
                                ("sdpa expanded kv", k.repeat_interleave(G, 2), v.repeat_interleave(G, 2), {})):
        outs = [None] * L

        def run(kk=kk, vv=vv, extra=extra, outs=outs):
            for i in range(L):
                outs[i] = F.scaled_dot_product_attention(q[i], kk[i], vv[i], attn_mask=mask, scale=wl.scale, **extra)
        yield name, run, outs


def sdpa_reference(wl: Workload) -> torch.Tensor:
    """SDPA's output for the workload (the first variant that runs), to check kernels by."""
    for _, run, outs in sdpa_variants(wl):
        try:
            run()
            return torch.stack(outs).float()
        except (RuntimeError, TypeError, ValueError):
            continue
    raise RuntimeError("no SDPA variant runs here")


# --------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------
PLAN_KNOBS = ("splits",)
CONFIG_KNOBS = ("min_chunk", "tile_n", "num_warps", "num_stages", "chunk_n")


def with_knob(plan, knob: str, value):
    """``plan`` with one knob changed (a plan field or a config field), or several
    (``"tile_n+num_warps"`` with a tuple of values)."""
    if "+" in knob:
        for one, v in zip(knob.split("+"), value):
            plan = with_knob(plan, one, v)
        return plan
    if knob in PLAN_KNOBS:
        return replace(plan, **{knob: value})
    if knob in CONFIG_KNOBS:
        return replace(plan, config=replace(plan.config, **{knob: value}))
    raise ValueError(f"unknown knob {knob!r}")


class Bench:
    def __init__(self, ca, sizes: Sizes, device: torch.device, budget: float):
        self.ca, self.sizes, self.device, self.budget = ca, sizes, device, budget
        self.deadline = float("inf")
        self.timer = Timer(device, sizes.reps)

    def workload(self, width, seqs, extent, *, max_seqs=None, max_len=None) -> Workload:
        return Workload(self.sizes.shape, width=width, seqs=seqs, extent=extent, max_seqs=max_seqs or seqs,
                        max_len=max_len or extent, block_size=self.sizes.block_size, device=self.device)

    def default_plan(self, wl: Workload):
        s = self.sizes.shape
        return self.ca.plan_attention(len(wl.seq), s.Hq, s.Hkv, s.D, splits=self.sizes.splits)

    def kernel(self, wl: Workload, plan=None, want=None) -> dict:
        """Time the kernel's 16-layer loop; its error against ``want`` (SDPA's output)."""
        plan = plan or self.default_plan(wl)
        res = {"plan": asdict(plan), "status": "ok"}
        try:
            res["us"] = self.timer(wl.kernel_fn(self.ca, plan))
        except Exception as e:  # a config that does not compile or launch is a result, not a crash
            return {**res, "status": f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        if want is not None:
            res["max_err"] = float((wl.kernel_out() - want.float()).abs().max())
            res["status"] = "ok" if res["max_err"] < 6e-2 else "WRONG"
        return res

    def sdpa(self, wl: Workload) -> tuple[float, str, dict, torch.Tensor | None]:
        """The fastest SDPA variant that runs (time, name, every variant's result) and its output."""
        results, best, want = {}, (float("inf"), "none"), None
        for name, run, outs in sdpa_variants(wl):
            try:
                us = self.timer(run)
            except Exception as e:  # a baseline that does not run here is reported, not fatal
                results[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                continue
            results[name] = us
            if us < best[0]:
                best, want = (us, name), torch.stack(outs).float()  # the last replay's outputs
        return best[0], best[1], results, want

    def against_sdpa(self, wl: Workload) -> dict:
        sdpa_us, variant, variants, want = self.sdpa(wl)
        k = self.kernel(wl, want=want)
        best = min(sdpa_us, k.get("us", float("inf")))
        return {"floor_us": wl.floor_us(), "kernel": k, "sdpa_us": sdpa_us, "sdpa_variant": variant,
                "sdpa_variants": variants, "kernel_rel_best": k.get("us", 0) / best, "sdpa_rel_best": sdpa_us / best,
                "kernel_over_floor": k.get("us", 0) / wl.floor_us()}

    def extents(self) -> list[dict]:
        return [{"extent": extent, "width": width, **self.against_sdpa(self.workload(width, 1, extent))}
                for extent in self.sizes.extents for width in self.sizes.widths]

    def many(self) -> dict:
        seqs, extent = self.sizes.many
        return {"width": seqs, "extent": extent, **self.against_sdpa(self.workload(seqs, seqs, extent))}

    def batch(self) -> list[dict]:
        """Small decode batches (see the module docstring) beside one sequence's rows."""
        rows = []
        for seqs, extent in self.sizes.batch:
            res = self.against_sdpa(self.workload(seqs, seqs, extent))  # seqs sequences, a row each
            one = self.kernel(self.workload(seqs, 1, extent))  # as many rows of one sequence
            rows.append({"width": seqs, "extent": extent, **res, "one_sequence": one,
                         "over_one_sequence": res["kernel"].get("us", 0) / max(one.get("us", 1e-9), 1e-9)})
        return rows

    def ceiling(self) -> list[dict]:
        """The streaming read of each goal extent's live K and V bytes (see the module
        docstring): time and x floor, per extent."""
        from .stream_read import stream_read

        s = self.sizes.shape
        rows = []
        for extent in self.sizes.ceiling:
            n = extent * s.Hkv * s.D * 2  # K and V of one layer
            layers = [torch.randn(n, device=self.device).to(s.dtype) for _ in range(s.layers)]
            out = torch.zeros(n, dtype=s.dtype, device=self.device)
            block = 8192
            warps = {"num_warps": 8} if self.device.type == "cuda" else {}

            def run(layers=layers, out=out, n=n):
                for x in layers:
                    stream_read[(-(-n // block),)](x, out, n, 1e4, BLOCK=block, **warps)  # randn never reaches 1e4
            us = self.timer(run)
            ok = not out.any()  # nothing equals 1e4: a store that lost its mask would show here
            floor = kv_floor_us(s, extent)
            rows.append({"extent": extent, "us": us, "floor_us": floor, "x_floor": us / floor,
                         "status": "ok" if ok else "WRONG"})
            del layers
        return rows

    def pool(self) -> list[dict]:
        rows = []
        for width in self.sizes.pool_widths:
            times = []
            for max_seqs, max_len in self.sizes.pools:
                wl = self.workload(width, 1, self.sizes.pool_live, max_seqs=max_seqs, max_len=max_len)
                times.append(self.kernel(wl))
                del wl
            rows.append({"width": width, "pools": [m * n for m, n in self.sizes.pools], "kernel": times,
                         "ratio": times[-1].get("us", 0) / max(times[0].get("us", 1e-9), 1e-9)})
        return rows

    def candidates(self) -> list[dict]:
        """Each goal case: its default plan, its single changes, then the faster ones together."""
        out, self.deadline = [], time.monotonic() + self.budget
        for case in self.sizes.cases:
            wl = self.workload(case.width, case.seqs, case.extent)
            want, base = sdpa_reference(wl), self.default_plan(wl)
            tried = [{"knob": "default", "value": None, **self.kernel(wl, base, want)}]
            tried += [self.try_one(wl, knob, value, with_knob(base, knob, value), want) for knob, value in case.tries]
            combined = combine(base, tried)
            if combined != base and combined not in [with_knob(base, k, v) for k, v in case.tries]:
                tried.append(self.try_one(wl, "combined", None, combined, want))
            out.append({"case": case.name, "width": case.width, "seqs": case.seqs, "extent": case.extent,
                        "floor_us": wl.floor_us(), "tried": tried})
            del wl, want
        return out

    def flashinfer(self) -> dict:
        """The goal cases against FlashInfer's wrappers, graphs and eager (skipped with the
        reason where FlashInfer cannot run): ``flashinfer_baseline.py``."""
        from .flashinfer_baseline import section
        return section(self, sdpa_reference)

    def try_one(self, wl, knob, value, plan, want) -> dict:
        if time.monotonic() > self.deadline:
            return {"knob": knob, "value": value, "plan": asdict(plan), "status": "skipped (time budget)"}
        return {"knob": knob, "value": value, **self.kernel(wl, plan, want)}


def combine(base, tried):
    """The base plan with each knob set to its fastest correct value, where that beat the
    default."""
    base_us = next((t.get("us") for t in tried if t["knob"] == "default"), None)
    best = {}
    for t in tried:
        if t.get("status") == "ok" and t["knob"] in PLAN_KNOBS + CONFIG_KNOBS and base_us and t["us"] < base_us:
            if t["knob"] not in best or t["us"] < best[t["knob"]]["us"]:
                best[t["knob"]] = t
    plan = base
    for knob, t in best.items():
        plan = with_knob(plan, knob, t["value"])
    return plan


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------
def _us(r: dict) -> str:
    return f"{r['us']:.1f}" if "us" in r else r.get("status", "?")


def _best(case: dict) -> dict:
    ok = [t for t in case["tried"] if t.get("status") == "ok"]
    return min(ok, key=lambda t: t["us"]) if ok else {}


def _label(t: dict) -> str:
    return "default" if t.get("knob") == "default" else f"{t.get('knob')}={t.get('value')}"


def print_extents(res: dict) -> None:
    print("\n== cell attention, 16-layer loop (us; rel = time / the faster at that extent and width)")
    print(f"{'extent':>7} {'width':>5} {'kernel':>9} {'floor':>8} {'x floor':>8} {'sdpa':>9} {'k rel':>6} "
          f"{'sdpa rel':>8}  {'err':>7} sdpa variant")
    for r in res.get("extents", []):
        k = r["kernel"]
        print(f"{r['extent']:>7} {r['width']:>5} {_us(k):>9} {r['floor_us']:>8.1f} {r['kernel_over_floor']:>8.2f} "
              f"{r['sdpa_us']:>9.1f} {r['kernel_rel_best']:>6.2f} {r['sdpa_rel_best']:>8.2f}  "
              f"{k.get('max_err', float('nan')):>7.1e} {r['sdpa_variant']}")
    m = res.get("many")
    if m:
        print(f"width {m['width']} ({m['width']} seqs x {m['extent']}): kernel {_us(m['kernel'])} us, floor "
              f"{m['floor_us']:.1f} us ({m['kernel_over_floor']:.2f}x), sdpa {m['sdpa_us']:.1f} us")
    for b in res.get("batch", []):
        print(f"batch of {b['width']} sequences x {b['extent']}: kernel {_us(b['kernel'])} us "
              f"({b['kernel_over_floor']:.1f}x floor, {b['over_one_sequence']:.2f}x one sequence's {b['width']} rows), "
              f"sdpa {b['sdpa_us']:.1f} us")
    for c in res.get("ceiling", []):
        print(f"ceiling at {c['extent']} cells: a streaming read of the live K/V bytes {c['us']:.1f} us = "
              f"{c['x_floor']:.2f}x the floor ({c['status']})")
    for p in res.get("pool", []):
        print(f"pool scaling, width {p['width']}: " + ", ".join(f"{c} cells {_us(k)} us" for c, k in
                                                              zip(p["pools"], p["kernel"])) + f" ({p['ratio']:.2f}x)")


def print_goals(res: dict) -> None:
    """The goal cases: default plan and best candidate against the floor, pass or miss."""
    cases = res.get("candidates", [])
    if not cases:
        return
    print(f"\n== goals: attention <= {GOAL_X_FLOOR:.2f}x the KV-read floor (16-layer loop, us)")
    print(f"{'case':>7} {'floor':>7} {'default':>9} {'x floor':>8} {'result':>6}   {'best':>9} {'x floor':>8} "
          f"{'result':>6}  best candidate")
    for case in cases:
        base = next((t for t in case["tried"] if t["knob"] == "default"), {})
        best, floor = _best(case), case["floor_us"]
        cols = []
        for t in (base, best):
            x = t["us"] / floor if "us" in t else float("nan")
            cols.append(f"{_us(t):>9} {x:>8.2f} {'pass' if x <= GOAL_X_FLOOR else 'MISS':>6}")
        print(f"{case['case']:>7} {floor:>7.1f} {cols[0]}   {cols[1]}  {_label(best)}")
    for case in cases:
        bad = [f"{_label(t)}: {t['status']}" for t in case["tried"] if t.get("status") != "ok"]
        if bad:
            print(f"  {case['case']} not ok: {bad}")


def suggestions(res: dict) -> list[str]:
    """Per case, the fastest correct plan as a plan rule and a TUNED_CONFIGS entry."""
    shape, lines = res["meta"]["shape"], []
    block_d = max(16, 1 << (shape["D"] - 1).bit_length())
    block_g = 1 << (shape["Hq"] // shape["Hkv"] - 1).bit_length()
    for case in res.get("candidates", []):
        best = _best(case)
        if not best:
            continue
        p, c = best["plan"], best["plan"]["config"]
        lines.append(f"{case['case']}: {_label(best)}; splits {p['splits']}; ({p['rows_per_tile']}, {block_d}, "
                     f"{block_g}, {p['splits'] > 1}): AttentionConfig(tile_n={c['tile_n']}, "
                     f"num_warps={c['num_warps']}, num_stages={c['num_stages']}, min_chunk={c['min_chunk']}, "
                     f"chunk_n={c['chunk_n']}, short_n={c['short_n']})")
    return lines


def print_tables(res: dict) -> None:
    from .flashinfer_baseline import print_section

    print_extents(res)
    print_goals(res)
    print_section(res.get("flashinfer"))
    if res.get("suggested"):
        print("suggested (fastest measured per case; splits are plan_attention's rule, the config TUNED_CONFIGS'):")
        for line in res["suggested"]:
            print("  " + line)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cudagraph_rt.tools.bench.attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--quick", action="store_true", help="tiny shapes (the interpreter without a GPU), for CI")
    p.add_argument("--budget", type=float, default=60.0, help="seconds for the candidates (from their start)")
    p.add_argument("--sections", default="extents,many,batch,pool,ceiling,flashinfer,candidates")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        if not a.quick:
            print("bench_attention: expected a CUDA device (or --quick), got none", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from cudagraph_rt.kernels import attention as ca
    from cudagraph_rt.kernels.common import triton_backend

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and triton_backend() != "interpreter":
        # Triton chose compiled kernels when the bench package imported it, before main():
        # without a GPU every kernel would fail to launch.
        print("bench_attention --quick: expected the Triton interpreter on a CPU (triton installed and "
              f"TRITON_INTERPRET=1 set when Python starts), got Triton backend {triton_backend()!r}", file=sys.stderr)
        return 2
    sizes = QUICK if a.quick else FULL
    bench = Bench(ca, sizes, device, a.budget)
    res = {"meta": {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "triton": _triton_version(), "triton_backend": triton_backend(),
                    "quick": a.quick, "shape": {**asdict(sizes.shape), "dtype": str(sizes.shape.dtype)},
                    "block_size": sizes.block_size, "hbm_bytes_per_s": HBM_BYTES_PER_S, "reps": sizes.reps}}
    t0 = time.monotonic()
    with torch.no_grad():
        for section in a.sections.split(","):
            res[section] = getattr(bench, section)()
            print(f"bench_attention: {section} done at {time.monotonic() - t0:.0f} s", file=sys.stderr)
    res["meta"]["seconds"] = time.monotonic() - t0
    res["suggested"] = suggestions(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print_tables(res)
    return 0


def _triton_version() -> str | None:
    try:
        import triton
        return triton.__version__
    except ImportError:  # pragma: no cover
        return None


if __name__ == "__main__":
    sys.exit(main())
