"""This tree's cell attention against another version of it, side by side in one process:
bench.attention's 16-layer loop and timer over the same workloads, the two versions
alternated twice (this, other, this, other) and each one's best kept, their outputs
compared. The other version is a copy of kernels/attention/ from another commit (its
relative imports resolve against this tree's kernels/common.py), or of the single file
kernels/cell_attention.py from a commit before the package:

    mkdir -p scratch/old && git archive COMMIT kernels/attention | tar -x -C scratch/old
    python3 -u tools/bench/experiments/kernel_versions.py scratch/old/kernels/attention
    git show 2bf9f11:kernels/cell_attention.py > scratch/cell_attention_old.py
    python3 -u tools/bench/experiments/kernel_versions.py scratch/cell_attention_old.py

``--quick``: bench.attention's small shapes on the CPU (TRITON_INTERPRET=1). JSON at
$OUT/kernel_versions.json; a line per case.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys

import torch

from cudagraph_rt.kernels import attention as ca
from cudagraph_rt.tools.bench.attention import FULL, QUICK, Timer, Workload

# (live cells a sequence, width, sequences): one sequence's decode and verify rows, a batch
CASES = ((128, 1, 1), (128, 8, 1), (128, 8, 8), (1024, 8, 1), (8192, 1, 1), (8192, 8, 1), (32768, 8, 1))
QUICK_CASES = ((24, 1, 1), (24, 4, 1), (12, 3, 3))


def load(path: str):
    """The version at ``path`` as a module of its own (its Triton kernels compiled apart): a
    copy of the package folder, loaded as ``cudagraph_rt.kernels.attention_other`` (so its
    relative imports find this tree's kernels/common.py), or a single file."""
    if os.path.isdir(path):
        spec = importlib.util.spec_from_file_location("cudagraph_rt.kernels.attention_other",
                                                      os.path.join(path, "__init__.py"),
                                                      submodule_search_locations=[path])
    else:
        spec = importlib.util.spec_from_file_location("cell_attention_other", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up while it runs
    spec.loader.exec_module(mod)
    return mod


def compare(other, quick: bool, out_dir: str) -> dict:
    sizes, cases = (QUICK, QUICK_CASES) if quick else (FULL, CASES)
    dev = torch.device("cpu" if quick else "cuda")
    timer, res = Timer(dev, sizes.reps), {}
    for extent, width, seqs in cases:
        wl = Workload(sizes.shape, width=width, seqs=seqs, extent=extent, max_seqs=seqs, max_len=extent,
                      block_size=sizes.block_size, device=dev)
        times, outs = {"this": [], "other": []}, {}
        for name, mod in (("this", ca), ("other", other)) * 2:
            wl.out.fill_(float("nan"))
            times[name].append(timer(wl.kernel_fn(mod, None)))  # each version's default plan
            outs[name] = wl.out.clone()
        err = float((outs["this"].float() - outs["other"].float()).abs().max())
        this, that = min(times["this"]), min(times["other"])
        key = f"{extent} cells x {seqs} seq, width {width}"
        res[key] = {"this_us": this, "other_us": that, "this_over_other": this / that, "max_diff": err,
                    "written": bool(torch.isfinite(outs["this"]).all() and torch.isfinite(outs["other"]).all()),
                    "floor_us": wl.floor_us(), "times_us": times}
        print(f"{key}: this {this:.1f} us, other {that:.1f} us ({this / that:.3f}x), max diff {err:.1e}", flush=True)
        with open(os.path.join(out_dir, "kernel_versions.json"), "w") as f:
            json.dump(res, f, indent=1)
        del wl
    return res


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    quick = "--quick" in args
    paths = [a for a in args if a != "--quick"]
    if len(paths) != 1:
        print("usage: kernel_versions.py [--quick] OTHER_ATTENTION_FOLDER_OR_FILE", file=sys.stderr)
        return 2
    compare(load(paths[0]), quick, os.environ.get("OUT", "/tmp"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
