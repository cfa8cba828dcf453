"""The cell-attention kernel on Llama-3.2-1B shapes (Hq 32, Hkv 8, D 64, bf16, 16 layers):
device time of the 16-layer loop against the KV-read floor and torch SDPA (issue 23).

    PYTHONPATH=. python3 -m cudagraph_rt.tools.bench.attention --json OUT.json [--budget 110]
    PYTHONPATH=. python3 -m cudagraph_rt.tools.bench.attention --quick --json OUT.json   # CPU smoke run

Sections (all in the JSON; a short table last on stdout):

* ``extents``: one sequence at 128 / 1k / 8k / 32k live cells, width 1 and width 8 (8 rows
  of the sequence at consecutive positions, a verify step): the kernel (default plan)
  against the floor (live K and V bytes of all layers / 4.8 TB/s) and against SDPA over
  exactly the live cells (contiguous K/V, the best case), each relative to the faster.
* ``many``: width 64 = 64 sequences of one row at 1k cells each, against its floor (and
  SDPA over the 64 contiguous contexts).
* ``pool``: one sequence of 128 live cells in a 4,096-cell and a 262,144-cell pool
  (16 x 256 and 64 x 4,096), widths 1 and 8: the times should match.
* ``candidates``: around the default plan, one knob at a time (splits, min chunk, tile of
  cells, warps, stages, rows/programs per tile, block size 16/32/64), on representative
  lengths; then the per-knob winners together. A config that fails to compile or run is
  reported, not fatal; every result is checked against SDPA. Stops at ``--budget``
  seconds (the rest is reported as skipped); prints TUNED_CONFIGS entries to paste.

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
from dataclasses import asdict, dataclass, field, replace

import torch

HBM_BYTES_PER_S = 4.8e12  # H200 nominal HBM3e bandwidth: the floor's assumption


@dataclass(frozen=True)
class Shape:
    layers: int
    Hq: int
    Hkv: int
    D: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Sizes:
    """What each section runs at."""

    shape: Shape
    extents: tuple[int, ...]
    widths: tuple[int, ...]
    many: tuple[int, int]  # sequences, cells each
    pools: tuple[tuple[int, int], ...]  # (max sequences, max length) per pool
    pool_live: int
    cases: tuple[tuple[str, int, int, int], ...]  # (name, width, sequences, cells each)
    knobs: dict = field(default_factory=dict)
    block_size: int = 16
    pool_widths: tuple[int, ...] = (1, 8)
    reps: int = 15
    splits: int | None = None  # override the default plan's splits (the interpreter is slow)


FULL = Sizes(
    Shape(16, 32, 8, 64, torch.bfloat16), (128, 1024, 8192, 32768), (1, 8), (64, 1024), ((16, 256), (64, 4096)), 128,
    (("w1@32k", 1, 1, 32768), ("w8@32k", 8, 1, 32768), ("w64@1k", 64, 64, 1024), ("w1@8k", 1, 1, 8192),
     ("w8@8k", 8, 1, 8192)),
    knobs={"splits": (1, 4, 8, 16, 32, 64), "min_chunk": (64, 128, 256, 512, 1024), "tile_n": (32, 64, 128),
           "num_warps": (2, 4, 8), "num_stages": (1, 2, 3, 4),
           "rows": {8: ((4, 1), (8, 1), (8, 2), (16, 1)), 64: ((1, 1), (4, 4), (8, 4), (8, 8), (16, 16))},
           "block_size": (16, 32, 64)},
)
QUICK = Sizes(
    Shape(1, 4, 2, 16, torch.float32), (24,), (1, 4), (3, 16), ((2, 16), (4, 64)), 12, (("w4@24", 4, 1, 24),),
    knobs={"splits": (1,), "tile_n": (32,), "rows": {4: ((4, 2),)}, "block_size": (8,)},
    block_size=4, pool_widths=(1,), reps=1, splits=2,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------
# Workloads and timing
# --------------------------------------------------------------------------------------
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
        s = self.shape
        live = self.seqs * self.extent * s.Hkv * s.D * torch.finfo(s.dtype).bits // 8 * 2
        return live * s.layers / HBM_BYTES_PER_S * 1e6

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
class Bench:
    def __init__(self, ca, sizes: Sizes, device: torch.device, deadline: float):
        self.ca, self.sizes, self.device, self.deadline = ca, sizes, device, deadline
        self.timer = Timer(device, sizes.reps)

    def workload(self, width, seqs, extent, *, max_seqs=None, max_len=None, block_size=None) -> Workload:
        return Workload(self.sizes.shape, width=width, seqs=seqs, extent=extent, max_seqs=max_seqs or seqs,
                        max_len=max_len or extent, block_size=block_size or self.sizes.block_size, device=self.device)

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

    def extents(self) -> list[dict]:
        rows = []
        for extent in self.sizes.extents:
            for width in self.sizes.widths:
                wl = self.workload(width, 1, extent)
                sdpa_us, variant, variants, want = self.sdpa(wl)
                k = self.kernel(wl, want=want)
                best = min(sdpa_us, k.get("us", float("inf")))
                rows.append({"extent": extent, "width": width, "floor_us": wl.floor_us(), "kernel": k,
                             "sdpa_us": sdpa_us, "sdpa_variant": variant, "sdpa_variants": variants, "kernel_rel_best": k.get("us", 0) / best,
                             "sdpa_rel_best": sdpa_us / best, "kernel_over_floor": k.get("us", 0) / wl.floor_us()})
        return rows

    def many(self) -> dict:
        seqs, extent = self.sizes.many
        wl = self.workload(seqs, seqs, extent)
        sdpa_us, variant, variants, want = self.sdpa(wl)
        k = self.kernel(wl, want=want)
        return {"width": seqs, "extent": extent, "floor_us": wl.floor_us(), "kernel": k, "sdpa_us": sdpa_us,
                "sdpa_variant": variant, "sdpa_variants": variants, "kernel_over_floor": k.get("us", 0) / wl.floor_us()}

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
        """Every case's cheap knobs first (no recompile), then the compiling ones case by
        case until the budget ends, then each case's winners together."""
        cases = [self.case(*c) for c in self.sizes.cases]
        for cheap in (True, False):
            for c in cases:
                for knob, value, plan in self.variants(c["base"], c["width"], cheap):
                    c["tried"].append(self.try_one(c["wl"], knob, value, plan, c["want"]))
                if not cheap:
                    self.block_sizes(c)
        for c in cases:
            combined = self.combine(c["base"], c["tried"])
            if combined != c["base"]:
                c["tried"].append(self.try_one(c["wl"], "combined", None, combined, c["want"]))
            c["floor_us"] = c.pop("wl").floor_us()
            del c["want"], c["base"]
        return cases

    def case(self, name, width, seqs, extent) -> dict:
        wl = self.workload(width, seqs, extent)
        want = sdpa_reference(wl)
        base = self.default_plan(wl)
        return {"case": name, "width": width, "seqs": seqs, "extent": extent, "wl": wl, "want": want, "base": base,
                "tried": [{"knob": "default", "value": None, **self.kernel(wl, base, want)}]}

    def block_sizes(self, c: dict) -> None:
        for bs in self.sizes.knobs.get("block_size", ()):
            if bs != self.sizes.block_size:
                other = self.workload(c["width"], c["seqs"], c["extent"], block_size=bs)
                c["tried"].append(self.try_one(other, "block_size", bs, c["base"], sdpa_reference(other)))
                del other

    def try_one(self, wl, knob, value, plan, want) -> dict:
        if time.monotonic() > self.deadline:
            return {"knob": knob, "value": value, "plan": asdict(plan), "status": "skipped (time budget)"}
        return {"knob": knob, "value": value, **self.kernel(wl, plan, want)}

    def variants(self, base, width, cheap: bool):
        """(knob, value, plan) around ``base``: the knobs that need no new kernel (splits
        other than 1, min chunk), or those that do."""
        knobs, cfg = self.sizes.knobs, base.config
        for s in knobs.get("splits", ()):
            if cheap == ((s == 1) == (base.splits == 1)) and s != base.splits:
                yield "splits", s, replace(base, splits=s)
        for c in knobs.get("min_chunk", ()):
            if cheap and c != cfg.min_chunk:
                yield "min_chunk", c, replace(base, config=replace(cfg, min_chunk=c))
        if cheap:
            return
        for key in ("tile_n", "num_warps", "num_stages"):
            for val in knobs.get(key, ()):
                if val != getattr(cfg, key):
                    yield key, val, replace(base, config=replace(cfg, **{key: val}))
        for r, p in knobs.get("rows", {}).get(width, ()):
            if (r, p) != (base.rows_per_tile, base.programs_per_tile):
                yield "rows", f"{r}/{p}", replace(base, rows_per_tile=r, programs_per_tile=p)

    @staticmethod
    def combine(base, tried):
        """The base plan with each knob set to its fastest correct value."""
        best = {}
        for t in tried:
            if t.get("status") == "ok" and t["knob"] not in ("default", "block_size", "combined"):
                if t["knob"] not in best or t["us"] < best[t["knob"]]["us"]:
                    best[t["knob"]] = t
        base_us = next((t.get("us") for t in tried if t["knob"] == "default"), None)
        plan, cfg = base, base.config
        for knob, t in best.items():
            if base_us is None or t["us"] >= base_us:
                continue
            won = t["plan"]
            if knob == "splits":
                plan = replace(plan, splits=won["splits"])
            elif knob == "rows":
                plan = replace(plan, rows_per_tile=won["rows_per_tile"], programs_per_tile=won["programs_per_tile"])
            else:
                cfg = replace(cfg, **{knob: won["config"][knob]})
        return replace(plan, config=cfg)


# --------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------
def _us(r: dict) -> str:
    return f"{r['us']:.1f}" if "us" in r else r.get("status", "?")


def print_tables(res: dict) -> None:
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
    for p in res.get("pool", []):
        print(f"pool scaling, width {p['width']}: " + ", ".join(f"{c} cells {_us(k)} us" for c, k in
                                                              zip(p["pools"], p["kernel"])) + f" ({p['ratio']:.2f}x)")
    for case in res.get("candidates", []):
        ok = [t for t in case["tried"] if t.get("status") == "ok"]
        base = next((t for t in case["tried"] if t["knob"] == "default"), {})
        best = min(ok, key=lambda t: t["us"]) if ok else {}
        bad = [f"{t['knob']}={t['value']}: {t['status']}" for t in case["tried"] if t.get("status") != "ok"]
        print(f"{case['case']:>7}: default {_us(base)} us, best {_us(best)} us ({best.get('knob')}={best.get('value')}), "
              f"floor {case['floor_us']:.1f} us" + (f"; not ok: {bad}" if bad else ""))
    if res.get("suggested"):
        print("suggested (fastest measured per case; the plan rule is plan_attention's, the config TUNED_CONFIGS'):")
        for line in res["suggested"]:
            print("  " + line)


def suggestions(res: dict) -> list[str]:
    """Per case, the fastest correct plan as a plan rule and a TUNED_CONFIGS entry."""
    shape, lines = res["meta"]["shape"], []
    block_d = max(16, 1 << (shape["D"] - 1).bit_length())
    block_g = 1 << (shape["Hq"] // shape["Hkv"] - 1).bit_length()
    for case in res.get("candidates", []):
        ok = [t for t in case["tried"] if t.get("status") == "ok" and t["knob"] != "block_size"]
        if not ok:
            continue
        best = min(ok, key=lambda t: t["us"])
        p, c = best["plan"], best["plan"]["config"]
        lines.append(f"{case['case']}: rows/programs {p['rows_per_tile']}/{p['programs_per_tile']}, splits "
                     f"{p['splits']}; ({p['rows_per_tile']}, {block_d}, {block_g}): AttentionConfig(tile_n={c['tile_n']}, "
                     f"num_warps={c['num_warps']}, num_stages={c['num_stages']}, min_chunk={c['min_chunk']})")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cudagraph_rt.tools.bench.attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--quick", action="store_true", help="tiny shapes (the interpreter without a GPU), for CI")
    p.add_argument("--budget", type=float, default=110.0, help="seconds; the candidate sweep stops there")
    p.add_argument("--sections", default="extents,many,pool,candidates")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        if not a.quick:
            print("bench_attention: expected a CUDA device (or --quick), got none", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
    from cudagraph_rt.kernels import cell_attention as ca

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = QUICK if a.quick else FULL
    bench = Bench(ca, sizes, device, time.monotonic() + a.budget)
    res = {"meta": {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "triton": _triton_version(), "kernel_mode": ca.kernel_mode(),
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
