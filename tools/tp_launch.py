"""``--tp N`` of the cgrt commands: one process per rank under torchrun.

``torchrun --standalone --nproc-per-node N -m cudagraph_rt <command> --tp N`` starts N
processes; each joins the group here (the device is set before ``init_process_group``:
see ``cudagraph_rt.distributed.init_distributed``), runs the command's tensor-parallel
path, and the ranks agree on one exit code. Only rank 0 prints to stdout; every rank
keeps stderr, so an error on any rank is seen.
"""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import Callable

import torch
import torch.distributed as dist

from ..distributed import init_distributed
from ..errors import InputError, expected

TIMEOUT_S = 300.0  # every collective: a rank that stops answering ends the job, never hangs it


def start(tp: int, device: str | None, command: str) -> torch.device:
    """Join the process group of ``tp`` ranks on ``device`` (cuda: NCCL, one GPU per rank;
    cpu: gloo). InputError when not launched by torchrun with ``tp`` processes, or when
    the machine has fewer GPUs than ranks."""
    launch = f"torchrun --standalone --nproc-per-node {tp} -m cudagraph_rt {command} --tp {tp}"
    world = os.environ.get("WORLD_SIZE")
    if world is None or not world.isdigit() or int(world) != tp:
        raise InputError(expected("--tp", f"{tp} processes started by torchrun ({launch})",
                                  f"WORLD_SIZE={world}"))
    want = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if want not in ("cuda", "cpu"):
        raise InputError(expected("--device", "cuda or cpu", repr(want)))
    if want == "cuda" and torch.cuda.device_count() < tp:
        raise InputError(expected("--tp", f"at most {torch.cuda.device_count()} (the GPUs here) with --device cuda",
                                  tp))
    dev = init_distributed("nccl" if want == "cuda" else "gloo", timeout_s=TIMEOUT_S)
    if dev.type == "cpu":
        torch.set_num_threads(1)  # N ranks share the CPU: one thread each
    return dev


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def broadcast(value):
    """Rank 0's ``value`` on every rank (a small Python object)."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather(value) -> list:
    """Every rank's ``value``, in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_ranks(tp: int, device: str | None, command: str, body: Callable[[torch.device], int]) -> int:
    """Start the group, run ``body(device)`` on every rank with stdout silenced beyond rank 0,
    and return the worst exit code of all ranks (on every rank). A bad launch is exit 2."""
    try:
        dev = start(tp, device, command)
    except (InputError, ValueError) as e:
        print(f"cgrt {command}: {e}", file=sys.stderr)
        return 2
    try:
        with open(os.devnull, "w") as null, (contextlib.redirect_stdout(null) if rank() else contextlib.nullcontext()):
            try:
                rc = int(body(dev) or 0)
            except Exception:  # noqa: BLE001 - this rank's failure is its exit code; the others still agree
                traceback.print_exc()
                print(f"cgrt {command}: rank {rank()} failed (traceback above)", file=sys.stderr)
                rc = 1
        return max(gather(rc))
    finally:
        dist.destroy_process_group()
