"""What a CUDA graph capture must leave as it found: the cuBLAS workspaces torch caches,
the garbage collector, and, after a failed capture, the CUDA context (no stream left
capturing, the caller's stream current, the allocator out of the graph pool). Shared by
whole-width captures (capture.py) and piecewise ones (piece_capture.py)."""
from __future__ import annotations

import gc
from contextlib import contextmanager

import torch


def release_blas_workspaces() -> None:
    """Free the cuBLAS / cuBLASLt workspaces torch caches per (handle, stream).

    Called before and after each capture, as torch.compile's own CUDA graphs do: a graph
    bakes in the workspace address its matmuls ran with. One cached from an eager run
    belongs to torch's general allocator, and whoever frees the cache later (torch.compile
    with mode="reduce-overhead" does, on every recording) hands that memory to other
    tensors while our graphs still write into it: silent corruption or an illegal memory
    access at replay. Freed before capture, the workspace is allocated inside our graph
    pool during capture, so it lives exactly as long as our graphs; freed after, no cache
    keeps a block of our pool."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _end_open_capture(stream: torch.cuda.Stream) -> None:
    """End the stream's capture if an exception left it open (torch's graph context does
    not when its own capture_end raises)."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:  # cuda-python missing: torch's own state is all we can fix
        return
    err, status = cudart.cudaStreamIsCapturing(stream.cuda_stream)
    if err == cudart.cudaError_t.cudaSuccess and status != cudart.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone:
        cudart.cudaStreamEndCapture(stream.cuda_stream)
    cudart.cudaGetLastError()  # capture errors are not sticky: clear them


def reset_after_failure(stream: torch.cuda.Stream, caller: torch.cuda.Stream, pool) -> None:
    """Leave the CUDA context as it was before a failed capture: no stream capturing, the
    caller's stream current again, the allocator no longer routing into the pool."""
    _end_open_capture(stream)
    dev = stream.device.index if stream.device.index is not None else torch.cuda.current_device()
    for end in ("_cuda_endAllocateToPool", "_cuda_endAllocateCurrentStreamToPool"):
        fn = getattr(torch._C, end, None)
        if fn is not None:
            try:
                fn(dev, pool) if end == "_cuda_endAllocateToPool" else fn(dev)
            except Exception:  # noqa: BLE001 - already ended by torch: nothing to undo
                pass
            break
    torch.cuda.set_stream(caller)
    torch.cuda.synchronize()


@contextmanager
def no_collection():
    """No automatic garbage collection while a stream captures: a collection may free
    unreachable cycles holding another runtime's graphs and pool (an exception kept in a
    local, a runtime referenced from its own step function), and freeing CUDA memory or
    destroying a graph while this thread captures invalidates the capture ('operation not
    permitted when stream is capturing'). Collection resumes afterwards, where it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
