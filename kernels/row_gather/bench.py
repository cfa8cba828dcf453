"""The row gather's benchmark helper (for ``cgrt bench``; needs CUDA)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .launch import gather_rows

__all__ = ["GatherBench", "bench_gather"]


@dataclass(frozen=True)
class GatherBench:
    """One measurement of a captured gather into pinned host memory: mean microseconds
    per graph replay and the payload bandwidth (accepted rows only, meta excluded)."""

    dtype: str
    H: int
    rows: int
    count: int
    us_per_replay: float
    payload_bytes: int
    gbytes_per_s: float


def bench_gather(
    H: int = 4096, rows: int = 64, count: int | None = None, dtype: torch.dtype = torch.bfloat16,
    *, slots: int = 4, iters: int = 200, device: str | torch.device = "cuda",
) -> GatherBench:
    """Capture one gather of ``count`` (default all) of ``rows`` random rows into a
    pinned ring and time ``iters`` replays with CUDA events. Allocates its own buffers
    (freed on return). Raises RuntimeError without CUDA. No assertions: numbers only."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench_gather needs CUDA")
    count = rows if count is None else count
    device = torch.device(device)
    src = torch.randn(rows, H, device=device).to(dtype)
    idx = torch.randint(0, rows, (rows,), device=device, dtype=torch.int32)
    cnt = torch.tensor([count], device=device, dtype=torch.int32)
    slot = torch.zeros(1, device=device, dtype=torch.int32)
    dst = torch.empty(slots, rows, H, dtype=dtype, pin_memory=True)
    meta = torch.empty(slots, 2 + rows, dtype=torch.int32, pin_memory=True)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up (compile) outside capture
        gather_rows(src, idx, cnt, dst, meta, dst_slot=slot)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gather_rows(src, idx, cnt, dst, meta, dst_slot=slot, validate=False)
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    us = start.elapsed_time(end) * 1e3 / iters
    payload = min(count, rows) * H * src.element_size()
    return GatherBench(str(dtype).replace("torch.", ""), H, rows, count, us, payload, payload / (us * 1e3))
