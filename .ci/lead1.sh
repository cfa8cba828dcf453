#!/usr/bin/env bash
export PYTHONPATH=$PWD PYTHONWARNINGS=ignore; mkdir -p "$OUT"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'tf', transformers.__version__, torch.cuda.get_device_name())"
timeout 130 python3 -m pytest -q -p no:cacheprovider -rfE -x tests/test_cell_attention.py > "$OUT/t_attn.txt" 2>&1; echo "== attn tests rc=$?"; tail -n 12 "$OUT/t_attn.txt" | cut -c1-250
timeout 100 python3 -m cudagraph_rt.tools.bench_attention --json "$OUT/bench_attention.json" --budget 40 > "$OUT/bench_attention.txt" 2>&1; echo "== bench_attention rc=$?"; grep -v -i warn "$OUT/bench_attention.txt" | tail -n 40 | cut -c1-200
timeout 100 python3 -m cudagraph_rt.tools.bench_projections --json "$OUT/projections.json" > "$OUT/projections.txt" 2>&1; echo "== projections rc=$?"; grep -v -i warn "$OUT/projections.txt" | tail -n 30 | cut -c1-180
timeout 220 python3 -m cudagraph_rt.tools.profile_replay --model hf:llama --size 1b --width 1 --top 14 --compile default --fuse --capture-widths default --json "$OUT/profile_cf.json" > "$OUT/profile_cf.txt" 2>&1; echo "== profile compiled fused rc=$?"; grep -v -i "warn\|^[VWI][0-9]" "$OUT/profile_cf.txt" | tail -n 30 | cut -c1-170
