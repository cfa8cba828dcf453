"""The sampler's Triton kernels: sorting-free, each row's vocabulary split over many programs.

Grid ``(chunks, N)``; the last program of a row to arrive (an acq_rel ticket) reduces the
row's partials in chunk order and moves the row's phase on. Launches: stats, the search
(``search_kernels.py``), final (+ residual for a full-q verify, + probabilities when
asked). How they work: ARCHITECTURE.md, "The sampler".
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
    from cudagraph_rt.kernels.sampling.row_state import (
        _I_PHASE, _I_THR, _I_KEFF, _I_ARGMAX, _I_WORDS, _F_M, _F_ZFIN, _F_TMIN, _F_WORDS, _DONE, _SEARCH_K,
        _READY, _RESIDUAL, _KEY_NEG_INF, _KEY_MAX, _f2key, _key2f, _last_to_arrive, _reset_ticket, _row_draft,
        _inv_temperature, _filtered, _better, _accept_uniform,
    )
    from cudagraph_rt.kernels.sampling.search_kernels import _settle

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
