"""Accepted hidden rows to the host: the pinned ring, its handles, and how rows are chosen.

A step's accepted rows are gathered (inside the captured graph on CUDA) straight into one
slot of a ring of pinned host buffers. The step's handle waits only on that slot's event.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from .buffers import record_event
from .errors import CapacityError, DeviceRowIndexError, InputError, StaleRowsError, expected

Mode = Literal["host", "device", "commit"]


@dataclass(frozen=True)
class HostRows:
    """Which output's rows go to the host, and who chooses them.

    - ``mode="host"``: the host passes ``rows=[...]`` (row indices of the step) to
      ``step``; they are staged with the inputs and gathered inside the replay.
    - ``mode="device"``: the step function chooses: its outputs ``rows_output`` ([N]
      int32 indices, packed at the front) and ``count_output`` ([1] int32) are read by the
      captured gather, so one replay verifies, accepts and ships the rows.
    - ``mode="commit"``: the host decides after the step and calls
      ``runtime.commit(result, rows)``; each step snapshots ``source`` on the device so
      later steps may run before the commit (up to ``depth`` steps later).

    ``source`` names the output ([N, H]) whose rows are shipped: a dict key, or a tuple
    index. ``capacity`` is the most rows one step ships (default: the runtime's dynamic
    limit); ``depth`` the number of ring slots (at least 2, so the host reads step k
    while step k+1 runs).
    """

    source: str | int = "hidden"
    mode: Mode = "host"
    capacity: int | None = None
    depth: int = 3
    rows_output: str | int = "accept_rows"
    count_output: str | int = "accept_count"
    allow_duplicates: bool = False

    def __post_init__(self):
        if self.mode not in ("host", "device", "commit"):
            raise InputError(expected("HostRows.mode", "'host', 'device' or 'commit'", repr(self.mode)))
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 2:
            raise InputError(expected("HostRows.depth", "an int >= 2", repr(self.depth)))
        if self.capacity is not None and (
            isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 1
        ):
            raise InputError(expected("HostRows.capacity", "a positive int or None", repr(self.capacity)))


def check_host_rows(rows: Any, T: int, capacity: int, allow_duplicates: bool) -> torch.Tensor:
    """Validate host-chosen row indices of a step of ``T`` rows; returns int32 CPU tensor.

    Raises InputError (type, range, duplicates) or CapacityError (too many) before any
    buffer is written.
    """
    if isinstance(rows, torch.Tensor):
        t = rows.detach()
        if t.device.type != "cpu":
            raise InputError(expected("rows", "host row indices (list, numpy or CPU tensor)", f"a tensor on {t.device}"))
    elif isinstance(rows, np.ndarray):
        if rows.dtype.kind not in "biuf":
            raise InputError(expected("rows", "integer row indices", f"numpy dtype {rows.dtype}"))
        if rows.dtype.kind == "u" and rows.size and int(rows.max()) >= T:
            raise InputError(expected("rows", f"indices in [0, {T})", f"index {int(rows.max())}"))
        rows = rows.astype(np.int64) if rows.dtype.kind == "u" else rows
        t = torch.from_numpy(np.ascontiguousarray(rows) if rows.ndim else rows.copy())
    elif isinstance(rows, (list, tuple, range)):
        if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in rows):
            raise InputError(expected("rows", "integer row indices", f"{list(rows)[:8]}"))
        try:
            t = torch.tensor(list(rows), dtype=torch.int64)
        except (OverflowError, RuntimeError, ValueError):
            raise InputError(expected("rows", f"indices in [0, {T})", "an index beyond int64")) from None
    else:
        raise InputError(expected("rows", "a list, numpy array or CPU tensor of row indices", type(rows).__name__))
    if t.dim() != 1:
        raise InputError(expected("rows", "a 1-D list of row indices", f"shape {tuple(t.shape)}"))
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex:
        raise InputError(expected("rows", "integer row indices", f"dtype {t.dtype}"))
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):  # min()/max() lack these
        a = t.numpy()
        if a.size and int(a.max()) >= T:
            raise InputError(expected("rows", f"indices in [0, {T})", f"index {int(a.max())}"))
        t = torch.from_numpy(a.astype(np.int64))
    if t.numel() > capacity:
        raise CapacityError(expected("rows", f"at most {capacity} rows (HostRows.capacity)", f"{t.numel()} rows"))
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= T:
            bad = lo if lo < 0 else hi
            raise InputError(expected("rows", f"indices in [0, {T})", f"index {bad}"))
        if not allow_duplicates and torch.unique(t).numel() != t.numel():
            raise InputError(expected("rows", "distinct indices (HostRows.allow_duplicates=False)", "duplicates"))
    return t.to(torch.int32)


class HostRowRing:
    """A ring of ``depth`` pinned host slots of ``capacity`` rows of width ``H``, plus one
    spare slot that steps shipping no rows write to.

    ``dst[slot]`` holds the rows, ``meta[slot]`` = ``[count, error_flag, index...]``. A slot
    is held from the step that fills it until its handle is released (explicitly, or by
    being garbage-collected); a step that needs a slot while the next one is still held
    raises CapacityError before anything is written. On CPU the ring is plain memory and
    every write is synchronous.
    """

    def __init__(self, depth: int, capacity: int, H: int, dtype: torch.dtype, device: torch.device):
        self.depth, self.capacity, self.H = depth, capacity, H
        self.device = device
        pin = device.type == "cuda"
        self.dst = torch.empty((depth + 1, capacity, H), dtype=dtype, pin_memory=pin)
        self.meta = torch.zeros((depth + 1, 2 + capacity), dtype=torch.int32, pin_memory=pin)
        self.spare = depth
        self._events = [torch.cuda.Event() if pin else None for _ in range(depth)]
        self._held: list[Any] = [None] * depth  # weakref to the live handle, or None
        self._gen = [0] * depth
        self._next = 0
        self._step = 0

    def digest_parts(self) -> list:
        """Rows, meta and bookkeeping, for ``StateDigest``."""
        held = [(r() is not None and not r().released) if r is not None else False for r in self._held]
        return [self.dst, self.meta, self._next, self._gen, self._step, held]

    def check_free(self) -> int:
        """The slot the next step will use; CapacityError if it is still held."""
        slot = self._next
        ref = self._held[slot]
        h = ref() if ref is not None else None
        if h is not None and not h.released:
            raise CapacityError(
                f"host-row ring: slot {slot} still holds step {h.step}'s rows; release() or drop "
                f"that handle before stepping again, or raise HostRows.depth (now {self.depth})"
            )
        return slot

    def acquire(self) -> int:
        """Take the next slot (call only after ``check_free``). The gather rewrites the
        slot's count and flag itself, so the host writes nothing here."""
        slot = self.check_free()
        self._next = (slot + 1) % self.depth
        self._gen[slot] += 1
        return slot

    def unacquire(self, slot: int) -> None:
        """Give back a slot taken by a step that then failed: the next step takes it again,
        and the ring's bookkeeping is as before the step. (The handle of the slot's earlier
        step was released or dropped, so whatever the failed step wrote is read by no one.)"""
        self._next = slot
        self._gen[slot] -= 1

    def publish(self, slot: int, T: int, host_count: int | None) -> "HostRowsHandle":
        """Record the slot's event on the current stream and hand out its handle."""
        ev = self._events[slot]
        if ev is not None:
            record_event(ev, self.device.index)
        self._step += 1
        h = HostRowsHandle(self, slot, self._gen[slot], self._step, T, host_count)
        self._held[slot] = weakref.ref(h)
        return h


class HostRowsHandle:
    """The accepted rows of one step, in a pinned host slot.

    ``rows()`` waits for this slot's event only (not the whole device), then returns a
    ``[count, H]`` CPU view of the slot, valid while the handle is held; ``release()`` (or
    dropping the handle) lets a later step reuse the slot, after which reading raises
    StaleRowsError. A device-chosen index out of range raises DeviceRowIndexError on read.
    """

    def __init__(self, ring: HostRowRing, slot: int, gen: int, step: int, T: int, host_count: int | None):
        self._ring, self.slot, self._gen, self.step, self.T = ring, slot, gen, step, T
        self.released = False

    def ready(self) -> bool:
        """True once the rows are on the host (never blocks)."""
        ev = self._ring._events[self.slot]
        return ev is None or ev.query()

    def wait(self) -> "HostRowsHandle":
        self._check()
        ev = self._ring._events[self.slot]
        if ev is not None:
            ev.synchronize()
        self._check()
        flag = int(self._ring.meta[self.slot, 1])
        if flag:
            raise DeviceRowIndexError(f"host rows of step {self.step}: " + "; ".join(self._flag_causes(flag)))
        return self

    def _flag_causes(self, flag: int) -> list[str]:
        """The gather's error bits (kernels.row_gather FLAG_*) in words."""
        causes = []
        if flag & 1:
            causes.append(f"the device chose row indices outside [0, {self.T}); those rows were not written")
        if flag & 2:
            causes.append(f"the device accepted more rows than HostRows.capacity ({self._ring.capacity}); "
                          f"rows past it were not written")
        if flag & 4:
            causes.append(f"the device's accept count was negative or above the rows the step ran "
                          f"(T={self.T} padded to its width)")
        if flag & ~7:
            causes.append(f"internal gather error (flag {flag})")
        return causes

    @property
    def count(self) -> int:
        self.wait()
        return int(self._ring.meta[self.slot, 0])

    def rows(self, copy: bool = False) -> torch.Tensor:
        """``[count, H]`` rows on the host (a view of the slot unless ``copy``)."""
        n = self.count
        out = self._ring.dst[self.slot, :n]
        return out.clone() if copy else out

    def indices(self) -> torch.Tensor:
        """The step's row index of each returned row, ``[count]`` int32 on the host."""
        n = self.count
        return self._ring.meta[self.slot, 2:2 + n].clone()

    def numpy(self) -> np.ndarray:
        r = self.rows()
        return r.float().numpy() if r.dtype == torch.bfloat16 else r.numpy()

    def release(self) -> None:
        """Give the slot back; the handle can no longer be read."""
        self.released = True

    def _check(self) -> None:
        if self.released or self._ring._gen[self.slot] != self._gen:
            raise StaleRowsError(
                f"host rows of step {self.step} (ring slot {self.slot}) were released or reused "
                f"by a later step; copy them (rows(copy=True)) before releasing"
            )

    def __repr__(self) -> str:
        return f"HostRowsHandle(step={self.step}, slot={self.slot}, T={self.T})"
