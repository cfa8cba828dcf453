"""The cell attention's 16-layer loop (bench.attention's timer) three ways: attention
only, write_cells + attention, and the write inside the attention launch
(``write_and_attend_triton``, where this tree has it); with ``stream``, first the plain
streaming read of the live K/V bytes (a ``tl.sum`` per program, 8 warps, PDL off and on).
JSON and lines under $OUT (BENCHMARKS.md run F).

    PYTHONPATH=. python3 -u tools/bench/experiments/attention_loops.py [stream]
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl

from cudagraph_rt.kernels import attention as ca
from cudagraph_rt.tools.bench.attention import FULL, Timer, Workload, kv_floor_us

OUT = os.environ.get("OUT", "/tmp")
DEV = torch.device("cuda")
RES = {}


def rec(key, value):
    RES[key] = value
    print(key, value, flush=True)
    with open(f"{OUT}/attention_loops.json", "w") as f:
        json.dump(RES, f, indent=1)


@triton.jit
def stream_sum(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    off = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + off, mask=off < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(x.to(tl.float32), 0))


def stream(timer):
    for ext in (8192, 32768):
        n = ext * 8 * 64 * 2  # K and V of one layer, bf16 elements
        xs = [torch.randn(n, device=DEV).to(torch.bfloat16) for _ in range(16)]
        for block in (4096, 8192, 16384):
            sums = torch.empty(n // block + 1, device=DEV)
            for pdl in (False, True):
                def run(block=block, pdl=pdl, sums=sums):
                    for x in xs:
                        stream_sum[(triton.cdiv(n, block),)](x, sums, n, BLOCK=block, PDL=pdl, launch_pdl=pdl,
                                                             num_warps=8)
                us = timer(run)
                rec(f"stream {ext} block {block} pdl {pdl}", {"us": us, "floor_us": kv_floor_us(FULL.shape, ext)})


class Fresh:
    """The step's own K/V rows and their cells (through the workload's table)."""

    def __init__(self, wl):
        L, N = wl.shape.layers, len(wl.seq)
        self.k = torch.randn(L, N, wl.shape.Hkv, wl.shape.D, device=DEV).to(wl.shape.dtype)
        self.v = torch.randn_like(self.k)
        t = wl.table.long()
        self.cells = t[wl.seq, wl.pos // wl.bs] * wl.bs + wl.pos % wl.bs


def loop(wl, fr, mode):
    kw = dict(block_size=wl.bs, scale=wl.scale)

    def run():
        for L in range(wl.shape.layers):
            args = (wl.table, wl.seq, wl.pos)
            if mode == "one launch":
                ca.write_and_attend_triton(wl.q[L], fr.k[L], fr.v[L], wl.k[L], wl.v[L], fr.cells, *args,
                                           out=wl.out[L], **kw)
                continue
            if mode == "write_cells + attention":
                ca.write_cells_triton(fr.k[L], fr.v[L], wl.k[L], wl.v[L], fr.cells)
            ca.cell_attention_triton(wl.q[L], wl.k[L], wl.v[L], *args, out=wl.out[L], **kw)
    return run


def main():
    timer = Timer(DEV, 15)
    if "stream" in sys.argv[1:]:
        stream(timer)
    modes = ["attention only", "write_cells + attention"]
    if hasattr(ca, "write_and_attend_triton"):
        modes.append("one launch")
    for ext, width, seqs in ((128, 1, 1), (128, 8, 1), (128, 8, 8), (8192, 1, 1), (8192, 8, 1), (32768, 1, 1),
                             (32768, 8, 1)):
        wl = Workload(FULL.shape, width=width, seqs=seqs, extent=ext, max_seqs=seqs, max_len=ext, block_size=16,
                      device=DEV)
        fr = Fresh(wl)
        for mode in modes:
            us = timer(loop(wl, fr, mode))
            rec(f"w{width} s{seqs} {ext} {mode}", {"us": us, "x_floor": us / wl.floor_us()})
        del wl, fr


if __name__ == "__main__":
    main()
