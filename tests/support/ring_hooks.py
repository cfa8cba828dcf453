"""Test hooks into a GraphRuntime's host-row ring, for suites that poison a slot before a
step (to see that the gather wrote every row it should) or compare the slots a step must
not touch. Test support only (not shipped in the package): it reads the ring's private
state, whose layout is not part of the API."""
from __future__ import annotations

from cudagraph_rt.host_rows import HostRowRing


def host_ring(rt) -> HostRowRing | None:
    """The runtime's host-row ring (None before the first-use probe sized it, or without
    HostRows). ``dst[slot]`` rows, ``meta[slot]`` = [count, error bits, indices...]."""
    return rt._row_choice.ring  # NoHostRows has none


def poison_next_slot(rt) -> None:
    """NaN rows and -7 meta into the ring slot the next shipping step will use, if free."""
    ring = host_ring(rt)
    if ring is None:
        return
    ref = ring._held[ring._next]
    h = ref() if ref is not None else None
    if h is None or h.released:
        ring.dst[ring._next].fill_(float("nan"))
        ring.meta[ring._next].fill_(-7)
