"""``F.linear`` for a few rows (decode and verify widths): a Triton kernel beside its torch reference.

Contract (shared by :func:`small_linear` and :func:`small_linear_reference`):

* ``x`` [M, K] with 1 <= M <= :data:`MAX_ROWS` (M = 0 gives an empty output), any strides;
  ``weight`` [N, K] with any strides and storage offset (a row-slice view of a merged
  tensor, as ``models/fused.py`` makes, is read in place); ``bias`` [N] or None; all of one
  dtype (fp32, fp16 or bf16) and device. ``out`` [M, N] in that dtype, or None (a new
  tensor). Returns ``x @ weight.T + bias``, accumulated in fp32, rounded once to x's dtype.

How the kernel does it (weight-read bound: every byte of ``weight`` is read once):

* Grid ``(N blocks, splits)``: program (n, s) multiplies rows ``[n * block_n, +block_n)``
  of the weight by split s's share of K, in a pipelined loop of ``[block_n, block_k]``
  tiles (16-byte loads along K when the weight's K stride is 1), against x's rows padded
  to 16 (``tl.dot``, the weight as the left operand) or, for ``dot=False``, a broadcast
  multiply and sum over x's rows padded to a power of two.
* ``splits == 1``: the program adds the bias and writes its output rows. ``splits > 1``:
  each program writes its fp32 partial [M, block_n] into a scratch, then bumps its N
  block's counter (an acq_rel atomic after a CTA barrier); the program that brings the
  counter to ``splits`` sums the partials in split order (the result does not depend on
  which program came last), adds the bias, writes the output and puts the counter back
  to 0. No zero-fill launch, one launch in all.
* The scratch (:class:`SplitScratch`) is allocated once per device and split shape,
  outside any capture, and kept for the process: captured graphs bake its address in.
  Launches sharing one must be stream-ordered (the runtime replays on one stream); two
  of the same split shape running at once on two streams would mix their partials.

Configs come from shapes only, never from device values nor a call-time autotune: a
measured table (:data:`TUNED_CONFIGS`, printed by ``tools/bench/projections.py --tune``)
and a rule (:func:`plan_linear`). So a launch is capturable in a CUDA graph; its first
launch per specialisation compiles (make it outside capture: the runtime's warm-up does).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from cudagraph_rt.errors import CaptureError, InputError, expected

from .common import describe, device_scope, next_pow2, tl, triton, triton_backend

__all__ = ["LinearConfig", "MAX_ROWS", "SUPPORTED_DTYPES", "SplitScratch", "TUNED_CONFIGS", "default_split",
           "plan_linear", "small_linear", "small_linear_reference"]

MAX_ROWS = 16  # x's rows: the widest step this kernel serves (verify of k <= 15 drafts)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DOT_ROWS = 16  # tl.dot's smallest tile: x's rows are padded to it


# --------------------------------------------------------------------------------------
# Launch configuration (host side: shapes only)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearConfig:
    """One launch's tile: ``block_n`` weight rows x ``block_k`` columns per loop step,
    ``split_k`` programs per N block (None: :func:`plan_linear`'s rule), Triton's
    ``num_warps``/``num_stages``, and ``dot`` (tl.dot on 16 padded rows) or a broadcast
    multiply + sum (``dot=False``, meant for M <= 4)."""

    block_n: int = 16
    block_k: int = 256
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True


# Measured entries, keyed on (N, K, rows bucket, element size); the rows bucket is M's
# next power of two (1, 2, 4, 8, 16). Empty until the H200 run of
# `tools/bench/projections.py --tune` prints the entries to paste here; the rule serves.
TUNED_CONFIGS: dict[tuple[int, int, int, int], LinearConfig] = {}

PROGRAMS_PER_SM = 3  # the rule's target: enough programs to keep every SM busy through the tail
MIN_K_PER_SPLIT_TILES = 2  # a split reads at least this many block_k tiles (the loop pipelines)
MAX_SPLIT = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the H200's (interpreted runs plan as for it)
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_split(n: int, k: int, config: LinearConfig, sms: int = 132) -> int:
    """The fewest splits (a power of two) that give ``PROGRAMS_PER_SM * sms`` programs,
    but no split reads fewer than ``MIN_K_PER_SPLIT_TILES`` tiles of K, at most MAX_SPLIT."""
    blocks = _cdiv(n, config.block_n)
    want = next_pow2(_cdiv(PROGRAMS_PER_SM * sms, blocks))
    room = max(1, k // (MIN_K_PER_SPLIT_TILES * config.block_k))
    return max(1, min(want, 1 << (room.bit_length() - 1), MAX_SPLIT))


def plan_linear(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device | str = "cuda") -> LinearConfig:
    """The config of one launch, a pure function of the shapes (and the device's SM count):
    the :data:`TUNED_CONFIGS` entry if any, else the default tile; ``split_k`` filled in by
    :func:`default_split` where the entry leaves it None."""
    bucket = next_pow2(max(1, min(m, MAX_ROWS)))
    config = TUNED_CONFIGS.get((n, k, bucket, dtype.itemsize)) or LinearConfig()
    if config.split_k is None:
        config = replace(config, split_k=default_split(n, k, config, _sm_count(torch.device(device))))
    return config


def _check_config(config) -> None:
    ok = isinstance(config, LinearConfig) and isinstance(config.split_k, int) and config.split_k >= 1
    ok = ok and all(isinstance(v, int) and v >= 1 and not v & (v - 1) for v in (config.block_n, config.block_k))
    ok = ok and config.num_warps >= 1 and config.num_stages >= 1 and (not config.dot or config.block_n >= 16)
    if not ok or config.block_k < 16:
        raise InputError(expected("config", "a LinearConfig with power-of-two block_n (>= 16 with dot) and "
                                  "block_k >= 16, an int split_k >= 1, warps and stages >= 1", config))


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _split_product(x_ptr, w_ptr, n0, k_lo, k_hi, M, N, s_xm, s_xk, s_wn, s_wk,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       EVEN_K: tl.constexpr, DOT: tl.constexpr, DOT_PREC: tl.constexpr):
        """acc [BLOCK_N, BLOCK_M] fp32: weight rows n0 + i times x rows m over K in [k_lo, k_hi).
        k_lo is a multiple of BLOCK_K; EVEN_K: so is k_hi - k_lo, and K needs no mask."""
        rn = n0 + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * s_wn  # 64-bit: a big head passes 2**31 elements
        x_rows = x_ptr + rm.to(tl.int64)[:, None] * s_xm
        n_ok = (rn < N)[:, None]  # constant along K: the loads stay 16-byte vectors
        m_ok = (rm < M)[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = tl.max_contiguous(tl.multiple_of(k0 + rk, BLOCK_K), BLOCK_K)  # k0: whole tiles from k_lo
            if EVEN_K:
                w = tl.load(w_rows + k[None, :] * s_wk, mask=n_ok, other=0.0)
                x = tl.load(x_rows + k[None, :] * s_xk, mask=m_ok, other=0.0)
            else:
                k_ok = (k < k_hi)[None, :]
                w = tl.load(w_rows + k[None, :] * s_wk, mask=n_ok & k_ok, other=0.0)
                x = tl.load(x_rows + k[None, :] * s_xk, mask=m_ok & k_ok, other=0.0)
            if DOT:
                acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PREC)
            else:
                acc += tl.sum(w[:, None, :].to(tl.float32) * x[None, :, :].to(tl.float32), 2)
        return acc

    @triton.jit
    def _store_out(out_ptr, bias_ptr, acc, n0, M, N, s_om, s_on, s_b,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
        """out[m, n0 + i] = acc[i, m] (+ bias[n0 + i]), rounded once to out's dtype."""
        rn = n0 + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn * s_b, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        ptr = out_ptr + rm.to(tl.int64)[None, :] * s_om + rn.to(tl.int64)[:, None] * s_on
        tl.store(ptr, acc.to(out_ptr.dtype.element_ty), mask=(rn < N)[:, None] & (rm < M)[None, :])

    @triton.jit
    def _partials(part_ptr, split, pid_n, n_blocks, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  ROWS: tl.constexpr):
        """Pointers [BLOCK_N, BLOCK_M] to split ``split``'s partial of N block ``pid_n``: the
        scratch is [splits, n_blocks, BLOCK_N, ROWS] fp32, one contiguous chunk per program."""
        i = tl.arange(0, BLOCK_N)[:, None]
        m = tl.arange(0, BLOCK_M)[None, :]
        return part_ptr + ((split * n_blocks + pid_n) * BLOCK_N + i).to(tl.int64) * ROWS + m

    @triton.jit
    def _sum_partials(part_ptr, pid_n, n_blocks, splits, M, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      ROWS: tl.constexpr):
        """Every split's partial of N block ``pid_n``, summed in split order (so the result
        does not depend on which program finished last). ``.cg``: read at L2, where the
        other programs' writes are, never a stale L1 line of an earlier launch."""
        m_ok = (tl.arange(0, BLOCK_M) < M)[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for s in range(0, splits):
            acc += tl.load(_partials(part_ptr, s, pid_n, n_blocks, BLOCK_M, BLOCK_N, ROWS), mask=m_ok, other=0.0,
                           cache_modifier=".cg")
        return acc

    @triton.jit
    def _small_gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
                           M, N, K, k_per_split, n_blocks, splits, s_xm, s_xk, s_wn, s_wk, s_b, s_om, s_on,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                           EVEN_K: tl.constexpr, DOT: tl.constexpr, DOT_PREC: tl.constexpr,
                           HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
        pid_n, pid_k = tl.program_id(0), tl.program_id(1)
        n0 = pid_n * BLOCK_N
        k_lo = pid_k * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        acc = _split_product(x_ptr, w_ptr, n0, k_lo, k_hi, M, N, s_xm, s_xk, s_wn, s_wk,
                             BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT, DOT_PREC)
        if SPLIT:
            m_ok = (tl.arange(0, BLOCK_M) < M)[None, :]
            tl.store(_partials(part_ptr, pid_k, pid_n, n_blocks, BLOCK_M, BLOCK_N, ROWS), acc, mask=m_ok)
            tl.debug_barrier()  # every thread's partial is written before the count says so
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == splits - 1:  # the last of the block's splits reduces and resets
                acc = _sum_partials(part_ptr, pid_n, n_blocks, splits, M, BLOCK_M, BLOCK_N, ROWS)
                _store_out(out_ptr, bias_ptr, acc, n0, M, N, s_om, s_on, s_b, BLOCK_M, BLOCK_N, HAS_BIAS)
                tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")
        else:
            _store_out(out_ptr, bias_ptr, acc, n0, M, N, s_om, s_on, s_b, BLOCK_M, BLOCK_N, HAS_BIAS)

else:  # pragma: no cover
    _small_gemv_kernel = None


# --------------------------------------------------------------------------------------
# The split scratch (counters and partials; fixed addresses, allocated outside capture)
# --------------------------------------------------------------------------------------
class SplitScratch:
    """Counters (int32, one per N block, 0 between launches: the last split puts its
    block's back) and fp32 partials of split launches, one pair per (device, N blocks,
    block_n, splits), allocated at that shape's first launch and kept for the process:
    a captured graph keeps their addresses, so they are never freed or moved.

    :meth:`get` raises CaptureError when a shape's first launch comes during a CUDA graph
    capture (warm it up outside, as the runtime does), before anything is launched."""

    def __init__(self):
        self._pairs: dict[tuple, tuple[Tensor, Tensor]] = {}

    def get(self, device: torch.device, n_blocks: int, block_n: int, splits: int) -> tuple[Tensor, Tensor]:
        key = (device, n_blocks, block_n, splits)
        pair = self._pairs.get(key)
        if pair is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise CaptureError(f"small_linear: the first launch of {n_blocks} blocks of {block_n} rows in "
                                   f"{splits} splits came during a capture; launch it once outside capture first "
                                   "(its scratch must not live in the graph's pool)")
            counts = torch.zeros(n_blocks, dtype=torch.int32, device=device)
            partials = torch.empty(splits * n_blocks * block_n * MAX_ROWS, dtype=torch.float32, device=device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the zeroed counters, before any stream's launch
            pair = self._pairs[key] = (counts, partials)
        return pair

    def counters(self) -> list[Tensor]:
        """Every counter buffer allocated so far (tests check that they are back at 0)."""
        return [c for c, _ in self._pairs.values()]


SCRATCH = SplitScratch()


# --------------------------------------------------------------------------------------
# Validation (metadata only), launcher, reference
# --------------------------------------------------------------------------------------
def check_linear_args(x, weight, bias=None, out=None) -> None:
    """InputError naming the first argument outside the contract; reads metadata only."""
    if not isinstance(x, Tensor) or x.dim() != 2 or x.dtype not in SUPPORTED_DTYPES:
        raise InputError(expected("x", f"a 2-D tensor of {[str(d) for d in SUPPORTED_DTYPES]}", describe(x)))
    if x.shape[0] > MAX_ROWS:
        raise InputError(expected("x", f"at most {MAX_ROWS} rows (F.linear serves wider steps)", tuple(x.shape)))
    like = f"{x.dtype} on {x.device}"
    if not isinstance(weight, Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[1] \
            or weight.dtype != x.dtype or weight.device != x.device:
        raise InputError(expected("weight", f"[N, {x.shape[1]}] {like} (x's K, dtype, device)", describe(weight)))
    n = weight.shape[0]
    if bias is not None and (not isinstance(bias, Tensor) or tuple(bias.shape) != (n,) or bias.dtype != x.dtype
                             or bias.device != x.device):
        raise InputError(expected("bias", f"None or [{n}] {like}", describe(bias)))
    if out is not None and (not isinstance(out, Tensor) or tuple(out.shape) != (x.shape[0], n)
                            or out.dtype != x.dtype or out.device != x.device):
        raise InputError(expected("out", f"None or [{x.shape[0]}, {n}] {like}", describe(out)))


def _launch_constants(config: LinearConfig, m: int, k: int, dtype: torch.dtype) -> dict:
    """The kernel's compile-time constants (one compiled kernel per distinct dict)."""
    block_m = DOT_ROWS if config.dot else next_pow2(m)
    return dict(BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, ROWS=MAX_ROWS,
                EVEN_K=k % (config.split_k * config.block_k) == 0, DOT=config.dot,
                DOT_PREC="ieee" if dtype == torch.float32 else "tf32", SPLIT=config.split_k > 1)


def small_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None, *,
                 config: LinearConfig | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for x [M <= 16, K] on the Triton kernel (CUDA tensors;
    CPU tensors under ``TRITON_INTERPRET=1``); see the module doc. ``config`` overrides
    :func:`plan_linear` (tests, tuning; ``split_k=None`` takes the rule's).

    Asynchronous on the current stream and capturable once warmed up: no host read of a
    device value. Returns ``out`` (or a new tensor), valid once the stream reaches it.
    InputError before anything is launched or allocated when an argument breaks the
    contract; CaptureError when a split shape's scratch would first be allocated during
    a capture; RuntimeError without triton (or for CPU tensors without the interpreter)."""
    check_linear_args(x, weight, bias, out)
    if config is None:
        config = plan_linear(x.shape[0], weight.shape[0], x.shape[1], x.dtype, x.device)
    elif config.split_k is None:
        config = replace(config, split_k=default_split(weight.shape[0], x.shape[1], config, _sm_count(x.device)))
    _check_config(config)
    backend = triton_backend()
    if backend == "unavailable" or (x.device.type != "cuda" and backend != "interpreter"):
        raise RuntimeError(f"small_linear: the Triton kernel cannot run on {x.device} here (triton {backend}); "
                           "use small_linear_reference")
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return out
    n_blocks, splits = _cdiv(n, config.block_n), config.split_k
    k_per = _cdiv(_cdiv(k, splits), config.block_k) * config.block_k  # whole tiles per split
    counts, partials = SCRATCH.get(x.device, n_blocks, config.block_n, splits) if splits > 1 else (out, out)
    opts = {"num_warps": config.num_warps, "num_stages": config.num_stages} if x.device.type == "cuda" else {}
    with device_scope(x):
        _small_gemv_kernel[(n_blocks, splits)](
            x, weight, weight if bias is None else bias, out, partials, counts, m, n, k, k_per, n_blocks, splits,
            x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), 0 if bias is None else bias.stride(0),
            out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
            **_launch_constants(config, m, k, x.dtype), **opts)
    return out


def small_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None = None, out: Tensor | None = None) -> Tensor:
    """The contract in plain torch, on any device: fp32 products and sums, rounded once
    to x's dtype (into ``out`` if given). Same InputErrors as :func:`small_linear`."""
    check_linear_args(x, weight, bias, out)
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    if out is None:
        return y
    out.copy_(y)
    return out
