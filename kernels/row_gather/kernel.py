"""The row gather's Triton kernel (the contract: :mod:`cudagraph_rt.kernels.row_gather`).

The grid is sized from R, C and H only; how much of it does work is decided on the device
from the count, so one captured launch serves every count.
"""
from __future__ import annotations

from ..common import tl, triton

__all__ = ["gather_rows_kernel"]

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
    def gather_rows_kernel(
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
    gather_rows_kernel = None
