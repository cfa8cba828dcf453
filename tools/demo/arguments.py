"""``cgrt demo``'s arguments (the shared ones from ``tools/options.py``, one meaning each)."""
from __future__ import annotations

import argparse

from .. import options

LANES, CHUNK = 2, 128  # the host runner's defaults (--dispatch device has neither)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sequences", type=options.int_at_least(1), default=12, metavar="N",
                   help="prompts to serve (default 12)")
    p.add_argument("--k", type=options.int_at_least(0), default=4, metavar="N",
                   help="draft tokens per sequence and step (default 4)")
    p.add_argument("--accept-prob", type=options.probability, default=0.7, metavar="P",
                   help="chance each draft token is right (default 0.7)")
    p.add_argument("--max-new", type=options.int_at_least(1), default=32, metavar="N",
                   help="most tokens per sequence; each draws its own limit in [max_new/2, max_new] (default 32)")
    p.add_argument("--rounds", type=options.int_at_least(0), default=0, metavar="N",
                   help="stop after this many steps (default 0: serve everything)")
    options.add_graphs(p)
    options.add_device(p)
    options.add_model(p)
    options.add_drafter(p, "coin")
    options.add_dispatch(p)
    p.add_argument("--slots", type=options.int_at_least(1), default=None, metavar="N",
                   help="sequences served at once (default: the model's max_seqs)")
    p.add_argument("--lanes", type=options.int_at_least(1), default=LANES, metavar="N",
                   help=f"groups of sequences that take turns on the GPU (default {LANES})")
    p.add_argument("--chunk", type=options.int_at_least(1), default=CHUNK, metavar="N",
                   help=f"prompt rows per step and lane; wider than the dynamic limit (96) gets sliced (default {CHUNK})")
    options.add_seed(p, 0, "the toy's weights, the prompts, the limits, the drafter and the sampled tokens")
    options.add_sampling(p)
    options.add_tp(p)
    p.add_argument("--profile", type=options.output_file, metavar="FILE", default=None,
                   help="cProfile the timed run(s) only; the top functions by own time go to FILE "
                        "(one section per run)")
    options.add_json(p)
    options.add_threads(p)
    options.add_verbosity(p)
