"""``cgrt bench --model hf:<family> --sections pieces``: piecewise graphs (issue 26's goals).

On the bench's transformers weights (an ``HFDecoder`` is a view of them plus a pool):

* eager-piece: the runtime's own cell attention marked ``cudagraph_rt.eager``
  (``attention="eager-piece"``). Per-step time of T = 1, 2, 4, 8 decode rows with every
  width in pieces (17 pieces around 16 eager attention calls on the 1B), as one whole
  graph per width (the marked call captured inline: what the whole-graph runtime runs),
  and eagerly (graphs off). Goals: pieces <= 1.3x the whole graph, eager >= 2x pieces.
  Capture time and pool bytes of all pieces beside the whole graphs'.
* varlen: attention through torch's ``varlen_attn`` with per-step host ints
  (``attention="varlen"``, ``models/varlen.py``), which a whole graph cannot capture (its
  capture is tried at width 1 and its CaptureError reported). Pieces against eager at the
  same T. Goal: eager >= 2x pieces.

Timing: ``bench.common.step_time_us`` (median of 5 batches of back-to-back steps, host rows
given as lists, synchronized once per batch), fewer repeats for the eager runs.
"""
from __future__ import annotations

import time

import torch

from cudagraph_rt import CaptureError, GraphRuntime
from cudagraph_rt.models import hf

WIDTHS = (1, 2, 4, 8)
WHOLE_GOAL, EAGER_GOAL, VARLEN_GOAL = 1.3, 2.0, 2.0


def _decoder(base: hf.HFDecoder, attention: str) -> hf.HFDecoder:
    c = base.config
    return hf.HFDecoder(base.model, max_seqs=c.max_seqs, max_len=c.max_len, family=c.family, size=c.size,
                        attention=attention)


def _runtime(model: hf.HFDecoder, graphs: bool, pieces: bool) -> tuple[GraphRuntime, dict]:
    rt = GraphRuntime(model.step, model.inputs(), widths=WIDTHS, graphs=graphs, pieces=pieces,
                      step_values=model.step_values, device=model.device)
    t0 = time.perf_counter()
    rep = rt.capture()
    facts = {"capture_s": time.perf_counter() - t0, "pool_bytes": rep.pool_bytes,
             "pieces": {w.width: w.pieces for w in rep.widths}, "modes": dict(rt.stats().width_modes)}
    return rt, facts


def _times(model, rt, repeats: int) -> dict[int, float]:
    from .common import step_time_us
    return {T: step_time_us(model, rt, T, repeats) for T in WIDTHS}


def _eager_piece(ctx) -> dict:
    model = _decoder(ctx.model, "eager-piece")
    out = {}
    for name, graphs, pieces, repeats in (("pieces", True, True, ctx.repeats), ("whole", True, False, ctx.repeats),
                                          ("eager", False, False, max(5, ctx.repeats // 5))):
        rt, facts = _runtime(model, graphs, pieces)
        try:
            out[name] = {**facts, "step_us": _times(model, rt, repeats)}
        finally:
            rt.close()
    rows = [{"T": T, "pieces_us": out["pieces"]["step_us"][T], "whole_us": out["whole"]["step_us"][T],
             "eager_us": out["eager"]["step_us"][T]} for T in WIDTHS]
    for r in rows:
        r["pieces_over_whole"] = r["pieces_us"] / r["whole_us"]
        r["eager_over_pieces"] = r["eager_us"] / r["pieces_us"]
    return {"rows": rows, "capture": {k: {x: v[x] for x in ("capture_s", "pool_bytes", "pieces")}
                                      for k, v in out.items() if k != "eager"}}


def _varlen(ctx) -> dict:
    model = _decoder(ctx.model, "varlen")
    out = {}
    for name, graphs, repeats in (("pieces", True, ctx.repeats), ("eager", False, max(5, ctx.repeats // 5))):
        rt, facts = _runtime(model, graphs, graphs)
        try:
            out[name] = {**facts, "step_us": _times(model, rt, repeats)}
        finally:
            rt.close()
    rows = [{"T": T, "pieces_us": out["pieces"]["step_us"][T], "eager_us": out["eager"]["step_us"][T]}
            for T in WIDTHS]
    for r in rows:
        r["eager_over_pieces"] = r["eager_us"] / r["pieces_us"]
    whole = GraphRuntime(model.step, model.inputs(), widths=(1,), graphs=True, step_values=model.step_values,
                         device=model.device)
    try:
        whole.capture()
        why = None
    except CaptureError as e:  # expected: a whole graph would freeze the per-step ints
        why = str(e).splitlines()[0]
    finally:
        whole.close()
    from cudagraph_rt.models.varlen import _VARLEN
    kernel = "torch varlen_attn" if _VARLEN is not None and model.config.dtype != torch.float32 else "torch reference"
    return {"rows": rows, "capture": {"capture_s": out["pieces"]["capture_s"], "pool_bytes": out["pieces"]["pool_bytes"],
                                      "pieces": out["pieces"]["pieces"]},
            "whole_graph_capture_error": why, "attention_kernel": kernel}


def sec_pieces(ctx) -> dict:
    if not ctx.graphs:
        return {"status": "skipped", "reason": "needs CUDA (graphs in pieces against whole graphs)"}
    return {"status": "ok", "eager_piece": _eager_piece(ctx), "varlen": _varlen(ctx), "widths": list(WIDTHS),
            "method": "HFDecoders over the bench's weights (their own pools): attention='eager-piece' in pieces, as "
                      "whole graphs and graphs off; attention='varlen' in pieces and graphs off; per-step time of T "
                      "decode rows (bench.common.step_time_us: median of 5 batches of back-to-back steps), widths "
                      f"{WIDTHS} captured; capture time and pool bytes from each runtime's CaptureReport"}


def goals(sec: dict) -> list[tuple]:
    """(name, value, target, ok) of the section's goals: the worst T of each."""
    if sec.get("status") != "ok":
        return []
    ep, vl = sec["eager_piece"]["rows"], sec["varlen"]["rows"]
    worst_whole = max(r["pieces_over_whole"] for r in ep)
    worst_eager = min(r["eager_over_pieces"] for r in ep)
    worst_varlen = min(r["eager_over_pieces"] for r in vl)
    return [("pieces / whole graph, T 1-8 (worst)", worst_whole, f"<= {WHOLE_GOAL}x", worst_whole <= WHOLE_GOAL),
            ("eager / pieces, T 1-8 (worst)", worst_eager, f">= {EAGER_GOAL}x", worst_eager >= EAGER_GOAL),
            ("varlen: eager / pieces, T 1-8 (worst)", worst_varlen, f">= {VARLEN_GOAL}x", worst_varlen >= VARLEN_GOAL)]


def print_section(con, sec: dict) -> None:
    from rich.table import Table

    from ..console import fit

    t = Table(title="pieces: step time (us) of T decode rows")
    for h in ("T", "eager-piece: pieces", "whole graph", "eager", "x whole", "eager / pieces", "varlen: pieces",
              "eager", "eager / pieces"):
        t.add_column(h, justify="right")
    for a, b in zip(sec["eager_piece"]["rows"], sec["varlen"]["rows"]):
        t.add_row(str(a["T"]), f"{a['pieces_us']:.0f}", f"{a['whole_us']:.0f}", f"{a['eager_us']:.0f}",
                  f"{a['pieces_over_whole']:.2f}", f"{a['eager_over_pieces']:.1f}", f"{b['pieces_us']:.0f}",
                  f"{b['eager_us']:.0f}", f"{b['eager_over_pieces']:.1f}")
    con.print(fit(t))
    cap = sec["eager_piece"]["capture"]
    for name, c in (("eager-piece in pieces", cap["pieces"]), ("eager-piece whole", cap["whole"]),
                    ("varlen in pieces", sec["varlen"]["capture"])):
        con.print(f"capture {name}: {c['capture_s']:.2f} s, pool {c['pool_bytes'] / 2**20:.1f} MiB, pieces per "
                  f"width {c['pieces']}", markup=False)
    con.print(f"varlen attention: {sec['varlen']['attention_kernel']}; its whole graph: "
              f"{sec['varlen']['whole_graph_capture_error'] or 'captured (unexpected)'}", markup=False)
