"""Attention over the live cells of a paged KV pool: Triton kernels beside their torch reference.

Contract (shared by :func:`cell_attention`, :func:`cell_attention_triton` and
:func:`cell_attention_reference`):

* ``q``: ``[N, Hq, D]``, the step's rows by query heads. ``k_cache`` / ``v_cache``: one
  layer of the pool, ``[cells, Hkv, D]``, last dimension contiguous. ``Hq = G * Hkv``:
  query head ``h`` reads KV head ``h // G``.
* ``block_table``: int32 ``[S, MB]``; ``seq_ids``: ``[N]`` integer, -1 for a padding row
  (its output is 0 and it reads nothing); ``positions``: ``[N]`` int64.
* Row r of sequence s at position p attends to the positions j in ``[lo, p]``, where
  ``lo = max(0, p - window + 1)`` with a ``window`` and 0 without; the cell of position j
  is ``block_table[s, j // block_size] * block_size + j % block_size``.
* ``score = scale * q.k - slopes[h] * |p - bias_shift - j|`` (no bias when ``slopes`` is
  None; ALiBi is ``bias_shift=0``, the toy decoder's previous-token head ``1``); softmax
  in fp32; the probabilities are rounded to the cache dtype for the product with V, as a
  flash kernel does; the output is in ``q``'s dtype (written into ``out`` when given).

``write_cells`` puts a step's K/V rows into their cells: ``k``/``v`` ``[N, Hkv, D]`` into
rows ``cells`` ``[N]`` of the caches. Only padding rows share a cell (the scratch cell),
so which of them wins does not matter.

How the kernel does it (one launch, plus a merge launch when ``splits > 1``):

* Grid ``(tiles * P, Hkv, splits)``, fixed by N and the host's plan
  (:func:`plan_attention`); everything that varies per step (sequences, positions, block
  tables) is read on the device, so one captured launch serves every context length.
* Rows come in tiles of R consecutive rows. A tile's rows are grouped by sequence on the
  device (a group = all the tile's rows of one sequence, in any order); P programs serve
  the tile, program p taking groups p, p + P, ... (P = 1: one program loops over them).
  A group's rows and the G query heads of the program's KV head are the ``R * G`` lanes
  of one tile, so a verify step (k+1 rows of one sequence) reads each K/V cell once per
  KV head. Padding rows (seq -1) join no group and read nothing; a program with no group
  exits after one look at the tile's sequence ids.
* A group reads the positions ``[min lo, max p]`` of its rows through the block table
  (gathered per position, so the tile of cells is independent of the block size). Split
  ``k`` takes the k-th share of that range, computed on the device from the group's own
  length (at least ``min_chunk`` positions, so short contexts leave splits empty rather
  than spread thin). A window raises the loop's lower bound: blocks wholly outside it
  are never loaded. Causality and each row's window are masks inside the tile.
* Online softmax in base 2 (fp32 running max and sum, guarded for all-masked lanes);
  ``splits == 1`` writes the normalised output directly, otherwise each split writes its
  running max, sum and unnormalised accumulator and the merge combines them by
  log-sum-exp (the largest running max of the splits, every split rescaled to it).
* Offsets into the caches are 64-bit (cells * Hkv * D passes 2**31 in big pools); D is
  padded to a power of two >= 16 with masks.

Configs come from a small measured table (:data:`TUNED_CONFIGS`) and a rule, never from
autotuning at call time (an autotune during capture would time padding rows).
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from cudagraph_rt.errors import InputError, expected

try:  # Triton is optional: without it every path runs the torch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

__all__ = [
    "AttentionConfig", "AttentionPlan", "TUNED_CONFIGS", "cell_attention", "cell_attention_reference",
    "cell_attention_triton", "kernel_mode", "plan_attention", "write_cells", "write_cells_reference",
    "write_cells_triton",
]

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


# --------------------------------------------------------------------------------------
# Launch configuration (host side: shapes only, never device values)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape of the attention kernel: ``tile_n`` cells per loop step, Triton's
    ``num_warps`` / ``num_stages``, and ``min_chunk``, the fewest positions a split takes."""

    tile_n: int = 64
    num_warps: int = 4
    num_stages: int = 3  # the block-table load, then the K/V tiles it addresses, then the math
    min_chunk: int = 256


@dataclass(frozen=True)
class AttentionPlan:
    """Everything a launch bakes in besides the tensors, a pure function of N and the
    shapes: ``rows_per_tile`` (R) consecutive rows share a tile; ``programs_per_tile``
    (P) programs serve each tile, program p taking the tile's distinct sequences p,
    p + P, ... (P = 1: one program loops over them; P = R: each gets its own);
    ``splits`` of each sequence's context; the tile ``config``."""

    rows_per_tile: int
    programs_per_tile: int
    splits: int
    config: AttentionConfig


# Measured defaults, keyed on (rows per tile, padded D, padded G). Empty until the H200
# run of tools/bench_attention.py fixes them (it prints the entries to paste here); until
# then the rule in _default_config serves.
TUNED_CONFIGS: dict[tuple[int, int, int], AttentionConfig] = {}

MAX_ROWS_PER_TILE = 8  # a verify step of up to 8 rows of one sequence reads its context once
MAX_TILE_LANES = 128  # rows per tile * padded G: the accumulator tile's height
MAX_SPLITS = 64
TARGET_PROGRAMS = 512  # programs wanted per launch (about 4 per SM of an H200)
ONE_PROGRAM_UP_TO = 8  # N up to this: a tile's sequences share one program (verify steps)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _default_config(rows: int, block_d: int, block_g: int) -> AttentionConfig:
    """The rule behind the table: about 16 KB of K and V per step of the loop (64 cells of
    D 64 in bf16, 32 of D 128), which keeps three stages in flight within the shared
    memory of any GPU Triton targets, fp32 included."""
    return AttentionConfig(tile_n=64 if block_d <= 64 else 32 if block_d <= 128 else 16)


def plan_attention(N: int, Hq: int, Hkv: int, D: int, *, splits: int | None = None) -> AttentionPlan:
    """The default plan. Rows per tile: N's next power of two, at most
    :data:`MAX_ROWS_PER_TILE` (and :data:`MAX_TILE_LANES` lanes with the G heads).
    Programs per tile: 1 up to :data:`ONE_PROGRAM_UP_TO` rows (a small step is most likely
    one sequence's verify rows, read once), else one per row (many sequences in parallel).
    Splits (unless given): enough for :data:`TARGET_PROGRAMS` programs if every program
    had a sequence to serve, at most :data:`MAX_SPLITS`; the device leaves the splits a
    short context does not need empty."""
    block_g = _next_pow2(Hq // Hkv)
    rows = max(1, min(_next_pow2(N), MAX_ROWS_PER_TILE, max(1, MAX_TILE_LANES // block_g)))
    programs = 1 if N <= ONE_PROGRAM_UP_TO else rows
    if splits is None:
        busy = -(-N // rows) * programs * Hkv
        splits = max(1, min(MAX_SPLITS, _next_pow2(-(-TARGET_PROGRAMS // busy))))
    block_d = max(16, _next_pow2(D))
    config = TUNED_CONFIGS.get((rows, block_d, block_g)) or _default_config(rows, block_d, block_g)
    return AttentionPlan(rows, programs, int(splits), config)


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _tile_groups(seq_ptr, s_seq, tile, N, num_seqs, R: tl.constexpr, BLOCK_R: tl.constexpr):
        """The tile's rows grouped by sequence, per row slot: its sequence (-1 outside N or
        padding), whether it is the first row of its sequence in the tile (a group's
        leader), and the running count of leaders (group k's leader has rank k + 1). A
        sequence id past the block table counts as padding."""
        ri = tl.arange(0, BLOCK_R)
        rows = tile * R + ri
        s = tl.load(seq_ptr + rows.to(tl.int64) * s_seq, mask=(ri < R) & (rows < N), other=-1)
        s = tl.where(s < num_seqs, s, -1)
        earlier = (s[:, None] == s[None, :]) & (ri[None, :] < ri[:, None])
        leader = (s >= 0) & (tl.max(earlier.to(tl.int32), 1) == 0)
        rank = tl.cumsum(leader.to(tl.int32), 0)
        return s, leader, rank

    @triton.jit
    def _tile_lanes(seq_ptr, pos_ptr, s_seq, s_pos, tile, N, num_seqs, window,
                    R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """The tile as lanes (row slot lane // BLOCK_G, head lane % BLOCK_G): each lane's
        row, sequence (-1 outside N), position and window start."""
        i = tl.arange(0, BLOCK_M) // BLOCK_G
        rows = tile * R + i
        inside = (i < R) & (rows < N)
        seq = tl.load(seq_ptr + rows.to(tl.int64) * s_seq, mask=inside, other=-1)
        seq = tl.where(seq < num_seqs, seq, -1)
        pos = tl.load(pos_ptr + rows.to(tl.int64) * s_pos, mask=inside, other=0).to(tl.int32)
        if HAS_WINDOW:
            lo = tl.maximum(pos - window + 1, 0)
        else:
            lo = tl.zeros_like(pos)
        return rows, inside, seq, pos, lo

    @triton.jit
    def _split_range(lo_min, hi_max, split, splits, min_chunk, TILE_N: tl.constexpr):
        """Split ``split``'s share [start, end) of the positions [lo_min, hi_max]: tiles
        aligned to TILE_N from below lo_min, ``max(span / splits, min_chunk)`` positions
        rounded up to whole tiles each; the splits past the end are empty (start >= end)."""
        first = (lo_min // TILE_N) * TILE_N
        per = tl.maximum(tl.cdiv(hi_max + 1 - first, splits), min_chunk)
        chunk = tl.cdiv(per, TILE_N) * TILE_N
        start = first + split * chunk
        end = tl.minimum(start + chunk, hi_max + 1)
        return start, end

    @triton.jit
    def _attend_tile(q, m, l, acc, k_head, v_head, bt_row, t, lo_min, hi_max, pos, lo, lane, slope2,
                     bias_shift, scale2, num_blocks, table_width, s_kc, s_vc,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                     HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr):
        """One step of the online softmax over the TILE_N positions from t: gather their
        cells through the block table, score the lanes given, fold into (m, l, acc)."""
        j = t + tl.arange(0, TILE_N)
        d = tl.arange(0, BLOCK_D)
        wanted = (j >= lo_min) & (j <= hi_max) & (j // BLOCK_SIZE < table_width)
        blk = tl.load(bt_row + j // BLOCK_SIZE, mask=wanted, other=0).to(tl.int64)
        wanted = wanted & (blk >= 0) & (blk < num_blocks)  # a bad table entry reads nothing either
        cell = blk * BLOCK_SIZE + j % BLOCK_SIZE  # int64: cell * stride passes 2**31
        kv_mask = wanted[:, None] & (d < D)[None, :]
        k = tl.load(k_head + cell[:, None] * s_kc + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale2
        if HAS_BIAS:
            s = s - slope2[:, None] * tl.abs(pos[:, None] - bias_shift - j[None, :]).to(tl.float32)
        seen = lane[:, None] & (j[None, :] <= pos[:, None]) & (j[None, :] >= lo[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane that saw nothing yet
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m - m_use)
        v = tl.load(v_head + cell[:, None] * s_vc + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        return m_new, l * alpha + tl.sum(p, 1), acc

    @triton.jit
    def _attend_group(q, m, l, acc, grp, pos, lo, slope2, seq_k, split, splits, min_chunk, bt_ptr, s_bt, k_head,
                      v_head, bias_shift, scale2, num_blocks, table_width, s_kc, s_vc,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr):
        """This split's share of one group's context (the union of its rows' ranges), read
        once for all the group's lanes."""
        hi_max = tl.max(tl.where(grp, pos, -1), 0)
        lo_min = tl.min(tl.where(grp, lo, 2147483647), 0)
        start, end = _split_range(lo_min, hi_max, split, splits, min_chunk, TILE_N)
        bt_row = bt_ptr + seq_k.to(tl.int64) * s_bt
        for t in range(start, end, TILE_N):
            m, l, acc = _attend_tile(q, m, l, acc, k_head, v_head, bt_row, t, lo_min, hi_max, pos, lo, grp,
                                     slope2, bias_shift, scale2, num_blocks, table_width, s_kc, s_vc,
                                     D, BLOCK_D, TILE_N, BLOCK_SIZE, HAS_BIAS, DOT_PREC)
        return m, l, acc

    @triton.jit
    def _store_rows(out_ptr, acc, l, rows, heads, lane, s_on, s_oh, D: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[row, head] = acc / l for the lanes given (0 where l == 0: padding rows)."""
        d = tl.arange(0, BLOCK_D)
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        ptr = out_ptr + rows.to(tl.int64)[:, None] * s_on + heads[:, None] * s_oh + d[None, :]
        tl.store(ptr, o.to(out_ptr.dtype.element_ty), mask=lane[:, None] & (d < D)[None, :])

    @triton.jit
    def _store_split(pm_ptr, pl_ptr, pacc_ptr, m, l, acc, rows, heads, lane, split, splits, Hq,
                     D: tl.constexpr, BLOCK_D: tl.constexpr):
        """Split ``split``'s running max (log2 units), sum and unnormalised accumulator of
        each lane into the scratch ``[N, Hq, splits, (D)]``; a lane that saw nothing here
        writes only m = -inf and l = 0, and the merge reads no accumulator where m is -inf."""
        d = tl.arange(0, BLOCK_D)
        at = (rows.to(tl.int64) * Hq + heads) * splits + split
        tl.store(pm_ptr + at, m, mask=lane)
        tl.store(pl_ptr + at, l, mask=lane)
        seen = lane & (m > float("-inf"))
        tl.store(pacc_ptr + at[:, None] * D + d[None, :], acc, mask=seen[:, None] & (d < D)[None, :])

    @triton.jit
    def _serve_groups(q_ptr, k_ptr, v_ptr, bt_ptr, slope_ptr, rows, heads, lanes, seq, pos, lo, s_row, leader, rank,
                      p, kvh, split, splits, min_chunk, num_blocks, table_width, scale2, bias_shift,
                      s_qn, s_qh, s_kc, s_kh, s_vc, s_vh, s_bt,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, P: tl.constexpr,
                      TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr):
        """Groups p, p + P, ... of the tile, one after the other, into one set of lanes.
        Returns (m, l, acc) and the lanes served."""
        d = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * s_qn + heads[:, None] * s_qh + d[None, :],
                    mask=(lanes & (seq >= 0))[:, None] & (d < D)[None, :], other=0.0).to(k_ptr.dtype.element_ty)
        slope2 = tl.zeros([BLOCK_M], tl.float32)
        if HAS_BIAS:
            slope2 = tl.load(slope_ptr + heads, mask=lanes, other=0.0).to(tl.float32) * 1.4426950408889634
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        mine = lanes & (seq < -1)  # no lane yet
        k_head, v_head = k_ptr + kvh.to(tl.int64) * s_kh, v_ptr + kvh.to(tl.int64) * s_vh
        for k in range(p, tl.max(rank, 0), P):
            seq_k = tl.max(tl.where(leader & (rank == k + 1), s_row, -1), 0)  # group k's sequence
            grp = lanes & (seq == seq_k)
            m, l, acc = _attend_group(q, m, l, acc, grp, pos, lo, slope2, seq_k, split, splits, min_chunk, bt_ptr,
                                      s_bt, k_head, v_head, bias_shift, scale2, num_blocks, table_width, s_kc, s_vc,
                                      D, BLOCK_D, TILE_N, BLOCK_SIZE, HAS_BIAS, DOT_PREC)
            mine = mine | grp
        return m, l, acc, mine

    @triton.jit
    def _cell_attention_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, pos_ptr, slope_ptr, out_ptr, pm_ptr, pl_ptr, pacc_ptr,
        N, Hq, splits, min_chunk, num_seqs, num_blocks, table_width, scale2, bias_shift, window,
        s_qn, s_qh, s_kc, s_kh, s_vc, s_vh, s_bt, s_seq, s_pos, s_on, s_oh,
        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
        R: tl.constexpr, BLOCK_R: tl.constexpr, P: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, DOT_PREC: tl.constexpr,
    ):
        tile, p = tl.program_id(0) // P, tl.program_id(0) % P
        kvh, split = tl.program_id(1), tl.program_id(2)
        s_row, leader, rank = _tile_groups(seq_ptr, s_seq, tile, N, num_seqs, R, BLOCK_R)
        rows, inside, seq, pos, lo = _tile_lanes(seq_ptr, pos_ptr, s_seq, s_pos, tile, N, num_seqs, window,
                                                 R, BLOCK_M, BLOCK_G, HAS_WINDOW)
        heads = kvh * G + tl.arange(0, BLOCK_M) % BLOCK_G
        lanes = inside & (heads < kvh * G + G)
        pad = lanes & (seq < 0) & (rows * 0 + p == 0)  # padding rows: program 0 of the tile writes 0s
        if p < tl.max(rank, 0):  # a program without a group reads nothing more
            m, l, acc, mine = _serve_groups(q_ptr, k_ptr, v_ptr, bt_ptr, slope_ptr, rows, heads, lanes, seq, pos, lo,
                                            s_row, leader, rank, p, kvh, split, splits, min_chunk, num_blocks,
                                            table_width, scale2, bias_shift, s_qn, s_qh, s_kc, s_kh, s_vc, s_vh, s_bt,
                                            D, BLOCK_D, BLOCK_M, P, TILE_N, BLOCK_SIZE, HAS_BIAS, DOT_PREC)
            if DIRECT:
                _store_rows(out_ptr, acc, l, rows, heads, mine | pad, s_on, s_oh, D, BLOCK_D)
            else:
                _store_split(pm_ptr, pl_ptr, pacc_ptr, m, l, acc, rows, heads, mine, split, splits, Hq, D, BLOCK_D)
        elif DIRECT:
            _store_rows(out_ptr, tl.zeros([BLOCK_M, BLOCK_D], tl.float32), tl.zeros([BLOCK_M], tl.float32), rows,
                        heads, pad, s_on, s_oh, D, BLOCK_D)

    @triton.jit
    def _merge_splits_kernel(out_ptr, pm_ptr, pl_ptr, pacc_ptr, seq_ptr, s_seq, s_on, s_oh, Hq, splits, num_seqs,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
        """out[row, head] from its splits: the largest running max M, every split's sum
        and accumulator rescaled by exp2(m - M), summed, divided. Padding rows get 0."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        d = tl.arange(0, BLOCK_D)
        ptr = out_ptr + row * s_on + head * s_oh + d
        seq = tl.load(seq_ptr + row * s_seq)
        if (seq < 0) | (seq >= num_seqs):
            tl.store(ptr, tl.zeros([BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty), mask=d < D)
            return
        s = tl.arange(0, BLOCK_S)
        at = (row * Hq + head) * splits + s
        m = tl.load(pm_ptr + at, mask=s < splits, other=float("-inf"))
        l = tl.load(pl_ptr + at, mask=s < splits, other=0.0)
        seen = m > float("-inf")
        top = tl.max(m, 0)
        w = tl.where(seen, tl.math.exp2(m - tl.where(top > float("-inf"), top, 0.0)), 0.0)
        a = tl.load(pacc_ptr + at[:, None] * D + d[None, :], mask=seen[:, None] & (d < D)[None, :], other=0.0)
        total = tl.sum(l * w, 0)
        o = tl.sum(a * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(ptr, o.to(out_ptr.dtype.element_ty), mask=d < D)

    @triton.jit
    def _write_cells_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, cells_ptr, num_cells, s_cells,
                            s_kn, s_kh, s_vn, s_vh, s_kcc, s_kch, s_vcc, s_vch,
                            HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """Row r of k and of v into cell cells[r] of each cache (a cell outside the caches
        writes nothing)."""
        r = tl.program_id(0).to(tl.int64)
        cell = tl.load(cells_ptr + r * s_cells).to(tl.int64)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        at = tl.zeros([BLOCK_H, 1], tl.int64) + cell  # (a vector: the interpreter mistypes vector & scalar)
        mask = (h < HKV) & (d < D) & (at >= 0) & (at < num_cells)
        k = tl.load(k_ptr + r * s_kn + h * s_kh + d, mask=mask)
        tl.store(kc_ptr + cell * s_kcc + h * s_kch + d, k.to(kc_ptr.dtype.element_ty), mask=mask)
        v = tl.load(v_ptr + r * s_vn + h * s_vh + d, mask=mask)
        tl.store(vc_ptr + cell * s_vcc + h * s_vch + d, v.to(vc_ptr.dtype.element_ty), mask=mask)

else:  # pragma: no cover
    _cell_attention_kernel = _merge_splits_kernel = _write_cells_kernel = None


def kernel_mode() -> str:
    """How the Triton kernels run in this process: ``"compiled"`` (CUDA tensors),
    ``"interpreter"`` (``TRITON_INTERPRET=1`` was set before this module was imported:
    CPU tensors, no bf16, not capturable) or ``"unavailable"`` (no triton). Fixed at
    import: ``triton.jit`` chooses when the kernels are defined."""
    if _cell_attention_kernel is None:
        return "unavailable"
    return "interpreter" if type(_cell_attention_kernel).__name__ == "InterpretedFunction" else "compiled"


# CGRT_CPU_KERNELS=1 (with TRITON_INTERPRET=1) makes cell_attention/write_cells run the
# Triton kernels on CPU tensors in the interpreter, e.g. to drive a model through them.
CPU_RUNS_KERNELS = os.environ.get("CGRT_CPU_KERNELS", "") == "1"


def _runs_kernel(t: Tensor) -> bool:
    mode = kernel_mode()
    if t.device.type == "cuda":
        return mode == "compiled"
    return mode == "interpreter" and CPU_RUNS_KERNELS


# --------------------------------------------------------------------------------------
# Validation (metadata only: no device values, safe during capture)
# --------------------------------------------------------------------------------------
def _desc(t) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, Tensor) else type(t).__name__


def _check_tensor(name: str, t, dims: int, dtypes, device=None) -> None:
    if not isinstance(t, Tensor) or t.dim() != dims:
        raise InputError(expected(name, f"a {dims}-D tensor", _desc(t)))
    if t.dtype not in dtypes:
        raise InputError(expected(name, f"dtype in {[str(x) for x in dtypes]}", t.dtype))
    if device is not None and t.device != device:
        raise InputError(expected(name, f"a tensor on {device} (the rows' device)", t.device))


def _check_caches(rows: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """Both caches ``[cells, Hkv, D]`` of one shape and dtype, on ``rows``' device and D."""
    D = rows.shape[2]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, c, 3, SUPPORTED_DTYPES, rows.device)
        if c.shape[2] != D or c.shape[1] < 1 or c.stride(2) != 1:
            raise InputError(expected(name, f"[cells, Hkv >= 1, {D}] with a contiguous last dimension",
                                      f"{tuple(c.shape)} strides {c.stride()}"))
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise InputError(expected("v_cache", f"k_cache's shape and dtype {_desc(k_cache)}", _desc(v_cache)))


def _check_attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, block_size, window, slopes,
                          out, splits) -> None:
    """Raise InputError naming the first argument that breaks the contract."""
    _check_tensor("q", q, 3, SUPPORTED_DTYPES)
    N, Hq, D = q.shape
    if not 1 <= D <= MAX_HEAD_DIM or q.stride(2) != 1:
        raise InputError(expected("q", f"[N, Hq, D] with 1 <= D <= {MAX_HEAD_DIM}, last dimension contiguous",
                                  f"{tuple(q.shape)} strides {q.stride()}"))
    _check_caches(q, k_cache, v_cache)
    if Hq % k_cache.shape[1]:
        raise InputError(expected("q", f"a multiple of k_cache's {k_cache.shape[1]} KV heads as Hq", Hq))
    _check_tensor("block_table", block_table, 2, (torch.int32,), q.device)
    if block_table.stride(1) != 1:
        raise InputError(expected("block_table", "a contiguous last dimension", f"strides {block_table.stride()}"))
    for name, t in (("seq_ids", seq_ids), ("positions", positions)):
        _check_tensor(name, t, 1, (torch.int32, torch.int64), q.device)
        if t.shape[0] != N:
            raise InputError(expected(name, f"{N} entries (q's rows)", tuple(t.shape)))
    if not isinstance(block_size, int) or block_size < 1:
        raise InputError(expected("block_size", "an int >= 1", block_size))
    if window is not None and (not isinstance(window, int) or window < 1):
        raise InputError(expected("window", "None or an int >= 1", window))
    if slopes is not None:
        _check_tensor("slopes", slopes, 1, (torch.float32,), q.device)
        if slopes.shape[0] != Hq:
            raise InputError(expected("slopes", f"{Hq} entries (one per query head)", tuple(slopes.shape)))
    if out is not None and (not isinstance(out, Tensor) or out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device or out.stride(2) != 1):
        raise InputError(expected("out", f"None or a tensor like q ({_desc(q)}, last dimension contiguous)",
                                  _desc(out)))
    if splits is not None and (not isinstance(splits, int) or splits < 1):
        raise InputError(expected("splits", "None or an int >= 1", splits))


def _check_plan(plan) -> None:
    """A plan given explicitly (tests, tuning) must describe a kernel that can exist."""
    c = getattr(plan, "config", None)
    if not isinstance(plan, AttentionPlan) or not isinstance(c, AttentionConfig) or plan.rows_per_tile < 1 \
            or not 1 <= plan.programs_per_tile <= plan.rows_per_tile or plan.splits < 1 or c.tile_n < 16 \
            or c.tile_n & (c.tile_n - 1) or c.num_warps < 1 or c.num_stages < 1:
        raise InputError(expected("plan", "None or an AttentionPlan with 1 <= programs <= rows, splits >= 1, a "
                                  "power-of-two tile_n >= 16, warps and stages >= 1", plan))


def _check_write_args(k, v, k_cache, v_cache, cells) -> None:
    """Raise InputError naming the first argument of write_cells that breaks the contract."""
    for name, t in (("k", k), ("v", v)):
        _check_tensor(name, t, 3, SUPPORTED_DTYPES)
        if t.shape != k.shape or t.stride(2) != 1:
            raise InputError(expected(name, f"[N, Hkv, D] like k {tuple(k.shape)}, last dimension contiguous",
                                      f"{tuple(t.shape)} strides {t.stride()}"))
    _check_caches(k, k_cache, v_cache)
    if k_cache.shape[1] != k.shape[1]:
        raise InputError(expected("k_cache", f"{k.shape[1]} KV heads (k's)", tuple(k_cache.shape)))
    _check_tensor("cells", cells, 1, (torch.int32, torch.int64), k.device)
    if cells.shape[0] != k.shape[0]:
        raise InputError(expected("cells", f"{k.shape[0]} entries (k's rows)", tuple(cells.shape)))


# --------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------
def _device_scope(t: Tensor):
    """Triton launches on the current CUDA device: make it the tensors' (multi-GPU hosts)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def kernel_constants(plan: AttentionPlan, Hq: int, Hkv: int, D: int, block_size: int, cache_dtype: torch.dtype,
                     has_window: bool, has_bias: bool) -> dict:
    """The attention kernel's compile-time constants for a launch (one compiled kernel per
    distinct dict): the lane tile (rows x padded G, at least 16 for the tensor cores), the
    padded D, the plan's tile shape, the block size and the optional features."""
    block_g = _next_pow2(Hq // Hkv)
    return dict(G=Hq // Hkv, D=D, BLOCK_D=max(16, _next_pow2(D)), BLOCK_G=block_g,
                BLOCK_M=max(16, _next_pow2(plan.rows_per_tile) * block_g), R=plan.rows_per_tile,
                BLOCK_R=_next_pow2(plan.rows_per_tile), P=plan.programs_per_tile, TILE_N=plan.config.tile_n,
                BLOCK_SIZE=block_size, HAS_WINDOW=has_window, HAS_BIAS=has_bias, DIRECT=plan.splits == 1,
                DOT_PREC="ieee" if cache_dtype == torch.float32 else "tf32")


def _launch_options(config: AttentionConfig, device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    return {"num_warps": config.num_warps, "num_stages": config.num_stages}


def cell_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_ids: Tensor,
                          positions: Tensor, *, block_size: int, scale: float, window: int | None = None,
                          slopes: Tensor | None = None, bias_shift: int = 0, out: Tensor | None = None,
                          splits: int | None = None, plan: AttentionPlan | None = None) -> Tensor:
    """The contract above on the Triton kernels (CUDA tensors; CPU tensors under
    ``TRITON_INTERPRET=1``). ``plan`` overrides :func:`plan_attention` (tests, tuning).

    Asynchronous on the current stream and capturable: no host read of a device value;
    the split scratch comes from ``torch.empty`` (the graph's pool during capture). The
    first launch of each specialisation compiles: make it outside capture. Returns ``out``
    (or a new tensor), valid once the stream reaches it. Raises InputError before
    launching anything when an argument breaks the contract. Device values outside the
    contract give undefined numbers but never an access out of bounds: a sequence id past
    the block table reads nothing (its row comes out 0), and positions past the table's
    width or blocks outside the caches read nothing."""
    _check_attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, block_size, window, slopes,
                          out, splits)
    if kernel_mode() == "unavailable":
        raise RuntimeError("cell_attention_triton: triton is not installed; use cell_attention_reference")
    N, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    if N == 0:
        return out
    if plan is None:
        plan = plan_attention(N, Hq, Hkv, D, splits=splits)
    _check_plan(plan)
    meta = kernel_constants(plan, Hq, Hkv, D, block_size, k_cache.dtype, window is not None, slopes is not None)
    if meta["DIRECT"]:  # no scratch: the kernel never touches these pointers
        pm = pl = pacc = out
    else:
        pm, pl = (torch.empty((N, Hq, plan.splits), dtype=torch.float32, device=q.device) for _ in range(2))
        pacc = torch.empty((N, Hq, plan.splits, D), dtype=torch.float32, device=q.device)
    grid = (-(-N // plan.rows_per_tile) * plan.programs_per_tile, Hkv, plan.splits)
    with _device_scope(q):
        _cell_attention_kernel[grid](
            q, k_cache, v_cache, block_table, seq_ids, positions, q if slopes is None else slopes, out, pm, pl, pacc,
            N, Hq, plan.splits, max(1, plan.config.min_chunk), block_table.shape[0], k_cache.shape[0] // block_size,
            block_table.shape[1],
            float(scale) * LOG2E,
            int(bias_shift), int(window or 0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), block_table.stride(0), seq_ids.stride(0), positions.stride(0),
            out.stride(0), out.stride(1), **meta, **_launch_options(plan.config, q.device))
        if not meta["DIRECT"]:
            _merge_splits_kernel[(N, Hq)](out, pm, pl, pacc, seq_ids, seq_ids.stride(0), out.stride(0), out.stride(1),
                                          Hq, plan.splits, block_table.shape[0], D=D, BLOCK_D=meta["BLOCK_D"],
                                          BLOCK_S=_next_pow2(plan.splits))
    return out


def write_cells_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cells: Tensor) -> None:
    """``k_cache[cells] = k`` and ``v_cache[cells] = v`` in one launch (CUDA tensors; CPU
    tensors under ``TRITON_INTERPRET=1``). Asynchronous and capturable (cells are read on
    the device); a cell outside the caches writes nothing. Raises InputError before
    writing anything when an argument breaks the contract."""
    _check_write_args(k, v, k_cache, v_cache, cells)
    if kernel_mode() == "unavailable":
        raise RuntimeError("write_cells_triton: triton is not installed; use write_cells_reference")
    N, Hkv, D = k.shape
    if N == 0:
        return
    with _device_scope(k):
        _write_cells_kernel[(N,)](
            k, v, k_cache, v_cache, cells, k_cache.shape[0], cells.stride(0), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            HKV=Hkv, D=D, BLOCK_H=_next_pow2(Hkv), BLOCK_D=_next_pow2(D))


# --------------------------------------------------------------------------------------
# References (plain torch, any device) and the dispatching entry points
# --------------------------------------------------------------------------------------
def write_cells_reference(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cells: Tensor) -> None:
    """``k_cache[cells] = k``, ``v_cache[cells] = v`` (in the caches' dtype)."""
    k_cache.index_copy_(0, cells, k.to(k_cache.dtype))
    v_cache.index_copy_(0, cells, v.to(v_cache.dtype))


def cell_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_ids: Tensor,
                             positions: Tensor, *, block_size: int, scale: float, window: int | None = None,
                             slopes: Tensor | None = None, bias_shift: int = 0, out: Tensor | None = None,
                             splits: int | None = None) -> Tensor:
    """The contract above in plain torch, on any device. No host read of a device value
    and no data-dependent shape (it runs inside captured step functions and under the
    hazard finder): every row gathers the static bound of ``MB * block_size`` positions
    and masks what it may not see. ``splits`` is accepted and ignored."""
    N, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    G = Hq // Hkv
    span = block_table.shape[1] * block_size
    j = torch.arange(span, device=q.device)
    live = seq_ids >= 0
    seq = torch.where(live, seq_ids, 0).long()
    pos = positions.long()
    cells = block_table[seq].long().repeat_interleave(block_size, 1) * block_size + j % block_size  # [N, span]
    lo = (pos - window + 1).clamp(min=0) if window is not None else torch.zeros_like(pos)
    visible = live[:, None] & (j[None, :] <= pos[:, None]) & (j[None, :] >= lo[:, None])
    k = k_cache[cells].view(N, span, Hkv, 1, D).expand(N, span, Hkv, G, D).reshape(N, span, Hq, D)
    v = v_cache[cells].view(N, span, Hkv, 1, D).expand(N, span, Hkv, G, D).reshape(N, span, Hq, D)
    s = torch.einsum("nhd,nshd->nhs", q.float(), k.float()) * scale
    if slopes is not None:
        dist = (pos[:, None] - bias_shift - j[None, :]).abs().float()  # [N, span]
        s = s - slopes.float()[None, :, None] * dist[:, None, :]
    s = s.masked_fill(~visible[:, None, :], float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # a padding row sees nothing: all -inf -> 0
    o = torch.einsum("nhs,nshd->nhd", p.to(v.dtype).float(), v.float()).to(q.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out


def cell_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_ids: Tensor,
                   positions: Tensor, *, block_size: int, scale: float, window: int | None = None,
                   slopes: Tensor | None = None, bias_shift: int = 0, out: Tensor | None = None,
                   splits: int | None = None) -> Tensor:
    """The contract above: the Triton kernels on CUDA tensors, the torch reference
    elsewhere (or the kernels in the interpreter with ``CGRT_CPU_KERNELS=1`` and
    ``TRITON_INTERPRET=1``). Same lifetimes and errors as the implementation chosen."""
    impl = cell_attention_triton if _runs_kernel(q) else cell_attention_reference
    return impl(q, k_cache, v_cache, block_table, seq_ids, positions, block_size=block_size, scale=scale,
                window=window, slopes=slopes, bias_shift=bias_shift, out=out, splits=splits)


def write_cells(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cells: Tensor) -> None:
    """``k_cache[cells] = k``, ``v_cache[cells] = v``: one Triton launch on CUDA tensors,
    the torch reference elsewhere (same switch as :func:`cell_attention`)."""
    (write_cells_triton if _runs_kernel(k) else write_cells_reference)(k, v, k_cache, v_cache, cells)
