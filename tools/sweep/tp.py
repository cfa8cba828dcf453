"""``cgrt sweep --tp N``: the width sweep on the tensor-parallel toy (``models/tp.py``).

Every rank runs the same sweep (rank 0's seed) through a DistributedRuntime with
``check_steps`` on, and checks each step against the ONE-device ToyDecoder with the same
weights: tokens equal, hidden rows to float tolerance. Only rank 0 prints.
"""
from __future__ import annotations

import sys
from typing import Callable, Sequence

import torch

from cudagraph_rt.distributed import DistributedRuntime
from cudagraph_rt.errors import expected
from cudagraph_rt.models.toy import ToyConfig
from cudagraph_rt.models.tp import TPToyDecoder
from cudagraph_rt.sweep import ToyAdapter
from cudagraph_rt.sweep.harness import fresh_seed
from .. import options, tp_launch


class TPAdapter(ToyAdapter):
    """The toy adapter with the model split over the ranks: ``self.model`` (the one-device
    ToyDecoder, same weights) is the reference and the planner; ``self.tp_model`` is what
    the runtime steps (and whose pool hands out the cells: every rank makes the same
    calls, so every rank holds the same cells). Build it on every rank (the steps are
    collective)."""

    def __init__(self, config: ToyConfig | None = None, device: str | torch.device | None = None,
                 widths: Sequence[int] | None = None):
        super().__init__(config, device, widths)
        self.tp_model = TPToyDecoder(self.config, self.device)
        self.name = f"{self.name} TP {self.tp_model.tp}"

    def build(self, graphs: bool) -> DistributedRuntime:
        self.tp_model.reset_cache()
        return DistributedRuntime(self.tp_model.step, self.input_specs(), widths=self.widths, graphs=graphs,
                                  device=self.device, check_steps=True)

    @property
    def stepped(self) -> TPToyDecoder:
        """The model the runtime steps: its pool gets the cells (the same on every rank)."""
        return self.tp_model

    def cli_args(self) -> list[str] | None:
        args = super().cli_args()
        return None if args is None else args + ["--tp", str(self.tp_model.tp)]


def run_tp(args, run: Callable) -> int:
    """``run`` (sweep.run) on every rank of a torchrun launch, rank 0's seed everywhere."""
    if getattr(args, "model", "toy") != "toy":
        print(f"cgrt sweep: {expected('--tp', '--model toy (the tensor-parallel toy)', args.model)}", file=sys.stderr)
        return 2
    if getattr(args, "compile", None):  # before the launch: the ranks would each refuse it
        print(f"cgrt sweep: {expected('--compile', options.COMPILE_WANTS, repr(args.model))}", file=sys.stderr)
        return 2

    def body(device: torch.device) -> int:
        args.device = device.type
        args.tp_inner = True
        if args.seed is None:
            args.seed = int(tp_launch.broadcast(fresh_seed()))
        return run(args)

    return tp_launch.run_ranks(args.tp, args.device, "sweep", body)
