export OUT PYTHONPATH=$PWD PYTHONWARNINGS=ignore
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
timeout 170 python3 -m pytest -m cuda -q -p no:cacheprovider -rfE tests/kernels/test_sampling.py tests/dispatch > $OUT/cuda_t.txt 2>&1; echo "cuda tests rc=$?"; tail -n 4 $OUT/cuda_t.txt | cut -c1-200
timeout 200 python3 -m cudagraph_rt.kernels.sampling.bench --rows 1,4,64 --dtypes bf16 --iters 50 --kernels --sweep > $OUT/sampler.txt 2>&1; echo "sampler rc=$?"; grep -v -i warn $OUT/sampler.txt | grep -v "^sweep" | tail -n 22 | cut -c1-200; grep "^sweep" $OUT/sampler.txt | awk '{c[$3]++; if (c[$3]<=4) print}' | cut -c1-160
timeout 150 python3 -u -m cudagraph_rt bench --sections dispatch --size bench > $OUT/dispatch_toy.txt 2>&1; echo "dispatch rc=$?"; grep -v -i "warn\|use case" $OUT/dispatch_toy.txt | tail -n 22 | cut -c1-200
timeout 90 python3 -m cudagraph_rt demo --dispatch device --size bench --sequences 8 --slots 1 --max-new 96 --graphs on --profile $OUT/prof.txt > $OUT/demo1.txt 2>&1; grep -E "tokens/s|│ on" $OUT/demo1.txt | cut -c1-150; grep -E -A 28 "ncalls" $OUT/prof.txt | cut -c1-150
