#!/usr/bin/env bash
# The split cell attention (models/hf.py: split_pool_attention): the transformers cuda tests, the 1B
# step's kernels at widths 1 and 8, and the 1B demo's checks.
export PYTHONPATH=$PWD PYTHONWARNINGS=ignore
timeout 150 python3 -m pytest -m cuda -q -p no:cacheprovider -rfE tests/test_hf.py 2>&1 | tail -n 5
for w in 1 8; do timeout 60 python3 -m cudagraph_rt.tools.profile_replay --width $w --top 4 2>&1 | grep -v "^[VWI][0-9]" | tail -n 5 | cut -c1-180; done
timeout 100 python3 -m cudagraph_rt demo --model hf:llama --size 1b --graphs both --sequences 3 --max-new 48 2>&1 \
  | grep -E "check|│ o" | cut -c1-200
