"""The compiled 1B step through the runtime (the bench's engine configuration), write_cells
+ attention (``base``) and, where this tree has it, the write inside the attention launch
(``fused``): step times at widths 1 and 8 (``step_time_us``), the capture, and the greedy
tokens of 4 prompts x 32 against the first variant. TAG ``nopdl`` compiles with
``options={"triton.enable_pdl": False}``; any other TAG with the defaults (and whatever
TORCHINDUCTOR_* the environment sets). JSON and lines under $OUT (BENCHMARKS.md run F).

    PYTHONPATH=. python3 -u tools/bench/experiments/step_variants.py TAG base[,fused]
"""
import json
import os
import sys
import time

import torch

from cudagraph_rt import GraphRuntime
from cudagraph_rt.kernels import attention as ca
from cudagraph_rt.models import hf
from cudagraph_rt.tools.bench.common import step_time_us
from cudagraph_rt.tools.bench.hf import prompts_for, runtime_greedy

OUT = os.environ.get("OUT", "/tmp")


def main():
    tag, variants = sys.argv[1], sys.argv[2].split(",")
    res = {"tag": tag}
    model = hf.build("llama", "1b", device=torch.device("cuda"), seed=0, fuse=True, max_seqs=16, max_len=256)
    rows = model.compile_decoder("default", **({"options": {"triton.enable_pdl": False}} if tag == "nopdl" else {}))
    one_launch = getattr(ca, "writes_in_one_launch", None)
    prompts, first = prompts_for(model, 4, 32, 0), None
    for var in variants:
        if var == "fused" and one_launch is None:
            res[var] = "skipped: this tree has no write_and_attend"
            continue
        if one_launch is not None:
            ca.writes_in_one_launch = one_launch if var == "fused" else (lambda plan, N: False)
        rt = GraphRuntime(model.step, model.inputs(), graphs=True, device=model.device)
        t0 = time.perf_counter()
        rt.capture()
        capture_s = time.perf_counter() - t0
        w1, w8 = step_time_us(model, rt, 1, 50), step_time_us(model, rt, 8, 50)
        model.reset_cache()
        _, toks = runtime_greedy(model, rt, prompts, 32)
        first = first or toks
        agree = sum(a == b for x, y in zip(toks, first) for a, b in zip(x, y))
        res[var] = {"w1_us": w1, "w8_us": w8, "capture_s": capture_s, "compile_s": rows.compile_s,
                    "tokens_agree_with_first_variant": f"{agree}/{sum(len(x) for x in toks)}"}
        print(tag, var, res[var], flush=True)
        with open(f"{OUT}/step_{tag}.json", "w") as f:
            json.dump(res, f, indent=1)
        rt.close()
        model.reset_cache()


if __name__ == "__main__":
    main()
