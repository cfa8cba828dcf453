#!/usr/bin/env bash
# One H200 call of this round (issue 15, step()'s launch path): every cuda test, the speed
# run (demo with either drafter, bench section 3), where step()'s host time goes, and the
# 1B transformers bench over the split cell attention. At most 8 files come back: the rest
# stay in /tmp.
export PYTHONPATH=$PWD PYTHONWARNINGS=ignore; OUT=${OUT:-/tmp/cgrt-out}; mkdir -p "$OUT"; W=/tmp/cgrt-work; mkdir -p $W
OUT=$W bash .ci/gpu tests --ignore=tests/test_tp.py > $W/tests.txt 2>&1; echo "== cuda tests rc=$?"
cp $W/pytest_cuda.txt "$OUT/"; tail -n 12 $W/pytest_cuda.txt | cut -c1-220
OUT=$W bash .ci/gpu speed > $W/speed.txt 2>&1; echo "== speed rc=$?"
cp $W/demo_host.txt $W/demo_gpu.txt $W/bench3.txt $W/bench3.json "$OUT/"
for f in demo_host demo_gpu; do head -n 5 $W/$f.txt | cut -c1-150; grep "check:" $W/$f.txt | cut -c1-150; done
grep -v -i "warn" $W/bench3.txt | sed -n '/host overhead/,$p' | cut -c1-200 | head -n 40
timeout 100 python3 tools/profile_step.py > "$OUT/profile_step.txt" 2>&1; echo "== profile_step rc=$?"
tail -n 22 "$OUT/profile_step.txt"
OUT=$W HF_BENCH_LIMIT=190 bash .ci/gpu hf-bench --compile-timeout 100 > $W/hf.txt 2>&1; echo "== hf bench rc=$?"
cp $W/hf_bench.json "$OUT/" 2>/dev/null; grep -E "tok|spec|goal|met|missed|unclear|replay|µs" $W/hf.txt | tail -n 40 | cut -c1-200
