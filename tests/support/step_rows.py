"""Hypothesis draws of a step's rows for the attention kernels' fuzzes."""
from __future__ import annotations

from hypothesis import strategies as st


def draw_step_rows(data, max_rows: int, max_seq: int, max_pos: int = 31) -> list[tuple[int, int]]:
    """1 to ``max_rows`` rows ``(seq, position)``, seq -1 (padding) to ``max_seq``: a
    sequence's later rows continue its positions (a verify run), its first anywhere in
    0..``max_pos``; positions never pass ``max_pos``."""
    rows = []
    for _ in range(data.draw(st.integers(1, max_rows), label="rows")):
        s = data.draw(st.integers(-1, max_seq), label="seq")
        mine = [p for t, p in rows if t == s]
        p = mine[-1] + 1 if mine and s >= 0 else data.draw(st.integers(0, max_pos), label="position")
        rows.append((s, min(p, max_pos)))
    return rows
