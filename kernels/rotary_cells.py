"""Rotary position embedding of a step's q and k rows with the K/V write into the pool's
cells, in one launch: a Triton kernel beside its torch reference.

A decode step's attention prologue is three small kernels a layer when the model rotates q
and k itself (inductor's RoPE of q, of k, then :func:`~.attention.write_cells`), each
of them a launch and a dependent round trip through memory for a few KB of data. This
kernel reads q, k and v where the projection left them (views of the merged q/k/v product,
any row and head strides), rotates q into ``q_out`` and k into its cell, and copies v into
its cell.

Contract (shared by :func:`rotary_write_cells`, :func:`rotary_write_cells_triton` and
:func:`rotary_write_cells_reference`):

* ``q`` ``[N, Hq, D]``, ``k`` / ``v`` ``[N, Hkv, D]``, last dimension contiguous, ``D``
  even; ``cos`` / ``sin`` ``[N, D]``, the rows' rotary tables (transformers' rotary
  embedding output for the rows' positions, any float dtype), last dimension contiguous.
* The rotation is transformers' (``rotate_half``): ``x * cos + rotate_half(x) * sin``
  with ``rotate_half(x) = cat(-x[D/2:], x[:D/2])``, in fp32, rounded once to the
  destination's dtype (as inductor computes the same expression; eager bf16 rounds after
  each product, so the two differ in the last bit).
* ``q_out`` ``[N, Hq, D]`` (last dimension contiguous) gets rotated q; row r's rotated k
  and its v go into cell ``cells[r]`` of ``k_cache`` / ``v_cache`` ``[cells, Hkv, D]``, as
  :func:`~.attention.write_cells` writes them: a cell outside the caches writes
  nothing, and padding rows sharing the scratch cell leave it unspecified element by
  element.

The kernel: one program a row, the row's Hq and Hkv heads as tiles of half rows (the two
halves of ``rotate_half`` loaded apart, so nothing is shuffled between lanes); 64-bit
offsets into the caches. Asynchronous and capturable (``cells`` is read on the device).
On Hopper and later (:func:`~.common.pdl_launch`) a programmatic dependent launch:
it waits for the launch before it at its very top, so it may follow any kernel, then lets
the next launch begin (the pool's attention, which waits for this one before reading q or
the caches).
"""
from __future__ import annotations

import torch
from torch import Tensor

from cudagraph_rt.errors import InputError, expected

from .attention.checks import SUPPORTED_DTYPES, check_write_args
from .common import check_tensor, device_scope, next_pow2, pdl_options, runs_kernel, tl, triton, triton_backend

__all__ = ["rotate_reference", "rotary_write_cells", "rotary_write_cells_reference",
           "rotary_write_cells_triton"]

FLOATS = (torch.float32, torch.float16, torch.bfloat16)

if triton is not None:

    @triton.jit
    def _rotate_store(src, dst, n, s_sn, s_sh, s_dn, s_dh, c1, c2, s1, s2, heads, ok, H2: tl.constexpr,
                      BLOCK_H: tl.constexpr, BLOCK_H2: tl.constexpr):
        """dst[n, h] = rotate(src[r, h]) for the heads < ``heads`` where ``ok``: the halves
        x1, x2 of each head as [BLOCK_H, BLOCK_H2] tiles, fp32 math, one rounding."""
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_H2)[None, :]
        mask = (h < heads) & (d < H2) & ok
        at = src + h * s_sh + d
        x1 = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(at + H2, mask=mask, other=0.0).to(tl.float32)
        to = dst + n * s_dn + h * s_dh + d
        tl.store(to, (x1 * c1 - x2 * s1).to(dst.dtype.element_ty), mask=mask)
        tl.store(to + H2, (x2 * c2 + x1 * s2).to(dst.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr, vc_ptr, cells_ptr, num_cells,
                             Hq, s_qn, s_qh, s_kn, s_kh, s_vn, s_vh, s_cn, s_sn, s_on, s_oh, s_kcc, s_kch, s_vcc, s_vch,
                             s_cells, HKV: tl.constexpr, H2: tl.constexpr, BLOCK_HQ: tl.constexpr,
                             BLOCK_HKV: tl.constexpr, BLOCK_H2: tl.constexpr, PDL: tl.constexpr = False):
        if PDL:  # wait for q, k, v; then let the attention launch (it reads nothing of ours before its own wait)
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        r = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_H2)[None, :]
        dm = d < H2
        c1 = tl.load(cos_ptr + r * s_cn + d, mask=dm, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + r * s_cn + H2 + d, mask=dm, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + r * s_sn + d, mask=dm, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + r * s_sn + H2 + d, mask=dm, other=0.0).to(tl.float32)
        cell = tl.load(cells_ptr + r * s_cells).to(tl.int64)
        at = tl.zeros([BLOCK_HKV, 1], tl.int64) + cell  # (a vector: the interpreter mistypes vector & scalar)
        inside = (at >= 0) & (at < num_cells)
        _rotate_store(q_ptr + r * s_qn, qo_ptr, r, s_qn, s_qh, s_on, s_oh, c1, c2, s1, s2, Hq,
                      tl.full([BLOCK_HQ, 1], 1, tl.int1), H2, BLOCK_HQ, BLOCK_H2)
        _rotate_store(k_ptr + r * s_kn, kc_ptr, cell, s_kn, s_kh, s_kcc, s_kch, c1, c2, s1, s2, HKV, inside, H2,
                      BLOCK_HKV, BLOCK_H2)
        h = tl.arange(0, BLOCK_HKV)[:, None]
        dd = tl.arange(0, 2 * BLOCK_H2)[None, :]
        vm = (h < HKV) & (dd < 2 * H2) & inside
        v = tl.load(v_ptr + r * s_vn + h * s_vh + dd, mask=vm)
        tl.store(vc_ptr + cell * s_vcc + h * s_vch + dd, v.to(vc_ptr.dtype.element_ty), mask=vm)

else:  # pragma: no cover
    _rotary_write_kernel = None


# --------------------------------------------------------------------------------------
# Validation (metadata only) and launch arguments
# --------------------------------------------------------------------------------------
def _check_args(q, k, v, cos, sin, k_cache, v_cache, cells, q_out) -> None:
    """Raise InputError naming the first argument that breaks the contract."""
    check_tensor("q", q, 3, SUPPORTED_DTYPES)
    N, Hq, D = q.shape
    if D % 2 or q.stride(2) != 1:
        raise InputError(expected("q", "[N, Hq, D] with an even D and a contiguous last dimension",
                                  f"{tuple(q.shape)} strides {q.stride()}"))
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 3, SUPPORTED_DTYPES, q.device)
        if t.shape[0] != N or t.shape[1] < 1 or t.shape[2] != D:
            raise InputError(expected(name, f"[{N}, Hkv >= 1, {D}] (q's rows and D)", tuple(t.shape)))
    check_write_args(k, v, k_cache, v_cache, cells)  # v like k, the caches, their heads, the cells
    if Hq % k.shape[1]:
        raise InputError(expected("q", f"a multiple of k's {k.shape[1]} KV heads as Hq", Hq))
    for name, t in (("cos", cos), ("sin", sin)):
        check_tensor(name, t, 2, FLOATS, q.device)
        if tuple(t.shape) != (N, D) or t.stride(1) != 1:
            raise InputError(expected(name, f"[{N}, {D}] (q's rows by D), last dimension contiguous",
                                      f"{tuple(t.shape)} strides {t.stride()}"))
    if not isinstance(q_out, Tensor) or q_out.shape != q.shape or q_out.dtype != q.dtype \
            or q_out.device != q.device or q_out.stride(2) != 1:
        raise InputError(expected("q_out", f"a tensor like q ({q.dtype} {tuple(q.shape)} on {q.device}, last "
                                  "dimension contiguous)", f"{type(q_out).__name__} {getattr(q_out, 'shape', '')}"))


def _args(q, k, v, cos, sin, k_cache, v_cache, cells, q_out) -> tuple:
    return (q, k, v, cos, sin, q_out, k_cache, v_cache, cells, k_cache.shape[0], q.shape[1], q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), q_out.stride(0),
            q_out.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            cells.stride(0))


def _meta(Hq: int, Hkv: int, D: int) -> dict:
    return dict(HKV=Hkv, H2=D // 2, BLOCK_HQ=next_pow2(Hq), BLOCK_HKV=next_pow2(Hkv), BLOCK_H2=next_pow2(D // 2))


# --------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------
def rotary_write_cells_triton(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                              v_cache: Tensor, cells: Tensor, q_out: Tensor) -> Tensor:
    """The contract above in one Triton launch (CUDA tensors; CPU tensors under
    ``TRITON_INTERPRET=1``). Returns ``q_out``, valid once the stream reaches it. Raises
    InputError before writing anything when an argument breaks the contract."""
    _check_args(q, k, v, cos, sin, k_cache, v_cache, cells, q_out)
    if triton_backend() == "unavailable":
        raise RuntimeError("rotary_write_cells_triton: triton is not installed; use rotary_write_cells_reference")
    N, Hq, D = q.shape
    if N:
        with device_scope(q):
            _rotary_write_kernel[(N,)](*_args(q, k, v, cos, sin, k_cache, v_cache, cells, q_out),
                                       **_meta(Hq, k.shape[1], D), **pdl_options(q.device))
    return q_out


def rotate_reference(x: Tensor, cos: Tensor, sin: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` ``[N, H, D]`` rotated by the rows' ``cos`` / ``sin`` ``[N, D]``
    (transformers' rotate_half convention), fp32 math, rounded once to ``dtype``."""
    x32, c, s = x.float(), cos.float()[:, None, :], sin.float()[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), -1)
    return (x32 * c + rotated * s).to(dtype)


def rotary_write_cells_reference(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                                 v_cache: Tensor, cells: Tensor, q_out: Tensor) -> Tensor:
    """The contract above in plain torch, on any device (``index_copy_`` for the cells:
    every cell must be inside the caches). Returns ``q_out``."""
    q_out.copy_(rotate_reference(q, cos, sin, q_out.dtype))
    at = cells.long()
    k_cache.index_copy_(0, at, rotate_reference(k, cos, sin, k_cache.dtype))
    v_cache.index_copy_(0, at, v.to(v_cache.dtype))
    return q_out


def rotary_write_cells(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                       cells: Tensor, q_out: Tensor) -> Tensor:
    """The contract above: the Triton kernel on CUDA tensors, the torch reference elsewhere
    (the kernel in the interpreter with ``CGRT_CPU_KERNELS=1`` and ``TRITON_INTERPRET=1``).
    Checks its arguments first either way (InputError, nothing written)."""
    if runs_kernel(q):
        return rotary_write_cells_triton(q, k, v, cos, sin, k_cache, v_cache, cells, q_out)
    _check_args(q, k, v, cos, sin, k_cache, v_cache, cells, q_out)
    return rotary_write_cells_reference(q, k, v, cos, sin, k_cache, v_cache, cells, q_out)

