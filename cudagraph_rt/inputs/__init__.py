"""Static inputs: one device arena, per-width views, validation, staging and the feed.

`StaticInputs` owns every buffer a graph reads its inputs from. Steps write the real rows
and the padding rows into it; graphs captured over its views read them at replay. Rooms:
``arena`` (layout, views), ``validate`` (the checks; casting rules in ``specs``),
``staging`` (host rows on their way in, a CPU and a pinned stager), ``feed`` (fed graphs).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Mapping

import torch

from ..errors import BusyError, InputError, expected
from ..specs import InputSpec
from .arena import ONE_COPY_BYTES, ArenaLayout
from .feed import Feed
from .staging import CpuStaging, PinnedStaging
from .validate import Prepared, Validator

__all__ = ["FEED", "Prepared", "StaticInputs"]

FEED = 2  # the handed-views id of the feed (the stagers' arenas are 0 and 1)


def _ranges(bufs: list[torch.Tensor]) -> list[tuple[int, int]]:
    return [(b.data_ptr(), b.data_ptr() + b.numel()) for b in bufs]


class StaticInputs:
    """Owns the static input buffers of one runtime.

    One device arena (``rows`` rows of every input, each a contiguous aligned block, plus
    fixed-size control blocks); ``views(N)`` gives the first N rows of every input: graphs
    are captured over these views and read them at replay, so the arena is never
    reallocated. It starts filled with the pad values, so warm-up and capture run on
    padding rows only. A stager brings host rows in (two alternating pinned arenas on
    CUDA, straight writes on a CPU); fed graphs (a ``feed_event``, which the graph mode
    gives, and a small arena) copy their host rows in themselves, from the feed.

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
        cuda = device.type == "cuda"
        self.stager = PinnedStaging(layout, self.arena, self._full, device) if cuda else CpuStaging(layout, self._full)
        self.fed = feed_event is not None and layout.nbytes <= ONE_COPY_BYTES
        self.feed = Feed(layout, self.arena, self._full, feed_event, pinned=cuda) if self.fed else None
        self._arenas = dict(enumerate(self.stager.arenas))  # ids 0 (, 1 on CUDA) (, FEED)
        if self.fed:
            self._arenas[FEED] = self.feed.host
        bufs = [self.arena, *(a.buf for a in self._arenas.values()), *([self.feed.mirror] if self.fed else [])]
        self.validator = Validator(self.specs, device, _ranges([b for b in bufs if not b.is_cuda]),
                                   _ranges([b for b in bufs if b.is_cuda]))
        self._hands: dict[tuple, _Handed] = {}  # per (arena id, T): the same objects every time
        self._handed_host: _Handed | None = None  # host views handed out for the next step ...
        self._handed_thread: int | None = None  # ... to this thread (its ident, fast to compare)
        self._handed_owner: threading.Thread | None = None  # (and the thread: is it still alive?)
        self._handed_device: _Handed | None = None

    @property
    def staging(self) -> list[torch.Tensor]:
        """The pinned host buffers (staging arenas and feed); empty on a CPU, whose host
        arenas are plain memory."""
        return [a.buf for a in self._arenas.values() if a.pinned]

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

    def host_views(self, T: int, fed: bool = False, numpy: bool = False) -> dict[str, Any]:
        """Host rows ``[:T]`` the next step will use (the feed when ``fed``: that step
        replays a fed graph): write the next step's rows here in place and pass these views
        to ``step`` to skip the packing. The same tensor objects (numpy arrays with
        ``numpy``: views of the same rows) come back for the same arena and ``T``; should
        the step take another path after all, its rows are copied from them. They belong to
        the calling thread until a step consumes them: another thread's ``host_views`` or
        step meanwhile raises BusyError, its step with them InputError (see ``prepare``)."""
        h, me = self._handed_host, threading.get_ident()
        if h is not None and self._handed_thread != me and self._held_elsewhere(h):
            raise BusyError("host_inputs: the rows handed out by host_inputs() to another thread are "
                            "not stepped yet (one thread at a time fills and steps them)")
        if fed and self.fed:
            k = FEED
            self.feed.event.synchronize()
        else:
            k = self.stager.next
            self.stager.wait(k)
        hand = self._hands.get((k, T))
        if hand is None:
            hand = self._hand(k, T)
        self._arenas[k].mark(T)  # the caller may fill rows [:T] and then step with fewer
        self._handed_host, self._handed_thread, self._handed_owner = hand, me, threading.current_thread()
        return dict(hand.arrays if numpy else hand.views)  # the caller may change its dict, never ours

    def _hand(self, k: int | None, T: int) -> "_Handed":
        """The views of arena ``k`` (None: the device arena) handed out for steps of T rows."""
        if k is None:
            views = {name: self._full[name][:T] for name in self.specs}
            hand = _Handed(None, views, {}, Prepared(T, views, frozenset(self.specs), {}))
        else:
            a = self._arenas[k]
            views = {name: a.views[name][:T] for name in self.specs}
            arrays = {name: a.np[name][:T] if a.np[name] is not None else views[name] for name in self.specs}
            ptrs = {name: v.data_ptr() for name, v in views.items()}
            hand = _Handed(k, views, arrays, Prepared(T, views, frozenset(), ptrs))
        if len(self._hands) < 8 * self.rows:  # bounded, whatever T a caller asks for
            self._hands[(k, T)] = hand
        return hand

    def device_views(self, T: int) -> dict[str, torch.Tensor]:
        """Rows ``[:T]`` of the device arena, for a runner that writes them in place with
        its own device ops (``device_inputs``); recognised by identity like host_views."""
        hand = self._hands.get((None, T)) or self._hand(None, T)
        self._handed_device = hand
        return dict(hand.views)

    def _live(self, hand: "_Handed") -> bool:
        """Handed views not consumed yet: device views, the feed, or the next arena."""
        return hand.arena in (None, FEED, self.stager.next)

    def _held_elsewhere(self, hand: "_Handed") -> bool:
        """Live host views handed to another thread that still runs (a thread that ended
        writes its views no more: they are free again)."""
        return self._live(hand) and self._handed_owner is not None and self._handed_owner.is_alive()

    def handed_rows(self, inputs: Mapping[str, Any]) -> int | None:
        """T when ``inputs`` are exactly the feed views ``host_views`` handed to this thread
        for the next step; -1 when live views are held by another thread (the step must be
        refused: ``prepare`` says how); else None. Changes nothing (``consume`` uses them up)."""
        h = self._handed_host
        if h is None:
            return None
        if self._handed_thread != threading.get_ident():
            return -1 if self._held_elsewhere(h) else None
        if h.arena != FEED or not h.matches(inputs):
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
        values into rows ``[length, width)``, control blocks set; stream-ordered."""
        k = self.stager.take()
        self._handed_host = None  # used up (see consume)
        self.stager.write(k, prep, start, length, width, control)

    def write_fed(self, prep: Prepared, start: int, length: int, width: int, control: Mapping[str, Any] | None = None) -> None:
        """``write`` for a fed graph's replay: host rows into the feed (see Feed.write)."""
        self._handed_host = None  # used up (see consume)
        self.feed.write(prep, start, length, width, control)

    def write_control(self, control: Mapping[str, Any]) -> None:
        """Set control blocks only (a commit between steps). Host views handed out survive
        it unless it took their arena (CUDA without fed graphs: its staging alternates)."""
        k = self.stager.take_for_control()
        if k is not None:
            self._consume(k)
        self.stager.write_control(k, control)

    def _consume(self, k: int) -> None:
        """Handed host views of arena ``k`` are good for one step."""
        h = self._handed_host
        if h is not None and h.arena == k:
            self._handed_host = None

    def unfeed(self) -> None:
        if self.fed:
            self.feed.unfeed()

    def feed_prologue(self) -> None:
        """The first work of every fed graph (captured with it; see Feed)."""
        self.feed.prologue()

    @torch.no_grad()
    def reset(self, control: Mapping[str, Any] | None = None) -> None:
        """Pad values into every row of the device arena, zeros (or ``control``'s values)
        into its control blocks (stream-ordered), so that warm-up and capture run on
        padding rows only, whatever the last step left there; the feed too."""
        self.layout.fill_pads(self._full, control)
        self._handed_host = None  # views handed out before may point anywhere now
        if self.fed:
            self.feed.reset(control)

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
        arenas = self._arenas.values()
        return [self.arena], [*(a.buf for a in arenas), self.stager.next, [a.dirty for a in arenas],
                              getattr(self.feed, "_flags", None), getattr(self.feed, "all_host", None),
                              getattr(self.feed, "_t_now", None)]


class _Handed:
    """Views of one arena handed out for steps of ``T`` rows (made once per arena and T):
    the tensors, the same rows as numpy arrays (``host_inputs(numpy=True)``), and the
    Prepared a step passed exactly these objects uses without checking them again."""

    __slots__ = ("arena", "views", "arrays", "prepared")

    def __init__(self, arena: int | None, views: dict, arrays: dict, prepared: Prepared):
        self.arena, self.views, self.arrays, self.prepared = arena, views, arrays, prepared

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
