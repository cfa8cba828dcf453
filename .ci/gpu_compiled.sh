#!/usr/bin/env bash
# Issue 13's open question: what the width-1 and width-8 graphs of the 1B Llama hold with
# and without torch.compile'd decoder (kernel counts, replay time), and whether dynamo
# recompiles or breaks while the runtime warms up and captures.
export PYTHONPATH=$PWD PYTHONWARNINGS=ignore; OUT=${OUT:-/tmp/cgrt-out}; mkdir -p "$OUT"
i="python3 -m cudagraph_rt inspect --model hf:llama --size 1b --widths 1,8 --no-compare"
TORCH_LOGS=recompiles,graph_breaks timeout 240 $i --compile default > "$OUT/inspect_compiled.txt" 2>&1
echo "== compiled rc=$?"; grep -v "^\s*$" "$OUT/inspect_compiled.txt" | grep -v -i "warn" | tail -n 40 | cut -c1-220
timeout 120 $i > "$OUT/inspect_eager.txt" 2>&1; echo "== eager rc=$?"; tail -n 8 "$OUT/inspect_eager.txt" | cut -c1-200
