"""The child process of ``cgrt bench --model hf:<family>`` (``bench.hf``'s ``_Ctx.child``):
transformers' ``generate`` with a static cache and its automatic compile, in a process of
its own so that a crash or a hang cannot take the bench down. Run by the bench as

    python -m cudagraph_rt.tools.bench.hf_child KIND PAYLOAD_JSON OUT_FILE

PAYLOAD_JSON: the model's build arguments and the run's sizes (``_Ctx.build_args``);
OUT_FILE: where the figures go (JSON). Exit 0 when it wrote them.
"""
from __future__ import annotations

import json
import sys

import torch

from cudagraph_rt.models import hf

from .hf import generate_greedy, prompts_for


def run_child(kind: str, payload: str, out: str) -> int:
    """``kind`` names the child (one today: ``static``); the figures per batch size go to ``out``."""
    a = json.loads(payload)
    dev = torch.device(a.get("device", "cuda"))
    model = hf.build(a["family"], a["size"], device=dev, seed=a["seed"], max_seqs=a["max_seqs"],
                     max_len=a["max_len"], path=a.get("path"))
    per = {}  # the one child: transformers' generate with a static cache and its automatic compile
    for B in a["seqs"]:
        prompts = prompts_for(model, B, a["prompt"], a["seed"] + B)
        first, _ = generate_greedy(model, prompts, a["new"], cache_implementation="static")
        dt, toks = generate_greedy(model, prompts, a["new"], cache_implementation="static")
        per[str(B)] = {"first_s": first, "tok_s": B * a["new"] / dt, "tokens": toks}
    res = {"per_batch": per}
    with open(out, "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4:
        sys.exit(run_child(*sys.argv[1:]))
    print("usage: python -m cudagraph_rt.tools.bench.hf_child KIND PAYLOAD_JSON OUT_FILE "
          "(the child process of cgrt bench --model hf:<family>)", file=sys.stderr)
    sys.exit(2)
