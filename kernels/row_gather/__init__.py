"""Captured gather of chosen hidden rows into a ring of (normally pinned host) slots.

One launch copies ``src[rows[j]]`` into ``dst[slot, j]`` for the first ``count`` entries
of ``rows`` and records what it did in ``meta[slot]``. Everything that changes from one
step to the next (``rows``, ``count``, ``src_slot``, ``dst_slot``) is read from device
memory by the kernel, never by the host, so the launch can be captured once in a CUDA
graph and replayed while those tensors are rewritten in place between replays.

Contract (shared with :func:`gather_rows_reference`, which the tests compare against):

* ``src``: ``[N, H]``, or ``[S_src, N, H]`` with ``src_slot`` (int32 ``[1]``) choosing
  the slab (``None`` -> slab 0). Last dimension contiguous.
* ``rows``: ``[R]`` int32 or int64 indices into the ``N`` rows of the chosen slab.
* ``count``: int32 ``[1]``: how many leading entries of ``rows`` to use.
* ``dst``: ``[S, C, H]`` ring of ``S`` slots of capacity ``C``; same dtype as ``src``.
  On CUDA it is normally pinned host memory (or a device tensor). ``dst_slot`` (int32
  ``[1]``) chooses the slot (``None`` -> slot 0).
* ``meta``: ``[S, 2 + C]`` int32, same memory kind as ``dst``. With
  ``n = min(max(count, 0), C, R)``:
  ``meta[slot, 0] = n``; ``meta[slot, 1]`` is 0, or the OR of the error bits
  (:data:`FLAG_INDEX` 1: some ``rows[j]`` with ``j < n`` is outside ``[0, N)``;
  :data:`FLAG_CAPACITY` 2: ``count > C``; :data:`FLAG_COUNT` 4: ``count < 0`` or
  ``count > R``, more rows asked for than ``rows`` holds; :data:`FLAG_SRC_SLOT` 8:
  ``src_slot`` is outside ``[0, S_src)``);
  ``meta[slot, 2 + j] = rows[j]`` (as int32) for ``j < n``. Exactly one program writes
  ``meta``, so there are no races.
* For ``j < n`` with ``0 <= rows[j] < N`` (and a valid ``src_slot``):
  ``dst[slot, j, :] = src[slab, rows[j], :]``. Nothing else changes: rows ``j >= n`` of
  the slot, other slots, ``meta[slot, 2 + n:]`` and other meta rows are never touched;
  bad rows are skipped (their ``dst`` row keeps its old contents).
* A ``dst_slot`` outside ``[0, S)`` makes the launch write nothing at all (there is no
  slot to record the error in). The host ring chooses slots, so it must never happen;
  a caller that wants to detect it can poison ``meta[:, 0]`` beforehand.

Pinned memory and Triton. Triton's NVIDIA launcher (3.x, including the 3.6 of the GPU
target and the 3.9 installed here) turns every tensor argument into a device pointer with
``cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_POINTER, tensor.data_ptr())`` and only
rejects a pointer ("cannot be accessed from Triton (cpu tensor?)") when that call returns
``CUDA_ERROR_INVALID_VALUE``, i.e. for host memory the driver does not know. Memory from
``torch.empty(..., pin_memory=True)`` is page-locked and mapped (cudaHostAlloc /
cudaHostRegister under UVA), so the call succeeds and yields the device alias (the same
address under UVA). Triton picks the device from the current CUDA device, not from the
tensor's ``.device``. We therefore pass pinned CPU tensors to the kernel directly, with no
``data_ptr()`` wrapper (a wrapper would gain nothing: the launcher runs the same
translation on whatever ``data_ptr()`` returns). With ``validate=True`` the launcher
checks ``is_pinned()`` first, so unpinned host memory is an :class:`InputError` rather
than Triton's ValueError at launch.

Capture. The first launch of each specialization (dtype, H, slot presence, and what
Triton specialises on: 16-byte alignment of pointers and integers, integers equal to 1)
compiles and loads the kernel; do it once outside capture with the very tensors to be
captured (the runtime's warm-up does), then capture. Validation only reads metadata
(shapes, dtypes, strides, ``is_pinned``, which is a ``cudaPointerGetAttributes`` query
like the one Triton's launcher makes on every launch), never device values, so it is
meant to be safe at capture time; pass ``validate=False`` to skip it on hot eager paths.

Lifetimes. A captured launch bakes in the addresses of ``src``, ``rows``, ``count``,
``dst``, ``meta`` and the slot tensors: all of them must outlive the graph and must be
updated in place (``copy_``/``fill_``), never rebound. The host may read ``dst[slot]`` and
``meta[slot]`` only after the work that wrote them has completed (an event or a
synchronize), and must not write them while a replay targeting that slot is in flight.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from cudagraph_rt.errors import InputError, expected

from ..common import triton_backend
from .bench import GatherBench, bench_gather
from .launch import (FLAG_CAPACITY, FLAG_COUNT, FLAG_INDEX, FLAG_SRC_SLOT, SUPPORTED_DTYPES, GatherLaunch, gather_rows,
                     plan_launch, validate_gather_args)
from .reference import gather_rows_reference

__all__ = ["FLAG_CAPACITY", "FLAG_COUNT", "FLAG_INDEX", "FLAG_SRC_SLOT", "GatherBench", "GatherLaunch",
           "SUPPORTED_DTYPES", "bench_gather", "choose_gather", "gather_rows", "gather_rows_auto",
           "gather_rows_reference", "plan_launch", "validate_gather_args"]


def choose_gather(src: torch.Tensor, use_kernel: bool | None = None) -> Callable[..., None]:
    """Pick the implementation for ``src``: the Triton kernel for CUDA tensors (compiled
    backend), the torch reference otherwise. ``use_kernel=True`` forces the kernel (on the
    CPU only under ``TRITON_INTERPRET=1``; otherwise :class:`InputError`), ``False``
    forces the reference (on CUDA: synchronous and not capturable)."""
    backend = triton_backend()
    if use_kernel is None:
        return gather_rows if (src.device.type == "cuda" and backend == "compiled") else gather_rows_reference
    if not use_kernel:
        return gather_rows_reference
    if backend == "unavailable":
        raise InputError(expected("use_kernel", "False or None (triton is not installed)", True))
    if src.device.type != "cuda" and backend != "interpreter":
        raise InputError(
            expected(
                "use_kernel", "False or None for CPU tensors unless TRITON_INTERPRET=1 was set before import", True
            )
        )
    return gather_rows


def gather_rows_auto(
    src, rows, count, dst, meta, *, src_slot=None, dst_slot=None, use_kernel: bool | None = None, validate: bool = True
) -> None:
    """:func:`choose_gather` then run it with the same arguments: for callers outside the
    runtime (the runtime picks its implementation once, at construction). Same contract,
    errors and lifetimes as the chosen implementation."""
    impl = choose_gather(src, use_kernel)
    impl(src, rows, count, dst, meta, src_slot=src_slot, dst_slot=dst_slot, validate=validate)
