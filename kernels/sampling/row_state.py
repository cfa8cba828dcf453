"""The sampler kernels' shared pieces: the row state's layout (int32 and float32 words per
row, the phase a row is in), its constants as the kernels see them (constexpr globals), and
the small jit helpers every launch uses (float keys, tickets, per-row settings)."""
from __future__ import annotations

try:  # Triton is optional: without it only the torch path runs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

from cudagraph_rt.kernels.sampling.settings import MIN_TEMPERATURE

# Row state: int32 words ...
I_PHASE, I_LO, I_HI, I_THR, I_KEFF, I_ARGMAX, I_WORDS = 0, 1, 2, 3, 4, 5, 8
# ... and float32 words
F_M, F_TARGET, F_ZFIN, F_TMIN, F_WORDS = 0, 1, 2, 3, 8
# Phases
DONE, SEARCH_K, SEARCH_P, READY, RESIDUAL = 0, 1, 2, 3, 4
FALLBACK_STEPS = 96  # bound of the fallback loop (it needs at most ~2 * 32 / log2(candidates) per phase)

if triton is not None:
    from cudagraph_rt.kernels.sampling.philox import tl_gumbel, tl_uniforms

    # the host's constants, as the kernels must see globals (constexpr)
    _I_PHASE = tl.constexpr(I_PHASE)
    _I_LO = tl.constexpr(I_LO)
    _I_HI = tl.constexpr(I_HI)
    _I_THR = tl.constexpr(I_THR)
    _I_KEFF = tl.constexpr(I_KEFF)
    _I_ARGMAX = tl.constexpr(I_ARGMAX)
    _I_WORDS = tl.constexpr(I_WORDS)
    _F_M = tl.constexpr(F_M)
    _F_TARGET = tl.constexpr(F_TARGET)
    _F_ZFIN = tl.constexpr(F_ZFIN)
    _F_TMIN = tl.constexpr(F_TMIN)
    _F_WORDS = tl.constexpr(F_WORDS)
    _DONE = tl.constexpr(DONE)
    _SEARCH_K = tl.constexpr(SEARCH_K)
    _SEARCH_P = tl.constexpr(SEARCH_P)
    _READY = tl.constexpr(READY)
    _RESIDUAL = tl.constexpr(RESIDUAL)
    _FALLBACK_STEPS = tl.constexpr(FALLBACK_STEPS)
    _MIN_T = tl.constexpr(MIN_TEMPERATURE)
    _KEY_NEG_INF = tl.constexpr(-2139095041)  # _f2key(-inf): a threshold that keeps everything
    _KEY_MAX = tl.constexpr(2147483647)
    _FLT_MAX = tl.constexpr(3.4028234663852886e38)

    @triton.jit
    def _f2key(s):
        """Order-preserving int32 key of float32 ``s`` (NaN excluded; -0.0 as +0.0)."""
        bits = s.to(tl.int32, bitcast=True)
        return tl.where(s == 0.0, 0, bits ^ ((bits >> 31) & 0x7FFFFFFF))

    @triton.jit
    def _key2f(key):
        """The float32 of an order-preserving key (the inverse of ``_f2key``)."""
        return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _last_to_arrive(ticket_ptr, n_chunks):
        """True in the row's last program to get here; its partials, and every other
        program's, are written before (a CTA barrier, then an acq_rel atomic)."""
        tl.debug_barrier()
        return tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu") == n_chunks - 1

    @triton.jit
    def _reset_ticket(ticket_ptr):
        tl.atomic_xchg(ticket_ptr, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _row_draft(draft_ptr, r, V, HAS_DRAFT: tl.constexpr):
        """Row r's draft token, -1 for none (or anything outside [0, V))."""
        if HAS_DRAFT:
            d = tl.load(draft_ptr + r)
            return tl.where((d >= 0) & (d < V), d, -1).to(tl.int32)
        return tl.full([], -1, tl.int32)

    @triton.jit
    def _inv_temperature(temp_ptr, r):
        """(1 / T rounded to nearest, greedy?): greedy rows scale by 1."""
        t = tl.load(temp_ptr + r)
        greedy = t < _MIN_T
        one = tl.full([], 1.0, tl.float32)
        return tl.where(greedy, one, tl.math.div_rn(one, tl.where(greedy, one, t))), greedy

    @triton.jit
    def _filtered(topk_ptr, topp_ptr, minp_ptr, r, V):
        k = tl.load(topk_ptr + r)
        return ((k > 0) & (k < V)) | (tl.load(topp_ptr + r) < 1.0) | (tl.load(minp_ptr + r) > 0.0)

    @triton.jit
    def _better(key, idx, best, best_idx):
        """Keep the larger key; on a tie the earlier candidate (callers go in index order)."""
        return tl.maximum(best, key), tl.where(key > best, idx, best_idx)

    @triton.jit
    def _accept_uniform(seed, position):
        """Index 0 of the acceptance stream (Stream.ACCEPT = 1)."""
        u = tl_uniforms(seed, position, tl.full([], 1, tl.int32), 0, 4)
        return tl.sum(tl.where(tl.arange(0, 4) == 0, u, 0.0), 0)

    @triton.jit
    def _load_f32(row_ptr, idx, ok):
        """The logits at ``idx`` as float32 (-inf where not ``ok``); bf16 read as its bits, the
        top half of its float32 (Triton 3.6 fails to lower the search's bf16 loads)."""
        if row_ptr.dtype.element_ty == tl.bfloat16:
            bits = tl.load(row_ptr.to(tl.pointer_type(tl.uint16)) + idx, mask=ok, other=0)
            x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
            return tl.where(ok, x, float("-inf"))
        return tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32)
