"""Static inputs: one device arena, per-width views, validation, and the stagers.

`StaticInputs` owns every buffer a graph reads its inputs from. Steps write the real rows
and the padding rows into it; graphs captured over its views read them at replay. Rooms:
``arena`` (layout, views), ``validate`` (the checks; casting rules in ``specs``),
``stager`` (what a stager offers, and which two a runtime holds), ``staging`` (the arena
stagers: a CPU's and a pinned one), ``feed`` (the stager of fed graphs).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Mapping

import torch

from ..errors import BusyError, InputError, expected
from .spec import InputSpec
from .arena import ArenaLayout
from .feed import Feed
from .stager import ArenaStager, Stager, stagers
from .validate import Prepared, Validator

__all__ = ["ArenaStager", "Prepared", "Stager", "StaticInputs"]


class _ArenaItself:
    """Where device views are handed from: the device arena, which no stager takes, so
    views of it stay live (their ``k`` is always ``next``)."""

    next = 0


_DEVICE = _ArenaItself()


def _ranges(bufs: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs]


class StaticInputs:
    """Owns the static input buffers of one runtime.

    One device arena (``rows`` rows of every input, each a contiguous aligned block, plus
    fixed-size control blocks); ``views(N)`` gives the first N rows of every input: graphs
    are captured over these views and read them at replay, so the arena is never
    reallocated. It starts filled with the pad values, so warm-up and capture run on
    padding rows only. Two stagers bring host rows in (``inputs/stager.py``): the arena
    stager (``stager``: two alternating pinned arenas on CUDA, straight writes on a CPU) for
    eager slices and control blocks, the graph stager (``graph_stager``) for graph slices:
    the feed where graphs are fed (a ``feed_event``, which the graph mode gives, and a
    small arena: they copy their host rows in themselves), else the arena stager. Each
    executor holds the stager its rows go through; nothing here or there asks which.

    Handed views (``host_views``/``device_views``) are recognised by identity in
    ``prepare`` and good for the next step only, from the thread that asked: every step
    uses up the host views handed out before it, whatever it wrote, and while views
    handed to one thread are not stepped, another thread's step is refused (BusyError).
    """

    def __init__(self, specs: Mapping[str, InputSpec], rows: int, device: torch.device,
                 control: Mapping[str, tuple[int, torch.dtype]] | None = None, feed_event=None):
        self.specs, self.rows, self.device = dict(specs), rows, device
        control = dict(control or {})
        if feed_event is not None:
            control.update(Feed.control_blocks(len(self.specs)))
        self.layout = layout = ArenaLayout(self.specs, rows, control)
        self.nbytes, self.control_specs = layout.nbytes, layout.control
        self.arena = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)
        self._full = layout.carve(self.arena)
        layout.fill_pads(self._full)
        self.stager: ArenaStager
        self.graph_stager: Stager
        self.stager, self.graph_stager = stagers(layout, self.arena, self._full, device, feed_event)
        self._stagers = list({id(s): s for s in (self.stager, self.graph_stager)}.values())  # each once
        bufs = [self.arena, *(b for s in self._stagers for b in s.buffers)]
        self.validator = Validator(self.specs, device, _ranges([b for b in bufs if not b.is_cuda]),
                                   _ranges([b for b in bufs if b.is_cuda]))
        self._hands: dict[tuple, _Handed] = {}  # per (stager, arena, T): the same objects every time
        self._handed_host: _Handed | None = None  # host views handed out for the next step ...
        self._handed_thread: int | None = None  # ... to this thread (its ident, fast to compare)
        self._handed_owner: threading.Thread | None = None  # (and the thread: is it still alive?)
        self._handed_device: _Handed | None = None

    @property
    def staging(self) -> list[torch.Tensor]:
        """The pinned host buffers (staging arenas and feed); empty on a CPU, whose host
        arenas are plain memory."""
        return [b for s in self._stagers for b in s.pinned]

    @property
    def fed(self) -> bool:
        """Whether graphs copy their own host rows in (the graph stager says; reported by
        ``rt.fed_graphs``, never branched on: ask the stager instead)."""
        return self.graph_stager.fed

    # -- views -----------------------------------------------------------------------
    def views(self, n: int) -> dict[str, torch.Tensor]:
        """The first ``n`` rows of every input in the device arena (what a graph reads)."""
        return {name: self._full[name][:n] for name in self.specs}

    def pad_rows(self, n: int) -> dict[str, torch.Tensor]:
        """``n`` rows of every input holding its pad, in fresh tensors shaped and placed
        like ``views(n)``: for running the step function off the record (the hazard
        finder), where it writes only what padding rows write (a scratch cell)."""
        return {name: torch.full_like(self._full[name][:n], spec.pad) for name, spec in self.specs.items()}

    def control(self, name: str) -> torch.Tensor:
        """A fixed-size control block in the device arena (host-row indices, counts)."""
        return self._full[name]

    def host_views(self, T: int, stager: Stager, numpy: bool = False) -> dict[str, Any]:
        """Host rows ``[:T]`` the next step will use, in ``stager``'s next arena (the
        stager of the executor that step runs on: the feed for a fed graph, else the arena
        stager): write the next step's rows here in place and pass these views
        to ``step`` to skip the packing. The same tensor objects (numpy arrays with
        ``numpy``: views of the same rows) come back for the same arena and ``T``; should
        the step take another path after all, its rows are copied from them. They belong to
        the calling thread until a step consumes them: another thread's ``host_views`` or
        step meanwhile raises BusyError, its step with them InputError (see ``prepare``)."""
        h, me = self._handed_host, threading.get_ident()
        if h is not None and self._handed_thread != me and self._held_elsewhere(h):
            raise BusyError("host_inputs: the rows handed out by host_inputs() to another thread are "
                            "not stepped yet (one thread at a time fills and steps them)")
        k = stager.next
        stager.wait(k)
        hand = self._hands.get((stager, k, T))
        if hand is None:
            hand = self._hand(stager, k, T)
        stager.arenas[k].mark(T)  # the caller may fill rows [:T] and then step with fewer
        self._handed_host, self._handed_thread, self._handed_owner = hand, me, threading.current_thread()
        return dict(hand.arrays if numpy else hand.views)  # the caller may change its dict, never ours

    def _hand(self, stager, k: int, T: int) -> "_Handed":
        """The views of ``stager``'s arena ``k`` (``_DEVICE``: the device arena) handed
        out for steps of T rows."""
        if stager is _DEVICE:
            views = {name: self._full[name][:T] for name in self.specs}
            hand = _Handed(stager, k, views, {}, Prepared(T, views, frozenset(self.specs), {}))
        else:
            a = stager.arenas[k]
            views = {name: a.views[name][:T] for name in self.specs}
            arrays = {name: a.np[name][:T] if a.np[name] is not None else views[name] for name in self.specs}
            ptrs = {name: v.data_ptr() for name, v in views.items()}
            hand = _Handed(stager, k, views, arrays, Prepared(T, views, frozenset(), ptrs))
        if len(self._hands) < 8 * self.rows:  # bounded, whatever T a caller asks for
            self._hands[(stager, k, T)] = hand
        return hand

    def device_views(self, T: int) -> dict[str, torch.Tensor]:
        """Rows ``[:T]`` of the device arena, for a runner that writes them in place with
        its own device ops (``device_inputs``); recognised by identity like host_views."""
        hand = self._hands.get((_DEVICE, 0, T)) or self._hand(_DEVICE, 0, T)
        self._handed_device = hand
        return dict(hand.views)

    @staticmethod
    def _live(hand: "_Handed") -> bool:
        """Handed views not consumed yet: those of their stager's next arena (device views,
        the feed and a CPU's one host arena always are)."""
        return hand.k == hand.stager.next

    def _held_elsewhere(self, hand: "_Handed") -> bool:
        """Live host views handed to another thread that still runs (a thread that ended
        writes its views no more: they are free again)."""
        return self._live(hand) and self._handed_owner is not None and self._handed_owner.is_alive()

    def handed_rows(self, inputs: Mapping[str, Any]) -> int | None:
        """T when ``inputs`` are exactly the graph stager's views (the feed's, for the short
        path) ``host_views`` handed to this thread for the next step; -1 when live views
        are held by another thread (the step must be refused: ``prepare`` says how); else
        None. Changes nothing (``consume`` uses them up)."""
        h = self._handed_host
        if h is None:
            return None
        if self._handed_thread != threading.get_ident():
            return -1 if self._held_elsewhere(h) else None
        if h.stager is not self.graph_stager or not h.matches(inputs):
            return None
        return h.prepared.T

    def consume(self) -> None:
        """A step writes its rows: the host views handed out before it are used up, whatever
        arena it writes (a dynamic step writes no feed, yet feed views kept past it are as
        stale as any)."""
        self._handed_host = None

    # -- validation (writes nothing) -----------------------------------------------------
    def prepare(self, inputs: Mapping[str, Any]) -> Prepared:
        """Check names, rows, per-row shapes, dtypes and devices of one step's inputs
        (handed views, unchanged, skip the checks). Raises InputError (BusyError while
        another thread holds views ``host_views`` handed out: a step would use them up
        while their owner may still write them); writes nothing."""
        self.validator.names(inputs)
        h = self._handed_host
        if h is not None and self._handed_thread != threading.get_ident() and self._live(h):
            if h.matches(inputs):
                raise InputError(expected("step inputs", "views host_inputs() handed to this thread",
                                          "the views handed to another thread"))
            if self._held_elsewhere(h):
                raise BusyError("step: host_inputs() handed the next step's rows to another thread, which has "
                                "not stepped them yet (one thread at a time fills and steps them)")
        for hand in (h, self._handed_device):
            if hand is not None and self._live(hand) and hand.matches(inputs):
                return hand.prepared
        return self.validator.check(inputs, self._owned)

    def _owned(self, name: str, t: torch.Tensor) -> bool | None:
        """For a tensor inside our buffers: False for the very view host_views() handed out
        for the next step (to this thread), True for rows ``[:T]`` of the arena itself
        (device_inputs(), static_inputs(): zero copy), None for anything else (refused:
        another pinned view may hold a step's stale rows)."""
        h = self._handed_host
        if h is not None and self._live(h) and h.views[name] is t and self._handed_thread == threading.get_ident():
            return False
        c = self._full[name]
        if t.data_ptr() == c.data_ptr() and t.dtype == c.dtype and t.device == c.device and t.stride() == c.stride():
            return True
        return None

    # -- writing -----------------------------------------------------------------------
    def write(self, prep: Prepared, start: int, length: int, width: int, control: Mapping[str, Any] | None = None) -> None:
        """Rows ``[start, start+length)`` of ``prep`` into arena rows ``[0, length)``, pad
        values into rows ``[length, width)``, control blocks set; stream-ordered. Through
        the arena stager (eager and dynamic slices): ``write_via`` with ``stager``."""
        self.write_via(self.stager, prep, start, length, width, control)

    def write_via(self, stager: Stager, prep: Prepared, start: int, length: int, width: int,
                  control: Mapping[str, Any] | None = None) -> None:
        """``write`` through ``stager`` (a graph slice's: the feed where graphs are fed,
        which the replay's prologue copies in). Host views handed out before are used up,
        whatever arena it writes (see consume)."""
        self._handed_host = None  # used up (see consume)
        stager.write(prep, start, length, width, control)

    def write_control(self, control: Mapping[str, Any]) -> None:
        """Set control blocks only (a commit between steps), through the arena stager (the
        feed reaches the arena only inside a replay). Host views handed out survive it
        unless it took their arena (CUDA: its staging alternates)."""
        k = self.stager.take_for_control()
        if k is not None:
            self._consume(self.stager, k)
        self.stager.write_control(k, control)

    def _consume(self, stager: Stager, k: int) -> None:
        """Handed host views of ``stager``'s arena ``k`` are good for one step."""
        h = self._handed_host
        if h is not None and h.stager is stager and h.k == k:
            self._handed_host = None

    def unfeed(self) -> None:
        """Graphs keep the arena's rows as they are until the next step (see Feed.unfeed;
        nothing to do where graphs are not fed)."""
        self.graph_stager.unfeed()

    @torch.no_grad()
    def reset(self, control: Mapping[str, Any] | None = None) -> None:
        """Pad values into every row of the device arena, zeros (or ``control``'s values)
        into its control blocks (stream-ordered), so that warm-up and capture run on
        padding rows only, whatever the last step left there; the feed too."""
        self.layout.fill_pads(self._full, control)
        self._handed_host = None  # views handed out before may point anywhere now
        for s in self._stagers:
            s.reset(control)

    @contextmanager
    def rows_kept(self):
        """Put the device arena back as it was when the block is left (stream-ordered):
        capture resets it to padding rows, and must not wipe rows a caller wrote into it."""
        kept = self.arena.clone()
        try:
            yield
        finally:
            with torch.no_grad():
                self.arena.copy_(kept)

    def digest_parts(self) -> tuple[list, list]:
        """(the arena, the host arenas and their bookkeeping) for ``StateDigest``."""
        stagers = self._stagers
        return [self.arena], [*(a.buf for s in stagers for a in s.arenas), *(x for s in stagers for x in s.digest_state())]


class _Handed:
    """Views of one arena handed out for steps of ``T`` rows (made once per arena and T):
    whose (``stager``, its arena ``k``), the tensors, the same rows as numpy arrays
    (``host_inputs(numpy=True)``), and the Prepared a step passed exactly these objects
    uses without checking them again."""

    __slots__ = ("stager", "k", "views", "arrays", "prepared")

    def __init__(self, stager, k: int, views: dict, arrays: dict, prepared: Prepared):
        self.stager, self.k, self.views, self.arrays, self.prepared = stager, k, views, arrays, prepared

    def matches(self, inputs: Mapping[str, Any]) -> bool:
        """``inputs`` are exactly these views, or exactly these arrays (by identity)."""
        if len(inputs) != len(self.views):
            return False
        for name, v in self.views.items():
            if inputs.get(name) is not v:
                break
        else:
            return True
        if not self.arrays:  # device views have none
            return False
        for name, v in self.arrays.items():
            if inputs.get(name) is not v:
                return False
        return True
