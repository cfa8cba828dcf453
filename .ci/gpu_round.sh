#!/usr/bin/env bash
# One H200 call of this round (issues 13 and 15): the runner's demo with either drafter on
# the bench toy, the 1B transformers demo's check, its width-1 graph contents, and its bench.
export PYTHONPATH=$PWD PYTHONWARNINGS=ignore; OUT=${OUT:-/tmp/cgrt-out}; mkdir -p "$OUT"
d="python3 -m cudagraph_rt demo --graphs both --bench-size bench --sequences 16 --max-new 64"
for dr in host gpu; do
  timeout 100 $d --drafter $dr > "$OUT/demo_$dr.txt" 2>&1; echo "== demo --drafter $dr rc=$?"
  head -n 14 "$OUT/demo_$dr.txt" | cut -c1-150
done
timeout 150 python3 -m cudagraph_rt demo --model hf:llama --size 1b --graphs both --sequences 3 --max-new 48 \
  > "$OUT/hf1b.txt" 2>&1; echo "== hf 1b demo rc=$?"; grep -E "check|tokens/s|│ o" "$OUT/hf1b.txt" | cut -c1-200
timeout 100 python3 -m cudagraph_rt inspect --model hf:llama --size 1b --widths 1 --no-compare > "$OUT/inspect1b.txt" 2>&1
echo "== inspect 1b rc=$?"; tail -n 30 "$OUT/inspect1b.txt" | cut -c1-180
HF_BENCH_LIMIT=250 bash .ci/gpu hf-bench --compile-timeout 150
