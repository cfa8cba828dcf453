"""What the device loop keeps on the device between rounds: the live sequences' state per
slot, the round's row layout, and the ring the committed rows land in.

Every tensor here is allocated once, at a fixed address, and only ever written in place:
the captured plan, the width graphs and the commit read and write them at those
addresses round after round (on CUDA inside one launch of the outer graph; emulated, by
the same code run eagerly). The host writes them only between launches.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor


# The per-row sampling columns of a verify step (models/choose.py) and their pads: a
# padding row, or a greedy one, samples nothing.
SAMPLING = {"temperature": (torch.float32, 0.0), "top_k": (torch.int64, 0), "top_p": (torch.float32, 1.0),
            "min_p": (torch.float32, 0.0), "seed": (torch.int64, 0)}


class Stop(enum.IntEnum):
    """Why a launch of the loop stopped (``LoopState.status``; 0 while it runs)."""

    RUNNING = 0
    FINISHED = 1  # no live sequence is left (each reached max tokens or a stop token)
    ROUNDS = 2  # the launch ran its N rounds
    RING_FULL = 3  # every ring entry holds a round the host has not read
    POOL = 4  # a sequence's next round needs positions the host reserved no KV blocks for
    BAD_TOKEN = 5  # a row would feed a token id outside [0, vocab): the round did not run
    RETIRED = 6  # a sequence finished and the host asked to hear of it (to admit a waiting one)


class Finish(enum.IntEnum):
    """Why a sequence left the loop (``LoopState.finish``)."""

    NOT = 0
    MAX_TOKENS = 1
    STOP_TOKEN = 2


@dataclass(frozen=True)
class LoopShape:
    """The loop's static sizes: ``slots`` sequence slots (the model's sequence ids), ``k``
    drafts per sequence and round (0: plain decoding), the captured ``widths`` (the widest
    holds ``slots * (k + 1)`` rows), the ``vocab`` a fed token must lie in, the pool's
    ``block_size`` and ``scratch_cell`` (padding rows write it), ``depth`` ring entries."""

    slots: int
    k: int
    widths: tuple[int, ...]
    vocab: int
    block_size: int
    scratch_cell: int
    depth: int

    @property
    def rows(self) -> int:
        """Rows the plan writes every round (real rows first, then padding): the widest width."""
        return self.widths[-1]


class LoopState:
    """Per slot (``[slots]``): ``live`` (decoding in the loop), ``uid``, ``n_tok`` (the
    sequence's tokens: prompt + generated; the last one committed, not fed yet),
    ``remaining`` (tokens still to generate), ``prev`` / ``cur`` (its last two tokens),
    ``reserved`` (positions ``[0, reserved)`` have KV blocks), ``last_accept`` (rows the
    last round committed), ``finish`` (:class:`Finish`). Loop-wide (``[1]``): ``status``
    (:class:`Stop`), ``round`` (rounds run in this launch), ``max_rounds``,
    ``stop_on_retire``; ``error`` ``[3]``: (slot, token, position) of a bad token.
    ``stop_tokens``: the ids that end a sequence (``[n]``, maybe empty). ``settings``: the
    slot's sampling settings per column of :data:`SAMPLING` (what the plan writes into a
    sampling verify step's rows; a greedy slot holds the pads)."""

    def __init__(self, slots: int, stop_tokens: tuple[int, ...], device: torch.device):
        z = lambda dtype=torch.int64: torch.zeros(slots, dtype=dtype, device=device)  # noqa: E731
        self.live = z(torch.bool)
        self.uid, self.n_tok, self.remaining, self.prev, self.cur = z(), z(), z(), z(), z()
        self.reserved, self.last_accept, self.finish = z(), z(), z()
        one = lambda: torch.zeros(1, dtype=torch.int64, device=device)  # noqa: E731
        self.status, self.round, self.max_rounds, self.stop_on_retire = one(), one(), one(), one()
        self.error = torch.full((3,), -1, dtype=torch.int64, device=device)
        self.stop_tokens = torch.tensor(stop_tokens, dtype=torch.int64, device=device)
        self.settings = {name: torch.full((slots,), pad, dtype=dtype, device=device)
                         for name, (dtype, pad) in SAMPLING.items()}

    def tensors(self) -> dict[str, Tensor]:
        return {name: v for name, v in vars(self).items() if isinstance(v, Tensor)}


class RoundRows:
    """The round's layout, written by the plan and read by the commit (``[rows]``): the
    slot each row belongs to (``slots`` for a padding row), its index ``j`` in the slot's
    rows (0: the last committed token, then the drafts), and its position. ``width_index``
    (int32 ``[1]``) is the SWITCH's value: the index of the narrowest captured width
    holding the round's rows, or ``len(widths)`` (no branch) when the loop stops; ``go``
    (int32 ``[1]``) the WHILE's value. ``drafts`` ``[slots, k]``: the round's drafts."""

    def __init__(self, shape: LoopShape, device: torch.device):
        n = shape.rows
        self.slot = torch.full((n,), shape.slots, dtype=torch.int64, device=device)
        self.j = torch.zeros(n, dtype=torch.int64, device=device)
        self.pos = torch.zeros(n, dtype=torch.int64, device=device)
        self.width_index = torch.full((1,), len(shape.widths), dtype=torch.int32, device=device)
        self.go = torch.zeros(1, dtype=torch.int32, device=device)
        self.drafts = torch.zeros(shape.slots, shape.k, dtype=torch.int64, device=device)


class LoopRing:
    """Where each round's committed rows land, one entry per round of a launch (the host
    reads entries ``[0, head)`` after the launch; ``head == depth`` stops the loop).

    Entry ``e`` holds ``counts[e]`` rows: ``hidden[e * rows + r]`` the committed hidden row,
    ``tokens`` the token it committed, ``slots`` its sequence slot, ``positions`` the
    position of the token fed there. Row ``depth * rows`` is a dump no one reads (what
    static shapes write for rows that commit nothing). Device memory: the host copies the
    entries it reads after the launch completes."""

    def __init__(self, shape: LoopShape, hidden: int, dtype: torch.dtype, device: torch.device):
        n = shape.depth * shape.rows + 1
        self.depth, self.rows = shape.depth, shape.rows
        self.hidden = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.tokens = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.positions = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.counts = torch.zeros(shape.depth, dtype=torch.int64, device=device)
        self.head = torch.zeros(1, dtype=torch.int64, device=device)
        self.mirror: NoMirror | RingMirror = NoMirror()  # the loop sets a RingMirror to stream rounds

    @property
    def dump(self) -> int:
        return self.depth * self.rows


class NoMirror:
    """The ring is read after each launch only: its commits publish nothing."""

    def publish(self, ring: LoopRing) -> None:
        pass


class RingMirror:
    """A host copy of the ring's tokens, slots, counts and head (pinned on CUDA), which every
    round's commit refreshes, the head last: on CUDA as copies inside the launch, so the
    host reads each round's tokens while the loop runs on. Entries below the mirrored head
    are complete (an entry is written once a launch; the head is copied after it).
    ``reset()`` before each launch."""

    def __init__(self, ring: LoopRing, device: torch.device):
        pin = device.type == "cuda"
        host = lambda t: torch.zeros(t.shape, dtype=t.dtype, pin_memory=pin)  # noqa: E731
        self.tokens, self.slots, self.counts, self.head = (host(ring.tokens), host(ring.slots), host(ring.counts),
                                                           host(ring.head))

    def publish(self, ring: LoopRing) -> None:
        for mine, theirs in ((self.tokens, ring.tokens), (self.slots, ring.slots), (self.counts, ring.counts),
                             (self.head, ring.head)):
            mine.copy_(theirs, non_blocking=True)

    def reset(self) -> None:
        self.head.zero_()


class LoopReadback:
    """What the host reads after a launch: the ring's head, counts, tokens and slots and the
    state's ``n_tok``, ``round``, ``status`` and ``finish``, copied together into host
    buffers (pinned on CUDA) and waited for once (:meth:`fetch`: valid until the next
    fetch); the hidden rows the host keeps, gathered on the device and copied once
    (:meth:`rows`: a fresh host tensor of the caller's)."""

    def __init__(self, ring: LoopRing, state: LoopState, device: torch.device):
        self._pin = device.type == "cuda"
        host = lambda t: torch.zeros(t.shape, dtype=t.dtype, pin_memory=self._pin)  # noqa: E731
        self._device, self._ring = device, ring
        self._pairs = {**{n: getattr(ring, n) for n in ("head", "counts", "tokens", "slots")},
                       **{n: getattr(state, n) for n in ("n_tok", "round", "status", "finish")}}
        self._host = {n: host(t) for n, t in self._pairs.items()}

    def _wait(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()

    def fetch(self) -> dict[str, list[int]]:
        """Every small value as a list of ints (``head``, ``round``, ``status``: one item)."""
        for name, t in self._pairs.items():
            self._host[name].copy_(t, non_blocking=True)
        self._wait()
        return {name: t.tolist() for name, t in self._host.items()}

    def rows(self, order: list[int]) -> torch.Tensor:
        """The ring's hidden rows ``order`` (indices), in that order, on the host: one gather
        on the device and one copy (no host-side indexing of a large tensor)."""
        return self.to_host(self._ring.hidden.index_select(0, torch.tensor(order, device=self._device)))

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A fresh host copy of ``t`` (through pinned memory on CUDA: one copy, one wait)."""
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pin)
        out.copy_(t, non_blocking=True)
        self._wait()
        return out
