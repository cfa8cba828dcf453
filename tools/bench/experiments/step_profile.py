"""profile_replay's kernel table of the compiled 1B step at one width, write_cells +
attention (``unfused``) and, where this tree has it, the write inside the attention launch
(``fused``), each its own model and capture. JSON per variant at PREFIX_VARIANT.json.

    PYTHONPATH=. python3 -u tools/bench/experiments/step_profile.py unfused[,fused] WIDTH PREFIX
"""
import sys

from cudagraph_rt.kernels import attention as ca
from cudagraph_rt.tools.bench import profile_replay


def main():
    variants, width, prefix = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
    one_launch = getattr(ca, "writes_in_one_launch", None)
    for var in variants:
        if var == "fused" and one_launch is None:
            print("fused: skipped, this tree has no write_and_attend")
            continue
        if one_launch is not None:
            ca.writes_in_one_launch = one_launch if var == "fused" else (lambda plan, N: False)
        print("=====", var, flush=True)
        profile_replay.main(["--model", "hf:llama", "--size", "1b", "--width", width, "--compile", "default", "--fuse",
                             "--top", "22", "--json", f"{prefix}_{var}.json"])


if __name__ == "__main__":
    main()
