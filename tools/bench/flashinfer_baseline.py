"""FlashInfer's paged attention as the attention bench's optional baseline (issue 39): the
same pool, block table, rows and layers as the cell attention, through FlashInfer's own
wrappers, so the ratios come from one run of our bench.

Variants (the best of them is the baseline of a case):

* ``decode``: ``BatchDecodeWithPagedKVCacheWrapper``, one request per query row (a verify
  step's rows are requests of one, two, ... more cells of the same pages);
* ``decode tensor cores``: the same with ``use_tensor_cores=True`` (FlashInfer's prefill
  kernel for grouped heads);
* ``prefill``: ``BatchPrefillWithPagedKVCacheWrapper``, one request per sequence, its rows
  the queries, causal (FlashInfer aligns the rows to the end of the context).

Each is planned once outside the graph (``use_cuda_graph=True``: fixed index buffers), and
its ``run`` per layer is what the graph captures. FlashInfer is not a dependency: where it
does not import (or there is no GPU) the section says why and is skipped. Pages are our
blocks: a layer's K (``[cells, Hkv, D]``) viewed as ``[blocks, block_size, Hkv, D]`` is
FlashInfer's ``NHD`` page layout.
"""
from __future__ import annotations

import torch

WORKSPACE_BYTES = 256 << 20
VARIANTS = ("decode", "decode tensor cores", "prefill")


def available() -> tuple[bool, str]:
    """(whether FlashInfer can run here, its version or why not)."""
    from cudagraph_rt import extras

    if not torch.cuda.is_available():
        return False, "FlashInfer needs a CUDA device"
    if not extras.available("bench"):
        return False, extras.message("bench", "the FlashInfer column")
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001 - an install that fails to import is a reason, not a crash
        return False, f"flashinfer does not import here ({type(e).__name__}: {str(e)[:200]})"
    return True, getattr(flashinfer, "__version__", "?")


def row_pages(table: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, block_size: int):
    """One paged request per row (the decode variants): ``(indptr, indices, last_page_len)``
    as int32, row i reading positions ``[0, pos[i]]`` of sequence ``seq[i]`` through its
    block table row."""
    n_pages = (pos // block_size + 1).to(torch.int64)
    indptr = torch.zeros(len(pos) + 1, dtype=torch.int64, device=pos.device)
    indptr[1:] = torch.cumsum(n_pages, 0)
    indices = torch.cat([table[s, :n] for s, n in zip(seq.tolist(), n_pages.tolist())])
    return indptr.int(), indices.int(), (pos % block_size + 1).int()


def sequence_pages(table: torch.Tensor, seqs: int, rows_per_seq: int, extent: int, block_size: int):
    """One paged request per sequence (the prefill variant): ``(qo_indptr, indptr, indices,
    last_page_len)``, each of ``seqs`` sequences with ``rows_per_seq`` query rows and
    ``extent`` cells."""
    n = -(-extent // block_size)
    dev = table.device
    qo = torch.arange(seqs + 1, dtype=torch.int32, device=dev) * rows_per_seq
    indptr = torch.arange(seqs + 1, dtype=torch.int32, device=dev) * n
    indices = table[:seqs, :n].reshape(-1).int()
    last = torch.full((seqs,), (extent - 1) % block_size + 1, dtype=torch.int32, device=dev)
    return qo, indptr, indices, last


class FlashInferAttention:
    """One variant over a workload (``tools/bench/attention.py``'s Workload): ``layer(i)``
    runs layer i into the workload's ``out[i]``; ``run()`` every layer (what a graph
    captures). Planned at construction, outside any capture."""

    def __init__(self, wl, variant: str):
        import flashinfer

        s, dev = wl.shape, wl.q.device
        self.wl, self.variant = wl, variant
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
        blocks = wl.k.shape[1] // wl.bs
        self.k = wl.k.view(s.layers, blocks, wl.bs, s.Hkv, s.D)
        self.v = wl.v.view(s.layers, blocks, wl.bs, s.Hkv, s.D)
        common = dict(q_data_type=s.dtype, kv_data_type=s.dtype, sm_scale=wl.scale)
        if variant == "prefill":
            qo, indptr, indices, last = sequence_pages(wl.table, wl.seqs, wl.per, wl.extent, wl.bs)
            self.bufs = (qo, indptr, indices, last)
            self.w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo.clone(), paged_kv_indptr_buf=indptr.clone(),
                paged_kv_indices_buf=indices.clone(), paged_kv_last_page_len_buf=last.clone())
            self.w.plan(qo, indptr, indices, last, s.Hq, s.Hkv, s.D, wl.bs, causal=True, **common)
        else:
            indptr, indices, last = row_pages(wl.table, wl.seq, wl.pos, wl.bs)
            self.bufs = (indptr, indices, last)
            self.w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=variant == "decode tensor cores",
                paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
                paged_kv_last_page_len_buffer=last.clone())
            self.w.plan(indptr, indices, last, s.Hq, s.Hkv, s.D, wl.bs, **common)

        import inspect
        # out=: FlashInfer writes the layer's output in place (no copy timed with it)
        self.in_place = "out" in inspect.signature(self.w.run).parameters

    def layer(self, i: int) -> None:
        wl = self.wl
        if self.in_place:
            self.w.run(wl.q[i], (self.k[i], self.v[i]), out=wl.out[i])
        else:
            wl.out[i].copy_(self.w.run(wl.q[i], (self.k[i], self.v[i])))

    def run(self) -> None:
        for i in range(self.wl.shape.layers):
            self.layer(i)


# ----------------------------------------------------------------------------- the section
GRAPH_GOAL, EAGER_GOAL = 0.9, 1.2  # issue 39: our time / FlashInfer's best, in graphs and eager
CASES = (("1 x 8k, width 1", 1, 1, 8192), ("1 x 32k, width 1", 1, 1, 32768), ("64 x 1k, width 64", 64, 64, 1024),
         ("1 x 8k, width 8", 8, 1, 8192), ("1 x 32k, width 8", 8, 1, 32768))  # (name, width, seqs, extent)
EAGER_REPS = 20


def eager_us(fn, calls: int, reps: int = EAGER_REPS) -> float:
    """Microseconds per call of ``fn``'s ``calls`` calls run eagerly back to back (one
    synchronisation at the end: what a host that launches them pays, or the device time
    where that is longer)."""
    import time

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (reps * calls) * 1e6


def _failed(e: Exception) -> str:
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def section(bench, reference) -> dict:
    """Each of CASES: the cell attention and every FlashInfer variant, graph-timed (the
    bench's Timer) and eager, outputs checked against ``reference(wl)`` (SDPA)."""
    ok, why = available()
    if not ok:
        return {"status": "skipped", "reason": why}
    rows = []
    for name, width, seqs, extent in CASES:
        wl = bench.workload(width, seqs, extent)
        want = reference(wl)
        kernel = bench.kernel(wl, want=want)
        plan = bench.default_plan(wl)
        layers = wl.shape.layers
        try:
            kernel["eager_us"] = eager_us(wl.kernel_fn(bench.ca, plan), layers)
        except Exception as e:  # noqa: BLE001 - reported, the other cases still run
            kernel["eager_status"] = _failed(e)
        variants = {}
        for v in VARIANTS:
            try:
                fa = FlashInferAttention(wl, v)
                res = {"us": bench.timer(fa.run)}
                res["max_err"] = float((wl.kernel_out() - want.float()).abs().max())
                res["status"] = "ok" if res["max_err"] < 6e-2 else "WRONG"
                res["eager_us"] = eager_us(fa.run, layers)
            except Exception as e:  # noqa: BLE001 - a variant that does not run here is a result
                res = {"status": _failed(e)}
            variants[v] = res
        good = {v: r for v, r in variants.items() if r["status"] == "ok"}
        best = min(good, key=lambda v: good[v]["us"]) if good else None
        eager_best = min(good, key=lambda v: good[v]["eager_us"]) if good else None
        rows.append({"case": name, "width": width, "seqs": seqs, "extent": extent, "kernel": kernel,
                     "flashinfer": variants, "best": best, "eager_best": eager_best,
                     "graph_ratio": kernel["us"] / good[best]["us"] if best and "us" in kernel else None,
                     "eager_ratio": (kernel["eager_us"] / good[eager_best]["eager_us"]
                                     if eager_best and "eager_us" in kernel else None)})
        del wl, want
    return {"status": "ok", "version": why, "rows": rows}


def print_section(res: dict) -> None:
    if not res:
        return
    if res.get("status") != "ok":
        print(f"\n== against FlashInfer: skipped: {res.get('reason')}")
        return
    print(f"\n== against FlashInfer {res['version']} (16-layer loop in a graph, L2 flushed; eager: us per call; "
          f"goals: graph <= {GRAPH_GOAL}x, eager <= {EAGER_GOAL}x its best)")
    print(f"{'case':>18} {'ours':>8} {'flashinfer':>10} {'ratio':>6} {'goal':>5}   {'ours eager':>10} "
          f"{'fi eager':>8} {'ratio':>6} {'goal':>5}  best variant / eager")
    for r in res["rows"]:
        k, fi = r["kernel"], r["flashinfer"]
        g, e = r["graph_ratio"], r["eager_ratio"]
        fi_us = fi[r["best"]]["us"] if r["best"] else float("nan")
        fi_eager = fi[r["eager_best"]]["eager_us"] if r["eager_best"] else float("nan")
        verdict = lambda x, goal: "-" if x is None else ("pass" if x <= goal else "MISS")  # noqa: E731
        print(f"{r['case']:>18} {k.get('us', float('nan')):>8.1f} {fi_us:>10.1f} {g or float('nan'):>6.2f} "
              f"{verdict(g, GRAPH_GOAL):>5}   {k.get('eager_us', float('nan')):>10.1f} {fi_eager:>8.1f} "
              f"{e or float('nan'):>6.2f} {verdict(e, EAGER_GOAL):>5}  {r['best']} / {r['eager_best']}")
        bad = [f"{v}: {x['status']}" for v, x in fi.items() if x["status"] != "ok"]
        if bad or k.get("status") != "ok":
            print(f"{'':>18} not ok: kernel {k.get('status')}; " + "; ".join(bad))
