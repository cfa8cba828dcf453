"""The pinned ring of host row slots and the handle of one step's rows.

A step's accepted rows are gathered (inside the captured graph on CUDA) straight into one
slot of a ring of pinned host buffers. The step's handle waits only on that slot's event.
"""
from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import torch

from .._cuda import record_event
from ..errors import CapacityError, DeviceRowIndexError, StaleRowsError


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
        pin = self.pinned = device.type == "cuda"
        self.dst = torch.empty((depth + 1, capacity, H), dtype=dtype, pin_memory=pin)
        self.meta = torch.zeros((depth + 1, 2 + capacity), dtype=torch.int32, pin_memory=pin)
        self.spare = depth
        self._events = [torch.cuda.Event() if pin else None for _ in range(depth)]
        self._held: list[Any] = [None] * depth  # weakref to the live handle, or None
        self._gen = [0] * depth
        self._next = 0
        self._step = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the slots and their meta."""
        return self.dst.nbytes + self.meta.nbytes

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
