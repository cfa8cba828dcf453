#!/usr/bin/env bash
# One H200 call for issue 22 (reliability): the graph-path items' cuda tests first (CUDA
# graphs and emulated graphs on the GPU), then every cuda test (the fed prologue now pads
# rows [T, width) on the device: two more kernels per graph), the emulated sweep on the
# GPU, and bench section 3 (the step's latency against a bare replay, prologue included).
# Logs under $OUT; a short table on stdout. Timeouts sum to under 600 s (one device call).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONWARNINGS=ignore; OUT=${OUT:-/tmp/cgrt-out}; mkdir -p "$OUT"
rc=0
timeout 120 python3 -m pytest -m cuda -q -p no:cacheprovider -rfE \
  -k "cuda-graphs or emulated or test_cuda_sweep" \
  tests/test_host_rows.py tests/test_inputs.py tests/test_runtime.py tests/test_emulated_graphs.py tests/test_sweep.py \
  > "$OUT/issue22_cuda.txt" 2>&1 || rc=1
echo "== issue 22 graph-path tests (expect 14 passed)"; tail -n 6 "$OUT/issue22_cuda.txt" | cut -c1-200
timeout 300 python3 -m pytest -m cuda -q -p no:cacheprovider -rfE --ignore=tests/test_tp.py \
  > "$OUT/pytest_cuda.txt" 2>&1 || rc=1
echo "== every cuda test"; tail -n 8 "$OUT/pytest_cuda.txt" | cut -c1-200
timeout 60 python3 -m cudagraph_rt sweep --graphs emulate --repeats 1 > "$OUT/sweep_emulate.txt" 2>&1 || rc=1
echo "== cgrt sweep --graphs emulate (cuda)"; tail -n 2 "$OUT/sweep_emulate.txt" | cut -c1-200
timeout 100 python3 -m cudagraph_rt bench --sections 3 --json "$OUT/bench3.json" > "$OUT/bench3.txt" 2>&1 || rc=1
echo "== bench section 3"; grep -v -i "warn" "$OUT/bench3.txt" | tail -n 25 | cut -c1-170
exit $rc
