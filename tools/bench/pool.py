"""``cgrt bench --model hf:<family> --sections pool``: what a step costs against the pool's
size and against the live context (issue 23's goals), on one model's weights.

* pool scaling: one sequence with 128 live cells, widths 1 and 8 (8 = a verify step of
  one sequence), the same steps on a 4,096-cell pool (16 x 256) and on a 262,144-cell pool
  (64 x 4,096); the step through the runtime, graphs on. Goal: the big pool's step <=
  1.10x the small pool's.
* context scaling: the same model on the big pool, one sequence at 1k, 8k and 32k live
  cells, widths 1 and 8: the whole step beside the attention kernels' device time of the
  same shapes (``tools/bench/attention.py``'s 16-layer loop) against the KV-read floor (the
  live cells' K and V bytes of all layers / 4.8 TB/s). Goal: attention <= 2x that floor
  at 8k and 32k.
* default pool, width 1: the step on ``hf.build``'s default pool (16 x 256 cells), for
  the issue's "no slower than before" (2,865 us before the paged pool).

Every pool shares the one transformers model (an ``HFDecoder`` is a view of its weights
plus a pool), and each pool's cells are filled with random values before timing.
"""
from __future__ import annotations

import statistics
import time

import torch

from cudagraph_rt import GraphRuntime
from cudagraph_rt.models import hf

HBM_BYTES_PER_S = 4.8e12
POOLS = {"small": (16, 256), "big": (64, 4096)}  # (sequences, positions each): 4,096 and 262,144 cells
CONTEXTS = (1024, 8192, 32768)
WIDTHS = (1, 8)
POOL_GOAL, ATTENTION_GOAL = 1.10, 2.0


def _decoder(base: hf.HFDecoder, seqs: int, length: int, max_len: int) -> hf.HFDecoder:
    """Another HFDecoder over ``base``'s transformers model with a pool of ``seqs x length``
    cells (positions up to ``max_len``), its cells random."""
    m = hf.HFDecoder(base.model, max_seqs=seqs, max_len=max_len, cells=seqs * length,
                     family=base.config.family, size=base.config.size)
    for layer in range(m.pool.k.shape[0]):  # one layer at a time: no pool-sized temporary
        m.pool.k[layer].normal_()
        m.pool.v[layer].normal_()
    return m


def step_us(model: hf.HFDecoder, rt: GraphRuntime, live: int, T: int, repeats: int) -> float:
    """Median per-step time (us) of ``repeats`` back-to-back steps of T rows of sequence 0
    at positions ``live .. live + T - 1`` (so the first row sees ``live + 1`` cells)."""
    model.pool.cell_range(0, 0, live)  # the context's blocks
    kw = dict(tokens=[1] * T, positions=list(range(live, live + T)), seq_ids=[0] * T,
              cells=model.cell_range(0, live, T), want=[1] * T)
    for _ in range(3):
        rt.step(**kw)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            rt.step(**kw)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / repeats * 1e6)
    return statistics.median(times)


def _runtime(model: hf.HFDecoder) -> GraphRuntime:
    rt = GraphRuntime(model.step, model.inputs(), widths=WIDTHS, graphs=True, device=model.device)
    rt.capture()
    return rt


def _kv_floor_us(model: hf.HFDecoder, live: int) -> float:
    k = model.pool.k
    per_cell = 2 * k.shape[0] * k.shape[2] * k.shape[3] * k.element_size()  # K and V, every layer
    return live * per_cell / HBM_BYTES_PER_S * 1e6


def _attention_us(model: hf.HFDecoder, live: int, T: int) -> float:
    """The attention kernels' device time of one step (all layers) at ``live`` cells and
    width T: tools/bench/attention.py's timed loop over the model's shapes (a CUDA graph of
    every layer's kernel launch, L2 flushed before each replay, median)."""
    from . import attention as ba
    from cudagraph_rt.kernels import attention as ca

    c = model.model.config
    shape = ba.Shape(c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, model.head_dim,
                     model.config.dtype)
    wl = ba.Workload(shape, width=T, seqs=1, extent=live, max_seqs=1, max_len=live,
                     block_size=model.pool.block_size, device=model.device)
    plan = ca.plan_attention(T, shape.Hq, shape.Hkv, shape.D)
    us = ba.Timer(model.device, 15)(wl.kernel_fn(ca, plan))
    del wl
    return us


def sec_pool(ctx) -> dict:
    """The section (``ctx``: bench.hf's context: its model, repeats)."""
    if not ctx.graphs:
        return {"status": "skipped", "reason": "needs CUDA (the kernels and graphs are what is measured)"}
    base, repeats = ctx.model, max(10, ctx.repeats)
    out = {"status": "ok", "pool_scaling": [], "context_scaling": []}
    small = _decoder(base, *POOLS["small"], max_len=POOLS["small"][1])
    rt = _runtime(small)
    times_small = {T: step_us(small, rt, 128, T, repeats) for T in WIDTHS}
    rt.close()
    del rt, small
    big = _decoder(base, *POOLS["big"], max_len=POOLS["big"][1] * 9)  # room for a 32k context
    rt = _runtime(big)
    for T in WIDTHS:
        t = step_us(big, rt, 128, T, repeats)
        out["pool_scaling"].append({"width": T, "small_pool_us": times_small[T], "big_pool_us": t,
                                    "ratio": t / times_small[T], "small_cells": small_cells(),
                                    "big_cells": big.pool.num_blocks * big.pool.block_size})
    for live in CONTEXTS:
        for T in WIDTHS:
            att = _attention_us(big, live, T)
            floor = _kv_floor_us(big, live)  # the kernel loop's rows see `live` cells, as the floor counts
            out["context_scaling"].append({"live": live, "width": T, "step_us": step_us(big, rt, live, T, repeats),
                                           "attention_us": att, "kv_floor_us": floor,
                                           "attention_over_floor": att / floor})
    rt.close()
    del rt, big
    torch.cuda.empty_cache()
    out["method"] = ("one sequence, its first row at `live` cells; steps through GraphRuntime (graphs on, widths 1 "
                     "and 8), median of 5 batches of back-to-back steps; pools filled with random K/V; attention: "
                     "tools/bench/attention.py's 16-layer loop of the model's shapes (L2 flushed, CUDA graph); "
                     "KV floor: live cells' K and V bytes of all layers / 4.8 TB/s")
    return out


def small_cells() -> int:
    return POOLS["small"][0] * POOLS["small"][1]


def goals(sec: dict) -> list[tuple[str, float | None, str, bool]]:
    """(goal, value, target, met) of the section."""
    rows = []
    for r in sec.get("pool_scaling", []):
        rows.append((f"pool 262,144 / 4,096 cells, width {r['width']}", r["ratio"], f"<= {POOL_GOAL}x",
                     r["ratio"] <= POOL_GOAL))
    for r in sec.get("context_scaling", []):
        if r["live"] >= 8192:
            rows.append((f"attention / KV floor, {r['live'] // 1024}k cells, width {r['width']}",
                         r["attention_over_floor"], f"<= {ATTENTION_GOAL}x", r["attention_over_floor"] <= ATTENTION_GOAL))
    return rows


__all__ = ["goals", "sec_pool", "step_us"]
