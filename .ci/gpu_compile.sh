#!/usr/bin/env bash
# Issue 24 on the H200 (device tool), logs and JSON under $OUT. Usage:
#   bash .ci/gpu_compile.sh tests        the compile and fused tests (CPU ones too: torch 2.11, transformers 5.17)
#                                        and the transformers cuda tests (~3 min)
#   bash .ci/gpu_compile.sh projections  the 1B's matmuls, separate vs merged, cuBLAS vs inductor (~2 min)
#   bash .ci/gpu_compile.sh profile      the 1B step at width 1 by kernel, eager and compiled (the compiled
#                                        one captures every default width: compile and capture seconds)
#   bash .ci/gpu_compile.sh profile-fused  the same compiled, with q/k/v and gate/up merged
#   bash .ci/gpu_compile.sh dynamic      the 1B step at width 8 compiled with a dynamic row dimension and
#                                        compiled for width 8 alone: what the dynamic dimension costs
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cgrt-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONWARNINGS=ignore
what=${1:-tests}
rc=0
case "$what" in
tests)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -rfExs tests/test_compiled_step.py tests/test_fused.py \
    tests/test_bench_projections.py > "$OUT/compile_pytest.txt" 2>&1 || rc=1
  timeout 240 python3 -m pytest -m cuda -q -p no:cacheprovider -rfE tests/test_hf.py > "$OUT/compile_hf_pytest.txt" 2>&1 || rc=1
  tail -n 14 "$OUT/compile_pytest.txt"; tail -n 4 "$OUT/compile_hf_pytest.txt" ;;
projections)
  timeout 400 python3 -m cudagraph_rt.tools.bench.projections --json "$OUT/projections.json" \
    > "$OUT/projections.txt" 2>&1 || rc=1
  grep -v -i "warn" "$OUT/projections.txt" | tail -n 40 ;;
profile|profile-fused)
  # profile: eager and compiled (<= 6 min); profile-fused: compiled with fused projections (<= 4 min)
  p="python3 -m cudagraph_rt.tools.bench.profile_replay --model hf:llama --size 1b --width 1 --top 12"
  runs=$([ "$what" = profile ] && echo "eager compiled" || echo "compiled_fused")
  for r in $runs; do
    case $r in
      eager) timeout 90 $p --json "$OUT/profile_$r.json" > "$OUT/profile_$r.txt" 2>&1 || rc=1 ;;
      compiled) timeout 250 $p --compile default --capture-widths default --json "$OUT/profile_$r.json" \
                  > "$OUT/profile_$r.txt" 2>&1 || rc=1 ;;
      compiled_fused) timeout 250 $p --compile default --fuse --capture-widths default \
                  --json "$OUT/profile_$r.json" > "$OUT/profile_$r.txt" 2>&1 || rc=1 ;;
    esac
    echo "== $r"; grep -v -i "warn\|^[VWI][0-9]" "$OUT/profile_$r.txt" | tail -n 22 | cut -c1-170
  done ;;
dynamic)
  p="python3 -m cudagraph_rt.tools.bench.profile_replay --model hf:llama --size 1b --width 8 --top 6 --compile default"
  timeout 200 $p --json "$OUT/profile_w8_dynamic.json" > "$OUT/profile_w8_dynamic.txt" 2>&1 || rc=1
  timeout 200 $p --static-widths --json "$OUT/profile_w8_static.json" > "$OUT/profile_w8_static.txt" 2>&1 || rc=1
  for f in profile_w8_dynamic profile_w8_static; do
    echo "== $f"; grep -v -i "warn\|^[VWI][0-9]" "$OUT/$f.txt" | tail -n 16 | cut -c1-170
  done ;;
*)
  echo "usage: bash .ci/gpu_compile.sh tests|projections|profile|profile-fused|dynamic" >&2; exit 2 ;;
esac
exit $rc
