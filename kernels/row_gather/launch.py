"""The row gather's host side: argument checks (metadata only), the launch plan (a pure
function of shapes and strides: what a captured graph bakes in) and the launcher
:func:`gather_rows`. The contract: :mod:`cudagraph_rt.kernels.row_gather`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cudagraph_rt.errors import InputError, expected

from ..common import describe, next_pow2, triton_backend
from .kernel import gather_rows_kernel

__all__ = ["FLAG_CAPACITY", "FLAG_COUNT", "FLAG_INDEX", "FLAG_SRC_SLOT", "GatherLaunch", "SUPPORTED_DTYPES",
           "gather_rows", "plan_launch", "validate_gather_args"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# meta[slot, 1]: the OR of these (0: nothing wrong)
FLAG_INDEX = 1  # a used index outside [0, N)
FLAG_CAPACITY = 2  # count > C, the slot's capacity
FLAG_COUNT = 4  # count < 0 or count > R, the indices given
FLAG_SRC_SLOT = 8  # src_slot outside [0, S_src)

# Tile shape limits. 1024 elements of H per program keeps one program's row within a few
# KiB (fp32: 4 KiB), and ~2048 elements per program gives each of 128 threads a couple
# of 16-byte vectors: enough bytes in flight per program without starving the grid of
# programs when only a few rows are accepted.
_MAX_BLOCK_H = 1024
_TILE_ELEMS = 2048
_MAX_ROWS_PER_PROGRAM = 64
_MAX_META_BLOCK = 1024
_VECTOR_BYTES = 16


# --------------------------------------------------------------------------------------
# Validation and launch planning (host side, metadata only: no device syncs)
# --------------------------------------------------------------------------------------
def _describe(t) -> str:
    return describe(t, pinned=True)  # the ring may be host memory: whether it is pinned matters here


def _check_int_scalar(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (1,):
        raise InputError(expected(name, "an int32 tensor of shape (1,)", _describe(t)))


def validate_gather_args(src, rows, count, dst, meta, src_slot=None, dst_slot=None) -> None:
    """Check every argument of :func:`gather_rows` against the contract; raise
    :class:`InputError` (message ``"<arg>: expected ..., got ..."``) on the first
    violation. Reads only metadata (shapes, dtypes, strides, devices, ``is_pinned``): no
    device values, no syncs, safe inside CUDA-graph capture. Nothing is written.
    """
    H = _check_src(src, src_slot)
    _check_indices(src, rows, count, src_slot, dst_slot)
    _check_ring(src, dst, meta, H)


def _check_src(src, src_slot) -> int:
    """src's shape, dtype and layout; returns H."""
    if not isinstance(src, torch.Tensor) or src.dim() not in (2, 3):
        raise InputError(expected("src", "a tensor of shape [N, H] or [S_src, N, H]", _describe(src)))
    if src.dtype not in SUPPORTED_DTYPES:
        raise InputError(expected("src", "dtype float32, float16 or bfloat16", src.dtype))
    H = src.shape[-1]
    if H < 1:
        raise InputError(expected("src", "a last dimension (H) >= 1", tuple(src.shape)))
    if src.stride(-1) != 1:
        raise InputError(expected("src", "a contiguous last dimension (stride 1)", f"stride {src.stride()}"))
    if src.dim() == 2 and src_slot is not None:
        raise InputError(expected("src_slot", "None for a 2-D src (no slabs to choose)", _describe(src_slot)))
    if src.dim() == 3 and src.shape[0] < 1:
        raise InputError(expected("src", "at least one slab", tuple(src.shape)))
    return H


def _check_indices(src, rows, count, src_slot, dst_slot) -> None:
    """rows, count and the slots: int tensors on src's device."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise InputError(expected("rows", "a 1-D int32 or int64 tensor", _describe(rows)))
    _check_int_scalar("count", count)
    if src_slot is not None:
        _check_int_scalar("src_slot", src_slot)
    if dst_slot is not None:
        _check_int_scalar("dst_slot", dst_slot)
    for name, t in (("rows", rows), ("count", count), ("src_slot", src_slot), ("dst_slot", dst_slot)):
        if t is not None and t.device != src.device:
            raise InputError(expected(name, f"a tensor on src's device {src.device}", t.device))


def _check_ring(src, dst, meta, H: int) -> None:
    """dst and meta: shapes, dtypes, layout, and memory the kernel can reach."""
    if not isinstance(dst, torch.Tensor) or dst.dim() != 3:
        raise InputError(expected("dst", "a tensor of shape [S, C, H]", _describe(dst)))
    S, C, dst_h = dst.shape
    if dst_h != H:
        raise InputError(expected("dst", f"last dimension {H} (src's H)", tuple(dst.shape)))
    if S < 1:
        raise InputError(expected("dst", "at least one slot (S >= 1)", tuple(dst.shape)))
    if dst.dtype != src.dtype:
        raise InputError(expected("dst", f"dtype {src.dtype} (same as src)", dst.dtype))
    if dst.stride(-1) != 1:
        raise InputError(expected("dst", "a contiguous last dimension (stride 1)", f"stride {dst.stride()}"))

    if not isinstance(meta, torch.Tensor) or meta.dtype != torch.int32 or tuple(meta.shape) != (S, 2 + C):
        raise InputError(expected("meta", f"an int32 tensor of shape ({S}, {2 + C})", _describe(meta)))
    if meta.stride(-1) != 1:
        raise InputError(expected("meta", "a contiguous last dimension (stride 1)", f"stride {meta.stride()}"))

    for name, t in (("dst", dst), ("meta", meta)):
        if t.device == src.device:
            continue
        # The only cross-device case allowed: a CUDA src writing into page-locked host
        # memory, which the GPU reaches through UVA. Unpinned host memory is not mapped.
        if src.device.type == "cuda" and t.device.type == "cpu":
            if not t.is_pinned():
                raise InputError(expected(name, "a CUDA tensor or PINNED host memory (pin_memory=True)", _describe(t)))
            continue
        raise InputError(expected(name, f"a tensor on {src.device} or pinned host memory", t.device))
    if dst.device != meta.device:
        raise InputError(expected("meta", f"the same memory kind as dst ({dst.device})", meta.device))



@dataclass(frozen=True)
class GatherLaunch:
    """The fixed launch configuration for one (src, rows, dst) shape: what a captured
    graph bakes in. ``grid`` = (row blocks, H blocks); ``vec`` = elements per 16-byte
    vector that every row stride and H are divisible by (1 disables vectorisation)."""

    grid: tuple[int, int]
    block_h: int
    rows_per_program: int
    meta_block: int
    vec: int
    num_warps: int


def plan_launch(src: torch.Tensor, rows: torch.Tensor, dst: torch.Tensor) -> GatherLaunch:
    """Pure function of shapes and strides: the grid and tile sizes for one launch."""
    H = src.shape[-1]
    R = rows.shape[0]
    C = dst.shape[1]
    cap = max(1, min(R, C))  # at most this many rows are ever copied
    block_h = min(next_pow2(H), _MAX_BLOCK_H)
    rows_pp = max(1, min(next_pow2(cap), _TILE_ELEMS // block_h, _MAX_ROWS_PER_PROGRAM))
    meta_block = min(next_pow2(cap), _MAX_META_BLOCK)

    vec = max(1, _VECTOR_BYTES // src.element_size())
    strides = [src.stride(-2), dst.stride(0), dst.stride(1)]
    if src.dim() == 3:
        strides.append(src.stride(0))
    while vec > 1 and (H % vec or any(st % vec for st in strides)):
        vec //= 2

    threads = max(1, rows_pp * block_h // vec)
    num_warps = max(1, min(4, next_pow2(threads) // 32))
    # At least one program along axis 0 even when R == 0 or C == 0: program (0, 0)
    # still has to write meta (count 0 and the error flag).
    grid = (max(1, -(-cap // rows_pp)), -(-H // block_h))
    return GatherLaunch(grid, block_h, rows_pp, meta_block, vec, num_warps)


# --------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------
def _launch_args(plan: GatherLaunch, src, rows, count, dst, meta, src_slot, dst_slot) -> tuple[tuple, dict]:
    """The kernel's positional arguments and constexpr keywords for one launch."""
    S, C, H = dst.shape
    three_d = src.dim() == 3
    args = (
        src, rows, count, dst, meta,
        # Unused slot pointers get `count` as a harmless placeholder: the kernel never
        # dereferences them (HAS_*_SLOT is a compile-time False), and it avoids
        # allocating a temporary whose address a captured graph would keep.
        src_slot if src_slot is not None else count,
        dst_slot if dst_slot is not None else count,
        src.shape[-2], rows.shape[0], C, src.shape[0] if three_d else 1, S,
        src.stride(0) if three_d else 0, src.stride(-2), rows.stride(0),
        dst.stride(0), dst.stride(1), meta.stride(0),
    )
    return args, dict(H=H, VEC=plan.vec, BLOCK_H=plan.block_h, ROWS=plan.rows_per_program,
                      META_BLOCK=plan.meta_block, HAS_SRC_SLOT=src_slot is not None,
                      HAS_DST_SLOT=dst_slot is not None)


def gather_rows(src, rows, count, dst, meta, *, src_slot=None, dst_slot=None, validate: bool = True) -> None:
    """Launch the Triton gather: ``dst[slot, j] = src[slab, rows[j]]`` for the first
    ``count`` rows, and record count / error flag / indices in ``meta[slot]`` (see the
    package docstring for the exact contract).

    Asynchronous on the current CUDA stream and capturable: ``count``, ``rows`` and the
    slots are read on the device, so a captured launch follows their values at replay.
    Compile it once outside capture first (any call with the same shapes, dtypes and
    alignment).

    Raises :class:`InputError` (when ``validate``) before anything is launched if an
    argument breaks the contract, and ``RuntimeError`` if triton is unavailable or the
    tensors are on the CPU without ``TRITON_INTERPRET=1`` (see
    :func:`~cudagraph_rt.kernels.common.triton_backend`).
    Bad device values (indices, count, slots) never raise: they are reported in
    ``meta[slot, 1]`` and skipped.
    """
    if validate:
        validate_gather_args(src, rows, count, dst, meta, src_slot, dst_slot)
    backend = triton_backend()
    if backend == "unavailable":
        raise RuntimeError("gather_rows: triton is not installed; use gather_rows_reference")
    if src.device.type != "cuda" and backend != "interpreter":
        raise RuntimeError(
            f"gather_rows: src is on {src.device}; the compiled Triton kernel needs CUDA "
            "tensors (set TRITON_INTERPRET=1 before importing to run it on the CPU)"
        )
    plan = plan_launch(src, rows, dst)
    args, meta_kwargs = _launch_args(plan, src, rows, count, dst, meta, src_slot, dst_slot)
    if backend == "interpreter":
        gather_rows_kernel[plan.grid](*args, **meta_kwargs)
        return
    # Triton launches on the *current* device; make it src's so multi-GPU hosts work.
    with torch.cuda.device(src.device):
        gather_rows_kernel[plan.grid](*args, **meta_kwargs, num_warps=plan.num_warps)
