"""The sampler's threshold search (top-k, then top-p, min-p folded in): the steps, and the
launch of one step per pass whose last reducer finishes a search alone.

A step tests ``MC`` candidate thresholds in the row's bracket ``[lo, hi)`` (order-preserving
int32 keys of the scaled logits): each program counts (top-k) or sums the mass (top-p) of
its chunk at or above each candidate; the row's totals, summed in chunk order, keep the
last candidate where the predicate holds, narrowed to the data. The threshold found is
exact, whatever the candidates tested were, so every number of passes gives the same
tokens for the same chunks. How: ARCHITECTURE.md, "The sampler".
"""
from __future__ import annotations

try:  # Triton is optional: without it only the torch path runs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

if triton is not None:
    from cudagraph_rt.kernels.sampling.row_state import (  # noqa: F401
        _I_PHASE, _I_LO, _I_HI, _I_THR, _I_KEFF, _I_WORDS, _F_M, _F_TARGET, _F_TMIN, _F_WORDS,
        _SEARCH_K, _SEARCH_P, _READY, _FALLBACK_STEPS, _FLT_MAX, _f2key, _last_to_arrive,
        _reset_ticket, _inv_temperature, _load_f32,
    )
    @triton.jit
    def _settle(phase, lo, hi, mass_lo, target, m, t_min, top_p, V, ist, fst):
        """Store the row's search state after a step and return (phase, lo, hi, target): a
        resolved top-k bracket (hi <= lo + 1) moves to top-p (when on) or to READY, a
        resolved top-p bracket to READY with threshold max(lo, key(m + log(min_p))).

        ``mass_lo`` is the mass at or above lo when known (< 0: not, a top-k step counts
        only): top-p then starts at lo = t_k with its target left for its first step, whose
        bottom candidate is t_k (``target`` < 0: top_p * the mass there)."""
        resolved = hi.to(tl.int64) <= lo.to(tl.int64) + 1
        if resolved & (phase == _SEARCH_K) & (top_p < 1.0):
            # t_p >= m + log((1 - top_p) / V) (the token at t_p carries >= (1 - top_p) / V of the
            # mass); one more e of margin for rounding
            bound = _f2key(m + tl.log(1.0 - top_p) - tl.log(tl.full([], 1.0, tl.float32) * V) - 1.0)
            phase = tl.full([], _SEARCH_P, tl.int32)
            known = mass_lo >= 0.0
            lo = tl.where(known, tl.maximum(lo, bound), lo)
            hi, target = _f2key(m) + 1, tl.where(known, top_p * mass_lo, -1.0)
            resolved = hi.to(tl.int64) <= lo.to(tl.int64) + 1
        if resolved:
            phase = tl.full([], _READY, tl.int32)
            tl.store(ist + _I_THR, tl.maximum(lo, _f2key(t_min)))
        tl.store(ist + _I_PHASE, phase)
        tl.store(ist + _I_LO, lo)
        tl.store(ist + _I_HI, hi)
        tl.store(fst + _F_TARGET, target)
        return phase, lo, hi, target

    @triton.jit
    def _candidates(lo, hi, key_uniform, MC: tl.constexpr):
        """MC thresholds in [lo, hi) as the floats they stand for, and the bracket's ends:
        c_0 = lo, then evenly spaced in value between the bracket's ends (in key space where
        that is not finite, or ``key_uniform``), non-decreasing, with c_1 > lo and
        c_{MC-1} < hi so that every step shrinks a bracket of two or more distinct values;
        every key when the bracket is that narrow. (Key to float inline: one call fewer.)"""
        j = tl.arange(0, MC)
        lo64, hi64 = lo.to(tl.int64), hi.to(tl.int64)
        width = hi64 - lo64
        by_key = lo64 + (width * j) // MC
        vlo = (lo ^ ((lo >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        top = hi - 1
        span = (top ^ ((top >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True) - vlo
        by_value = _f2key(vlo + span * (j.to(tl.float32) * (1.0 / MC))).to(tl.int64)
        c = tl.where((span <= _FLT_MAX) & (span > 0.0) & (key_uniform == 0), by_value, by_key)
        c = tl.minimum(tl.maximum(c, lo64 + j), hi64 - MC + j)
        c = tl.where(width >= MC, c, lo64 + j).to(tl.int32)
        hi_f = (hi ^ ((hi >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)
        return (c ^ ((c >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True), vlo, hi_f

    @triton.jit
    def _scan(row_ptr, start, end, inv_t, m, cand_f, lo_f, hi_f, by_mass, MC: tl.constexpr, BLOCK: tl.constexpr):
        """One range of the row against the bracket [lo, hi) and its candidates (keys
        compared as the floats they stand for: the same order for non-NaN values): per
        candidate c, the count (``by_mass`` false: a top-k step) or the mass exp(s - m)
        (a top-p step) of key >= c, those at or above hi included; within the bracket the
        smallest s >= c and the largest s < c; and the largest s in the bracket. Tiles with
        nothing in the bracket only count. Outside the bracket s is NaN for the comparisons
        (never >= anything) and -inf for the largest-below: two operations fewer per pair."""
        cnt = tl.full([MC], 0, tl.int32)
        mass = tl.full([MC], 0.0, tl.float32)
        succ = tl.full([MC], float("inf"), tl.float32)
        pred = tl.full([MC], float("-inf"), tl.float32)
        n_above, m_above = tl.full([BLOCK], 0, tl.int32), tl.full([BLOCK], 0.0, tl.float32)
        top = tl.full([BLOCK], float("-inf"), tl.float32)
        for b in range(start, end, BLOCK):
            idx = b + tl.arange(0, BLOCK)
            ok = idx < end
            s = _load_f32(row_ptr, idx, ok) * inv_t
            w = tl.where(s > float("-inf"), tl.exp(s - m), 0.0)
            above = ok & (s >= hi_f)
            inb = ok & (s >= lo_f) & (~above)
            n_above += above.to(tl.int32)
            m_above += tl.where(above, w, 0.0)
            low = tl.where(inb, s, float("-inf"))
            top = tl.maximum(top, low)
            if tl.max(inb.to(tl.int32), 0) > 0:
                ge = tl.where(inb, s, float("nan"))[:, None] >= cand_f[None, :]
                if by_mass:
                    mass += tl.sum(tl.where(ge, w[:, None], 0.0), 0)
                else:
                    cnt += tl.sum(ge.to(tl.int32), 0)
                succ = tl.minimum(succ, tl.min(tl.where(ge, s[:, None], float("inf")), 0))
                pred = tl.maximum(pred, tl.max(tl.where(ge, float("-inf"), low[:, None]), 0))
        return cnt + tl.sum(n_above, 0), mass + tl.sum(m_above, 0), succ, pred, tl.max(top, 0)

    @triton.jit
    def _step(phase, lo, hi, keff, target, cnt, mass, succ, pred, top, m, t_min, top_p, V, ist, fst,
              MC: tl.constexpr):
        """Keep the last candidate where pred holds (pred at lo is taken as true), narrowed
        to the data between it and the next candidate; store and return the new state."""
        j = tl.arange(0, MC)
        target = tl.where(target < 0.0, top_p * tl.max(tl.where(j == 0, mass, 0.0), 0), target)
        ok = tl.where(phase == _SEARCH_K, cnt >= keff, mass >= target) | (j == 0)
        js = tl.max(tl.where(ok, j, 0), 0)
        new_lo = tl.max(tl.where(j == js, succ, float("-inf")), 0)
        nxt = tl.max(tl.where(j == js + 1, pred, float("-inf")), 0)
        mass_lo = tl.where(phase == _SEARCH_K, -1.0, tl.max(tl.where(j == js, mass, 0.0), 0))
        empty = new_lo == float("inf")  # no data at or above the kept candidate: cannot happen, stop
        lo_key = tl.where(empty, lo, _f2key(new_lo))
        hi_key = tl.where(empty, lo, _f2key(tl.where(js + 1 < MC, nxt, top)) + 1)
        return _settle(phase, lo_key, hi_key, mass_lo, target, m, t_min, top_p, V, ist, fst)

    @triton.jit
    def _search_reduce(ipart, fpart, n_chunks, IW: tl.constexpr, FW: tl.constexpr, CB: tl.constexpr,
                       MC: tl.constexpr):
        """The row's per-candidate totals from its chunks' partials, summed in chunk order."""
        j = tl.arange(0, MC)
        cnt, mass = tl.full([MC], 0, tl.int32), tl.full([MC], 0.0, tl.float32)
        succ, pred = tl.full([MC], float("inf"), tl.float32), tl.full([MC], float("-inf"), tl.float32)
        top = float("-inf")
        for cb in range(0, n_chunks, CB):
            cc = cb + tl.arange(0, CB)
            ok = cc < n_chunks
            at_f, ok2 = fpart + cc[:, None] * FW + j[None, :], ok[:, None]
            cnt += tl.sum(tl.load(ipart + cc[:, None] * IW + j[None, :], mask=ok2, other=0, cache_modifier=".cg"), 0)
            mass += tl.sum(tl.load(at_f, mask=ok2, other=0.0, cache_modifier=".cg"), 0)
            succ = tl.minimum(succ, tl.min(tl.load(at_f + MC, mask=ok2, other=float("inf"), cache_modifier=".cg"), 0))
            pred = tl.maximum(pred, tl.max(tl.load(at_f + 2 * MC, mask=ok2, other=float("-inf"),
                                                   cache_modifier=".cg"), 0))
            top = tl.maximum(top, tl.max(tl.load(fpart + cc * FW + 3 * MC, mask=ok, other=float("-inf"),
                                                 cache_modifier=".cg"), 0))
        return cnt, mass, succ, pred, top

    @triton.jit
    def _search_alone(row_ptr, V, inv_t, m, t_min, phase, lo, hi, keff, target, top_p, ist, fst,
                      MC: tl.constexpr, BLOCK: tl.constexpr):
        """The fallback: one program steps the row's search over the whole row until it is
        resolved, key-uniform candidates on every other step (at most ~2 * 32 / log2(MC)
        steps a phase); past FALLBACK_STEPS the threshold is the bracket's bottom."""
        steps = 0
        while ((phase == _SEARCH_K) | (phase == _SEARCH_P)) & (steps < _FALLBACK_STEPS):
            cand_f, lo_f, hi_f = _candidates(lo, hi, steps % 2, MC)
            cnt, mass, succ, pred, top = _scan(row_ptr, 0, V, inv_t, m, cand_f, lo_f, hi_f, phase == _SEARCH_P, MC,
                                               BLOCK)
            phase, lo, hi, target = _step(phase, lo, hi, keff, target, cnt, mass, succ, pred, top, m, t_min,
                                          top_p, V, ist, fst, MC)
            steps += 1
        if (phase == _SEARCH_K) | (phase == _SEARCH_P):
            tl.store(ist + _I_THR, tl.maximum(lo, _f2key(t_min)))
            tl.store(ist + _I_PHASE, _READY)

    @triton.jit
    def _search_kernel(logits_ptr, stride_l, V, temp_ptr, topp_ptr, ist_ptr, fst_ptr, ipart_ptr, fpart_ptr,
                       ticket_ptr, chunk, n_chunks, IW: tl.constexpr, FW: tl.constexpr, BLOCK: tl.constexpr,
                       CB: tl.constexpr, MC: tl.constexpr, LAST: tl.constexpr):
        c, r = tl.program_id(0), tl.program_id(1).to(tl.int64)
        ist, fst = ist_ptr + r * _I_WORDS, fst_ptr + r * _F_WORDS
        phase = tl.load(ist + _I_PHASE)
        if (phase == _SEARCH_K) | (phase == _SEARCH_P):
            lo, hi, m = tl.load(ist + _I_LO), tl.load(ist + _I_HI), tl.load(fst + _F_M)
            inv_t, _ = _inv_temperature(temp_ptr, r)
            row_ptr = logits_ptr + r * stride_l
            start = c * chunk
            cand_f, lo_f, hi_f = _candidates(lo, hi, 0, MC)
            cnt, mass, succ, pred, top = _scan(row_ptr, start, tl.minimum(start + chunk, V), inv_t, m, cand_f, lo_f,
                                               hi_f, phase == _SEARCH_P, MC, BLOCK)
            j = tl.arange(0, MC)
            ipart, fpart = ipart_ptr + (r * n_chunks + c) * IW, fpart_ptr + (r * n_chunks + c) * FW
            tl.store(ipart + j, cnt)
            tl.store(fpart + j, mass)
            tl.store(fpart + MC + j, succ)
            tl.store(fpart + 2 * MC + j, pred)
            tl.store(fpart + 3 * MC, top)
            if _last_to_arrive(ticket_ptr + r, n_chunks):
                cnt, mass, succ, pred, top = _search_reduce(ipart_ptr + r * n_chunks * IW, fpart_ptr + r * n_chunks * FW,
                                                            n_chunks, IW, FW, CB, MC)
                keff, target, top_p = tl.load(ist + _I_KEFF), tl.load(fst + _F_TARGET), tl.load(topp_ptr + r)
                t_min = tl.load(fst + _F_TMIN)
                phase, lo, hi, target = _step(phase, lo, hi, keff, target, cnt, mass, succ, pred, top, m, t_min,
                                              top_p, V, ist, fst, MC)
                if LAST:
                    _search_alone(row_ptr, V, inv_t, m, t_min, phase, lo, hi, keff, target, top_p, ist, fst, MC, BLOCK)
                _reset_ticket(ticket_ptr + r)
