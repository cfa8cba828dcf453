"""Attention over the live cells of a paged KV pool: Triton kernels beside their torch reference.

Contract (shared by :func:`cell_attention`, :func:`cell_attention_triton` and
:func:`cell_attention_reference`):

* ``q``: ``[N, Hq, D]``, the step's rows by query heads. ``k_cache`` / ``v_cache``: one
  layer of the pool, ``[cells, Hkv, D]``, last dimension contiguous, fewer than 2**31
  cells. ``Hq = G * Hkv``: query head ``h`` reads KV head ``h // G``.
* ``block_table``: int32 ``[S, MB]``; ``seq_ids``: ``[N]`` integer, -1 for a padding row
  (its output is 0 and it reads nothing); ``positions``: ``[N]`` int64.
* Row r of sequence s at position p attends to the positions j in ``[lo, p]``, where
  ``lo = max(0, p - window + 1)`` with a ``window`` and 0 without; the cell of position j
  is ``block_table[s, j // block_size] * block_size + j % block_size``.
* ``score = scale * q.k - slopes[h] * |p - bias_shift - j|`` (no bias when ``slopes`` is
  None; ALiBi is ``bias_shift=0``, the toy decoder's previous-token head ``1``); softmax
  in fp32; the probabilities are rounded to the cache dtype for the product with V, as a
  flash kernel does; the output is in ``q``'s dtype (written into ``out`` when given).
* A NaN or inf in a K or V cell that a row sees reaches its output; one it does not see
  does not. One exception, the kernel's: rows of one sequence in one tile share the
  product of probabilities and V, so a non-finite V that one of them sees (a later
  position of a verify step) also spoils the ones that do not (probability 0 x NaN).

``write_cells`` puts a step's K/V rows into their cells: ``k``/``v`` ``[N, Hkv, D]`` into
rows ``cells`` ``[N]`` of the caches. Only padding rows share a cell (the scratch cell,
which no row reads): its contents afterwards are unspecified element by element (padding
rows write it concurrently, so each element comes from one of them, not all from one).

How the kernel does it (ONE launch: the splits of a context merge inside it):

* Grid ``(tiles * P, Hkv, splits)``, fixed by N and the host's plan
  (:func:`plan_attention`); everything that varies per step (sequences, positions, block
  tables) is read on the device, so one captured launch serves every context length.
* Rows come in tiles of R consecutive rows. A tile's rows are grouped by sequence on the
  device (a group = all the tile's rows of one sequence, in any order); P programs serve
  the tile, program p taking groups p, p + P, ... (P = 1: one program loops over them).
  A group's rows and the G query heads of the program's KV head are the ``R * G`` lanes
  of one tile, so a verify step (k+1 rows of one sequence) reads each K/V cell once per
  KV head. Padding rows (seq -1) join no group and read nothing.
* The ``splits`` programs of a (tile, program, KV head) are shared out among that
  program's groups on the device: with n groups and W = min(splits, n), split s serves
  groups s mod W, s mod W + W, ..., each in sub-split s div W of ceil((splits - s mod W)
  / W). One sequence's rows (a verify step) get all the splits; a few sequences' decode
  rows in one tile each get their share instead of waiting for one program in turn.
* A group reads the positions ``[min lo, max p]`` of its rows. Sub-split ``k`` takes the k-th
  share of that range, computed on the device from the group's own length (at least
  ``min_chunk`` positions, whole tiles of ``tile_n``), so a short context leaves the
  later splits without work: those programs exit after one look at the tile's rows. A
  window raises the range's lower bound: blocks wholly outside it are never loaded.
  Causality and each row's window are masks inside the tile.
* A split's positions go through the block table in chunks of ``chunk_n`` positions
  (``CHUNK_TILES`` tiles): the chunk's cells are gathered into registers once, so the K/V
  loads of the tile loop depend on no load inside the loop and Triton's pipeliner keeps
  ``num_stages - 1`` tiles of K and V in flight (a table load inside the loop would cost
  the pipeline a stage: one tile in flight, the loop latency-bound). Each tile picks its
  row of the chunk with a masked sum over the chunk's tiles, so a long chunk costs a
  short share dearly (16 tiles gathered for the one it reads) while a long share wants
  long chunks (the pipeline drains at every chunk): a share of at most ``short_n``
  positions is read as one chunk of ``SHORT_TILES`` tiles, a longer one in chunks of
  ``CHUNK_TILES`` (two loops in the kernel, the branch per share; BENCHMARKS.md run H).
  V is loaded beside K, before the softmax math.
* Online softmax in base 2 (fp32 running max and sum, guarded for all-masked lanes).
* The sub-splits merge in the kernel. The programs serving a group count its sub-splits
  with work (``arrivals``, the same number in each of them, computed from the rows; more
  than one only when a program serves that one group). With one, that program writes
  the output directly (no scratch, no counter). Otherwise each stores its lanes'
  log-sum-exp (fp32) and normalised output (in the output's dtype, fp32 for fp32) and
  increments the counter of (tile, program, KV head, group) (acq_rel, after a barrier);
  the one that sees ``arrivals - 1`` resets the counter to 0 and merges every sub-split
  of its lanes: the largest log-sum-exp, every sub-split weighted by ``exp2(lse - max)``,
  in order (the result does not depend on which came last). The counters are zero again
  when the launch ends, so a captured graph replays them as they are. Program 0, split 0
  of a tile writes the padding rows' zeros.
* Launched right after a K/V write (``dependent=True``, the pool's path), it is a
  programmatic dependent launch on Hopper and later: its programs start while the write
  finishes, read their rows' sequences and positions, and wait for the write before
  anything else (``griddepcontrol.wait``); a program with no work never waits.
* Offsets into the caches are 64-bit (cells * Hkv * D passes 2**31 in big pools); D is
  padded to a power of two >= 16 with masks.

Configs come from a small measured table (:data:`TUNED_CONFIGS`) and a rule, never from
autotuning at call time (an autotune during capture would time padding rows).
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from cudagraph_rt.checks import as_int, resolve_device
from cudagraph_rt.errors import CaptureError, InputError, expected

try:  # Triton is optional: without it every path runs the torch reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

__all__ = [
    "AttentionConfig", "AttentionPlan", "BoundLaunch", "COUNTERS", "TUNED_CONFIGS", "attention_counters",
    "bind_cell_attention", "bind_write_cells", "cell_attention", "cell_attention_reference", "cell_attention_triton",
    "DEPENDENT_LAUNCH", "kernel_mode", "new_attention_counters", "pdl_launch", "pdl_options", "plan_attention",
    "write_cells", "write_cells_reference", "write_cells_triton",
]

LOG2E = 1.4426950408889634
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MAX_CELLS = 2**31 - 1  # a chunk's cells are gathered as int32
INT32_MAX = 2**31 - 1  # window and bias_shift: kernel scalars, distances between positions


# --------------------------------------------------------------------------------------
# Launch configuration (host side: shapes only, never device values)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionConfig:
    """Tile shape of the attention kernel: ``tile_n`` cells per loop step, Triton's
    ``num_warps`` / ``num_stages`` (``num_stages - 1`` tiles of K and V in flight),
    ``min_chunk``, the fewest positions a split takes, ``chunk_n``, the positions whose
    cells are gathered from the block table at once (at least one tile, at most 16), and
    ``short_n``: a split's share of at most that many positions is gathered in one chunk
    of that size instead (at least one tile, at most chunk_n). Both are rounded down to a
    power-of-two number of tiles."""

    tile_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    min_chunk: int = 128
    chunk_n: int = 2048
    short_n: int = 256


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


# Measured defaults, keyed on (rows per tile, padded D, padded G, splits > 1: the kernel
# with the merge, which needs more registers), from H200 runs of tools/bench/attention.py
# (Llama-3.2-1B shapes, bf16, 16 layers) and scratch sweeps around them (BENCHMARKS.md).
# Width 1: tiles of 128 cells (429 us against 446 with 64 at 32k; 64 is 8% faster at 8k
# but not at 32k), splits of at least 128 positions; shares up to 256 positions gathered
# at once (run H, one chunk for every share: 74.9 us with 2 tiles against 95.6 with 16 at
# 128 cells, 205 against 232 at 8k; 32k wants 16: 425 against 447). Width 8 (a verify step, 32 lanes):
# 4 warps and tiles of 128 (612 us against 1078 with 2 warps and 64 at 32k, 306 against
# 414 at 8k, 113 against 139 at 128 cells), splits of at least 512 positions (16 splits
# at 8k, 32 at 32k: the best of each); shares up to 512 gathered at once (run H: 8k 317
# against 333 with 16 tiles; 32k wants 16: 618 against 717 with 2). Other shapes take the rule in _default_config.
TUNED_CONFIGS: dict[tuple[int, int, int, bool], AttentionConfig] = {
    (1, 64, 4, True): AttentionConfig(tile_n=128, num_warps=4, num_stages=3, min_chunk=128, short_n=256),
    (8, 64, 4, True): AttentionConfig(tile_n=128, num_warps=4, num_stages=3, min_chunk=512, short_n=512),
}

MAX_ROWS_PER_TILE = 8  # a verify step of up to 8 rows of one sequence reads its context once
MAX_TILE_LANES = 128  # rows per tile * padded G: the accumulator tile's height
SHARED_TILES_UP_TO = 8  # N in 2..8: the rows share one tile (a verify step); else one row per tile
MAX_SPLITS = 64
TARGET_PROGRAMS = 256  # programs per launch: one wave at the 3 per SM that fit (142 registers, 70 KB)
MERGE_LANE_SPLITS = 1024  # lanes x splits the last split reads at most (its merge is one program's)
MERGE_ELEMENTS_PER_THREAD = 128  # of one merge step (lanes x splits x D over the threads), at most 16 splits
COUNTERS = 1 << 16  # arrival counters per buffer: (tile, program, KV head, row slot) of grids up to 65,536


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _default_config(rows: int, block_d: int, block_g: int, split: bool) -> AttentionConfig:
    """The rule behind the table: about 32 KB of K and V per tile (128 cells of D 64 in
    bf16, 64 of D 128), two tiles in flight; a split takes at least one tile. Without
    splits (many sequences) half that: the kernel without the merge then needs about 80
    registers instead of 140 and twice the programs fit on an SM (one wave)."""
    tile_n = 128 if block_d <= 64 else 64 if block_d <= 128 else 32
    tile_n = tile_n if split else max(16, tile_n // 2)
    return AttentionConfig(tile_n=tile_n, min_chunk=tile_n)


def plan_attention(N: int, Hq: int, Hkv: int, D: int, *, splits: int | None = None) -> AttentionPlan:
    """The default plan. Rows per tile: N's next power of two for 2 <= N <=
    :data:`SHARED_TILES_UP_TO` (a small step is most likely one sequence's verify rows,
    read once for all of them; at most :data:`MAX_TILE_LANES` lanes with the G heads),
    one row per tile otherwise (decode rows of many sequences: G lanes each, no lane
    idle). One program per tile. Splits (unless given): enough for
    :data:`TARGET_PROGRAMS` programs if every row had a long context, at most
    :data:`MAX_SPLITS` and at most :data:`MERGE_LANE_SPLITS` over the tile's lanes (the
    last split merges them all); the device leaves the splits a short context does not
    need without work."""
    block_g = _next_pow2(Hq // Hkv)
    rows = 1
    if 2 <= N <= SHARED_TILES_UP_TO:
        rows = max(1, min(_next_pow2(N), MAX_ROWS_PER_TILE, max(1, MAX_TILE_LANES // block_g)))
    if splits is None:
        busy = max(1, -(-N // rows) * Hkv)
        cap = max(1, min(MAX_SPLITS, MERGE_LANE_SPLITS // (rows * block_g)))
        splits = max(1, min(cap, _next_pow2(-(-TARGET_PROGRAMS // busy))))
    block_d = max(16, _next_pow2(D))
    key = (rows, block_d, block_g, splits > 1)
    config = TUNED_CONFIGS.get(key) or _default_config(*key)
    return AttentionPlan(rows, 1, int(splits), config)


def kernel_constants(plan: AttentionPlan, Hq: int, Hkv: int, D: int, block_size: int, cache_dtype: torch.dtype,
                     has_window: bool, has_bias: bool) -> dict:
    """The attention kernel's compile-time constants for a launch (one compiled kernel per
    distinct dict): the lane tile (rows x padded G, at least 16 for the tensor cores;
    the merge's lanes unpadded), the padded D, the plan's tile shape, the chunk of tiles
    whose cells are gathered at once, the splits a merge step reads, the block size and
    the optional features."""
    block_g, block_r = _next_pow2(Hq // Hkv), _next_pow2(plan.rows_per_tile)
    block_d, tile_n = max(16, _next_pow2(D)), plan.config.tile_n
    block_l = block_r * block_g
    threads = 32 * plan.config.num_warps
    # not capped by the splits: one compiled kernel serves every split count (the unrolled
    # steps past the arrivals load nothing)
    merge_chunk = _prev_pow2(max(1, min(16, MERGE_ELEMENTS_PER_THREAD * threads // (block_l * block_d))))
    # whole tiles, a power of two of them (a chunk is a tl.arange over its tiles), rounded down
    chunk_tiles = _prev_pow2(min(16, plan.config.chunk_n // tile_n))
    return dict(G=Hq // Hkv, D=D, BLOCK_D=block_d, BLOCK_G=block_g, BLOCK_M=max(16, block_l), BLOCK_L=block_l,
                R=plan.rows_per_tile, BLOCK_R=block_r, P=plan.programs_per_tile, TILE_N=tile_n,
                CHUNK_TILES=chunk_tiles, SHORT_TILES=min(chunk_tiles, _prev_pow2(plan.config.short_n // tile_n)),
                BLOCK_SIZE=block_size,
                HAS_WINDOW=has_window, HAS_BIAS=has_bias, SPLIT=plan.splits > 1, MERGE_CHUNK=merge_chunk,
                DOT_PREC="ieee" if cache_dtype == torch.float32 else "tf32")


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _window_start(pos, window, HAS_WINDOW: tl.constexpr):
        if HAS_WINDOW:
            lo = tl.maximum(pos - window + 1, 0)
        else:
            lo = tl.zeros_like(pos)
        return lo

    @triton.jit
    def _split_range(lo, hi, split, splits, min_chunk, TILE_N: tl.constexpr):
        """Split ``split``'s share [start, end) of the positions [lo, hi] and how many
        splits have work there: tiles aligned to TILE_N from below lo, ``max(span /
        splits, min_chunk)`` positions rounded up to whole tiles each (the splits past the
        end get start >= end). Scalars or vectors (one range per element); an empty range
        is lo = 0, hi = -1 (no work for any split)."""
        first = (lo // TILE_N) * TILE_N
        span = hi + 1 - first
        chunk = tl.cdiv(tl.maximum(tl.cdiv(span, splits), min_chunk), TILE_N) * TILE_N
        start = first + split * chunk
        end = tl.minimum(start + chunk, hi + 1)
        return start, end, tl.maximum(tl.cdiv(span, chunk), 0)

    @triton.jit
    def _served(seq, s_row, leader, rank, p, W, i0, P: tl.constexpr, BLOCK_R: tl.constexpr):
        """Per element of ``seq`` (the sequences of rows or lanes of the tile): whether
        this program serves it: its group k (the leader's rank - 1) is program p's
        (k = p modulo P) and, of p's groups, one of those this split takes (index i0
        modulo W, see :func:`_tile_rows`); never for padding."""
        own = seq >= 0
        if BLOCK_R > 1:  # one row slot: one group at most, always this program's
            grp = tl.max(tl.where((s_row[None, :] == seq[:, None]) & leader[None, :], rank[None, :], 0), 1)
            k = grp - 1
            own = own & (grp > 0) & (k % P == p) & ((k // P) % W == i0)
        return own

    @triton.jit
    def _tile_rows(seq_ptr, pos_ptr, s_seq, s_pos, tile, p, N, num_seqs, window, split, splits, min_chunk,
                   R: tl.constexpr, BLOCK_R: tl.constexpr, P: tl.constexpr, TILE_N: tl.constexpr,
                   HAS_WINDOW: tl.constexpr):
        """The tile's rows grouped by sequence, per row slot: its sequence (-1 outside N,
        for padding and for ids past the block table), whether it leads its group (the
        group's first row in the tile), the leaders' running count (group k's leader has
        rank k + 1), its group's positions [lo, hi] (0, -1 for padding).

        And this split's share: program p's groups (k = p, p + P, ...: n of them) take
        the ``splits`` programs of (tile, p, KV head) between them, on the device: with
        W = min(splits, n), split s serves p's groups i0, i0 + W, ... (i0 = s mod W), each
        in sub-split j = s div W of S = ceil((splits - i0) / W). So several sequences'
        rows in one tile (a small decode batch) spread over the splits, and a tile of
        one sequence's rows (a verify step) splits its context ``splits`` ways. The
        arrivals: how many of the S sub-splits have work for the groups served (0: none;
        more than 1 only when one group is served, W = n)."""
        ri = tl.arange(0, BLOCK_R)
        rows = tile * R + ri
        ok = (ri < R) & (rows < N)
        s = tl.load(seq_ptr + rows.to(tl.int64) * s_seq, mask=ok, other=-1)
        s = tl.where(s < num_seqs, s, -1)
        pos = tl.load(pos_ptr + rows.to(tl.int64) * s_pos, mask=ok, other=0).to(tl.int32)
        lo = _window_start(pos, window, HAS_WINDOW)
        same = (s[:, None] == s[None, :]) & (s[:, None] >= 0)
        leader = (s >= 0) & (tl.max((same & (ri[None, :] < ri[:, None])).to(tl.int32), 1) == 0)
        rank = tl.cumsum(leader.to(tl.int32), 0)
        hi = tl.where(s >= 0, tl.max(tl.where(same, pos[None, :], -1), 1), -1)
        lo = tl.where(s >= 0, tl.min(tl.where(same, lo[None, :], 2147483647), 1), 0)
        groups = tl.max(rank, 0)
        n = tl.where(groups > p, (groups - p + P - 1) // P, 0)
        W = tl.maximum(tl.minimum(splits, n), 1)
        i0, j = split % W, split // W
        S = (splits - i0 + W - 1) // W
        _, _, count = _split_range(lo, hi, j, S, min_chunk, TILE_N)
        arrivals = tl.max(tl.where(leader & _served(s, s, leader, rank, p, W, i0, P, BLOCK_R), count, 0), 0)
        return s, leader, rank, lo, hi, arrivals, W, i0, j, S

    @triton.jit
    def _tile_lanes(seq_ptr, pos_ptr, s_seq, s_pos, tile, kvh, N, num_seqs, window, G: tl.constexpr,
                    R: tl.constexpr, BLOCK: tl.constexpr, BLOCK_G: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """The tile as BLOCK lanes (row slot lane // BLOCK_G, head lane % BLOCK_G): each
        lane's row, whether it is a real (row, head), its sequence (-1 outside N or past
        the block table), query head, position and window start."""
        li = tl.arange(0, BLOCK)
        i = li // BLOCK_G
        rows = tile * R + i
        lanes = (i < R) & (rows < N) & (li % BLOCK_G < G)
        seq = tl.load(seq_ptr + rows.to(tl.int64) * s_seq, mask=lanes, other=-1)
        seq = tl.where(seq < num_seqs, seq, -1)
        pos = tl.load(pos_ptr + rows.to(tl.int64) * s_pos, mask=lanes, other=0).to(tl.int32)
        return rows, lanes, seq, kvh * G + li % BLOCK_G, pos, _window_start(pos, window, HAS_WINDOW)

    @triton.jit
    def _chunk_cells(bt_row, c0, lo, hi, num_blocks, table_width, TILE_N: tl.constexpr,
                     CHUNK_TILES: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """The cells of the CHUNK_TILES tiles from position c0, [tile, position], through
        the block table: -1 outside [lo, hi] and where the entry is outside the table or
        the caches (those read nothing)."""
        j = c0 + tl.arange(0, CHUNK_TILES)[:, None] * TILE_N + tl.arange(0, TILE_N)[None, :]
        ok = (j >= lo) & (j <= hi) & (j // BLOCK_SIZE < table_width)
        blk = tl.load(bt_row + j // BLOCK_SIZE, mask=ok, other=-1)
        ok = ok & (blk >= 0) & (blk < num_blocks)
        return tl.where(ok, blk * BLOCK_SIZE + j % BLOCK_SIZE, -1)

    @triton.jit
    def _attend_tile(q, m, l, acc, k_head, v_head, cells, t, i, pos_g, lo_g, slope2, bias_shift, scale2, s_kc, s_vc,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, TILE_N: tl.constexpr, CHUNK_TILES: tl.constexpr,
                     HAS_WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr):
        """One step of the online softmax over the TILE_N positions from t (tile i of the
        chunk's cells): K and V loaded together, scored for the lanes whose position
        ``pos_g`` (-1: not this group) sees them, folded into (m, l, acc)."""
        cell = tl.sum(tl.where(tl.arange(0, CHUNK_TILES)[:, None] == i, cells, 0), 0).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        kv_mask = (cell >= 0)[:, None] & (d < D)[None, :]
        k = tl.load(k_head + cell[:, None] * s_kc + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_head + cell[:, None] * s_vc + d[None, :], mask=kv_mask, other=0.0)
        j = t + tl.arange(0, TILE_N)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale2
        if HAS_BIAS:
            s = s - slope2[:, None] * tl.abs(pos_g[:, None] - bias_shift - j[None, :]).to(tl.float32)
        seen = j[None, :] <= pos_g[:, None]
        if HAS_WINDOW:
            seen = seen & (j[None, :] >= lo_g[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane that saw nothing yet
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m - m_use)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        return m_new, l * alpha + tl.sum(p, 1), acc

    @triton.jit
    def _attend_share(q, m, l, acc, k_head, v_head, bt_row, start, end, lo, hi, pos_g, lo_g, slope2, bias_shift,
                      scale2, num_blocks, table_width, s_kc, s_vc, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      TILE_N: tl.constexpr, CHUNK_TILES: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      HAS_WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr):
        """A split's positions [start, end) of one group (range [lo, hi]), a chunk of
        cells at a time; the tile loop inside a chunk is the pipelined one."""
        for c0 in range(start, end, CHUNK_TILES * TILE_N):
            cells = _chunk_cells(bt_row, c0, lo, tl.minimum(hi, end - 1), num_blocks, table_width, TILE_N,
                                 CHUNK_TILES, BLOCK_SIZE)
            for i in range(0, tl.cdiv(tl.minimum(end - c0, CHUNK_TILES * TILE_N), TILE_N)):
                m, l, acc = _attend_tile(q, m, l, acc, k_head, v_head, cells, c0 + i * TILE_N, i, pos_g, lo_g, slope2,
                                         bias_shift, scale2, s_kc, s_vc, D, BLOCK_D, TILE_N, CHUNK_TILES, HAS_WINDOW,
                                         HAS_BIAS, DOT_PREC)
        return m, l, acc

    @triton.jit
    def _serve_groups(q_ptr, k_ptr, v_ptr, bt_ptr, slope_ptr, rows, heads, lanes, seq, pos, lo, s_row, leader, rank,
                      g_lo, g_hi, p, kvh, W, i0, j, S, min_chunk, num_blocks, table_width, scale2, bias_shift,
                      s_qn, s_qh, s_kc, s_kh, s_vc, s_vh, s_bt,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, P: tl.constexpr,
                      TILE_N: tl.constexpr, CHUNK_TILES: tl.constexpr, SHORT_TILES: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_BIAS: tl.constexpr,
                      DOT_PREC: tl.constexpr):
        """The groups this split serves (:func:`_tile_rows`: p + P (i0 + W t) for t = 0, 1,
        ...), one after the other, into one set of lanes: sub-split j of S of each
        group's range, read once for all its lanes (and folded into those lanes only); a
        share of at most SHORT_TILES tiles in one chunk of that size, a longer one in
        chunks of CHUNK_TILES."""
        d = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * s_qn + heads[:, None] * s_qh + d[None, :],
                    mask=(lanes & (seq >= 0))[:, None] & (d < D)[None, :], other=0.0).to(k_ptr.dtype.element_ty)
        slope2 = tl.zeros([BLOCK_M], tl.float32)
        if HAS_BIAS:
            slope2 = tl.load(slope_ptr + heads, mask=lanes, other=0.0).to(tl.float32) * 1.4426950408889634
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_head, v_head = k_ptr + kvh.to(tl.int64) * s_kh, v_ptr + kvh.to(tl.int64) * s_vh
        for k in range(p + P * i0, tl.max(rank, 0), P * W):
            first = leader & (rank == k + 1)
            seq_k = tl.max(tl.where(first, s_row, -1), 0)  # group k's sequence and range
            lo_k, hi_k = tl.max(tl.where(first, g_lo, 0), 0), tl.max(tl.where(first, g_hi, -1), 0)
            start, end, _ = _split_range(lo_k, hi_k, j, S, min_chunk, TILE_N)
            pos_g = tl.where(lanes & (seq == seq_k), pos, -1)
            bt_row = bt_ptr + seq_k.to(tl.int64) * s_bt
            if end - start <= SHORT_TILES * TILE_N:
                m_k, l_k, acc_k = _attend_share(q, m, l, acc, k_head, v_head, bt_row, start, end, lo_k, hi_k, pos_g,
                                                lo, slope2, bias_shift, scale2, num_blocks, table_width, s_kc, s_vc,
                                                D, BLOCK_D, TILE_N, SHORT_TILES, BLOCK_SIZE, HAS_WINDOW, HAS_BIAS,
                                                DOT_PREC)
            else:
                m_k, l_k, acc_k = _attend_share(q, m, l, acc, k_head, v_head, bt_row, start, end, lo_k, hi_k, pos_g,
                                                lo, slope2, bias_shift, scale2, num_blocks, table_width, s_kc, s_vc,
                                                D, BLOCK_D, TILE_N, CHUNK_TILES, BLOCK_SIZE, HAS_WINDOW, HAS_BIAS,
                                                DOT_PREC)
            m, l, acc = _group_only(pos_g >= 0, m_k, l_k, acc_k, m, l, acc)
        return m, l, acc

    @triton.jit
    def _group_only(g, m_k, l_k, acc_k, m, l, acc):
        """(m, l, acc) updated by one group's step on the lanes ``g`` of that group only: the
        others' probability 0 times a non-finite V of this group (a NaN in its cells) is
        NaN, and their rows never see this group's cells."""
        return tl.where(g, m_k, m), tl.where(g, l_k, l), tl.where(g[:, None], acc_k, acc)

    @triton.jit
    def _store_rows(out_ptr, o, rows, heads, mask, s_on, s_oh, D: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[row, head] = o for the lanes in ``mask``."""
        d = tl.arange(0, BLOCK_D)
        ptr = out_ptr + rows.to(tl.int64)[:, None] * s_on + heads[:, None] * s_oh + d[None, :]
        tl.store(ptr, o.to(out_ptr.dtype.element_ty), mask=mask[:, None] & (d < D)[None, :])

    @triton.jit
    def _store_split(pm_ptr, pacc_ptr, m, l, acc, rows, heads, mine, split, splits, Hq,
                     D: tl.constexpr, BLOCK_D: tl.constexpr):
        """Split ``split``'s log-sum-exp (log2 units; -inf where it saw nothing) and
        normalised output (0 there) of each lane into the scratch ``[N, Hq, splits, (D)]``."""
        d = tl.arange(0, BLOCK_D)
        at = (rows.to(tl.int64) * Hq + heads) * splits + split
        has = l > 0
        tl.store(pm_ptr + at, tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf")), mask=mine)
        o = acc / tl.where(has, l, 1.0)[:, None]
        tl.store(pacc_ptr + at[:, None] * D + d[None, :], o.to(pacc_ptr.dtype.element_ty),
                 mask=mine[:, None] & (d < D)[None, :])

    @triton.jit
    def _merge_splits(out_ptr, pm_ptr, pacc_ptr, rows, heads, own, arrivals, splits, Hq, s_on, s_oh,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, MERGE_CHUNK: tl.constexpr):
        """out of the lanes ``own`` from their splits 0 .. arrivals - 1 (each stored both):
        every split's output weighted by exp2(lse - the largest lse), summed in split
        order, divided by the weights' sum. MERGE_CHUNK splits per step, unrolled with
        elementwise math only (no reduction, no barrier), so their loads are in flight
        together. The loads bypass L1 (.cg): other SMs wrote the partials."""
        d = tl.arange(0, BLOCK_D)
        at0 = (rows.to(tl.int64) * Hq + heads) * splits
        top = tl.full([BLOCK_L], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_L], tl.float32)
        o = tl.zeros([BLOCK_L, BLOCK_D], tl.float32)
        for c in range(0, arrivals, MERGE_CHUNK):
            for u in tl.static_range(MERGE_CHUNK):
                ok = own & (tl.zeros([BLOCK_L], tl.int32) + c + u < arrivals)  # (a vector: see _write_cells_kernel)
                lse = tl.load(pm_ptr + at0 + c + u, mask=ok, other=float("-inf"), cache_modifier=".cg")
                part = tl.load(pacc_ptr + (at0 + c + u)[:, None] * D + d[None, :], mask=ok[:, None] & (d < D)[None, :],
                               other=0.0, cache_modifier=".cg")
                new = tl.maximum(top, lse)
                use = tl.where(new == float("-inf"), 0.0, new)
                w, rescale = tl.math.exp2(lse - use), tl.math.exp2(top - use)
                o = o * rescale[:, None] + w[:, None] * part.to(tl.float32)
                total = total * rescale + w
                top = new
        _store_rows(out_ptr, o / tl.where(total > 0, total, 1.0)[:, None], rows, heads, own, s_on, s_oh, D, BLOCK_D)

    @triton.jit
    def _arrive_and_merge(out_ptr, pm_ptr, pacc_ptr, cnt_ptr, seq_ptr, pos_ptr, s_seq, s_pos, s_row, leader, rank,
                          tile, p, kvh, W, i0, arrivals, N, Hq, splits, num_seqs, s_on, s_oh,
                          G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
                          BLOCK_G: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, P: tl.constexpr,
                          MERGE_CHUNK: tl.constexpr):
        """After this sub-split's partials are stored: count it in the counter of (tile,
        program, KV head, the one group served: i0); the last of the ``arrivals`` resets
        the counter to 0 and merges the group's lanes (the barrier first: every thread's
        stores precede the release)."""
        tl.debug_barrier()
        counter = cnt_ptr + (tl.program_id(0) * tl.num_programs(1) + kvh) * BLOCK_R + i0
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == arrivals - 1:
            tl.atomic_xchg(counter, 0)
            tl.debug_barrier()
            rows, lanes, seq, heads, _, _ = _tile_lanes(seq_ptr, pos_ptr, s_seq, s_pos, tile, kvh, N, num_seqs, 0, G,
                                                        R, BLOCK_L, BLOCK_G, False)
            own = lanes & _served(seq, s_row, leader, rank, p, W, i0, P, BLOCK_R)
            _merge_splits(out_ptr, pm_ptr, pacc_ptr, rows, heads, own, arrivals, splits, Hq, s_on, s_oh, D, BLOCK_D,
                          BLOCK_L, MERGE_CHUNK)

    @triton.jit
    def _store_padding(out_ptr, seq_ptr, pos_ptr, s_seq, s_pos, tile, kvh, N, num_seqs, s_on, s_oh, G: tl.constexpr,
                       D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_G: tl.constexpr,
                       R: tl.constexpr):
        """Zeros for the tile's padding rows (and rows of sequence ids past the table)."""
        rows, lanes, seq, heads, _, _ = _tile_lanes(seq_ptr, pos_ptr, s_seq, s_pos, tile, kvh, N, num_seqs, 0, G, R,
                                                    BLOCK_L, BLOCK_G, False)
        _store_rows(out_ptr, tl.zeros([BLOCK_L, BLOCK_D], tl.float32), rows, heads, lanes & (seq < 0), s_on, s_oh,
                    D, BLOCK_D)

    @triton.jit
    def _cell_attention_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, seq_ptr, pos_ptr, slope_ptr, out_ptr, pm_ptr, pacc_ptr, cnt_ptr,
        N, Hq, splits, min_chunk, num_seqs, num_blocks, table_width, scale2, bias_shift, window,
        s_qn, s_qh, s_kc, s_kh, s_vc, s_vh, s_bt, s_seq, s_pos, s_on, s_oh,
        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_L: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr, P: tl.constexpr, TILE_N: tl.constexpr,
        CHUNK_TILES: tl.constexpr, SHORT_TILES: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, MERGE_CHUNK: tl.constexpr, DOT_PREC: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        tile, p = tl.program_id(0) // P, tl.program_id(0) % P
        kvh, split = tl.program_id(1), tl.program_id(2)
        s_row, leader, rank, g_lo, g_hi, arrivals, W, i0, j, S = _tile_rows(seq_ptr, pos_ptr, s_seq, s_pos, tile, p, N,
                                                                            num_seqs, window, split, splits, min_chunk,
                                                                            R, BLOCK_R, P, TILE_N, HAS_WINDOW)
        if PDL:  # the rows are older than the launch before this one; q, K/V, the table and out may not be
            if (j < arrivals) | ((p == 0) & (split == 0)):
                tl.extra.cuda.gdc_wait()
        if (p == 0) & (split == 0):
            _store_padding(out_ptr, seq_ptr, pos_ptr, s_seq, s_pos, tile, kvh, N, num_seqs, s_on, s_oh, G, D, BLOCK_D,
                           BLOCK_L, BLOCK_G, R)
        if j < arrivals:  # a program without work reads nothing more
            rows, lanes, seq, heads, pos, lo = _tile_lanes(seq_ptr, pos_ptr, s_seq, s_pos, tile, kvh, N, num_seqs,
                                                           window, G, R, BLOCK_M, BLOCK_G, HAS_WINDOW)
            m, l, acc = _serve_groups(q_ptr, k_ptr, v_ptr, bt_ptr, slope_ptr, rows, heads, lanes, seq, pos, lo, s_row,
                                      leader, rank, g_lo, g_hi, p, kvh, W, i0, j, S, min_chunk, num_blocks,
                                      table_width, scale2, bias_shift, s_qn, s_qh, s_kc, s_kh, s_vc, s_vh, s_bt, D,
                                      BLOCK_D, BLOCK_M, P, TILE_N, CHUNK_TILES, SHORT_TILES, BLOCK_SIZE, HAS_WINDOW,
                                      HAS_BIAS, DOT_PREC)
            mine = lanes & _served(seq, s_row, leader, rank, p, W, i0, P, BLOCK_R)
            o = acc / tl.where(l > 0, l, 1.0)[:, None]
            if SPLIT:
                if arrivals == 1:  # the only split with work: no scratch, no counter
                    _store_rows(out_ptr, o, rows, heads, mine, s_on, s_oh, D, BLOCK_D)
                else:
                    _store_split(pm_ptr, pacc_ptr, m, l, acc, rows, heads, mine, j, splits, Hq, D, BLOCK_D)
                    _arrive_and_merge(out_ptr, pm_ptr, pacc_ptr, cnt_ptr, seq_ptr, pos_ptr, s_seq, s_pos, s_row,
                                      leader, rank, tile, p, kvh, W, i0, arrivals, N, Hq, splits, num_seqs, s_on,
                                      s_oh, G, D, BLOCK_D, BLOCK_L, BLOCK_G, R, BLOCK_R, P, MERGE_CHUNK)
            else:
                _store_rows(out_ptr, o, rows, heads, mine, s_on, s_oh, D, BLOCK_D)

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
    _cell_attention_kernel = _write_cells_kernel = None


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
    if not isinstance(t, Tensor):
        return False  # the reference's checks name it
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
    if k_cache.shape[0] > MAX_CELLS:
        raise InputError(expected("k_cache", f"at most {MAX_CELLS} cells", k_cache.shape[0]))


def _is_int(v) -> bool:
    """A plain int (a bool is not one here: ``window=True`` is a mistake, not 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _check_attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, block_size, window, slopes,
                          out, splits, counters=None, dependent=False, scale=1.0, bias_shift=0) -> None:
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
    if not _is_int(block_size) or block_size < 1:
        raise InputError(expected("block_size", "an int >= 1", repr(block_size)))
    if k_cache.shape[0] % block_size:  # the kernel reads whole blocks: a partial last one would be skipped
        raise InputError(expected("k_cache", f"whole blocks of block_size {block_size} cells",
                                  f"{k_cache.shape[0]} cells"))
    if window is not None and (not _is_int(window) or not 1 <= window <= INT32_MAX):
        raise InputError(expected("window", f"None or an int in [1, {INT32_MAX}]", repr(window)))
    if not _is_int(bias_shift) or not -INT32_MAX <= bias_shift <= INT32_MAX:  # a shift of positions
        raise InputError(expected("bias_shift", f"an int in [-{INT32_MAX}, {INT32_MAX}]", repr(bias_shift)))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise InputError(expected("scale", "a finite float", repr(scale)))
    if slopes is not None:
        _check_tensor("slopes", slopes, 1, (torch.float32,), q.device)
        if slopes.shape[0] != Hq:
            raise InputError(expected("slopes", f"{Hq} entries (one per query head)", tuple(slopes.shape)))
    if out is not None and (not isinstance(out, Tensor) or out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device or out.stride(2) != 1):
        raise InputError(expected("out", f"None or a tensor like q ({_desc(q)}, last dimension contiguous)",
                                  _desc(out)))
    if splits is not None and (not _is_int(splits) or splits < 1):
        raise InputError(expected("splits", "None or an int >= 1", repr(splits)))
    if not isinstance(dependent, bool):
        raise InputError(expected("dependent", "a bool", repr(dependent)))
    if counters is not None:
        _check_tensor("counters", counters, 1, (torch.int32,), q.device)
        if not counters.is_contiguous():
            raise InputError(expected("counters", "a contiguous int32 tensor", f"strides {counters.stride()}"))


def _check_plan(plan) -> None:
    """A plan given explicitly (tests, tuning) must describe a kernel that can exist."""
    c = getattr(plan, "config", None)
    ints = ()
    if isinstance(plan, AttentionPlan) and isinstance(c, AttentionConfig):
        ints = (plan.rows_per_tile, plan.programs_per_tile, plan.splits, c.tile_n, c.num_warps, c.num_stages,
                c.min_chunk, c.chunk_n, c.short_n)
    if not ints or not all(_is_int(i) for i in ints) or plan.rows_per_tile < 1 \
            or not 1 <= plan.programs_per_tile <= plan.rows_per_tile or plan.splits < 1 or c.tile_n < 16 \
            or c.tile_n & (c.tile_n - 1) or c.num_warps < 1 or c.num_stages < 1 or c.chunk_n < 1 or c.short_n < 1:
        raise InputError(expected("plan", "None or an AttentionPlan of ints with 1 <= programs <= rows, splits "
                                  ">= 1, a power-of-two tile_n >= 16, warps, stages, chunk_n and short_n >= 1", plan))


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


DEPENDENT_LAUNCH = True  # False: later launches and binds of these kernels use no PDL (captured graphs keep theirs)


def pdl_launch(device: torch.device) -> bool:
    """Whether a launch on ``device`` may use programmatic dependent launch (PDL): compiled
    kernels on Hopper or later, a Triton with ``gdc_wait``, and :data:`DEPENDENT_LAUNCH`."""
    return DEPENDENT_LAUNCH and device.type == "cuda" and kernel_mode() == "compiled" \
        and hasattr(tl.extra.cuda, "gdc_wait") and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_options(device: torch.device, dependent: bool = True) -> dict:
    """A launch's PDL options: the kernel's ``PDL`` constexpr (always named:
    :class:`BoundLaunch`'s direct path needs every constexpr) and Triton's ``launch_pdl``
    only where the launch is a dependent one: a Triton without that option (torch 2.6's
    Triton 3.2, in pyproject's range) refuses the keyword even when False ("Keyword
    argument launch_pdl was specified but unrecognised")."""
    pdl = bool(dependent) and pdl_launch(device)
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}


def _launch_options(config: AttentionConfig, device: torch.device, dependent: bool = False) -> dict:
    """The launch's options on CUDA: warps, stages and :func:`pdl_options`."""
    if device.type != "cuda":
        return {}
    return {"num_warps": config.num_warps, "num_stages": config.num_stages, **pdl_options(device, dependent)}


def new_attention_counters(device, entries: int = COUNTERS) -> Tensor:
    """A zeroed arrival-counter buffer for :func:`cell_attention_triton`'s ``counters``:
    ``entries`` int32 counters, enough for launches of up to that many (tile, program,
    KV head, row slot of a tile: the power of two >= rows per tile) counters. The kernel
    leaves it zero after every launch. Keep it alive (and
    at its address) as long as any graph that captured a launch with it; launches that
    may run at the same time (other streams) each need their own. InputError for a device
    this machine lacks (:func:`cudagraph_rt.checks.resolve_device`) or ``entries`` < 1."""
    return torch.zeros(as_int("entries", entries, 1), dtype=torch.int32, device=resolve_device(device))


_COUNTER_BUFFERS: dict[torch.device, list[Tensor]] = {}


def attention_counters(device, need: int = 1) -> Tensor:
    """This process's shared counter buffer of ``device`` with at least ``need`` entries
    (the launches that pass no ``counters``): allocated zeroed on first use, replaced by
    a bigger one when a launch needs more. Old buffers stay alive (graphs captured with
    them keep replaying them). Raises CaptureError when it would have to allocate while
    the current stream captures (a buffer allocated in a capture belongs to the graph):
    make one launch of the widest grid before capturing, or pass ``counters``. InputError
    for a device this machine lacks."""
    bufs = _COUNTER_BUFFERS.get(device) if isinstance(device, torch.device) else None
    dev = device
    if bufs is None:  # a device not seen before (a launch's are): checked once, then a key
        dev = resolve_device(device)
        bufs = _COUNTER_BUFFERS.setdefault(dev, [])
    if bufs and bufs[-1].numel() >= need:
        return bufs[-1]
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise CaptureError(f"cell_attention: the split counters of {dev} ({need} entries) are allocated outside "
                           "graph capture: launch once before capturing, or pass counters=")
    bufs.append(new_attention_counters(dev, max(COUNTERS, _next_pow2(need))))
    return bufs[-1]


def _scratch(q: Tensor, out: Tensor, plan: AttentionPlan, counters: Tensor | None, need: int):
    """The split partials (log-sum-exp fp32, outputs in out's dtype) and the counters; for
    one split, dummies the kernel never touches."""
    if plan.splits == 1:
        return out, out, out
    if counters is None:
        counters = attention_counters(q.device, need)
    elif counters.numel() < need:
        raise InputError(expected("counters", f"at least {need} entries (tiles x programs x KV heads x row slots)",
                                  counters.numel()))
    N, Hq, D = q.shape
    pm = torch.empty((N, Hq, plan.splits), dtype=torch.float32, device=q.device)
    pacc = torch.empty((N, Hq, plan.splits, D), dtype=out.dtype, device=q.device)
    return pm, pacc, counters


def _attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, slopes, out, scratch, plan, block_size,
                    scale, bias_shift, window) -> tuple:
    """The attention kernel's runtime arguments, in its signature's order."""
    N, Hq, _ = q.shape
    pm, pacc, cnt = scratch
    return (q, k_cache, v_cache, block_table, seq_ids, positions, q if slopes is None else slopes, out, pm, pacc, cnt,
            N, Hq, plan.splits, max(1, plan.config.min_chunk), block_table.shape[0], k_cache.shape[0] // block_size,
            block_table.shape[1], float(scale) * LOG2E, int(bias_shift), int(window or 0), q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), block_table.stride(0),
            seq_ids.stride(0), positions.stride(0), out.stride(0), out.stride(1))


def _write_args(k, v, k_cache, v_cache, cells) -> tuple:
    """The K/V write kernel's runtime arguments, in its signature's order."""
    return (k, v, k_cache, v_cache, cells, k_cache.shape[0], cells.stride(0), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))


def _write_meta(Hkv: int, D: int) -> dict:
    return dict(HKV=Hkv, D=D, BLOCK_H=_next_pow2(Hkv), BLOCK_D=_next_pow2(D))


def cell_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_ids: Tensor,
                          positions: Tensor, *, block_size: int, scale: float, window: int | None = None,
                          slopes: Tensor | None = None, bias_shift: int = 0, out: Tensor | None = None,
                          splits: int | None = None, plan: AttentionPlan | None = None,
                          counters: Tensor | None = None, dependent: bool = False) -> Tensor:
    """The contract above on the Triton kernel, one launch (CUDA tensors; CPU tensors
    under ``TRITON_INTERPRET=1``). ``plan`` overrides :func:`plan_attention` (tests,
    tuning). ``counters``: the splits' arrival counters (see
    :func:`new_attention_counters`; None: this process's buffer of the device, see
    :func:`attention_counters`).

    ``dependent=True`` (where :func:`pdl_launch` allows it): a programmatic dependent
    launch; it starts while the launch before it is still finishing and waits for it
    (``griddepcontrol.wait``) before it reads q, the caches, the block table or the scratch
    or writes anything. Before the wait it reads ``seq_ids`` and ``positions``: the launch
    just before must not write those and must be ordered after what did (an ordinary
    launch, or a dependent one that waits before it lets this one start, as the K/V writes
    of this module and of :mod:`.rotary_cells`, which :meth:`KVPool.attend` launches just
    before it). False: an ordinary launch, after everything before it.

    Asynchronous on the current stream and capturable: no host read of a device value;
    the split scratch comes from ``torch.empty`` (the graph's pool during capture). The
    first launch of each specialisation compiles: make it outside capture. Returns ``out``
    (or a new tensor), valid once the stream reaches it. Raises InputError before
    launching anything when an argument breaks the contract. Device values outside the
    contract give undefined numbers but never an access out of bounds: a sequence id past
    the block table reads nothing (its row comes out 0), and positions past the table's
    width or blocks outside the caches read nothing."""
    _check_attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, block_size, window, slopes,
                          out, splits, counters, dependent, scale, bias_shift)
    if kernel_mode() == "unavailable":
        raise RuntimeError("cell_attention_triton: triton is not installed; use cell_attention_reference")
    N, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    plan = plan_attention(N, Hq, Hkv, D, splits=splits) if plan is None else plan
    _check_plan(plan)
    grid = (-(-N // plan.rows_per_tile) * plan.programs_per_tile, Hkv, plan.splits)
    with _device_scope(q):
        out = torch.empty_like(q) if out is None else out
        if N == 0:
            return out
        pm, pacc, cnt = _scratch(q, out, plan, counters, grid[0] * grid[1] * _next_pow2(plan.rows_per_tile))
        meta = kernel_constants(plan, Hq, Hkv, D, block_size, k_cache.dtype, window is not None, slopes is not None)
        _cell_attention_kernel[grid](
            *_attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, slopes, out, (pm, pacc, cnt), plan,
                             block_size, scale, bias_shift, window),
            **meta, **_launch_options(plan.config, q.device, dependent))
    return out


def write_cells_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cells: Tensor) -> None:
    """``k_cache[cells] = k`` and ``v_cache[cells] = v`` in one launch (CUDA tensors; CPU
    tensors under ``TRITON_INTERPRET=1``). Asynchronous and capturable (cells are read on
    the device); a cell outside the caches writes nothing; a cell given by several rows
    (the scratch cell of padding rows) gets each element from one of them, which one
    unspecified. Raises InputError before writing anything when an argument breaks the
    contract."""
    _check_write_args(k, v, k_cache, v_cache, cells)
    if kernel_mode() == "unavailable":
        raise RuntimeError("write_cells_triton: triton is not installed; use write_cells_reference")
    N, Hkv, D = k.shape
    if N == 0:
        return
    with _device_scope(k):
        _write_cells_kernel[(N,)](*_write_args(k, v, k_cache, v_cache, cells), **_write_meta(Hkv, D))


class BoundLaunch:
    """One Triton kernel launch with every argument fixed, repeated by ``__call__`` on the
    current stream. The first call launches through Triton's ``kernel[grid](...)``
    (compiling if needed, outside any capture) and keeps the compiled kernel; later calls
    go straight to its launcher with the arguments in signature order, skipping the
    argument binding and the cache lookup (about 30 us of host time a launch with this
    kernel's 38 arguments). Where that is unavailable (the interpreter, a Triton whose
    compiled kernel lacks the launcher) every call takes the first call's path.

    Lifetime: the tensors it holds stay alive with it; their contents may change between
    calls (a piece rewrites them), never their storage."""

    __slots__ = ("_kernel", "_grid", "_args", "_meta", "_device", "_fast", "_all")

    def __init__(self, kernel, grid: tuple, args: tuple, meta: dict, device: torch.device):
        self._kernel, self._grid, self._args, self._meta, self._device = kernel, grid, args, meta, device
        self._fast, self._all = None, ()

    @property
    def direct(self) -> bool:
        """Whether calls now go straight to the compiled kernel's launcher (after the first
        call, on CUDA, with a Triton that offers it)."""
        return self._fast is not None

    def __call__(self) -> None:
        fast = self._fast
        if fast is not None and torch.cuda.current_device() == self._device.index:
            fast(*self._all)
            return
        with torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext():
            compiled = self._kernel[self._grid](*self._args, **self._meta)
        if fast is None and self._device.type == "cuda":
            self._fast, self._all = _fast_launcher(self._kernel, compiled, self._grid, self._args, self._meta)


def _fast_launcher(kernel, compiled, grid: tuple, args: tuple, meta: dict):
    """``(compiled[grid], every argument in the kernel's signature order)``, or ``(None, ())``
    when this Triton offers no such launcher (then each launch binds its arguments)."""
    names = getattr(kernel, "arg_names", None)
    if compiled is None or names is None or not hasattr(type(compiled), "__getitem__"):
        return None, ()
    values = dict(zip(names, args))
    for name in names[len(args):]:
        if name not in meta:
            return None, ()
        values[name] = meta[name]
    try:
        return compiled[tuple(grid) + (1,) * (3 - len(grid))], tuple(values[n] for n in names)
    except Exception:  # noqa: BLE001 - an older or newer launcher API: keep the binding path
        return None, ()


def bind_cell_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_ids: Tensor,
                        positions: Tensor, *, block_size: int, scale: float, out: Tensor, window: int | None = None,
                        slopes: Tensor | None = None, bias_shift: int = 0, plan: AttentionPlan | None = None,
                        counters: Tensor | None = None, scratch=None, dependent: bool = False):
    """A zero-argument callable that does ``cell_attention(...)`` on these very tensors
    (``out`` required: each call writes it and returns it). Validation, the plan and the
    split scratch are done once, here; each call is then one launch (:class:`BoundLaunch`)
    with nothing else on the host: a marked eager call's replay between two graph pieces.
    Where :func:`cell_attention` would run the reference, each call runs the reference.

    ``scratch`` (optional): ``scratch(lse_elements, out_elements, dtype)`` returns two flat
    contiguous buffers (float32 and ``dtype``, on q's device) of at least that many
    elements for the split partials, shared by bound launches that never run at the same
    time (one model's layers: :meth:`KVPool.bind_attend`); None: this launch's own.
    Buffers that cannot hold them are an InputError, here.

    ``dependent``: as :func:`cell_attention_triton`'s (the launch before each call must
    not write ``seq_ids`` or ``positions`` and must be ordered after what did). Raises
    InputError here, before anything runs, when an argument breaks the contract. Lifetime:
    as long as its tensors; their contents may change between calls (read on the device at
    each call), never their storage."""
    if out is None:
        raise InputError(expected("out", "a tensor like q (a bound launch writes in place)", "None"))
    _check_attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, block_size, window, slopes, out,
                          None, counters, dependent, scale, bias_shift)
    N, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    plan = plan_attention(N, Hq, Hkv, D) if plan is None else plan
    _check_plan(plan)  # where the reference runs too: the argument is checked either way
    if not _runs_kernel(q):
        kw = dict(block_size=block_size, scale=scale, window=window, slopes=slopes, bias_shift=bias_shift, out=out)
        return lambda: cell_attention_reference(q, k_cache, v_cache, block_table, seq_ids, positions, **kw)
    if N == 0:
        return lambda: out
    grid = (-(-N // plan.rows_per_tile) * plan.programs_per_tile, Hkv, plan.splits)
    with _device_scope(q):
        pm, pacc, cnt = _scratch(q, out, plan, counters, grid[0] * grid[1] * _next_pow2(plan.rows_per_tile))
        if scratch is not None and plan.splits > 1:  # the same layout in shared memory
            pm, pacc = _in_shared_scratch(scratch, pm, pacc)
    meta = kernel_constants(plan, Hq, Hkv, D, block_size, k_cache.dtype, window is not None, slopes is not None)
    args = _attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, slopes, out, (pm, pacc, cnt), plan,
                           block_size, scale, bias_shift, window)
    launch = BoundLaunch(_cell_attention_kernel, grid, args,
                         {**meta, **_launch_options(plan.config, q.device, dependent)}, q.device)

    def attend() -> Tensor:
        launch()
        return out
    attend.launch = launch  # type: ignore[attr-defined]
    return attend


def _in_shared_scratch(scratch, pm: Tensor, pacc: Tensor) -> tuple[Tensor, Tensor]:
    """``pm`` and ``pacc``'s layouts at the start of the buffers ``scratch`` gives (the
    kernel indexes them as contiguous), or InputError when they cannot hold them."""
    got = scratch(pm.numel(), pacc.numel(), pacc.dtype)
    want = (f"two flat contiguous tensors on {pm.device} of at least {pm.numel()} float32 and {pacc.numel()} "
            f"{str(pacc.dtype).replace('torch.', '')} elements")
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(
            isinstance(b, Tensor) and b.dim() == 1 and b.is_contiguous() and b.device == pm.device
            and b.dtype == a.dtype and b.numel() >= a.numel() for a, b in zip((pm, pacc), got)):
        what = ", ".join(_desc(b) + ("" if not isinstance(b, Tensor) or b.is_contiguous()
                                     else f" strides {b.stride()}")
                         for b in (got if isinstance(got, (tuple, list)) else (got,)))
        raise InputError(expected("scratch", want, what))
    lse, part = got
    return lse[:pm.numel()].view(pm.shape), part[:pacc.numel()].view(pacc.shape)


def bind_write_cells(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cells: Tensor):
    """A zero-argument callable that does ``write_cells(k, v, k_cache, v_cache, cells)`` on
    these very tensors: checked once, here (InputError before anything is written), then
    one launch a call (:class:`BoundLaunch`), or the reference where :func:`write_cells`
    would run it. Lifetime as :func:`bind_cell_attention`."""
    _check_write_args(k, v, k_cache, v_cache, cells)
    if not _runs_kernel(k):
        return lambda: write_cells_reference(k, v, k_cache, v_cache, cells)
    N, Hkv, D = k.shape
    if N == 0:
        return lambda: None
    return BoundLaunch(_write_cells_kernel, (N,), _write_args(k, v, k_cache, v_cache, cells), _write_meta(Hkv, D),
                       k.device)


# --------------------------------------------------------------------------------------
# References (plain torch, any device) and the dispatching entry points
# --------------------------------------------------------------------------------------
def write_cells_reference(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cells: Tensor) -> None:
    """``k_cache[cells] = k``, ``v_cache[cells] = v`` (in the caches' dtype)."""
    k_cache.index_copy_(0, cells.long(), k.to(k_cache.dtype))  # (index_copy_ takes int64 indices only)
    v_cache.index_copy_(0, cells.long(), v.to(v_cache.dtype))


def cell_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_ids: Tensor,
                             positions: Tensor, *, block_size: int, scale: float, window: int | None = None,
                             slopes: Tensor | None = None, bias_shift: int = 0, out: Tensor | None = None,
                             splits: int | None = None, counters: Tensor | None = None,
                             dependent: bool = False) -> Tensor:
    """The contract above in plain torch, on any device. No host read of a device value
    and no data-dependent shape (it runs inside captured step functions and under the
    hazard finder): every row gathers the static bound of ``MB * block_size`` positions
    and masks what it may not see. ``splits``, ``counters`` and ``dependent`` are checked
    as the kernel's, and ignored. Raises InputError before anything is read or written
    when an argument breaks the contract (the kernel's checks: metadata only)."""
    _check_attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, block_size, window, slopes,
                          out, splits, counters, dependent, scale, bias_shift)
    scale = float(scale)  # an int scale past torch's scalar range multiplies as its float
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
    # A row that sees nothing (padding) is 0; a NaN or inf the row sees stays in its output,
    # one it does not see (probability 0) is no part of it, V's included: 0 x NaN is NaN.
    p = torch.where(visible.any(-1)[:, None, None], torch.softmax(s, -1), 0.0)
    v = torch.where(visible[:, :, None, None], v, 0)
    o = torch.einsum("nhs,nshd->nhd", p.to(v.dtype).float(), v.float()).to(q.dtype)
    if out is None:
        return o
    out.copy_(o)
    return out


def cell_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_ids: Tensor,
                   positions: Tensor, *, block_size: int, scale: float, window: int | None = None,
                   slopes: Tensor | None = None, bias_shift: int = 0, out: Tensor | None = None,
                   splits: int | None = None, counters: Tensor | None = None, dependent: bool = False) -> Tensor:
    """The contract above: the Triton kernel on CUDA tensors, the torch reference
    elsewhere (or the kernel in the interpreter with ``CGRT_CPU_KERNELS=1`` and
    ``TRITON_INTERPRET=1``). Same lifetimes and errors as the implementation chosen;
    ``dependent`` as :func:`cell_attention_triton`'s (the reference ignores it)."""
    impl = cell_attention_triton if _runs_kernel(q) else cell_attention_reference
    return impl(q, k_cache, v_cache, block_table, seq_ids, positions, block_size=block_size, scale=scale,
                window=window, slopes=slopes, bias_shift=bias_shift, out=out, splits=splits, counters=counters,
                dependent=dependent)


def write_cells(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cells: Tensor) -> None:
    """``k_cache[cells] = k``, ``v_cache[cells] = v``: one Triton launch on CUDA tensors,
    the torch reference elsewhere (same switch as :func:`cell_attention`). Checks its
    arguments first either way (InputError, nothing written)."""
    if _runs_kernel(k):
        write_cells_triton(k, v, k_cache, v_cache, cells)
        return
    _check_write_args(k, v, k_cache, v_cache, cells)
    write_cells_reference(k, v, k_cache, v_cache, cells)
