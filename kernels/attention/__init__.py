"""Attention over the live cells of a paged KV pool, and the K/V write: Triton kernels
beside their torch references. This package's surface: :func:`cell_attention` and
:func:`write_cells` dispatch to the kernel or the reference; the planned calls a model
repeats (:func:`plan_cell_attention`, :func:`plan_write_cells`); the launch plans
(:func:`plan_attention`). Inside: ``kernel.py`` (the Triton code), ``launch.py`` (the
launchers, split counters and planned calls), ``checks.py``, ``reference.py``,
``tuning.py``; how the kernel works: ARCHITECTURE.md, "The cell attention".

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
"""
from __future__ import annotations

from torch import Tensor

from ..common import runs_kernel
from .checks import MAX_CELLS, SUPPORTED_DTYPES, check_write_args
from .launch import (COUNTERS, BoundLaunch, PlannedCall, attention_counters, cell_attention_triton,
                     new_attention_counters, plan_cell_attention, plan_write_cells, write_cells_triton)
from .reference import cell_attention_reference, write_cells_reference
from .tuning import TUNED_CONFIGS, AttentionConfig, AttentionPlan, kernel_constants, plan_attention

__all__ = [
    "AttentionConfig", "AttentionPlan", "BoundLaunch", "COUNTERS", "MAX_CELLS", "PlannedCall", "SUPPORTED_DTYPES",
    "TUNED_CONFIGS", "attention_counters", "cell_attention", "cell_attention_reference", "cell_attention_triton",
    "kernel_constants", "new_attention_counters", "plan_attention", "plan_cell_attention", "plan_write_cells",
    "write_cells", "write_cells_reference", "write_cells_triton",
]


def cell_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_ids: Tensor,
                   positions: Tensor, *, block_size: int, scale: float, window: int | None = None,
                   slopes: Tensor | None = None, bias_shift: int = 0, out: Tensor | None = None,
                   splits: int | None = None, counters: Tensor | None = None, dependent: bool = False) -> Tensor:
    """The contract above: the Triton kernel on CUDA tensors, the torch reference
    elsewhere (or the kernel in the interpreter with ``CGRT_CPU_KERNELS=1`` and
    ``TRITON_INTERPRET=1``). Same lifetimes and errors as the implementation chosen;
    ``dependent`` as :func:`cell_attention_triton`'s (the reference ignores it)."""
    impl = cell_attention_triton if runs_kernel(q) else cell_attention_reference
    return impl(q, k_cache, v_cache, block_table, seq_ids, positions, block_size=block_size, scale=scale,
                window=window, slopes=slopes, bias_shift=bias_shift, out=out, splits=splits, counters=counters,
                dependent=dependent)


def write_cells(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cells: Tensor) -> None:
    """``k_cache[cells] = k``, ``v_cache[cells] = v``: one Triton launch on CUDA tensors,
    the torch reference elsewhere (same switch as :func:`cell_attention`). Checks its
    arguments first either way (InputError, nothing written)."""
    if runs_kernel(k):
        write_cells_triton(k, v, k_cache, v_cache, cells)
        return
    check_write_args(k, v, k_cache, v_cache, cells)
    write_cells_reference(k, v, k_cache, v_cache, cells)
