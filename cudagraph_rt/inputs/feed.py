"""The feed of fed graphs: a pinned arena that each captured graph copies in itself.

Every captured width starts with :meth:`Feed.prologue`: copy the feed to a device mirror,
record the feed event, and move into the arena the words of every input the feed holds
this step (its ``__src__`` flags; device inputs keep the rows copied into the arena before
the replay). A graph step then costs the host no copy call and no event record, only a
wait on the feed event (the last replay's copy has left the feed) before writing it.
"""
from __future__ import annotations

from ctypes import memmove
from typing import Any, Mapping

import torch

from .arena import SRC, ArenaLayout
from .staging import HostArena
from .validate import Prepared


class Feed:
    """The feed arena, its device mirror and its external event. Lifetime: the runtime's;
    the graphs bake in the addresses of the feed, the mirror and the arena."""

    def __init__(self, layout: ArenaLayout, arena: torch.Tensor, full: Mapping[str, torch.Tensor], event,
                 pinned: bool = True):
        self.layout, self.arena, self._full, self.event = layout, arena, full, event
        self.host = HostArena(layout, pinned=pinned)  # plain memory only in CPU tests
        self.host.views[SRC].fill_(True)
        self.mirror = torch.empty_like(arena)
        self._mirror_src = layout.carve(self.mirror)[SRC]
        self._word_src = layout.input_of_word().to(arena.device)
        self._arena_words, self._mirror_words = arena.view(torch.int32), self.mirror.view(torch.int32)
        self._flags = [True] * len(layout.specs)  # host copy of the feed's per-input flags
        self.all_host = True  # every flag set: the graphs take every input from the feed
        self._rows = [(n, self.host.ptr[n], layout.row_bytes[n]) for n in layout.specs]

    def write(self, prep: Prepared, start: int, length: int, width: int, control) -> None:
        """Host rows (and control blocks) into the feed, which the graph copies itself;
        device rows into the arena (rows ``[length, width)`` padded), flagged so that the
        graph keeps them."""
        self.event.synchronize()  # the last replay's copy has left the feed
        self.all_host = False  # first: an interrupted write leaves the short path off (it keeps no flags)
        h, flags_np, flags, dev = self.host, self.host.np[SRC], self._flags, []
        ptrs = prep.host_ptrs
        for i, (name, t) in enumerate(prep.tensors.items()):
            p = ptrs.get(name)
            if p is not None or not t.is_cuda:
                h.stage(name, t, p, start, length)
                if not flags[i]:  # the feed's byte first: it is what the graph reads
                    flags_np[i] = flags[i] = True
            else:
                if flags[i]:
                    flags_np[i] = flags[i] = False
                dev.append(name)
        self.all_host = not dev
        if control:
            h.set_control(control)
        for name in dev:
            if name not in prep.zero_copy:
                self._full[name][:length].copy_(prep.tensors[name][start:start + length], non_blocking=True)
            if width > length:
                self._full[name][length:width].fill_(self.layout.specs[name].pad)

    def write_rows(self, ptrs: list[int] | None, T: int) -> None:
        """``write`` for host rows only (``all_host``): ``ptrs`` (spec order) point at T
        contiguous rows of each input, or None for rows already written in place (the
        views ``host_inputs`` handed out, after waiting on the feed event itself); rows a
        wider step left are padded."""
        h = self.host
        dirty = h.dirty
        if ptrs is not None:
            self.event.synchronize()  # the last replay's copy has left the feed
            for (name, dst, nb), p in zip(self._rows, ptrs):
                d = dirty[name]
                if d < T:  # raised first: an interrupted copy leaves no untracked rows
                    dirty[name] = T
                memmove(dst, p, T * nb)
                if d > T:
                    h.fill_pad(name, T, d)
                    dirty[name] = T
            return
        synced = False
        for name, _, _ in self._rows:
            d = dirty[name]
            if d > T:  # handed rows [:d], T of them stepped: the rest become padding
                if not synced:  # (a graph replayed by hand since may still read the feed)
                    self.event.synchronize()
                    synced = True
                h.fill_pad(name, T, d)
                dirty[name] = T

    def unfeed(self) -> None:
        """Graphs keep every input's arena rows until the next step (which feeds again):
        for a caller that writes the arena itself and replays a graph directly."""
        if not any(self._flags):
            return
        self.event.synchronize()
        self.all_host = False  # first, as in write
        self.host.np[SRC][:len(self._flags)] = False
        self._flags = [False] * len(self._flags)

    def prologue(self) -> None:
        """The first work of every fed graph (captured with it)."""
        self.mirror.copy_(self.host.buf, non_blocking=True)
        self.event.record()  # external: a node of the graph, waited on by write()
        keep = self._mirror_src[self._word_src]
        torch.where(keep, self._mirror_words, self._arena_words, out=self._arena_words)

    def reset(self, control: Mapping[str, Any] | None) -> None:
        """Padding only: the prologue copies the feed at warm-up and capture too."""
        self.event.synchronize()
        self.layout.fill_pads(self.host.views, control)
        self.host.views[SRC].fill_(True)
        self._flags = [True] * len(self._flags)
        self.all_host = True
        self.host.dirty = {n: 0 for n in self.layout.specs}
