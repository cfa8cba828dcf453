export OUT PYTHONWARNINGS=ignore
python3 -c "import torch, os; print('threads', torch.get_num_threads(), 'cpus', os.cpu_count(), 'affinity', len(os.sched_getaffinity(0)))"
CGRT_GPU_TESTS_LIMIT=250 bash .ci/gpu tests > $OUT/tests_summary.txt 2>&1; echo "tests rc=$?"; grep "== group" $OUT/tests_summary.txt | cut -c1-140; grep -E "^(FAILED|ERROR)" $OUT/tests_summary.txt | head
export PYTHONPATH=$PWD
timeout 130 python3 -u -m cudagraph_rt bench --sections dispatch --size bench --json $OUT/dispatch_toy.json > $OUT/dispatch_toy.txt 2>&1; echo "dispatch toy rc=$?"; grep -E "^│ +[0-9]|device dispatch" $OUT/dispatch_toy.txt | cut -c1-200
timeout 60 python3 -m cudagraph_rt demo --dispatch device --size bench --sequences 8 --slots 1 --max-new 96 --graphs on --profile $OUT/prof.txt > $OUT/demo1.txt 2>&1; grep -E "│ on" $OUT/demo1.txt | cut -c1-150; grep -E -A 12 "ncalls" $OUT/prof.txt | cut -c1-150
left=$((585 - SECONDS)); echo "left $left s"
[ $left -gt 60 ] && { timeout $left python3 -u -m cudagraph_rt bench --model hf:llama --size 1b --sections dispatch --json $OUT/dispatch_1b.json > $OUT/dispatch_1b.txt 2>&1; echo "dispatch 1b rc=$?"; grep -E "^│ +[0-9]|device dispatch|step at" $OUT/dispatch_1b.txt | cut -c1-200; }
