"""The cell attention's argument checks, shared by the kernel's launchers and the torch
reference (so both refuse the same calls): metadata only (shapes, dtypes, strides,
devices), never a device value, so they are safe during capture. Each raises InputError
naming the first argument that breaks the contract, before anything is touched.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from cudagraph_rt.errors import InputError, expected

from ..common import check_tensor, describe
from .tuning import AttentionConfig, AttentionPlan

__all__ = ["INT32_MAX", "MAX_CELLS", "MAX_HEAD_DIM", "SUPPORTED_DTYPES", "check_attention_args", "check_plan",
           "check_write_args"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
MAX_CELLS = 2**31 - 1  # a chunk's cells are gathered as int32
INT32_MAX = 2**31 - 1  # window and bias_shift: kernel scalars, distances between positions


def _check_caches(rows: Tensor, k_cache: Tensor, v_cache: Tensor) -> None:
    """Both caches ``[cells, Hkv, D]`` of one shape and dtype, on ``rows``' device and D."""
    D = rows.shape[2]
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, c, 3, SUPPORTED_DTYPES, rows.device)
        if c.shape[2] != D or c.shape[1] < 1 or c.stride(2) != 1:
            raise InputError(expected(name, f"[cells, Hkv >= 1, {D}] with a contiguous last dimension",
                                      f"{tuple(c.shape)} strides {c.stride()}"))
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise InputError(expected("v_cache", f"k_cache's shape and dtype {describe(k_cache)}", describe(v_cache)))
    if k_cache.shape[0] > MAX_CELLS:
        raise InputError(expected("k_cache", f"at most {MAX_CELLS} cells", k_cache.shape[0]))


def _is_int(v) -> bool:
    """A plain int (a bool is not one here: ``window=True`` is a mistake, not 1)."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, block_size, window, slopes,
                         out, splits, counters=None, dependent=False, scale=1.0, bias_shift=0) -> None:
    """Raise InputError naming the first argument that breaks the contract."""
    check_tensor("q", q, 3, SUPPORTED_DTYPES)
    N, Hq, D = q.shape
    if not 1 <= D <= MAX_HEAD_DIM or q.stride(2) != 1:
        raise InputError(expected("q", f"[N, Hq, D] with 1 <= D <= {MAX_HEAD_DIM}, last dimension contiguous",
                                  f"{tuple(q.shape)} strides {q.stride()}"))
    _check_caches(q, k_cache, v_cache)
    if Hq % k_cache.shape[1]:
        raise InputError(expected("q", f"a multiple of k_cache's {k_cache.shape[1]} KV heads as Hq", Hq))
    check_tensor("block_table", block_table, 2, (torch.int32,), q.device)
    if block_table.stride(1) != 1:
        raise InputError(expected("block_table", "a contiguous last dimension", f"strides {block_table.stride()}"))
    for name, t in (("seq_ids", seq_ids), ("positions", positions)):
        check_tensor(name, t, 1, (torch.int32, torch.int64), q.device)
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
        check_tensor("slopes", slopes, 1, (torch.float32,), q.device)
        if slopes.shape[0] != Hq:
            raise InputError(expected("slopes", f"{Hq} entries (one per query head)", tuple(slopes.shape)))
    if out is not None and (not isinstance(out, Tensor) or out.shape != q.shape or out.dtype != q.dtype
                            or out.device != q.device or out.stride(2) != 1):
        raise InputError(expected("out", f"None or a tensor like q ({describe(q)}, last dimension contiguous)",
                                  describe(out)))
    if splits is not None and (not _is_int(splits) or splits < 1):
        raise InputError(expected("splits", "None or an int >= 1", repr(splits)))
    if not isinstance(dependent, bool):
        raise InputError(expected("dependent", "a bool", repr(dependent)))
    if counters is not None:
        check_tensor("counters", counters, 1, (torch.int32,), q.device)
        if not counters.is_contiguous():
            raise InputError(expected("counters", "a contiguous int32 tensor", f"strides {counters.stride()}"))


def check_plan(plan) -> None:
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


def check_write_args(k, v, k_cache, v_cache, cells) -> None:
    """Raise InputError naming the first argument of write_cells that breaks the contract."""
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 3, SUPPORTED_DTYPES)
        if t.shape != k.shape or t.stride(2) != 1:
            raise InputError(expected(name, f"[N, Hkv, D] like k {tuple(k.shape)}, last dimension contiguous",
                                      f"{tuple(t.shape)} strides {t.stride()}"))
    _check_caches(k, k_cache, v_cache)
    if k_cache.shape[1] != k.shape[1]:
        raise InputError(expected("k_cache", f"{k.shape[1]} KV heads (k's)", tuple(k_cache.shape)))
    check_tensor("cells", cells, 1, (torch.int32, torch.int64), k.device)
    if cells.shape[0] != k.shape[0]:
        raise InputError(expected("cells", f"{k.shape[0]} entries (k's rows)", tuple(cells.shape)))
