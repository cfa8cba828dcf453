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
from dataclasses import dataclass

import torch

from cudagraph_rt.errors import InputError, expected

try:  # Triton is optional: without it every path falls back to the torch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

__all__ = [
    "FLAG_CAPACITY",
    "FLAG_COUNT",
    "FLAG_INDEX",
    "FLAG_SRC_SLOT",
    "GatherBench",
    "GatherLaunch",
    "SUPPORTED_DTYPES",
    "bench_gather",
    "choose_gather",
    "gather_rows",
    "gather_rows_auto",
    "gather_rows_reference",
    "kernel_mode",
    "plan_launch",
    "validate_gather_args",
]

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
# Kernel
# --------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _write_meta(meta_row, rows_ptr, stride_rows, count, n_used, src_ok, N, R, C,
                    META_BLOCK: tl.constexpr):
        """meta[slot] = [n_used, error bits, indices...] (program (0, 0) alone)."""
        bad = ((count > C).to(tl.int32) * 2 + ((count < 0) | (count > R)).to(tl.int32) * 4
               + (src_ok == 0).to(tl.int32) * 8)
        # META_BLOCK = next_pow2(min(R, C)) (capped at 1024): one iteration for any
        # realistic capacity.
        for start in range(0, n_used, META_BLOCK):
            j = start + tl.arange(0, META_BLOCK)
            jm = j < n_used
            idx = tl.load(rows_ptr + j.to(tl.int64) * stride_rows, mask=jm, other=0)
            oob = jm & ((idx < 0) | (idx >= N))
            bad = bad | tl.max(oob.to(tl.int32), axis=0)  # FLAG_INDEX
            tl.store(meta_row + 2 + j, idx.to(tl.int32), mask=jm)
        tl.store(meta_row, n_used)
        tl.store(meta_row + 1, bad)

    @triton.jit
    def _copy_rows(src_ptr, rows_ptr, dst_ptr, row0, pid_h, n_copy, s64, d64, N,
                   stride_src_s, stride_src_n, stride_rows, stride_dst_s, stride_dst_c,
                   H: tl.constexpr, VEC: tl.constexpr, BLOCK_H: tl.constexpr, ROWS: tl.constexpr,
                   HAS_DST_SLOT: tl.constexpr):
        """dst[slot, j] = src[slab, rows[j]] for this program's rows j < n_copy (bad
        indices skipped) and its BLOCK_H columns."""
        j = row0 + tl.arange(0, ROWS)
        jm = j < n_copy
        idx = tl.load(rows_ptr + j.to(tl.int64) * stride_rows, mask=jm, other=0).to(tl.int64)
        ok = jm & (idx >= 0) & (idx < N)
        # Masked-off lanes get offset 0 so no address outside src is even formed.
        src_off = tl.where(ok, s64 * stride_src_s + idx * stride_src_n, 0)
        dst_off = j.to(tl.int64) * stride_dst_c
        if HAS_DST_SLOT:
            # Only added when there is a slot: a constant-0 slot term would be folded
            # away together with the alignment hint set just below.
            dst_off = dst_off + d64 * stride_dst_s
        # Honest alignment hints: the launcher picks VEC so that it divides every stride
        # and H, so each row starts on a VEC boundary and the compiler can emit 16-byte
        # loads/stores (H = 1000 included, where a plain int argument would only be known
        # to be divisible by 8, not 16).
        src_off = tl.multiple_of(src_off, VEC)
        dst_off = tl.multiple_of(dst_off, VEC)
        h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = ok[:, None] & (h < H)[None, :]
        vals = tl.load(src_ptr + src_off[:, None] + h[None, :], mask=mask)
        tl.store(dst_ptr + dst_off[:, None] + h[None, :], vals, mask=mask)

    @triton.jit
    def _gather_rows_kernel(
        src_ptr, rows_ptr, count_ptr, dst_ptr, meta_ptr, src_slot_ptr, dst_slot_ptr,
        N, R, C, S_src, S_dst,
        stride_src_s, stride_src_n, stride_rows,
        stride_dst_s, stride_dst_c, stride_meta_s,
        H: tl.constexpr,
        VEC: tl.constexpr,
        BLOCK_H: tl.constexpr,
        ROWS: tl.constexpr,
        META_BLOCK: tl.constexpr,
        HAS_SRC_SLOT: tl.constexpr,
        HAS_DST_SLOT: tl.constexpr,
    ):
        # Grid: axis 0 = blocks of ROWS output rows, axis 1 = blocks of BLOCK_H columns.
        # The grid is sized from R, C and H only; how much of it does work is decided here
        # from the device-resident count, so one captured launch serves every count.
        pid_r = tl.program_id(0)
        pid_h = tl.program_id(1)
        count = tl.load(count_ptr).to(tl.int32)
        s = tl.load(src_slot_ptr).to(tl.int32) if HAS_SRC_SLOT else tl.full([], 0, tl.int32)
        d = tl.load(dst_slot_ptr).to(tl.int32) if HAS_DST_SLOT else tl.full([], 0, tl.int32)
        src_ok = (s >= 0) & (s < S_src)
        # Rows actually used: never more than the slot holds nor than `rows` provides.
        n_used = tl.minimum(tl.minimum(tl.maximum(count, 0), C), R)
        # 64-bit offsets: S * C * H can exceed 2**31 elements for a big host ring.
        s64 = tl.where(src_ok, s, 0).to(tl.int64)
        d64 = d.to(tl.int64)
        if (d >= 0) & (d < S_dst):
            # meta is written by program (0, 0) alone: the flag needs every used index,
            # and one writer means no atomics and no ordering between programs.
            if (pid_r == 0) & (pid_h == 0):
                _write_meta(meta_ptr + d64 * stride_meta_s, rows_ptr, stride_rows, count, n_used, src_ok,
                            N, R, C, META_BLOCK)
            # A bad src_slot copies nothing (it is flagged above); folding it into the
            # row count keeps the per-row mask to the row checks alone.
            n_copy = tl.where(src_ok, n_used, 0)
            row0 = pid_r * ROWS
            if row0 < n_copy:  # programs past count do nothing
                _copy_rows(src_ptr, rows_ptr, dst_ptr, row0, pid_h, n_copy, s64, d64, N,
                           stride_src_s, stride_src_n, stride_rows, stride_dst_s, stride_dst_c,
                           H, VEC, BLOCK_H, ROWS, HAS_DST_SLOT)

else:  # pragma: no cover
    _gather_rows_kernel = None


def kernel_mode() -> str:
    """How the Triton kernel runs in this process: ``"compiled"`` (needs CUDA tensors),
    ``"interpreter"`` (``TRITON_INTERPRET=1`` was set before this module was imported;
    runs on CPU tensors, no bf16, not capturable) or ``"unavailable"`` (no triton).

    Fixed at import time: ``triton.jit`` decides between compiled and interpreted when
    the kernel is defined, so changing the environment afterwards has no effect.
    """
    if _gather_rows_kernel is None:
        return "unavailable"
    return "interpreter" if type(_gather_rows_kernel).__name__ == "InterpretedFunction" else "compiled"


# --------------------------------------------------------------------------------------
# Validation and launch planning (host side, metadata only: no device syncs)
# --------------------------------------------------------------------------------------
def _desc(t) -> str:
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    pinned = ""
    if t.device.type == "cpu" and torch.cuda.is_available():
        pinned = ", pinned" if t.is_pinned() else ", not pinned"
    return f"{t.dtype} {tuple(t.shape)} on {t.device}{pinned}"


def _check_int_scalar(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (1,):
        raise InputError(expected(name, "an int32 tensor of shape (1,)", _desc(t)))


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
        raise InputError(expected("src", "a tensor of shape [N, H] or [S_src, N, H]", _desc(src)))
    if src.dtype not in SUPPORTED_DTYPES:
        raise InputError(expected("src", "dtype float32, float16 or bfloat16", src.dtype))
    H = src.shape[-1]
    if H < 1:
        raise InputError(expected("src", "a last dimension (H) >= 1", tuple(src.shape)))
    if src.stride(-1) != 1:
        raise InputError(expected("src", "a contiguous last dimension (stride 1)", f"stride {src.stride()}"))
    if src.dim() == 2 and src_slot is not None:
        raise InputError(expected("src_slot", "None for a 2-D src (no slabs to choose)", _desc(src_slot)))
    if src.dim() == 3 and src.shape[0] < 1:
        raise InputError(expected("src", "at least one slab", tuple(src.shape)))
    return H


def _check_indices(src, rows, count, src_slot, dst_slot) -> None:
    """rows, count and the slots: int tensors on src's device."""
    if not isinstance(rows, torch.Tensor) or rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64):
        raise InputError(expected("rows", "a 1-D int32 or int64 tensor", _desc(rows)))
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
        raise InputError(expected("dst", "a tensor of shape [S, C, H]", _desc(dst)))
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
        raise InputError(expected("meta", f"an int32 tensor of shape ({S}, {2 + C})", _desc(meta)))
    if meta.stride(-1) != 1:
        raise InputError(expected("meta", "a contiguous last dimension (stride 1)", f"stride {meta.stride()}"))

    for name, t in (("dst", dst), ("meta", meta)):
        if t.device == src.device:
            continue
        # The only cross-device case allowed: a CUDA src writing into page-locked host
        # memory, which the GPU reaches through UVA. Unpinned host memory is not mapped.
        if src.device.type == "cuda" and t.device.type == "cpu":
            if not t.is_pinned():
                raise InputError(expected(name, "a CUDA tensor or PINNED host memory (pin_memory=True)", _desc(t)))
            continue
        raise InputError(expected(name, f"a tensor on {src.device} or pinned host memory", t.device))
    if dst.device != meta.device:
        raise InputError(expected("meta", f"the same memory kind as dst ({dst.device})", meta.device))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


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
    block_h = min(_next_pow2(H), _MAX_BLOCK_H)
    rows_pp = max(1, min(_next_pow2(cap), _TILE_ELEMS // block_h, _MAX_ROWS_PER_PROGRAM))
    meta_block = min(_next_pow2(cap), _MAX_META_BLOCK)

    vec = max(1, _VECTOR_BYTES // src.element_size())
    strides = [src.stride(-2), dst.stride(0), dst.stride(1)]
    if src.dim() == 3:
        strides.append(src.stride(0))
    while vec > 1 and (H % vec or any(st % vec for st in strides)):
        vec //= 2

    threads = max(1, rows_pp * block_h // vec)
    num_warps = max(1, min(4, _next_pow2(threads) // 32))
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
    module docstring for the exact contract).

    Asynchronous on the current CUDA stream and capturable: ``count``, ``rows`` and the
    slots are read on the device, so a captured launch follows their values at replay.
    Compile it once outside capture first (any call with the same shapes, dtypes and
    alignment).

    Raises :class:`InputError` (when ``validate``) before anything is launched if an
    argument breaks the contract, and ``RuntimeError`` if triton is unavailable or the
    tensors are on the CPU without ``TRITON_INTERPRET=1`` (see :func:`kernel_mode`).
    Bad device values (indices, count, slots) never raise: they are reported in
    ``meta[slot, 1]`` and skipped.
    """
    if validate:
        validate_gather_args(src, rows, count, dst, meta, src_slot, dst_slot)
    mode = kernel_mode()
    if mode == "unavailable":
        raise RuntimeError("gather_rows: triton is not installed; use gather_rows_reference")
    if src.device.type != "cuda" and mode != "interpreter":
        raise RuntimeError(
            f"gather_rows: src is on {src.device}; the compiled Triton kernel needs CUDA "
            "tensors (set TRITON_INTERPRET=1 before importing to run it on the CPU)"
        )
    plan = plan_launch(src, rows, dst)
    args, meta_kwargs = _launch_args(plan, src, rows, count, dst, meta, src_slot, dst_slot)
    if mode == "interpreter":
        _gather_rows_kernel[plan.grid](*args, **meta_kwargs)
        return
    # Triton launches on the *current* device; make it src's so multi-GPU hosts work.
    with torch.cuda.device(src.device):
        _gather_rows_kernel[plan.grid](*args, **meta_kwargs, num_warps=plan.num_warps)


def gather_rows_reference(src, rows, count, dst, meta, *, src_slot=None, dst_slot=None, validate: bool = True) -> None:
    """Plain-torch implementation of the same contract as :func:`gather_rows`; the CPU
    path of the runtime and the oracle of the tests.

    Synchronous: it reads ``count`` and the slots with ``.item()`` (a device sync on
    CUDA, so it cannot be captured in a graph). Raises :class:`InputError` like
    :func:`gather_rows`; bad device values are flagged in ``meta``, never raised.
    """
    if validate:
        validate_gather_args(src, rows, count, dst, meta, src_slot, dst_slot)
    S, C, _ = dst.shape
    R = rows.shape[0]
    d = int(dst_slot.item()) if dst_slot is not None else 0
    if not 0 <= d < S:
        return  # no slot to write into: nothing at all is written (as in the kernel)
    n_rows = src.shape[-2]
    s = int(src_slot.item()) if src_slot is not None else 0
    slabs = src.shape[0] if src.dim() == 3 else 1
    src_ok = 0 <= s < slabs
    c = int(count.item())
    n = min(max(c, 0), C, R)

    idx = rows[:n].to(torch.int64)
    in_range = (idx >= 0) & (idx < n_rows)
    bad = ((FLAG_INDEX if not bool(in_range.all()) else 0) | (FLAG_CAPACITY if c > C else 0)
           | (FLAG_COUNT if (c < 0 or c > R) else 0) | (FLAG_SRC_SLOT if not src_ok else 0))

    meta[d, 0] = n
    meta[d, 1] = bad
    meta[d, 2 : 2 + n] = idx.to(torch.int32).to(meta.device)
    if src_ok and n > 0:
        slab = src[s] if src.dim() == 3 else src
        j = torch.nonzero(in_range).flatten()
        dst[d, j.to(dst.device)] = slab[idx[j]].to(dst.device)


def choose_gather(src: torch.Tensor, use_kernel: bool | None = None) -> Callable[..., None]:
    """Pick the implementation for ``src``: the Triton kernel for CUDA tensors (compiled
    mode), the torch reference otherwise. ``use_kernel=True`` forces the kernel (on the
    CPU only under ``TRITON_INTERPRET=1``; otherwise :class:`InputError`), ``False``
    forces the reference (on CUDA: synchronous and not capturable)."""
    mode = kernel_mode()
    if use_kernel is None:
        return gather_rows if (src.device.type == "cuda" and mode == "compiled") else gather_rows_reference
    if not use_kernel:
        return gather_rows_reference
    if mode == "unavailable":
        raise InputError(expected("use_kernel", "False or None (triton is not installed)", True))
    if src.device.type != "cuda" and mode != "interpreter":
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


# --------------------------------------------------------------------------------------
# Benchmark helper (for `cgrt bench`; needs CUDA)
# --------------------------------------------------------------------------------------
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
