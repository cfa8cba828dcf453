#!/usr/bin/env bash
# The paged KV pool on the H200 (issue 23, helper "pool"), in parts that each fit one
# device call (< 10 min):  bash .ci/gpu_pool.sh tests | sweeps | demos | tp (2 GPUs) | all
#   tests:  every cuda test the pool work added or touched (test_pool's prefix cache with
#           graphs on, the toy/hf/demo/compile/inspect cuda tests over the pool)
#   sweeps: `cgrt sweep` on the toy (tiny, and bench with its 262,144-cell pool) and on the
#           four transformers families, graphs on and off each
#   demos:  the demo on the toy (host and device drafter) and on hf:llama; `cgrt inspect`
#           on the toy (no hazard, graphs on == off); the bench toy's step time on a
#           1,024-cell and a 262,144-cell pool side by side (informational)
#   tp:     the two-GPU tests of tests/test_tp.py (NCCL, graphs on)
# Short lines on stdout; every log in $OUT.
export PYTHONPATH=$PWD PYTHONWARNINGS=ignore; OUT=${OUT:-/tmp/cgrt-out}; mkdir -p "$OUT"
run() { local name=$1 t=$2; shift 2; timeout "$t" "$@" > "$OUT/$name.txt" 2>&1; echo "== $name rc=$?"; }
part=${1:-all}
if [[ $part == tests || $part == all ]]; then
  run cuda_tests 540 python3 -m pytest -m cuda -q -p no:cacheprovider -rfE tests/test_pool.py tests/test_toy.py \
    tests/test_hf.py tests/test_demo.py tests/test_torch_compile_cuda.py tests/test_inspect_cuda.py
  tail -n 8 "$OUT/cuda_tests.txt" | cut -c1-200
fi
if [[ $part == sweeps || $part == all ]]; then
  for m in toy hf:llama hf:qwen2 hf:qwen3 hf:mistral; do
    run "sweep_${m#hf:}" 150 python3 -m cudagraph_rt sweep --model "$m"
    grep -E "sweep (PASSED|FAILED)|^graphs (on|off)" "$OUT/sweep_${m#hf:}.txt" | cut -c1-200
  done
  run sweep_toy_bench 150 python3 -m cudagraph_rt sweep --bench-size
  grep -E "sweep (PASSED|FAILED)|^graphs (on|off)" "$OUT/sweep_toy_bench.txt" | cut -c1-200
fi
if [[ $part == demos || $part == all ]]; then
  run demo_toy 120 python3 -m cudagraph_rt demo
  run demo_toy_gpu_drafter 120 python3 -m cudagraph_rt demo --drafter gpu --sequences 8 --max-new 16
  run demo_llama 150 python3 -m cudagraph_rt demo --model hf:llama
  for f in demo_toy demo_toy_gpu_drafter demo_llama; do grep "check:" "$OUT/$f.txt" | cut -c1-200; done
  run inspect_toy 120 python3 -m cudagraph_rt inspect --json
  python3 - "$OUT/inspect_toy.txt" <<'PY'
import json, sys
text = open(sys.argv[1]).read()
doc = json.loads(text[text.index("{"):])
print("inspect toy: widths", [w["width"] for w in doc["widths"]], "hazards",
      sum(len(w["hazards"]) for w in doc["widths"]), "on/off differ",
      sum(1 for w in doc["widths"] for d in w.get("diffs", []) if not d.get("equal", True)))
PY
  run pool_size 120 python3 - <<'PY'
import statistics, time, torch
from cudagraph_rt import GraphRuntime
from cudagraph_rt.models import ToyConfig, ToyDecoder
for cells in (1024, 262144):
    m = ToyDecoder(ToyConfig.bench(cells=cells), "cuda")
    rt = GraphRuntime(m.step, m.inputs(), widths=(1, 8), graphs=True)
    rt.capture()
    for T in (1, 8):
        kw = dict(tokens=[1] * T, positions=[64 + i for i in range(T)], seq_ids=[0] * T,
                  cells=m.cell_range(0, 64, T), want=[1] * T)
        m.cell_range(0, 0, 64)
        times = []
        for _ in range(5):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            for _ in range(200):
                rt.step(**kw)
            torch.cuda.synchronize(); times.append((time.perf_counter() - t0) / 200 * 1e6)
        print(f"toy bench, pool {cells:>7} cells ({m.pool.nbytes / 2**30:.2f} GiB), width {T}: "
              f"{statistics.median(times):.0f} us a step")
    rt.close(); del m, rt; torch.cuda.empty_cache()
PY
  cat "$OUT/pool_size.txt" | grep "toy bench" | cut -c1-200
fi
if [[ $part == tp ]]; then
  export NCCL_NVLS_ENABLE=0
  run tp_cuda 540 python3 -m pytest -m cuda -q -p no:cacheprovider -rfE tests/test_tp.py
  tail -n 6 "$OUT/tp_cuda.txt" | cut -c1-200
fi
