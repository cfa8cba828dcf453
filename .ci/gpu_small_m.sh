#!/usr/bin/env bash
# Issue 24, the small-M kernel on the H200 (device tool), logs and JSON under $OUT. Usage:
#   bash .ci/gpu_small_m.sh tests    the kernel and model tests (compiled kernel on CUDA), the compiled
#                                    stand-in with the op, the bench smoke (~1.5 min)
#   bash .ci/gpu_small_m.sh bench    the 1B's matmuls: cuBLAS vs the kernel at M 1..16, then --tune
#                                    (candidates and the TUNED_CONFIGS entries to paste) (~1 min)
#   bash .ci/gpu_small_m.sh all      both (< 3 min)
#   bash .ci/gpu_small_m.sh profile  the compiled 1B width-1 step, fused, through the kernel, by kernel (~2 min)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cgrt-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONWARNINGS=ignore
what=${1:-all}
rc=0
run_tests() {
  timeout 200 python3 -m pytest -q -p no:cacheprovider -rfEs tests/test_small_linear.py tests/test_small_m.py \
    tests/test_fused.py tests/test_bench_projections.py \
    "tests/test_compiled_step.py::test_compiled_step_equals_eager[hf-qwen3-fused-small]" \
    "tests/test_compiled_step.py::test_small_m_compiled_step_runs_the_kernel_op_once_per_projection" \
    > "$OUT/small_m_pytest.txt" 2>&1 || rc=1
  tail -n 12 "$OUT/small_m_pytest.txt"
}
run_bench() {
  timeout 240 python3 -m cudagraph_rt.tools.bench.projections --json "$OUT/small_m_bench.json" \
    --impls cublas,small --tune > "$OUT/small_m_bench.txt" 2>&1 || rc=1
  grep -v -i "warn" "$OUT/small_m_bench.txt" | tail -n 70
}
case "$what" in
tests) run_tests ;;
bench) run_bench ;;
all) run_tests; run_bench ;;
profile)
  timeout 300 python3 -m cudagraph_rt.tools.bench.profile_replay --model hf:llama --size 1b --width 1 --top 12 \
    --compile default --fuse --small-m --json "$OUT/profile_small_m.json" > "$OUT/profile_small_m.txt" 2>&1 || rc=1
  grep -v -i "warn\|^[VWI][0-9]" "$OUT/profile_small_m.txt" | tail -n 22 | cut -c1-170 ;;
*)
  echo "usage: bash .ci/gpu_small_m.sh tests|bench|all|profile" >&2; exit 2 ;;
esac
exit $rc
