"""Host rows on their way into the arena.

`HostArena`: one host buffer laid out like the arena (pinned on CUDA). `PinnedStaging`:
two of them that CUDA steps alternate between, each copied to the device arena in one
stream-ordered copy. `CpuStaging`: graphs off on a CPU, where the arena is host memory
and rows go straight in; its one host arena only backs ``host_inputs()`` views, so that
views kept past their step are told apart from the arena (and refused) as on CUDA. Both
are arena stagers (``stager.ArenaStager``, the interface the feed shares too); the owner
never asks which device it is on.
"""
from __future__ import annotations

import ctypes
from typing import Any, Mapping

import torch

from .._cuda import RawEvent, copy_h2d, cudart
from .arena import ONE_COPY_BYTES, ArenaLayout, numpy_views
from .casting import NUMPY_DTYPES
from .validate import Prepared


def put_rows(dst: torch.Tensor, dst_np, t: torch.Tensor, start: int, length: int) -> None:
    """Rows ``[start, start+length)`` of ``t`` into rows ``[0, length)`` of host ``dst``
    when no memmove can (a cast, or strided rows): numpy where it can (a fraction of
    torch's per-op cost), else torch (bfloat16 and other dtypes numpy lacks)."""
    if dst_np is not None and t.dtype in NUMPY_DTYPES and t.device.type == "cpu":
        dst_np[:length] = t.detach().numpy()[start:start + length]
    else:  # (detached: the staging must never join an autograd graph)
        dst[:length].copy_(t[start:start + length].detach())


class HostArena:
    """One host buffer with the arena's layout: views, numpy views, raw row pointers, and
    per input how many leading rows may hold real rows (``dirty``), so that a narrower
    write pads the rest. Lifetime: as long as its owner."""

    def __init__(self, layout: ArenaLayout, pinned: bool):
        self.layout, self.pinned = layout, pinned
        self.buf = torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.views = layout.carve(self.buf)
        layout.fill_pads(self.views)
        self.np = numpy_views(self.views)
        self.ptr = {n: v.data_ptr() for n, v in self.views.items()}
        self.dirty = {n: 0 for n in layout.specs}
        self._pads = {n: s.pad for n, s in layout.specs.items()}

    def stage(self, name: str, t: torch.Tensor, p: int | None, start: int, length: int, width: int = 0) -> None:
        """Rows ``[start, start+length)`` of ``t`` (data pointer ``p`` when a memmove can
        take them) into rows ``[0, length)``, and pad values into rows a wider step left
        and into the step's padding rows ``[length, width)`` whatever the bookkeeping says
        (views written after their step leave rows it cannot see)."""
        dirty = self.dirty
        if dirty[name] < length:  # raised first: an interrupted copy leaves no untracked rows
            dirty[name] = length
        if p is not None:
            nb = self.layout.row_bytes[name]
            if p + start * nb != self.ptr[name]:  # else: written in place (host_inputs)
                ctypes.memmove(self.ptr[name], p + start * nb, length * nb)
        else:
            put_rows(self.views[name], self.np[name], t, start, length)
        hi = max(dirty[name], width)
        if hi > length:
            self.fill_pad(name, length, hi)
        dirty[name] = length

    def fill_pad(self, name: str, lo: int, hi: int) -> None:
        a = self.np[name]
        if a is not None:
            a[lo:hi] = self._pads[name]
        else:  # bfloat16 and other dtypes numpy lacks
            self.views[name][lo:hi].fill_(self._pads[name])

    def mark(self, T: int) -> None:
        """Rows ``[:T]`` were handed out to be filled: the next narrower write pads them."""
        for name, d in self.dirty.items():
            if d < T:
                self.dirty[name] = T

    def set_control(self, control: Mapping[str, Any]) -> None:
        for name, v in control.items():
            self.np[name][:len(v)] = v


class _InArena:
    """What the arena stagers share: graphs over them read the arena as it is (no
    prologue, nothing fed, nothing to reset: every write pads what earlier ones left)."""

    fed = False
    short_path = False
    arenas: list[HostArena]  # set by each stager
    next: int

    def prologue(self) -> None:
        pass

    def unfeed(self) -> None:
        pass

    def reset(self, control: Mapping[str, Any] | None) -> None:
        pass

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [a.buf for a in self.arenas]

    def digest_state(self) -> list:
        return [self.next, [a.dirty for a in self.arenas]]


class CpuStaging(_InArena):
    """Graphs off on a CPU: ``write`` puts rows straight into the (host) arena."""

    next = 0  # the id of the host arena host_inputs() hands out; never changes here

    def __init__(self, layout: ArenaLayout, full: Mapping[str, torch.Tensor]):
        self.layout, self._full = layout, full
        self._full_np = numpy_views(full)
        self._full_ptr = {n: v.data_ptr() for n, v in full.items()}
        self.arenas = [HostArena(layout, pinned=False)]

    def take_for_control(self) -> None:
        """Control blocks go straight into the arena: no host arena is taken."""
        return None

    def wait(self, k: int) -> None:
        """Nothing is in flight on a CPU."""

    def write(self, prep: Prepared, start: int, length: int, width: int, control) -> None:
        """Every step writes the arena itself (its host arena's handed views are used up
        all the same: the owner drops them on every write)."""
        ptrs, nbs, pads = prep.host_ptrs, self.layout.row_bytes, self.layout.specs
        for name, t in prep.tensors.items():
            p = ptrs.get(name)
            if p is not None:
                nb = nbs[name]
                if p + start * nb != self._full_ptr[name]:  # else: the rows are in place
                    ctypes.memmove(self._full_ptr[name], p + start * nb, length * nb)
            elif name not in prep.zero_copy:
                put_rows(self._full[name], self._full_np[name], t, start, length)
            self._full[name][length:width].fill_(pads[name].pad)
        for name, v in (control or {}).items():
            self._full_np[name][:len(v)] = v

    def write_control(self, k: None, control: Mapping[str, Any]) -> None:
        for name, v in control.items():
            self._full_np[name][:len(v)] = v

    @property
    def pinned(self) -> list[torch.Tensor]:
        return []


class PinnedStaging(_InArena):
    """Two pinned arenas that steps alternate between. Each waits for its own previous
    host-to-device copy before it is rewritten, so the host never overwrites bytes still
    in flight. A small arena crosses the bus in one copy (latency-bound), else one per
    input; device rows are copied device-to-device, stream-ordered after it.

    A device input is one on the arena's device with no host pointer taken: rows a
    caller wrote into the arena itself (``device_inputs()``: zero copy) are never copied
    over. Built on a CUDA device by ``stagers()``; ``pinned=False`` and ``events`` (two
    objects with ``record`` and ``synchronize``) build it over plain memory on a CPU, for
    tests of its bookkeeping (the arena's device is then the CPU)."""

    def __init__(self, layout: ArenaLayout, arena: torch.Tensor, full: Mapping[str, torch.Tensor], device, *,
                 pinned: bool = True, events: list | None = None):
        self.layout, self.arena, self._full, self.device = layout, arena, full, device
        self.arenas = [HostArena(layout, pinned=pinned) for _ in range(2)]
        self._rt = cudart() if arena.is_cuda else None  # (copy_h2d: torch's copy without it)
        self._events = events if events is not None else [RawEvent(device.index, self._rt) for _ in self.arenas]
        self._on = arena.device
        self.next = 0

    def take(self) -> int:
        """The arena the next write uses, once its previous copy has left it."""
        k = self.next
        self.next = k ^ 1
        self._events[k].synchronize()
        return k

    def wait(self, k: int) -> None:
        self._events[k].synchronize()

    def take_for_control(self) -> int:
        return self.take()

    def write(self, prep: Prepared, start: int, length: int, width: int, control) -> None:
        k = self.take()
        a, ptrs, zero_copy = self.arenas[k], prep.host_ptrs, prep.zero_copy
        host, dev = [], []
        for name, t in prep.tensors.items():
            p = ptrs.get(name)
            if p is not None or t.device != self._on:
                host.append(name)
                a.stage(name, t, p, start, length, width)
            else:
                dev.append(name)
        if control:
            a.set_control(control)
            host += list(control)
        # One copy of the whole (small) arena when some input comes from the host and none
        # was written in place on the device: a device input's rows then come from staging
        # as pad values, and its real rows are copied over them right after, in stream
        # order. With device inputs only, no copy crosses the bus and padding is a fill.
        one_copy = bool(host) and self.layout.nbytes <= ONE_COPY_BYTES and not zero_copy.intersection(dev)
        if one_copy:
            for name in dev:
                if a.dirty[name] > 0:
                    a.fill_pad(name, 0, a.dirty[name])
                    a.dirty[name] = 0
        if host:
            self._copy(k, host, width, one_copy)
        for name in dev:
            if name not in zero_copy:
                self._full[name][:length].copy_(prep.tensors[name][start:start + length], non_blocking=True)
            if width > length and not one_copy:
                self._full[name][length:width].fill_(self.layout.specs[name].pad)
        self._events[k].record()

    def write_control(self, k: int, control: Mapping[str, Any]) -> None:
        self.arenas[k].set_control(control)
        self._copy(k, list(control), 0, one_copy=False)
        self._events[k].record()

    def _copy(self, k: int, names: list[str], width: int, one_copy: bool) -> None:
        src = self.arenas[k]
        if one_copy:
            copy_h2d(self._rt, self.arena, src.buf, self.layout.nbytes, self.device.index)
            return
        for name in names:
            dst, s = self._full[name], src.views[name]
            if name in self.layout.specs:
                dst, s = dst[:width], s[:width]
            dst.copy_(s, non_blocking=True)

    @property
    def pinned(self) -> list[torch.Tensor]:
        return [a.buf for a in self.arenas]
