"""`StateDigest`: a fingerprint of everything a runtime's calls may write, so a test (or a
cautious engine) can check that a refused call wrote nothing without reading private
attributes."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields
from typing import Any, Iterable

import torch


def fingerprint(parts: Iterable[Any]) -> str:
    """blake2b over tensors (their bytes, copied to the host) and plain values (repr)."""
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        if isinstance(p, torch.Tensor):
            t = p.detach()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.contiguous().view(-1).view(torch.uint8).cpu().numpy().data)
        else:
            h.update(repr(p).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class StateDigest:
    """What ``GraphRuntime.state_digest()`` returns: one fingerprint per part.

    - ``arena``: the device input arena (every input's rows and the control blocks);
    - ``staging``: the pinned staging arenas and the fed graphs' feed, with their
      bookkeeping (which arena is next, how many rows each holds);
    - ``ring``: the host-row ring's rows and meta, its next slot, generations and which
      slots are held;
    - ``snapshots``: the commit mode's device snapshots, their generations, the next one;
    - ``counters``: ``stats()`` as a tuple.

    Two digests are equal (``==``) when nothing changed; ``changed(other)`` names the
    parts that differ. Parts that do not exist yet (the ring before the first capture)
    read ``"-"``: a part built since is new memory, not a write, and ``changed`` skips it.
    """

    arena: str
    staging: str
    ring: str
    snapshots: str
    counters: tuple

    def changed(self, other: "StateDigest") -> list[str]:
        """Names of the parts that differ from ``other`` (parts absent in either skipped)."""
        out = []
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if a != b and "-" not in (a, b):
                out.append(f.name)
        return out


def runtime_digest(inputs, row_choice, stats) -> StateDigest:
    """The StateDigest of a runtime's static inputs, row choice and stats."""
    arena, staging = inputs.digest_parts()
    ring, snaps = row_choice.digest()
    counters = (stats.steps, stats.slices, stats.padding_rows, *(tuple(sorted(m.items())) for m in
                (stats.graph_replays, stats.eager_calls, stats.dynamic_calls)), stats.commits)
    return StateDigest(fingerprint(arena), fingerprint(staging), ring, snaps, counters)
