"""The sampler's Triton kernels: sorting-free, each row's vocabulary split over many programs.

Grid ``(chunks, N)``; the last program of a row to arrive (an acq_rel ticket) reduces the
row's partials in chunk order and moves the row's phase on. Launches: stats, search x
passes, final (+ residual for a full-q verify, + probabilities when asked). How they work:
ARCHITECTURE.md, "The sampler".
"""
from __future__ import annotations

try:  # Triton is optional: without it only the torch path runs.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

from cudagraph_rt.kernels.sampling.row_state import F_WORDS, I_WORDS  # noqa: F401 - the launcher's

if triton is not None:
    from cudagraph_rt.kernels.sampling.philox import tl_gumbel
    from cudagraph_rt.kernels.sampling.row_state import (  # noqa: F401
        _I_PHASE, _I_LO, _I_HI, _I_THR, _I_KEFF, _I_ARGMAX, _I_WORDS, _F_M, _F_TARGET, _F_ZFIN,
        _F_TMIN, _F_WORDS, _DONE, _SEARCH_K, _SEARCH_P, _READY, _RESIDUAL, _FALLBACK_STEPS,
        _KEY_NEG_INF, _KEY_MAX, _FLT_MAX, _f2key, _key2f, _last_to_arrive,
        _reset_ticket, _row_draft, _inv_temperature, _filtered, _better, _accept_uniform, _load_f32,
    )

    # ----------------------------------------------------------------------------- stats
    @triton.jit
    def _lane_winner(best, bi):
        """(max, first index of it) over per-lane maxima and their first indices (-1: none)."""
        top = tl.max(best, 0)
        first = tl.min(tl.where((best == top) & (bi >= 0), bi, _KEY_MAX), 0)
        return top, tl.where(first == _KEY_MAX, -1, first)

    @triton.jit
    def _stats_scan(row_ptr, start, end, inv_t, noisy, seed, position, stream, d, BLOCK: tl.constexpr):
        """One chunk: (max, first argmax, min, mass relative to the max, Gumbel winner key
        and index over everything but d when ``noisy``). Per-lane accumulators, reduced
        once at the end (the scans' loops make at most one call, the noise: under the
        interpreter every call of a jit function, reductions included, costs a re-patch
        of triton.language)."""
        lane = tl.arange(0, BLOCK)
        mx, am = tl.full([BLOCK], float("-inf"), tl.float32), start + lane
        mn, z = tl.full([BLOCK], float("inf"), tl.float32), tl.full([BLOCK], 0.0, tl.float32)
        best, bi = tl.full([BLOCK], float("-inf"), tl.float32), tl.full([BLOCK], -1, tl.int32)
        for b in range(start, end, BLOCK):
            idx = b + lane
            ok = idx < end
            s = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            am = tl.where(s > mx, idx, am)
            new_mx = tl.maximum(mx, s)
            z = z * tl.where(mx > float("-inf"), tl.exp(mx - new_mx), 0.0) \
                + tl.where(s > float("-inf"), tl.exp(s - new_mx), 0.0)
            mx = new_mx
            mn = tl.minimum(mn, tl.where(ok, s, float("inf")))
            if noisy:
                score = tl.where(ok & (idx != d), s + tl_gumbel(seed, position, stream, b, BLOCK), float("-inf"))
                bi = tl.where(score > best, idx, bi)
                best = tl.maximum(best, score)
        m, first = _lane_winner(mx, am)
        z = tl.sum(tl.where(mx > float("-inf"), z * tl.exp(mx - m), 0.0), 0)
        best, bi = _lane_winner(best, bi)
        return m, tl.where(first < 0, start, first), tl.min(mn, 0), z, best, bi

    @triton.jit
    def _stats_reduce(ipart, fpart, n_chunks, IW: tl.constexpr, FW: tl.constexpr, CB: tl.constexpr):
        """The row's (m, first argmax, min, Z, Gumbel winner) from its chunks' partials."""
        m, am, mn = float("-inf"), tl.full([], 0, tl.int32), float("inf")
        best, bi = float("-inf"), tl.full([], -1, tl.int32)
        for cb in range(0, n_chunks, CB):
            cc = cb + tl.arange(0, CB)
            ok = cc < n_chunks
            mxc = tl.load(fpart + cc * FW, mask=ok, other=float("-inf"), cache_modifier=".cg")
            amc = tl.load(ipart + cc * IW, mask=ok, other=0, cache_modifier=".cg")
            tm = tl.max(mxc, 0)
            m, am = _better(tm, tl.min(tl.where(mxc == tm, amc, _KEY_MAX), 0), m, am)
            mn = tl.minimum(mn, tl.min(tl.load(fpart + cc * FW + 1, mask=ok, other=float("inf"),
                                               cache_modifier=".cg"), 0))
            bgc = tl.load(fpart + cc * FW + 3, mask=ok, other=float("-inf"), cache_modifier=".cg")
            bic = tl.load(ipart + cc * IW + 1, mask=ok, other=-1, cache_modifier=".cg")
            tb = tl.max(bgc, 0)
            best, bi = _better(tb, tl.min(tl.where((bgc == tb) & (bic >= 0), bic, _KEY_MAX), 0), best, bi)
        z = 0.0
        for cb in range(0, n_chunks, CB):
            cc = cb + tl.arange(0, CB)
            ok = cc < n_chunks
            mxc = tl.load(fpart + cc * FW, mask=ok, other=float("-inf"), cache_modifier=".cg")
            zc = tl.load(fpart + cc * FW + 2, mask=ok, other=0.0, cache_modifier=".cg")
            z += tl.sum(tl.where(mxc > float("-inf"), zc * tl.exp(mxc - m), 0.0), 0)
        return m, am, mn, z, best, bi

    @triton.jit
    def _decide(r, d, best, thr, z, m, inv_t, row_ptr, q_row, seed, position, tok_ptr, pd_ptr, ist, fst,
                HAS_DRAFT: tl.constexpr, FULL_Q: tl.constexpr):
        """Row r's token from its Gumbel winner ``best`` over the kept set minus the draft:
        the draft when accepted (u * q(d) < p(d), p(d) = exp(s_d - m) / z on the kept set),
        else the winner (a one-hot q's residual; a full q's residual is left to the
        residual launch: phase RESIDUAL). Stores the token, p(d), threshold and mass."""
        token = tl.where(best < 0, 0, best)
        phase = tl.full([], _DONE, tl.int32)
        pd = 0.0
        if HAS_DRAFT:
            dc = tl.maximum(d, 0)
            s_d = tl.load(row_ptr + dc).to(tl.float32) * inv_t
            pd = tl.where((d >= 0) & (_f2key(s_d) >= thr), tl.math.div_rn(tl.exp(s_d - m), z), 0.0)
            q_d = tl.load(q_row + dc) if FULL_Q else 1.0
            accept = (d >= 0) & (_accept_uniform(seed, position) * q_d < pd)
            token = tl.where(accept, d, token)
            if FULL_Q:
                phase = tl.where((d >= 0) & (~accept), _RESIDUAL, _DONE).to(tl.int32)
        tl.store(tok_ptr + r, token.to(tl.int64))
        tl.store(pd_ptr + r, pd)
        tl.store(ist + _I_PHASE, phase)
        tl.store(ist + _I_THR, thr)
        tl.store(fst + _F_ZFIN, z)

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
    def _stats_finish(r, V, d, m, am, mn, z, best, inv_t, greedy, filtered, row_ptr, q_row, seed, position,
                      topk_ptr, topp_ptr, minp_ptr, tok_ptr, pd_ptr, ist, fst,
                      HAS_DRAFT: tl.constexpr, FULL_Q: tl.constexpr):
        """After the stats: greedy rows take the first maximal logit, unfiltered rows their
        Gumbel winner; filtered rows enter the search (top-k, or a top-k of everything
        resolved at once when it is off)."""
        tl.store(fst + _F_M, m)
        tl.store(ist + _I_ARGMAX, am)
        min_p = tl.load(minp_ptr + r)
        t_min = tl.where(min_p > 0.0, m + tl.log(tl.where(min_p > 0.0, min_p, 1.0)), float("-inf"))
        tl.store(fst + _F_TMIN, t_min)
        if greedy:
            tl.store(tok_ptr + r, am.to(tl.int64))
            tl.store(pd_ptr + r, ((d >= 0) & (d == am)).to(tl.float32))
            tl.store(ist + _I_PHASE, _DONE)
            tl.store(ist + _I_THR, _KEY_NEG_INF)
            tl.store(fst + _F_ZFIN, 1.0)
        elif filtered:
            k = tl.load(topk_ptr + r)
            k_on = (k > 0) & (k < V)
            tl.store(ist + _I_KEFF, tl.where(k_on, k, 0).to(tl.int32))
            lo = _f2key(mn)
            _settle(tl.full([], _SEARCH_K, tl.int32), lo, tl.where(k_on, _f2key(m) + 1, lo + 1), z,
                    tl.full([], 0.0, tl.float32), m, t_min,
                    tl.load(topp_ptr + r), V, ist, fst)
        else:
            _decide(r, d, best, _KEY_NEG_INF, z, m, inv_t, row_ptr, q_row, seed, position, tok_ptr, pd_ptr, ist, fst,
                    HAS_DRAFT, FULL_Q)

    @triton.jit
    def _stats_kernel(logits_ptr, stride_l, V, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, pos_ptr, draft_ptr,
                      q_ptr, stride_q, tok_ptr, pd_ptr, ist_ptr, fst_ptr, ipart_ptr, fpart_ptr, ticket_ptr,
                      chunk, n_chunks, base_stream, IW: tl.constexpr, FW: tl.constexpr, BLOCK: tl.constexpr,
                      CB: tl.constexpr, HAS_DRAFT: tl.constexpr, FULL_Q: tl.constexpr):
        c, r = tl.program_id(0), tl.program_id(1).to(tl.int64)
        inv_t, greedy = _inv_temperature(temp_ptr, r)
        filtered = _filtered(topk_ptr, topp_ptr, minp_ptr, r, V)
        d = _row_draft(draft_ptr, r, V, HAS_DRAFT)
        seed, position = tl.load(seed_ptr + r), tl.load(pos_ptr + r)
        stream = tl.where(d >= 0, 2, base_stream)  # Stream.RESIDUAL with a draft
        row_ptr = logits_ptr + r * stride_l
        start = c * chunk
        mx, am, mn, z, best, bi = _stats_scan(row_ptr, start, tl.minimum(start + chunk, V), inv_t,
                                              (~greedy) & (~filtered), seed, position, stream, d, BLOCK)
        ipart, fpart = ipart_ptr + r * n_chunks * IW, fpart_ptr + r * n_chunks * FW
        tl.store(fpart + c * FW, mx)
        tl.store(fpart + c * FW + 1, mn)
        tl.store(fpart + c * FW + 2, z)
        tl.store(fpart + c * FW + 3, best)
        tl.store(ipart + c * IW, am)
        tl.store(ipart + c * IW + 1, bi)
        if _last_to_arrive(ticket_ptr + r, n_chunks):
            m, am, mn, z, best, bi = _stats_reduce(ipart, fpart, n_chunks, IW, FW, CB)
            _stats_finish(r, V, d, m, am, mn, z, bi, inv_t, greedy, filtered, row_ptr, q_ptr + r * stride_q, seed,
                          position, topk_ptr, topp_ptr, minp_ptr, tok_ptr, pd_ptr, ist_ptr + r * _I_WORDS,
                          fst_ptr + r * _F_WORDS, HAS_DRAFT, FULL_Q)
            _reset_ticket(ticket_ptr + r)

    # ----------------------------------------------------------------------------- search
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

    # ----------------------------------------------------------------------------- final
    @triton.jit
    def _final_scan(row_ptr, start, end, inv_t, m, thr, seed, position, stream, d, BLOCK: tl.constexpr):
        """One chunk: the Gumbel winner over {key >= thr} minus d and the kept mass; tiles
        with nothing kept are only read (no noise drawn)."""
        lane = tl.arange(0, BLOCK)
        best, bi = tl.full([BLOCK], float("-inf"), tl.float32), tl.full([BLOCK], -1, tl.int32)
        z = tl.full([BLOCK], 0.0, tl.float32)
        thr_f = _key2f(thr)
        for b in range(start, end, BLOCK):
            idx = b + lane
            ok = idx < end
            s = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            kept = ok & (s >= thr_f)
            if tl.max(kept.to(tl.int32), 0) > 0:
                z += tl.where(kept & (s > float("-inf")), tl.exp(s - m), 0.0)
                score = tl.where(kept & (idx != d), s + tl_gumbel(seed, position, stream, b, BLOCK), float("-inf"))
                bi = tl.where(score > best, idx, bi)
                best = tl.maximum(best, score)
        best, bi = _lane_winner(best, bi)
        return best, bi, tl.sum(z, 0)

    @triton.jit
    def _winner_reduce(ipart, fpart, n_chunks, slot, IW: tl.constexpr, FW: tl.constexpr, CB: tl.constexpr):
        """The row's first maximal (key, index) over its chunks' partials at ``slot``."""
        best, bi = float("-inf"), tl.full([], -1, tl.int32)
        for cb in range(0, n_chunks, CB):
            cc = cb + tl.arange(0, CB)
            ok = cc < n_chunks
            kc = tl.load(fpart + cc * FW + slot, mask=ok, other=float("-inf"), cache_modifier=".cg")
            ic = tl.load(ipart + cc * IW + slot, mask=ok, other=-1, cache_modifier=".cg")
            tb = tl.max(kc, 0)
            best, bi = _better(tb, tl.min(tl.where((kc == tb) & (ic >= 0), ic, _KEY_MAX), 0), best, bi)
        return best, bi

    @triton.jit
    def _sum_partials(fpart, n_chunks, slot, FW: tl.constexpr, CB: tl.constexpr):
        z = 0.0
        for cb in range(0, n_chunks, CB):
            cc = cb + tl.arange(0, CB)
            z += tl.sum(tl.load(fpart + cc * FW + slot, mask=cc < n_chunks, other=0.0, cache_modifier=".cg"), 0)
        return z

    @triton.jit
    def _final_kernel(logits_ptr, stride_l, V, temp_ptr, seed_ptr, pos_ptr, draft_ptr, q_ptr, stride_q, tok_ptr,
                      pd_ptr, ist_ptr, fst_ptr, ipart_ptr, fpart_ptr, ticket_ptr, chunk, n_chunks, base_stream,
                      IW: tl.constexpr, FW: tl.constexpr, BLOCK: tl.constexpr, CB: tl.constexpr,
                      HAS_DRAFT: tl.constexpr, FULL_Q: tl.constexpr):
        c, r = tl.program_id(0), tl.program_id(1).to(tl.int64)
        ist, fst = ist_ptr + r * _I_WORDS, fst_ptr + r * _F_WORDS
        if tl.load(ist + _I_PHASE) == _READY:
            thr, m = tl.load(ist + _I_THR), tl.load(fst + _F_M)
            inv_t, _ = _inv_temperature(temp_ptr, r)
            d = _row_draft(draft_ptr, r, V, HAS_DRAFT)
            seed, position = tl.load(seed_ptr + r), tl.load(pos_ptr + r)
            row_ptr = logits_ptr + r * stride_l
            start = c * chunk
            best, bi, z = _final_scan(row_ptr, start, tl.minimum(start + chunk, V), inv_t, m, thr, seed, position,
                                      tl.where(d >= 0, 2, base_stream), d, BLOCK)
            ipart, fpart = ipart_ptr + r * n_chunks * IW, fpart_ptr + r * n_chunks * FW
            tl.store(fpart + c * FW, best)
            tl.store(fpart + c * FW + 1, z)
            tl.store(ipart + c * IW, bi)
            if _last_to_arrive(ticket_ptr + r, n_chunks):
                best, bi = _winner_reduce(ipart, fpart, n_chunks, 0, IW, FW, CB)
                z = _sum_partials(fpart, n_chunks, 1, FW, CB)
                _decide(r, d, bi, thr, z, m, inv_t, row_ptr, q_ptr + r * stride_q, seed, position, tok_ptr, pd_ptr,
                        ist, fst, HAS_DRAFT, FULL_Q)
                _reset_ticket(ticket_ptr + r)

    # ----------------------------------------------------------------------------- residual
    @triton.jit
    def _residual_scan(row_ptr, q_row, start, end, inv_t, m, thr, z, seed, position, d, BLOCK: tl.constexpr):
        """One chunk: the Gumbel winner of log(max(0, p - q)) (p = exp(s - m) / z on the
        kept set), and of the kept s but the draft d (used where p - q has no positive entry)."""
        lane = tl.arange(0, BLOCK)
        best, bi = tl.full([BLOCK], float("-inf"), tl.float32), tl.full([BLOCK], -1, tl.int32)
        fb, fi = tl.full([BLOCK], float("-inf"), tl.float32), tl.full([BLOCK], -1, tl.int32)
        thr_f = _key2f(thr)
        for b in range(start, end, BLOCK):
            idx = b + lane
            ok = idx < end
            s = tl.load(row_ptr + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            kept = ok & (s >= thr_f)
            p = tl.math.div_rn(tl.where(kept & (s > float("-inf")), tl.exp(s - m), 0.0), z)
            rest = p - tl.load(q_row + idx, mask=ok, other=0.0)
            g = tl_gumbel(seed, position, tl.full([], 2, tl.int32), b, BLOCK)  # Stream.RESIDUAL
            score = tl.where(ok & (rest > 0.0), tl.log(rest) + g, float("-inf"))
            bi = tl.where(score > best, idx, bi)
            best = tl.maximum(best, score)
            score = tl.where(kept & (idx != d), s + g, float("-inf"))
            fi = tl.where(score > fb, idx, fi)
            fb = tl.maximum(fb, score)
        best, bi = _lane_winner(best, bi)
        fb, fi = _lane_winner(fb, fi)
        return best, bi, fb, fi

    @triton.jit
    def _residual_kernel(logits_ptr, stride_l, V, temp_ptr, seed_ptr, pos_ptr, draft_ptr, q_ptr, stride_q, tok_ptr,
                         ist_ptr, fst_ptr, ipart_ptr, fpart_ptr, ticket_ptr, chunk, n_chunks, IW: tl.constexpr,
                         FW: tl.constexpr, BLOCK: tl.constexpr, CB: tl.constexpr):
        c, r = tl.program_id(0), tl.program_id(1).to(tl.int64)
        ist, fst = ist_ptr + r * _I_WORDS, fst_ptr + r * _F_WORDS
        if tl.load(ist + _I_PHASE) == _RESIDUAL:
            inv_t, _ = _inv_temperature(temp_ptr, r)
            start = c * chunk
            best, bi, fb, fi = _residual_scan(logits_ptr + r * stride_l, q_ptr + r * stride_q, start,
                                              tl.minimum(start + chunk, V), inv_t, tl.load(fst + _F_M),
                                              tl.load(ist + _I_THR), tl.load(fst + _F_ZFIN), tl.load(seed_ptr + r),
                                              tl.load(pos_ptr + r), _row_draft(draft_ptr, r, V, True), BLOCK)
            ipart, fpart = ipart_ptr + r * n_chunks * IW, fpart_ptr + r * n_chunks * FW
            tl.store(fpart + c * FW, best)
            tl.store(fpart + c * FW + 1, fb)
            tl.store(ipart + c * IW, bi)
            tl.store(ipart + c * IW + 1, fi)
            if _last_to_arrive(ticket_ptr + r, n_chunks):
                best, bi = _winner_reduce(ipart, fpart, n_chunks, 0, IW, FW, CB)
                fb, fi = _winner_reduce(ipart, fpart, n_chunks, 1, IW, FW, CB)
                token = tl.where(best > float("-inf"), bi, tl.maximum(fi, 0))
                tl.store(tok_ptr + r, token.to(tl.int64))
                tl.store(ist + _I_PHASE, _DONE)
                _reset_ticket(ticket_ptr + r)

    # ----------------------------------------------------------------------------- probabilities
    @triton.jit
    def _probs_kernel(logits_ptr, stride_l, V, temp_ptr, probs_ptr, stride_p, ist_ptr, fst_ptr, chunk,
                      BLOCK: tl.constexpr):
        """p of every row after the final launch: exp(s - m) / Z on the kept set, 0 elsewhere;
        one-hot at the first maximal logit for greedy rows."""
        c, r = tl.program_id(0), tl.program_id(1).to(tl.int64)
        ist, fst = ist_ptr + r * _I_WORDS, fst_ptr + r * _F_WORDS
        inv_t, greedy = _inv_temperature(temp_ptr, r)
        thr, m, z, am = tl.load(ist + _I_THR), tl.load(fst + _F_M), tl.load(fst + _F_ZFIN), tl.load(ist + _I_ARGMAX)
        start = c * chunk
        end = tl.minimum(start + chunk, V)
        thr_f = _key2f(thr)
        for b in range(start, end, BLOCK):
            idx = b + tl.arange(0, BLOCK)
            ok = idx < end
            s = tl.load(logits_ptr + r * stride_l + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
            p = tl.math.div_rn(tl.where((s >= thr_f) & (s > float("-inf")), tl.exp(s - m), 0.0), z)
            p = tl.where(greedy, (idx == am).to(tl.float32), p)
            tl.store(probs_ptr + r * stride_p + idx, p, mask=ok)
