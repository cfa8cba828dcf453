#!/usr/bin/env bash
# Issue 23's kernel (kernels/cell_attention.py): its tests on the H200 (the compiled kernels; the
# cuda ones against SDPA, past 2**31 elements and through a CUDA graph), then the kernel bench
# (16-layer loop of Llama-3.2-1B shapes: extents, width 64, pool scaling, config candidates until
# its budget). About 4 minutes on a cold Triton cache.
export PYTHONPATH=$PWD PYTHONWARNINGS=ignore; OUT=${OUT:-/tmp/cgrt-out}; mkdir -p "$OUT"
timeout 180 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_cell_attention.py tests/test_bench_attention.py \
  > "$OUT/pytest_attention.txt" 2>&1; echo "== attention tests rc=$?"; tail -n 15 "$OUT/pytest_attention.txt" | cut -c1-220
timeout 130 python3 -m cudagraph_rt.tools.bench.attention --json "$OUT/bench_attention.json" --budget 85 \
  > "$OUT/bench_attention.txt" 2>&1; echo "== bench rc=$?"; grep -v -i warn "$OUT/bench_attention.txt" | tail -n 30 | cut -c1-240
