"""The cell attention's Triton code: the attention kernel (``cell_attention_kernel``, one
launch a step: the splits of a context merge inside it) with its jit helpers, and the K/V
write (``write_cells_kernel``). How it works: ARCHITECTURE.md, "The cell attention"; the
launchers, their arguments and checks: :mod:`.launch`.

Every value that changes per step (sequences, positions, block tables, counts) is read on
the device, so one captured launch serves every context length. Offsets into the caches
are 64-bit (cells * Hkv * D passes 2**31 in big pools).
"""
from __future__ import annotations

from ..common import tl, triton

__all__ = ["cell_attention_kernel", "write_cells_kernel"]

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
                ok = own & (tl.zeros([BLOCK_L], tl.int32) + c + u < arrivals)  # (a vector: see write_cells_kernel)
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
    def cell_attention_kernel(
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
    def write_cells_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, cells_ptr, num_cells, s_cells,
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
    cell_attention_kernel = write_cells_kernel = None
