"""Six launches of the cell attention on bench.attention's workload (one sequence, WIDTH
rows at its last positions, EXTENT live cells), for ``ncu`` to profile one of them
(BENCHMARKS.md run F):

    ncu --clock-control none --kernel-name regex:cell_attention --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python3 tools/bench/experiments/ncu_attention.py WIDTH EXTENT
"""
import sys

import torch

from cudagraph_rt.kernels import attention as ca
from cudagraph_rt.tools.bench.attention import FULL, Workload


def main():
    width, extent = int(sys.argv[1]), int(sys.argv[2])
    wl = Workload(FULL.shape, width=width, seqs=1, extent=extent, max_seqs=1, max_len=extent, block_size=16,
                  device=torch.device("cuda"))
    for i in range(6):
        ca.cell_attention_triton(wl.q[i], wl.k[i], wl.v[i], wl.table, wl.seq, wl.pos, block_size=wl.bs,
                                 scale=wl.scale, out=wl.out[i])
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
