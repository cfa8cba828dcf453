"""The 1B Llama's weight matmuls at decode widths, separate against merged, cuBLAS against
inductor, each against its weight-read floor (issue 24: what the floor needs). CUDA only.

    python -m cudagraph_rt.tools.bench.projections --json OUT.json [--widths 1,2,4,8,16] [--impls cublas,...]
        [--tune]

Per group of one layer (q/k/v, o, gate/up, down; the LM head once), at every width M:
``separate`` runs the model's linears one by one (q, k, v; gate, up), ``merged`` one
linear over the merged weight (cudagraph_rt.models.fused's layout: the separate weights
are views of it, so both read the same bytes). Implementations:

* ``cublas``: ``F.linear`` (what the eager step runs);
* ``inductor``: ``torch.compile`` default through CompiledRows (one graph for M >= 2, one
  for M = 1);
* ``autotune`` (M = 1 only): mode ``max-autotune-no-cudagraphs``,
  whose coordinate-descent tuning turns an M = 1 matmul into a tuned Triton reduction;
* ``small``: the small-M kernel (kernels/small_linear.py) with its planned config (the
  model path of ``fuse_projections(model)`` then ``use_small_m_kernel(model)``; the head is timed too,
  but the model keeps it on cuBLAS, so the step totals take the head's cuBLAS figure).

``--tune`` then times the kernel's short candidate list (:data:`CANDIDATES`) on q/k/v,
o, gate/up and down (merged) at every width and prints, per group and width, cuBLAS, the
planned config and the best candidate (x floor), and the TUNED_CONFIGS entries to paste
into kernels/small_linear.py where the best beats the plan by more than 3%.

Each case runs all 16 layers' weights (distinct tensors, 2 GB in all, far past the 50 MB
L2) in one CUDA graph, replayed ``--replays`` times between CUDA events; the figure is
per layer. Floor: the group's weight bytes / 4.8 TB/s. Prints a table; writes every row
(and the compile seconds) to ``--json`` after each implementation, so a run cut short
still leaves its figures. About a minute on an H200.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from .hf import HBM_BYTES_PER_S


@dataclass(frozen=True)
class Group:
    """One matmul group: its members' output sizes, the input size, repeated per layer?"""

    name: str
    outs: tuple[int, ...]
    inp: int
    per_layer: bool = True

    @property
    def weight_bytes(self) -> int:
        return sum(self.outs) * self.inp * 2  # bf16 (the floor's assumption, also in --quick)


def llama_groups(size: str = "1b") -> tuple[list[Group], int]:
    """The groups of ``hf_config("llama", size)`` and its layer count."""
    from cudagraph_rt.models.hf import hf_config

    c = hf_config("llama", size)
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    h, i = c.hidden_size, c.intermediate_size
    return [Group("qkv", (q, kv, kv), h), Group("o", (h,), q), Group("gate_up", (i, i), h), Group("down", (h,), i),
            Group("head", (c.vocab_size,), h, per_layer=False)], c.num_hidden_layers


@dataclass(frozen=True)
class Row:
    group: str
    layout: str  # separate | merged
    impl: str  # cublas | inductor | autotune
    width: int
    us: float  # per layer (per step for the head)
    floor_us: float

    @property
    def over_floor(self) -> float:
        return self.us / self.floor_us


def stack_fn(weights: list[torch.Tensor], group: Group, layout: str, linear=F.linear):
    """x -> every layer's outputs of the group (separate: one linear per member, on row
    views of the merged weight); ``linear(x, w)``: F.linear or the small-M kernel."""
    if layout == "merged":
        def run(x):
            return [linear(x, w) for w in weights]
        return run
    starts = [sum(group.outs[:j]) for j in range(len(group.outs))]
    views = [[w[s:s + n] for s, n in zip(starts, group.outs)] for w in weights]

    def run(x):
        return [linear(x, v) for vs in views for v in vs]
    return run


def kernel_linear(config=None):
    """The small-M kernel as ``linear(x, w)``: its planned config, or ``config``."""
    from cudagraph_rt.kernels.small_linear import small_linear

    return lambda x, w: small_linear(x, w, config=config)


def timed_us(fn, x: torch.Tensor, replays: int) -> float:
    """Microseconds per replay of a CUDA graph of ``fn(x)`` (warmed up on a side stream);
    on a CPU (``--quick``) per call, by the wall clock."""
    if x.device.type != "cuda":
        fn(x)
        t0 = time.perf_counter()
        for _ in range(replays):
            fn(x)
        return (time.perf_counter() - t0) * 1e6 / replays
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(x)
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def check(outs: list[torch.Tensor], weights: list[torch.Tensor], x: torch.Tensor, layout: str) -> None:
    """Every layer's outputs (members joined) equal eager ``F.linear`` over the merged
    weight, within the dtype's matmul tolerance: a wrong view or a wrong kernel fails here."""
    per = len(outs) // len(weights)
    for i, w in enumerate(weights):
        got = torch.cat(outs[i * per:(i + 1) * per], -1)
        tol = 2e-2 if x.dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(got, F.linear(x, w), rtol=tol, atol=tol, msg=f"{layout} layer {i}")


def compiled(fn, impl: str):
    from cudagraph_rt.models.compiled import CompiledRows

    return fn if impl in ("cublas", "small") else CompiledRows(
        fn, mode="default" if impl == "inductor" else "max-autotune-no-cudagraphs", fullgraph=True)


def measure(group: Group, weights, impl: str, widths, replays: int) -> tuple[list[Row], float]:
    """Rows of one group and implementation at every width; compile seconds spent."""
    rows, compile_s = [], 0.0
    linear = kernel_linear() if impl == "small" else F.linear
    for layout in ("separate", "merged") if len(group.outs) > 1 else ("merged",):
        fn = compiled(stack_fn(weights, group, layout, linear), impl)
        for m in widths:
            x = torch.randn(m, group.inp, dtype=weights[0].dtype, device=weights[0].device)
            check(fn(x), weights, x, layout)
            us = timed_us(fn, x, replays) / len(weights)
            rows.append(Row(group.name, layout, impl, m, us, group.weight_bytes / HBM_BYTES_PER_S * 1e6))
        compile_s += getattr(fn, "compile_s", 0.0)
    return rows, compile_s


IMPLS, LAYOUTS = ("cublas", "inductor", "autotune", "small"), ("separate", "merged")


def step_totals(rows: list[Row], groups: list[Group], layers: int) -> dict:
    """(layout, impl, width) -> us of one whole step's matmuls: every group once per layer
    (the head once), in that layout where the group has it, else merged (o, down, head).
    ``small`` takes the head's cuBLAS figure: the model keeps its head on cuBLAS."""
    by = {(r.group, r.layout, r.impl, r.width): r.us for r in rows}
    out = {}
    for impl, m, lay in sorted({(r.impl, r.width, r.layout) for r in rows if r.impl in IMPLS},
                               key=lambda k: (IMPLS.index(k[0]), k[1], LAYOUTS.index(k[2]))):
        own = [impl if (g.per_layer or impl != "small") else "cublas" for g in groups]
        got = [by.get((g.name, lay, i, m), by.get((g.name, "merged", i, m))) for g, i in zip(groups, own)]
        if None not in got:
            out[(lay, impl, m)] = sum(us * (layers if g.per_layer else 1) for us, g in zip(got, groups))
    return out


def table(rows: list[Row], widths) -> str:
    """One line per (group, layout, impl): us per layer and x floor at each width."""
    order = [r.group for r in rows]
    keys = sorted({(r.group, r.layout, r.impl) for r in rows},
                  key=lambda k: (order.index(k[0]), IMPLS.index(k[2]), LAYOUTS.index(k[1])))
    head = f"{'group':8} {'layout':9} {'impl':9} {'floor us':>8} " + " ".join(f"{'M=' + str(m):>15}" for m in widths)
    out = [head]
    for k in keys:
        got = {r.width: r for r in rows if (r.group, r.layout, r.impl) == k}
        floor = next(iter(got.values())).floor_us
        cells = [f"{got[m].us:7.2f} ({got[m].over_floor:4.2f}x)" if m in got else f"{'-':>15}" for m in widths]
        out.append(f"{k[0]:8} {k[1]:9} {k[2]:9} {floor:8.2f} " + " ".join(cells))
    return "\n".join(out)


# ------------------------------------------------------------------------------ --tune
# The kernel's short candidate list: (label, config, splits as a multiple of the rule's
# for that tile; 0 keeps the config's own split_k). About 10 s of compiling on an H200.
CANDIDATES = (
    ("n16k256", dict(block_n=16, block_k=256), 1),
    ("n16k256 2x split", dict(block_n=16, block_k=256), 2),
    ("n16k256 no split", dict(block_n=16, block_k=256, split_k=1), 0),
    ("n16k128 4 stages", dict(block_n=16, block_k=128, num_stages=4), 1),
    ("n16k512 2 stages", dict(block_n=16, block_k=512, num_stages=2), 1),
    ("n16k256 8 warps", dict(block_n=16, block_k=256, num_warps=8), 1),
    ("n32k256", dict(block_n=32, block_k=256), 1),
    ("n64k128", dict(block_n=64, block_k=128), 1),
    ("bcast n16k256", dict(block_n=16, block_k=256, num_stages=2, dot=False), 1),  # M <= 4 only
)
TUNED = ("qkv", "o", "gate_up", "down")


def candidates(n: int, k: int, m: int, dtype, device, limit: int | None = None) -> list[tuple[str, object]]:
    """("plan", the planned config) and every candidate (the first ``limit``) that applies
    at M rows, with its split resolved (the rule's for its tile, times its factor)."""
    from dataclasses import replace

    from cudagraph_rt.kernels import small_linear as sl

    out = [("plan", sl.plan_linear(m, n, k, dtype, device))]
    for label, kw, factor in CANDIDATES[:limit]:
        c = sl.LinearConfig(**kw)
        if c.dot or m <= 4:
            split = c.split_k if factor == 0 else min(sl.MAX_SPLIT, factor * sl.default_split(n, k, c, sl._sm_count(
                torch.device(device))))
            out.append((label, replace(c, split_k=split)))
    return out


def tune(weights: dict, groups: list[Group], widths, replays: int, limit: int | None = None) -> list[dict]:
    """Every candidate on every tuned group (merged) and width: us per layer, checked."""
    found = []
    for g in [g for g in groups if g.name in TUNED]:
        ws = weights[g.name]
        for m in widths:
            x = torch.randn(m, g.inp, dtype=ws[0].dtype, device=ws[0].device)
            for label, config in candidates(sum(g.outs), g.inp, m, x.dtype, x.device, limit):
                fn = stack_fn(ws, g, "merged", kernel_linear(config))
                check(fn(x)[:1], ws[:1], x, f"{g.name} M={m} {label}")
                us = timed_us(fn, x, replays) / len(ws)
                found.append(dict(group=g.name, width=m, n=sum(g.outs), k=g.inp, esize=x.element_size(),
                                  label=label, config=config, us=us,
                                  floor_us=g.weight_bytes / HBM_BYTES_PER_S * 1e6))
    return found


def tune_report(found: list[dict], rows: list[Row]) -> None:
    """Per group and width: cuBLAS (merged), the plan, the best candidate; then entries."""
    from cudagraph_rt.kernels.common import next_pow2
    from cudagraph_rt.kernels.small_linear import MAX_ROWS

    cublas = {(r.group, r.width): r.us for r in rows if r.impl == "cublas" and r.layout == "merged"}
    print(f"{'group':8} {'M':>3} {'floor':>6} {'cublas':>15} {'plan':>15} {'best':>15}  best config")
    entries = []
    for key in dict.fromkeys((f["group"], f["width"]) for f in found):
        sel = [f for f in found if (f["group"], f["width"]) == key]
        plan, best = sel[0], min(sel, key=lambda f: f["us"])
        cell = lambda us: f"{us:7.2f} ({us / plan['floor_us']:4.2f}x)" if us else f"{'-':>15}"  # noqa: E731
        print(f"{key[0]:8} {key[1]:3} {plan['floor_us']:6.2f} {cell(cublas.get(key))} {cell(plan['us'])} "
              f"{cell(best['us'])}  {best['label']}")
        if best["us"] < 0.97 * plan["us"]:
            bucket = next_pow2(min(key[1], MAX_ROWS))
            entries.append(f"    ({best['n']}, {best['k']}, {bucket}, {best['esize']}): {best['config']!r},"
                           f"  # {key[0]} M={key[1]}: {best['us']:.2f} us vs plan {plan['us']:.2f}")
    print("suggested TUNED_CONFIGS entries (kernels/small_linear.py):" if entries else
          "the plan is within 3% of the best candidate everywhere: no table entry suggested")
    print("\n".join(entries))


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m cudagraph_rt.tools.bench.projections", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="where to write every row (rewritten after each implementation)")
    p.add_argument("--widths", default="1,2,4,8,16", help="comma-separated widths (default 1,2,4,8,16)")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--impls", default="cublas,inductor,autotune",
                   help="which implementations, in this order (default cublas,inductor,autotune; autotune runs M = 1 "
                        "only; small: the small-M kernel)")
    p.add_argument("--tune", action="store_true",
                   help="then time the small-M kernel's candidate configs (q/k/v, o, gate/up, down) and print the "
                        "table entries to paste")
    p.add_argument("--candidates", type=int, default=None, help="--tune: only the first N candidates (smoke runs)")
    p.add_argument("--quick", action="store_true", help="a CPU smoke run: the tiny Llama's shapes, fp32, wall clock")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    impls = [i for i in a.impls.split(",") if not (a.quick and i == "autotune")]  # its M = 1 rewrite is GPU-only
    if not impls or any(i not in IMPLS for i in impls):
        print(f"bench_projections: --impls: expected some of {','.join(IMPLS)}, got {a.impls!r}", file=sys.stderr)
        return 2
    if a.quick and ("small" in impls or a.tune) and _triton_backend() != "interpreter":
        print("bench_projections: --quick with the small-M kernel: expected TRITON_INTERPRET=1 (the kernel on a "
              "CPU), got none", file=sys.stderr)
        return 2
    if not a.quick and not torch.cuda.is_available():
        print("bench_projections: expected a CUDA device, got none (--quick runs on a CPU)", file=sys.stderr)
        return 2
    widths = [int(w) for w in a.widths.split(",")]
    groups, layers = llama_groups("tiny" if a.quick else "1b")
    dev, dtype = ("cpu", torch.float32) if a.quick else ("cuda", torch.bfloat16)
    torch.manual_seed(0)
    weights = {g.name: [torch.randn(sum(g.outs), g.inp, dtype=dtype, device=dev) * 0.02
                        for _ in range(layers if g.per_layer else 1)] for g in groups}
    rows, compile_s, t0 = [], {}, time.perf_counter()
    for impl in impls:
        ws = [1] if impl == "autotune" else widths
        if ws != [1] or 1 in widths:
            compile_s[impl] = 0.0
            for g in groups:
                got, s = measure(g, weights[g.name], impl, ws, a.replays)
                rows += got
                compile_s[impl] += s
            record(a.json, rows, compile_s, time.perf_counter() - t0)
            print(f"{impl}: done ({compile_s[impl]:.1f} s compiling)", flush=True)
    report(rows, groups, layers, widths)
    if a.tune:
        found = tune(weights, groups, widths, a.replays, a.candidates)
        record(a.json, rows, compile_s, time.perf_counter() - t0, found)
        tune_report(found, rows)
    print(f"wall {time.perf_counter() - t0:.0f} s")
    return 0


def _triton_backend() -> str:
    from cudagraph_rt.kernels.common import triton_backend
    return triton_backend()


def record(path: str, rows: list[Row], compile_s: dict, wall_s: float, tuned: list[dict] | None = None) -> None:
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    tuned = [dict(f, config=repr(f["config"]), over_floor=f["us"] / f["floor_us"]) for f in tuned or []]
    with open(path, "w") as f:
        json.dump({"rows": [dict(asdict(r), over_floor=r.over_floor) for r in rows], "compile_s": compile_s,
                   "tune": tuned,
                   "hbm_bytes_per_s": HBM_BYTES_PER_S, "device": dev, "torch": torch.__version__, "wall_s": wall_s},
                  f, indent=1)


def report(rows: list[Row], groups: list[Group], layers: int, widths) -> None:
    print(table(rows, widths))
    floor = sum(g.weight_bytes * (layers if g.per_layer else 1) for g in groups) / HBM_BYTES_PER_S * 1e6
    print(f"one step's matmuls ({layers} layers + head), floor {floor:.0f} us:")
    for (lay, impl, m), us in step_totals(rows, groups, layers).items():
        print(f"  {impl:9} {lay:9} M={m:<3} {us:8.0f} us ({us / floor:.2f}x floor)")


if __name__ == "__main__":
    sys.exit(main())
