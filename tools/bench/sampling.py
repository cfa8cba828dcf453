"""``cgrt bench --model hf:<family> --sections sampling``: the sampler (``kernels.sampling``)
against torch's sort-based top-p sampling at the model's vocabulary, side by side in one
run, and the sampler's time as a share of the bench model's width-1 step.

On CUDA each figure is ``kernels/sampling/bench.py``'s: one CUDA graph of each sampler per
(rows, setting), L2 flushed before every replay, the median device time of a replay; the
width-1 step is ``common.step_time_us`` of the bench's own runtime (graphs on, compiled
where the bench compiles). The goals (issue 37): <= 0.5x torch's sort-based top-p at 1 and
64 rows, and <= 3% of the width-1 step at 1 row. On a CPU (``--quick``) the same pairs run
through the torch path, timed by the host clock: a smoke run, held to no goal.
"""
from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch

ROWS = (1, 64)
SETTINGS = ("top_p=0.9", "top_k=50,top_p=0.9")  # kernels/sampling/bench.py CASES
RATIO_GOAL, SHARE_GOAL = 0.5, 0.03
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def sec_sampling(ctx) -> dict:
    from cudagraph_rt.kernels.sampling import bench as kb

    from .common import step_time_us

    model = ctx.model
    vocab, dtype = model.config.vocab, _DTYPE_NAMES.get(model.config.dtype, "fp32")
    step_us = step_time_us(model, ctx.rt, 1, ctx.repeats)
    if ctx.graphs:
        args = SimpleNamespace(vocab=vocab, scale=3.0, iters=max(ctx.repeats, 20), passes=None, candidates=None,
                               chunk=None)
        flush = torch.empty(256 << 20, dtype=torch.int8, device=model.device)
        with torch.cuda.device(model.device):
            rows = [kb._measure(args, dtype, n, case, flush) for n in ROWS for case in SETTINGS]
        method = ("device time of one CUDA graph replay per sampler (median, L2 flushed before each), "
                  "kernels/sampling/bench.py; logits randn * 3")
    else:
        rows = [_cpu_row(kb, dtype, n, case, vocab, ctx.repeats) for n in ROWS for case in SETTINGS]
        method = "CPU smoke: the torch path and torch's sort-based sampler, host wall time (median); no goal"
    out = [{"rows": r.rows, "setting": r.case, "dtype": r.dtype, "ours_us": r.ours_us, "torch_us": r.torch_us,
            "ratio": r.ratio(), "share_of_step": None if r.ours_us is None else r.ours_us / step_us,
            "launches": r.launches, "same_tokens": r.same_tokens} for r in rows]
    return {"status": "ok", "vocab": vocab, "step_us_width1": step_us, "rows": out, "method": method,
            "ok": all(r["same_tokens"] for r in out)}


def _cpu_row(kb, dtype: str, n: int, case: str, vocab: int, repeats: int):
    from cudagraph_rt.kernels.sampling import sample
    from cudagraph_rt.kernels.sampling.reference import reference_sample

    logits = torch.randn(n, vocab) * 3.0
    settings = kb._settings(n, case, "cpu")

    def median_us(fn) -> float:
        times = []
        for _ in range(max(repeats, 3)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)

    ours = median_us(lambda: sample(logits, settings, use_kernel=False))
    base = median_us(lambda: reference_sample(logits, settings))
    same = bool((sample(logits, settings, use_kernel=False) == sample(logits, settings)).all())
    return kb.Row("fp32", n, case, ours, base, 0, same)


def goals(sec: dict) -> list[tuple[str, float | None, str, bool]]:
    """(name, value, target, met) per goal, from a CUDA run's section."""
    out = []
    for r in sec.get("rows", []):
        if r["setting"] == "top_p=0.9":
            v = r["ratio"]
            out.append((f"sampler / torch sort-based top-p, {r['rows']} rows (vocab {sec.get('vocab')})", v,
                        f"<= {RATIO_GOAL}x", v is not None and v <= RATIO_GOAL))
    for r in sec.get("rows", []):
        if r["rows"] == 1 and r["setting"] == "top_p=0.9":
            v = r["share_of_step"]
            out.append(("sampler top-p, 1 row / width-1 step", v, f"<= {SHARE_GOAL:.2f}",
                        v is not None and v <= SHARE_GOAL))
    return out


def print_section(con, sec: dict) -> None:
    con.print(f"sampling at vocab {sec['vocab']} ({sec['method']}); width-1 step {sec['step_us_width1']:.1f} us",
              markup=False)
    for r in sec["rows"]:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.2f}x"
        share = "-" if r["share_of_step"] is None else f"{100 * r['share_of_step']:.2f}%"
        con.print(f"  {r['rows']:>3} rows {r['setting']:<20} ours {r['ours_us']:9.1f} us  torch sort-based "
                  f"{r['torch_us']:9.1f} us  ratio {ratio:>7}  of step {share:>7}  same tokens "
                  f"{'yes' if r['same_tokens'] else 'NO'}", markup=False)
