"""The feed of fed graphs: a pinned arena that each captured graph copies in itself.

Every captured width starts with :meth:`Feed.prologue`: copy the feed to a device mirror,
record the feed event, move into the arena the words of every input the feed holds this
step (its ``__src__`` flags; device inputs keep the rows copied into the arena before the
replay), then write the pad values into every row from the step's T on (the ``__t__``
word): padding rows are the pads whatever the feed or the arena held, even rows a caller
wrote into views after their step (which no host bookkeeping sees). A graph step then
costs the host no copy call and no event record, only a wait on the feed event (the last
replay's copy has left the feed) before writing it.

The feed is the graph stager of a runtime whose graphs are fed (``stager.Stager``: the
interface the two arena stagers share); ``write_rows`` and ``all_host`` are its own, for
the short path.
"""
from __future__ import annotations

from ctypes import memmove
from typing import Any, Mapping

import torch

from .arena import ROWS_T, SRC, ArenaLayout
from .staging import HostArena
from .validate import Prepared


class Feed:
    """The feed arena, its device mirror and its external event. Lifetime: the runtime's;
    the graphs bake in the addresses of the feed, the mirror and the arena. A stager:
    ``write`` leaves host rows in the feed for the next replay's prologue to copy in."""

    fed = True
    short_path = True
    next = 0  # its one host arena, the feed, is always the next one
    arenas: list[HostArena]

    @staticmethod
    def control_blocks(n_inputs: int) -> dict[str, tuple[int, torch.dtype]]:
        """The control blocks a layout needs for a feed of ``n_inputs`` inputs."""
        return {SRC: (n_inputs + 1, torch.bool), ROWS_T: (1, torch.int32)}

    def __init__(self, layout: ArenaLayout, arena: torch.Tensor, full: Mapping[str, torch.Tensor], event,
                 pinned: bool = True):
        self.layout, self.arena, self._full, self.event = layout, arena, full, event
        self.host = HostArena(layout, pinned=pinned)  # plain memory on a CPU (emulated graphs, tests)
        self.host.views[SRC].fill_(True)
        self.arenas = [self.host]  # (a list made once: host_inputs() indexes it per step)
        self.mirror = torch.empty_like(arena)
        mirror = layout.carve(self.mirror)
        self._mirror_src, self._mirror_t = mirror[SRC], mirror[ROWS_T]
        self._t, self._t_now = self.host.np[ROWS_T], 0  # the feed's T word, and what it holds
        self._row_of_byte = layout.row_of_byte().to(arena.device)
        self._pad_bytes = layout.pad_bytes().to(arena.device)
        self._word_src = layout.input_of_word().to(arena.device)
        self._arena_words, self._mirror_words = arena.view(torch.int32), self.mirror.view(torch.int32)
        self._flags = [True] * len(layout.specs)  # host copy of the feed's per-input flags
        self.all_host = True  # every flag set: the graphs take every input from the feed
        self._rows = [(n, self.host.ptr[n], layout.row_bytes[n]) for n in layout.specs]

    @property
    def pinned(self) -> list[torch.Tensor]:
        return [self.host.buf] if self.host.pinned else []

    @property
    def buffers(self) -> list[torch.Tensor]:
        return [self.host.buf, self.mirror]

    def wait(self, k: int) -> None:
        """Until the last replay's copy has left the feed."""
        self.event.synchronize()

    def digest_state(self) -> list:
        return [[self.host.dirty], self._flags, self.all_host, self._t_now]

    def write(self, prep: Prepared, start: int, length: int, width: int, control) -> None:
        """Host rows (and control blocks) into the feed, which the graph copies itself;
        device rows into the arena (rows ``[length, width)`` padded), flagged so that the
        graph keeps them."""
        self.event.synchronize()  # the last replay's copy has left the feed
        self.all_host = False  # first: an interrupted write leaves the short path off (it keeps no flags)
        self._set_t(length)
        h, flags_np, flags, dev = self.host, self.host.np[SRC], self._flags, []
        ptrs = prep.host_ptrs
        for i, (name, t) in enumerate(prep.tensors.items()):
            p = ptrs.get(name)
            if p is not None or not t.is_cuda:
                h.stage(name, t, p, start, length, width)
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
            if self._t_now != T:
                self._set_t(T)
            for (name, dst, nb), p in zip(self._rows, ptrs):
                d = dirty[name]
                if d < T:  # raised first: an interrupted copy leaves no untracked rows
                    dirty[name] = T
                memmove(dst, p, T * nb)
                if d > T:
                    h.fill_pad(name, T, d)
                    dirty[name] = T
            return
        synced = self._t_now != T
        if synced:  # (a graph replayed by hand since may still read the feed)
            self.event.synchronize()
            self._set_t(T)
        for name, _, _ in self._rows:
            d = dirty[name]
            if d > T:  # handed rows [:d], T of them stepped: the rest become padding
                if not synced:  # (a graph replayed by hand since may still read the feed)
                    self.event.synchronize()
                    synced = True
                h.fill_pad(name, T, d)
                dirty[name] = T

    def _set_t(self, T: int) -> None:
        """The step's real rows into the feed's T word (after the feed event: the last
        replay's copy has left the feed)."""
        self._t[0] = self._t_now = T

    def unfeed(self) -> None:
        """Graphs keep every input's arena rows, all of them (none padded), until the next
        step (which feeds again): for a caller that writes the arena itself and replays a
        graph directly."""
        if not any(self._flags) and self._t_now == self.layout.rows:
            return
        self.event.synchronize()
        self.all_host = False  # first, as in write
        self.host.np[SRC][:len(self._flags)] = False
        self._flags = [False] * len(self._flags)
        self._set_t(self.layout.rows)

    def prologue(self) -> None:
        """The first work of every fed graph (captured with it)."""
        self.mirror.copy_(self.host.buf, non_blocking=True)
        self.event.record()  # external: a node of the graph, waited on by write()
        keep = self._mirror_src[self._word_src]
        torch.where(keep, self._mirror_words, self._arena_words, out=self._arena_words)
        pad = self._row_of_byte >= self._mirror_t  # rows [T, ...) of every input
        torch.where(pad, self._pad_bytes, self.arena, out=self.arena)

    def reset(self, control: Mapping[str, Any] | None) -> None:
        """Padding only: the prologue copies the feed at warm-up and capture too."""
        self.event.synchronize()
        self.layout.fill_pads(self.host.views, control)
        self.host.views[SRC].fill_(True)
        self._flags = [True] * len(self._flags)
        self.all_host = True
        self.host.dirty = {n: 0 for n in self.layout.specs}
        self._set_t(0)  # every row is a padding row
