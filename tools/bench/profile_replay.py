"""Where one captured width's device time goes: the kernels of ``--replays`` replays of a
model's graph at ``--width``, by total device time (torch.profiler, CUDA activity).

    python -m cudagraph_rt.tools.bench.profile_replay --model hf:llama --size 1b --width 1 \\
        [--compile default] [--fuse] [--small-m] [--capture-widths default] [--json OUT.json]

Prints the replay's median time (CUDA events), the top kernels with their share and a
summary by kind (matmul, attention, copy, other: norms, elementwise, RoPE) with kernels
per step, the table BENCHMARKS.md shows before/after. ``--fuse`` merges q/k/v and gate/up
weights first (models/fused.py), ``--small-m`` runs the layers' projections through the
small-M kernel (models/small_m.py; the kernel shows as ``_small_gemv_kernel``, a matmul);
``--capture-widths default`` captures every default
width (the runtime's warm-up compiles them: the report gives warm-up seconds, compiling
included, apart from capture seconds) and profiles ``--width`` among them. CUDA only.
For the toy, ``--model toy`` (the bench size)."""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

import torch

from cudagraph_rt import GraphRuntime

# Kernel kinds by name: cuBLAS/CUTLASS GEMM and GEMV kernels, and inductor kernels made
# from a matmul (an M = 1 mm under coordinate-descent tuning becomes a reduction named
# after it); attention kernels and the op; copies (a whole-cache copy shows up here; a
# dtype cast, ``_to_copy``, does not).
KINDS = (("matmul", re.compile(r"gemm|gemv|cutlass|nvjet|xmma|splitk|sm\d\d_|_mm_|_mm$|addmm|bmm", re.I)),
         ("attention", re.compile(r"attn|attention|attend|flash|fmha|softmax|sdpa", re.I)),
         ("copy", re.compile(r"(?<!_to)_copy_|copy_kernel|memcpy|memset|index_put|scatter|CatArray", re.I)))


def kind(name: str) -> str:
    return next((k for k, pat in KINDS if pat.search(name)), "other")


def _model(name: str, size: str):
    if name == "toy":
        from cudagraph_rt.models import ToyConfig, ToyDecoder
        return ToyDecoder(ToyConfig.bench(), "cuda")
    from cudagraph_rt.models.hf import build, parse_model
    return build(parse_model(name), size, device=torch.device("cuda"))


def _sdpa(name: str | None):
    from contextlib import nullcontext

    if name is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name])


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m cudagraph_rt.tools.bench.profile_replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="hf:llama")
    p.add_argument("--size", default="1b")
    p.add_argument("--width", type=int, default=1)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--context", type=int, default=None,
                   help="the position of each profiled row, live rows of distinct sequences (default 128, or half "
                        "the model's max_len if less)")
    p.add_argument("--compile", default=None, help="hf models: compile_decoder(MODE) before capture")
    p.add_argument("--static-widths", action="store_true",
                   help="compile each width on its own (compile_decoder(dynamic=False)): what the dynamic row "
                        "dimension costs, at --width 2 or more")
    p.add_argument("--fuse", action="store_true", help="hf models: merge q/k/v and gate/up weights (models/fused.py)")
    p.add_argument("--small-m", action="store_true",
                   help="hf models: the layers' projections through the small-M kernel (models/small_m.py; with "
                        "--fuse, the merged products)")
    p.add_argument("--capture-widths", choices=("one", "default"), default="one",
                   help="capture --width only (default) or every default width, timing warm-up and capture")
    p.add_argument("--json", default=None, help="write the step time, capture times and kernel table here")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--sdpa", default=None, choices=("flash", "efficient", "cudnn", "math"),
                   help="capture under torch.nn.attention.sdpa_kernel(this backend) (an experiment: the "
                        "backend is chosen when the graph is captured)")
    return p.parse_args(argv)


def _runtime(a):
    """The model (fused and compiled as asked) and its captured runtime; capture figures."""
    model = _model(a.model, a.size)
    if a.fuse:
        from cudagraph_rt.models.fused import fuse_projections
        fuse_projections(model.model)
    if a.small_m:  # after fusing: the merged groups' products too
        from cudagraph_rt.models.small_m import use_small_m_kernel
        use_small_m_kernel(model.model)
    kw = {"dynamic": False} if a.static_widths else {}
    compiled = model.compile_decoder(a.compile, **kw) if a.compile else None
    widths = None if a.capture_widths == "default" else (a.width,)
    rt = GraphRuntime(model.step, model.inputs(), widths=widths, graphs=True, device=model.device)
    with _sdpa(a.sdpa):
        rep = rt.capture()
    cap = {"widths": list(rt.widths), "warmup_s_incl_compile": sum(w.warmup_s for w in rep.widths),
           "capture_s": sum(w.capture_s for w in rep.widths), "total_s": rep.seconds,
           "graphs_compiled": getattr(compiled, "graphs", None), "compile_s": getattr(compiled, "compile_s", None)}
    return model, rt, cap


def _inputs(model, width: int, context: int) -> dict:
    """Live rows (an attention over live cells does no work for a padding row): row r is
    sequence r % max_seqs at position context + r // max_seqs, its cells allocated."""
    S = model.config.max_seqs
    seqs, pos = [r % S for r in range(width)], [context + r // S for r in range(width)]
    for s in set(seqs):
        model.cell_range(s, 0, max(p for q, p in zip(seqs, pos) if q == s) + 1)
    cols = dict(tokens=torch.randint(0, model.config.vocab, (width,)).tolist(), positions=pos, seq_ids=seqs,
                cells=[model.cell_for(s, p) for s, p in zip(seqs, pos)], want=[1] * width)
    return {k: torch.tensor(v, dtype=torch.int64) for k, v in cols.items()}


def _step_us(rt, x, replays: int) -> float:
    for _ in range(3):
        rt.step(**x)
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        rt.step(**x)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return statistics.median(times)


def _kernels(rt, x, replays: int) -> list[dict]:
    """[{name, kind, us (per step), calls (per step)}], by device time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            rt.step(**x)
        torch.cuda.synchronize()
    events = [ev for ev in prof.key_averages() if getattr(ev, "self_device_time_total", 0)]
    rows = [{"name": ev.key, "kind": kind(ev.key), "us": ev.self_device_time_total / replays,
             "calls": ev.count / replays} for ev in events]
    return sorted(rows, key=lambda r: -r["us"])


def _print(a, step_us: float, cap: dict, rows: list[dict]) -> None:
    total = sum(r["us"] for r in rows) or 1.0
    print(f"{a.model} {a.size} width {a.width} at position {a.context}{' compiled ' + a.compile if a.compile else ''}"
          f"{' (static widths)' if a.static_widths else ''}"
          f"{' fused' if a.fuse else ''}{' small-M kernel' if a.small_m else ''}"
          f"{' sdpa ' + a.sdpa if a.sdpa else ''}: step median {step_us:.1f} us "
          f"(events), profiled device time {total:.1f} us per step, {sum(r['calls'] for r in rows):.0f} kernels")
    print(f"capture of widths {cap['widths']}: warm-up {cap['warmup_s_incl_compile']:.1f} s (compiling included"
          f"{'' if cap['graphs_compiled'] is None else ', %d graphs in %.1f s' % (cap['graphs_compiled'], cap['compile_s'])})"
          f", capture {cap['capture_s']:.2f} s")
    for r in rows[:a.top]:
        print(f"{100 * r['us'] / total:5.1f}%  {r['us']:8.1f} us/step  x{r['calls']:<5.0f} {r['kind']:9} {r['name'][:100]}")
    print("by kind:")
    for k in [k for k, _ in KINDS] + ["other"]:
        sel = [r for r in rows if r["kind"] == k]
        us = sum(r["us"] for r in sel)
        print(f"  {k:9} {us:8.1f} us/step ({100 * us / total:4.1f}%)  {sum(r['calls'] for r in sel):5.0f} kernels/step")


def main(argv=None) -> int:
    a = _parse(argv)
    if not torch.cuda.is_available():
        print("profile_replay: expected a CUDA device, got none", file=sys.stderr)
        return 2
    if a.model == "toy" and (a.compile or a.fuse or a.small_m):
        print("profile_replay: --compile, --fuse and --small-m: expected an hf: model, got toy", file=sys.stderr)
        return 2
    model, rt, cap = _runtime(a)
    if a.context is None:
        a.context = min(128, model.config.max_len // 2)
    x = _inputs(model, a.width, a.context)
    step_us = _step_us(rt, x, a.replays)
    rows = _kernels(rt, x, a.replays)
    _print(a, step_us, cap, rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "step_us": step_us, "capture": cap, "kernels": rows}, f, indent=1)
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
