"""The cell attention's launch plans: a pure function of the step's width and the shapes,
never of device values nor of a call-time autotune (an autotune during capture would time
padding rows). A small measured table (:data:`TUNED_CONFIGS`, the H200 runs behind it in
BENCHMARKS.md, "The cell attention's measured table") and a rule for every other shape.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common import next_pow2, prev_pow2

__all__ = ["AttentionConfig", "AttentionPlan", "MAX_SPLITS", "MAX_TILE_LANES", "MERGE_LANE_SPLITS", "TUNED_CONFIGS",
           "kernel_constants", "plan_attention"]


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
# with the merge, which needs more registers): Llama-3.2-1B's shapes, bf16, at width 1 and
# at width 8 (a verify step, 32 lanes). Other shapes take the rule in _default_config.
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
    block_g = next_pow2(Hq // Hkv)
    rows = 1
    if 2 <= N <= SHARED_TILES_UP_TO:
        rows = max(1, min(next_pow2(N), MAX_ROWS_PER_TILE, max(1, MAX_TILE_LANES // block_g)))
    if splits is None:
        busy = max(1, -(-N // rows) * Hkv)
        cap = max(1, min(MAX_SPLITS, MERGE_LANE_SPLITS // (rows * block_g)))
        splits = max(1, min(cap, next_pow2(-(-TARGET_PROGRAMS // busy))))
    block_d = max(16, next_pow2(D))
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
    block_g, block_r = next_pow2(Hq // Hkv), next_pow2(plan.rows_per_tile)
    block_d, tile_n = max(16, next_pow2(D)), plan.config.tile_n
    block_l = block_r * block_g
    threads = 32 * plan.config.num_warps
    # not capped by the splits: one compiled kernel serves every split count (the unrolled
    # steps past the arrivals load nothing)
    merge_chunk = prev_pow2(max(1, min(16, MERGE_ELEMENTS_PER_THREAD * threads // (block_l * block_d))))
    # whole tiles, a power of two of them (a chunk is a tl.arange over its tiles), rounded down
    chunk_tiles = prev_pow2(min(16, plan.config.chunk_n // tile_n))
    return dict(G=Hq // Hkv, D=D, BLOCK_D=block_d, BLOCK_G=block_g, BLOCK_M=max(16, block_l), BLOCK_L=block_l,
                R=plan.rows_per_tile, BLOCK_R=block_r, P=plan.programs_per_tile, TILE_N=tile_n,
                CHUNK_TILES=chunk_tiles, SHORT_TILES=min(chunk_tiles, prev_pow2(plan.config.short_n // tile_n)),
                BLOCK_SIZE=block_size,
                HAS_WINDOW=has_window, HAS_BIAS=has_bias, SPLIT=plan.splits > 1, MERGE_CHUNK=merge_chunk,
                DOT_PREC="ieee" if cache_dtype == torch.float32 else "tf32")

