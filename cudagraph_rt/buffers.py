"""Static inputs: one device arena, per-width views, pad fill, validation, pinned staging
and the feed of fed graphs.

`StaticInputs` owns every buffer a graph reads its inputs from. Steps write the real rows
and the padding rows into it; graphs captured over its views read them at replay.
"""
from __future__ import annotations

import ctypes
import threading
from contextlib import contextmanager
from typing import Any, Mapping, NamedTuple

import torch

from .errors import BusyError, InputError, expected
from .specs import NUMPY_DTYPES, InputSpec, as_input_tensor, cast_input, itemsize

__all__ = ["FEED", "Prepared", "StaticInputs", "current_stream", "record_event"]

_STRIDED = torch.strided
FEED = 2  # index of the fed graphs' pinned arena in StaticInputs.staging
_ALIGN = 256  # bytes: keeps every view aligned for vectorised loads
_ONE_COPY_BYTES = 64 * 1024  # below this a host-to-device copy costs its latency, not its size


def current_stream(device_index: int) -> "torch.cuda.Stream":
    """``torch.cuda.current_stream()`` without its Python overhead (several microseconds on
    a step's hot path): the Stream object is built once per stream id and reused."""
    sid, dev, kind = torch._C._cuda_getCurrentStream(device_index)
    stream = _STREAMS.get((sid, dev))
    if stream is None:
        stream = _STREAMS[(sid, dev)] = torch.cuda.Stream(stream_id=sid, device_index=dev, device_type=kind)
    return stream


def record_event(ev: "torch.cuda.Event", device_index: int) -> None:
    """``ev.record()`` on the current stream (see ``current_stream``)."""
    torch._C._CudaEventBase.record(ev, current_stream(device_index))


def _external_event() -> "torch.cuda.Event | None":
    """An event whose record inside a capture becomes a node of the graph (None where this
    torch cannot make one: fed graphs are then off)."""
    try:
        return torch.cuda.Event(external=True)
    except TypeError:
        return None


def _cudart():
    try:
        from cuda.bindings import runtime
    except ImportError:  # cuda-python missing: torch's copy_ does the same, more slowly
        return None
    return runtime


_STREAMS: dict[tuple, "torch.cuda.Stream"] = {}  # a cache of immutable wrappers, not state


def _numpy_views(views: dict[str, torch.Tensor]) -> dict[str, Any]:
    """numpy views of host tensors (None for dtypes numpy lacks, and for device memory)."""
    return {n: (v.numpy() if v.device.type == "cpu" and v.dtype in NUMPY_DTYPES else None)
            for n, v in views.items()}


class Prepared(NamedTuple):
    """Validated inputs of one step: ``T`` rows each; nothing has been written yet.
    (A NamedTuple, not a dataclass: it is built on every step's path.)"""

    T: int
    tensors: Mapping[str, torch.Tensor]
    zero_copy: frozenset  # names whose rows already sit in the arena (device_inputs() views)
    host_ptrs: Mapping[str, int]  # contiguous host tensors of the declared dtype: data_ptr()


class StaticInputs:
    """Owns the static input buffers of one runtime.

    One device arena (``rows`` rows of every input, each input a contiguous aligned block,
    plus fixed-size control blocks) and, on CUDA, two pinned staging arenas of the same
    layout. ``views(N)`` gives the first N rows of every input: graphs are captured over
    these views and read them at replay, so the arena is never reallocated.

    The arena starts filled with the pad values, so warm-up and capture run on padding
    rows only. Staging arenas alternate between steps; each waits for its own previous
    host-to-device copy before it is rewritten, so the host never overwrites bytes still
    in flight.

    Fed graphs (``feed=True`` on CUDA, small arenas, a torch with external events): a
    third pinned arena, the feed, is copied by the graph itself. Every captured width
    starts with :meth:`feed_prologue`: copy the feed to a device mirror, record the feed
    event, and move into the arena the words of every input the feed holds this step
    (its ``__src__`` flags; device inputs keep the rows copied into the arena before the
    replay). A graph step then costs the host no copy call and no event record, only a
    wait on the feed event (the last replay's copy has left the feed) before writing it.
    """

    def __init__(self, specs: Mapping[str, InputSpec], rows: int, device: torch.device,
                 control: Mapping[str, tuple[int, torch.dtype]] | None = None, feed: bool = False):
        self.specs = dict(specs)
        self.rows = rows
        self.device = device
        self._offsets: dict[str, int] = {}
        control = dict(control or {})
        feed_event = _external_event() if feed and device.type == "cuda" else None
        if feed_event is not None:
            control["__src__"] = (len(self.specs) + 1, torch.bool)  # per input: the feed holds it
        off = 0
        layout = [(n, s.row_bytes * rows) for n, s in self.specs.items()]
        layout += [(n, numel * itemsize(dt)) for n, (numel, dt) in control.items()]
        for name, nbytes in layout:
            self._offsets[name] = off
            off += -(-nbytes // _ALIGN) * _ALIGN
        self.nbytes = max(off, _ALIGN)
        self.fed = feed_event is not None and self.nbytes <= _ONE_COPY_BYTES
        if not self.fed:
            feed_event = None
        self.control_specs = control
        self.arena = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self._full = self._carve(self.arena)
        self.staging: list[torch.Tensor] = []
        self._staged: list[dict[str, torch.Tensor]] = []
        self._events: list[torch.cuda.Event | None] = []
        self._dirty: list[dict[str, int]] = []
        self._next = 0
        if device.type == "cuda":
            for _ in range(3 if self.fed else 2):  # two alternating, then the feed (FEED)
                buf = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=True)
                self.staging.append(buf)
                self._staged.append(self._carve(buf))
                self._events.append(None)
                self._dirty.append({n: rows for n in self.specs})
            self._host_stage = None
        else:
            # host_inputs() rows on a CPU: never the arena itself, so that views kept past
            # their step, or cut, are told apart from the arena rows (and refused) as on CUDA.
            self._host_stage = torch.empty(self.nbytes, dtype=torch.uint8)
        cpu_staged = [self._carve(self._host_stage)] if self._host_stage is not None else []
        with torch.no_grad():
            for views in [self._full, *self._staged, *cpu_staged]:
                for name, spec in self.specs.items():
                    views[name].fill_(spec.pad)
                for name in self.control_specs:
                    views[name].zero_()
        for d in self._dirty:
            d.update({n: 0 for n in self.specs})
        self._feed_event = feed_event
        if self.fed:
            self.mirror = torch.empty_like(self.arena)
            self._mirror_src = self._carve(self.mirror)["__src__"]
            self._staged[FEED]["__src__"].fill_(True)
            self._feed_flags = [True] * len(self.specs)
            # word -> flag index: input i's block -> i, everything else -> the last flag
            # (always set: control blocks always come from the feed). Blocks are 256-byte
            # aligned, so no 4-byte word holds bytes of two of them.
            words = torch.full((self.nbytes // 4,), len(self.specs), dtype=torch.int64)
            for i, (name, spec) in enumerate(self.specs.items()):
                o = self._offsets[name]
                words[o // 4:-(-(o + spec.row_bytes * rows) // 4)] = i
            self._word_src = words.to(device)
            self._arena_words, self._mirror_words = self.arena.view(torch.int32), self.mirror.view(torch.int32)
        self._full_np = _numpy_views(self._full)
        self._staged_np = [_numpy_views(v) for v in self._staged]
        self._pads_np = {n: s.pad for n, s in self.specs.items()}
        self._cudart = _cudart() if device.type == "cuda" else None
        self._h2d = self._cudart.cudaMemcpyKind.cudaMemcpyHostToDevice if self._cudart is not None else None
        self._cpu_staged = cpu_staged[0] if cpu_staged else None
        host_bufs = [b for b in [self.arena, *self.staging, self._host_stage]
                     if b is not None and b.device.type == "cpu"]
        self._host_ranges = [(b.data_ptr(), b.data_ptr() + b.numel()) for b in host_bufs]
        self._device_ranges = [(b.data_ptr(), b.data_ptr() + b.numel())
                               for b in [self.arena, *([self.mirror] if self.fed else [])] if b.device.type != "cpu"]
        self._checks = [(n, s, s.ndim1, torch.Size(s.shape), s.dtype) for n, s in self.specs.items()]
        self._names = self.specs.keys()
        self._row_bytes = {n: s.row_bytes for n, s in self.specs.items()}
        # Raw addresses for the hot path: host rows go in with ctypes.memmove, the arena
        # crosses the bus with one cudaMemcpyAsync (each a fraction of a torch call).
        self._full_ptr = {n: v.data_ptr() for n, v in self._full.items()}
        self._staged_ptr = [{n: v.data_ptr() for n, v in st.items()} for st in self._staged]
        self._arena_ptr = self.arena.data_ptr()
        self._host_views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self._device_views: dict[int, dict[str, torch.Tensor]] = {}
        # (staging k or FEED, views, Prepared, thread id) of host_views(): good for the next
        # step only, and only from the thread that asked for them
        self._handed_host: tuple | None = None
        self._handed_device: tuple | None = None  # (None, views, Prepared) of device_views()
        self._raw_events: list[int | None] = [None] * len(self.staging)
        self._staging_ptr = [b.data_ptr() for b in self.staging]

    def _carve(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, spec in self.specs.items():
            o = self._offsets[name]
            out[name] = buf[o:o + spec.row_bytes * self.rows].view(spec.dtype).view(self.rows, *spec.shape)
        for name, (numel, dt) in self.control_specs.items():
            o = self._offsets[name]
            out[name] = buf[o:o + numel * itemsize(dt)].view(dt)
        return out

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
        """(the arena, the staging arenas and their bookkeeping) for ``StateDigest``."""
        staging = [*self.staging, *([self._host_stage] if self._host_stage is not None else []),
                   self._next, self._dirty, getattr(self, "_feed_flags", None)]
        return [self.arena], staging

    # -- views -----------------------------------------------------------------------
    def views(self, n: int) -> dict[str, torch.Tensor]:
        """The first ``n`` rows of every input in the device arena (what a graph reads)."""
        return {name: self._full[name][:n] for name in self.specs}

    def control(self, name: str) -> torch.Tensor:
        """A fixed-size control block in the device arena (host-row indices, counts)."""
        return self._full[name]

    def host_views(self, T: int, fed: bool = False) -> dict[str, torch.Tensor]:
        """Pinned staging rows ``[:T]`` the next step will use (the feed when ``fed``: that
        step replays a fed graph): write the next step's rows here in place and pass these
        views to ``step`` to skip the packing.

        The same tensor objects come back for the same arena and ``T``; passing them
        unchanged lets ``prepare`` recognise them by identity and skip every check. Should
        the step take another path after all, its rows are copied from them.

        The views belong to the calling thread until a step consumes them: another
        thread's ``host_views`` meanwhile raises BusyError (it would hand out the same rows
        while they are being filled), and another thread's step with them InputError."""
        h = self._handed_host
        me = threading.get_ident()
        if h is not None and h[3] != me and h[0] in (None, FEED, self._next):
            raise BusyError("host_inputs: the rows handed out by host_inputs() to another thread are "
                            "not stepped yet (one thread at a time fills and steps them)")
        if fed and self.fed:
            k = FEED
            self._feed_event.synchronize()
        else:
            k = self._next
            self._wait_staging(k)
        src = self._staged[k] if self._staged else self._cpu_staged
        views = self._handed_cache(self._host_views, (k, T), src, T)
        if self._staged:  # the caller may fill rows [:T] and then step with fewer
            dirty = self._dirty[k]
            for name in self._names:
                if dirty[name] < T:
                    dirty[name] = T
        ptrs = {name: v.data_ptr() for name, v in views.items()}
        self._handed_host = (k, views, Prepared(T, views, frozenset(), ptrs), me)
        return dict(views)  # the caller may change its dict, never ours

    def device_views(self, T: int) -> dict[str, torch.Tensor]:
        """Rows ``[:T]`` of the device arena, for a runner that writes them in place with
        its own device ops (``device_inputs``); recognised by identity like host_views."""
        views = self._handed_cache(self._device_views, T, self._full, T)
        self._handed_device = (None, views, Prepared(T, views, frozenset(self.specs), {}), None)
        return dict(views)

    def _handed_cache(self, cache: dict, key, src: dict, T: int) -> dict[str, torch.Tensor]:
        views = cache.get(key)
        if views is None:
            views = {name: src[name][:T] for name in self.specs}
            if len(cache) < 4 * self.rows:  # bounded, whatever T a caller asks for
                cache[key] = views
        return views

    def _handed_back(self, inputs: Mapping[str, Any]) -> Prepared | None:
        """The Prepared of views host_views()/device_views() handed out, when ``inputs``
        are exactly those tensor objects (and, for host views, the arena is still next)."""
        for handed in (self._handed_host, self._handed_device):
            if handed is None or handed[0] not in (None, FEED, self._next):
                continue
            k, views, prep, owner = handed
            for name in self._names:
                if inputs[name] is not views[name]:
                    break
            else:
                if owner is not None and owner != threading.get_ident():
                    raise InputError(expected("step inputs", "views host_inputs() handed to this thread",
                                              "the views handed to another thread"))
                return prep
        return None

    # -- validation (writes nothing) -----------------------------------------------------
    def prepare(self, inputs: Mapping[str, Any]) -> Prepared:
        """Check names, rows, per-row shapes, dtypes and devices of one step's inputs.

        Raises InputError naming the input; writes nothing. This is on every step's path,
        so the common case (tensors of the declared dtype) takes few Python operations.
        """
        if inputs.keys() != self._names:
            missing = [n for n in self.specs if n not in inputs]
            extra = [n for n in inputs if n not in self.specs]
            raise InputError(
                expected("step inputs", f"exactly {sorted(self.specs)}", f"missing {missing}, unexpected {extra}")
            )
        if self._handed_host is not None or self._handed_device is not None:
            prep = self._handed_back(inputs)
            if prep is not None:
                return prep
        tensors, host_ptrs, zero_copy, T = {}, {}, (), -1
        for name, spec, ndim, shape, dtype in self._checks:
            t = inputs[name]
            if type(t) is not torch.Tensor:
                t = as_input_tensor(name, t, spec)
            if t.layout is not _STRIDED:
                raise InputError(expected(name, "a dense (strided) tensor", f"layout {t.layout}"))
            if t.is_neg():  # a lazy negation (conj().imag): its bytes hold the other sign
                t = t.resolve_neg()
            try:
                sh = t.shape
            except RuntimeError:  # a nested tensor has no sizes
                raise InputError(expected(name, "a dense (strided) tensor", "a nested tensor")) from None
            if len(sh) != ndim or (ndim > 1 and sh[1:] != shape):
                raise InputError(
                    expected(name, f"shape (T, {', '.join(map(str, shape))})".replace(", )", ")"), tuple(sh))
                )
            if T < 0:
                T = sh[0]
            elif sh[0] != T:
                first = next(iter(self.specs))
                raise InputError(expected(name, f"{T} rows like {first!r}", f"{sh[0]} rows"))
            cast = t.dtype is not dtype
            if cast:
                if t.dtype.is_complex or t.is_quantized:
                    raise InputError(expected(name, f"dtype {dtype}", t.dtype))
                t = cast_input(name, t, spec)
            if t.is_cuda:
                if t.device != self.device:
                    raise InputError(expected(name, f"a tensor on {self.device} or the host", f"one on {t.device}"))
                if t.requires_grad:  # the copy into the arena must not join an autograd graph
                    t = t.detach()
                ranges = self._device_ranges
            elif not t.is_cpu:
                raise InputError(expected(name, f"a tensor on {self.device} or the host", f"one on {t.device}"))
            else:
                ranges = self._host_ranges
            # Only a view of one of our own buffers can overlap them, and such a view
            # starts inside the buffer: one range test per buffer is exact.
            p = t.data_ptr()
            for lo, hi in ranges:
                if lo <= p < hi and not self._is_handed_view(name, t):
                    if not self._is_static_rows(name, t):
                        raise InputError(
                            expected(name, "memory apart from the runtime's static buffers "
                                     "(or the rows device_inputs() gave, or the unchanged views "
                                     "host_inputs() gave for this step)",
                                     "a tensor overlapping them")
                        )
                    zero_copy += (name,)
            if ranges is self._host_ranges and not cast and t.is_contiguous():
                host_ptrs[name] = p  # written with one memmove, no tensor op
            tensors[name] = t
        if T <= 0:
            raise InputError(expected("step inputs", "at least one row", "0 rows"))
        return Prepared(T, tensors, frozenset(zero_copy), host_ptrs)

    def _is_handed_view(self, name: str, t: torch.Tensor) -> bool:
        """``t`` is the very view host_views() handed out for the next step (passed along
        with inputs from elsewhere; its rows are then taken from where they lie)."""
        h = self._handed_host
        return h is not None and h[0] in (FEED, self._next) and h[1][name] is t and h[3] == threading.get_ident()

    def _is_static_rows(self, name: str, t: torch.Tensor) -> bool:
        """Rows ``[:T]`` of the arena itself (device_inputs(), static_inputs()). Staging rows
        are taken only as the unchanged views host_views() handed out for this very step
        (``_handed_back``): any other pinned view may hold a step's stale rows."""
        c = self._full[name]
        return t.data_ptr() == c.data_ptr() and t.dtype == c.dtype and t.device == c.device and t.stride() == c.stride()

    # -- writing -----------------------------------------------------------------------
    @torch.no_grad()
    def reset(self, control: Mapping[str, Any] | None = None) -> None:
        """Pad values into every row of the device arena, zeros (or ``control``'s values)
        into its control blocks (stream-ordered), so that warm-up and capture run on
        padding rows only, whatever the last step left there; the feed too, since fed
        graphs copy it in at warm-up and capture."""
        control = control or {}
        for name, spec in self.specs.items():
            self._full[name].fill_(spec.pad)
        for name in self.control_specs:
            self._full[name].zero_()
        for name, v in control.items():
            self._full[name][:len(v)].copy_(torch.as_tensor(v, dtype=self._full[name].dtype))
        self._handed_host = None  # views handed out before may point anywhere now
        if self.fed:  # the prologue copies the feed: it must hold padding only, too
            self._feed_event.synchronize()
            feed = self._staged[FEED]
            for name, spec in self.specs.items():
                feed[name].fill_(spec.pad)
            for name in self.control_specs:
                feed[name].zero_()
            for name, v in control.items():
                feed[name][:len(v)].copy_(torch.as_tensor(v, dtype=feed[name].dtype))
            feed["__src__"].fill_(True)
            self._feed_flags = [True] * len(self.specs)
            self._dirty[FEED] = {n: 0 for n in self.specs}

    def _stage(self, k: int, name: str, t: torch.Tensor, p: int | None, start: int, length: int) -> None:
        """Host rows ``[start, start+length)`` of ``t`` (data pointer ``p`` when a memmove
        can take them) into rows ``[0, length)`` of staging arena ``k``, and pad values
        into the rows a wider step left there."""
        dirty = self._dirty[k]
        if dirty[name] < length:  # raised first: an interrupted copy leaves no untracked rows
            dirty[name] = length
        if p is not None:
            nb = self._row_bytes[name]
            if p + start * nb != self._staged_ptr[k][name]:  # else: written in place (host_inputs)
                ctypes.memmove(self._staged_ptr[k][name], p + start * nb, length * nb)
        else:
            self._put(self._staged[k][name], self._staged_np[k][name], t, start, length)
        if dirty[name] > length:
            self._fill_pad(k, name, length, dirty[name])
        dirty[name] = length

    def _fill_pad(self, k: int, name: str, lo: int, hi: int) -> None:
        """Pad values into rows ``[lo, hi)`` of staging arena ``k`` (numpy where it can)."""
        a = self._staged_np[k][name]
        if a is not None:
            a[lo:hi] = self._pads_np[name]
        else:  # bfloat16 and other dtypes numpy lacks
            self._staged[k][name][lo:hi].fill_(self.specs[name].pad)

    def _wait_staging(self, k: int) -> None:
        if self._events and self._events[k] is not None:
            self._events[k].synchronize()

    @staticmethod
    def _put(dst: torch.Tensor, dst_np, t: torch.Tensor, start: int, length: int) -> None:
        """Host rows into host memory when no memmove can (a cast, or strided rows):
        through numpy where it can (a fraction of torch's per-op cost), else torch
        (bfloat16 and other dtypes numpy lacks)."""
        if dst_np is not None and t.dtype in NUMPY_DTYPES:
            src = t.numpy() if not t.requires_grad else t.detach().numpy()
            dst_np[:length] = src[start:start + length]
        else:  # (detached: the staging must never join an autograd graph)
            dst[:length].copy_(t[start:start + length].detach())

    def write(self, prep: Prepared, start: int, length: int, width: int,
              control: Mapping[str, Any] | None = None) -> None:
        """Write rows ``[start, start+length)`` of ``prep`` into arena rows ``[0, length)``,
        fill rows ``[length, width)`` with the pad values, and set control blocks.

        On CUDA, host rows go through the next pinned staging arena and reach the device
        in one copy when the arena is small (else one copy per input); device rows are
        copied device-to-device. Stream-ordered on the current stream.
        """
        ptrs, row_bytes = prep.host_ptrs, self._row_bytes
        if self.device.type != "cuda":
            self._handed_host = None
            for name, t in prep.tensors.items():
                p = ptrs.get(name)
                if p is not None:
                    nb = row_bytes[name]
                    if p + start * nb != self._full_ptr[name]:  # else: the rows are in place
                        ctypes.memmove(self._full_ptr[name], p + start * nb, length * nb)
                elif name not in prep.zero_copy:
                    if t.device.type == "cpu":
                        self._put(self._full[name], self._full_np[name], t, start, length)
                    else:
                        self._full[name][:length].copy_(t[start:start + length].detach())
                self._full[name][length:width].fill_(self.specs[name].pad)
            for name, v in (control or {}).items():
                self._full_np[name][:len(v)] = v
            return
        k = self._next
        self._next = k ^ 1
        ev = self._events[k]
        if ev is not None:
            ev.synchronize()  # this arena's previous copy has left it
        if self._handed_host is not None and self._handed_host[0] == k:
            self._handed_host = None  # host_views() rows are good for one step
        staged_np, dirty = self._staged_np[k], self._dirty[k]
        zero_copy = prep.zero_copy
        host, dev = [], []
        for name, t in prep.tensors.items():
            p = ptrs.get(name)
            if p is not None or not t.is_cuda:
                host.append(name)
                self._stage(k, name, t, p, start, length)
            else:
                dev.append(name)
        if control:
            for name, v in control.items():
                staged_np[name][:len(v)] = v
                host.append(name)
        # One copy of the whole (small) arena when some input comes from the host and none
        # was written in place on the device: a device input's rows then come from staging
        # as pad values, and its real rows are copied over them right after, in stream
        # order. With device inputs only, no copy crosses the bus and padding is a fill.
        one_copy = bool(host) and self.nbytes <= _ONE_COPY_BYTES and not (dev and zero_copy.intersection(dev))
        if one_copy:
            for name in dev:
                if dirty[name] > 0:
                    self._fill_pad(k, name, 0, dirty[name])
                    dirty[name] = 0
        if host:
            self._copy_host(k, host, width, one_copy=one_copy)
        for name in dev:
            t = prep.tensors[name]
            if name not in zero_copy:
                self._full[name][:length].copy_(t[start:start + length], non_blocking=True)
            if width > length and not one_copy:
                self._full[name][length:width].fill_(self.specs[name].pad)
        self._record(k)

    def _record(self, k: int) -> None:
        """Record staging arena ``k``'s event on the current stream: through cudart with
        the event's raw handle once torch has created it (a fraction of torch's cost)."""
        raw = self._raw_events[k]
        if raw is not None:
            err, = self._cudart.cudaEventRecord(raw, torch._C._cuda_getCurrentRawStream(self.device.index))
            if err == self._cudart.cudaError_t.cudaSuccess:
                return
        ev = self._events[k]
        if ev is None:
            ev = self._events[k] = torch.cuda.Event()
        record_event(ev, self.device.index)
        if self._cudart is not None:
            self._raw_events[k] = ev._as_parameter_.value

    def write_fed(self, prep: Prepared, start: int, length: int, width: int,
                  control: Mapping[str, Any] | None = None) -> None:
        """``write`` for a fed graph's replay: host rows (and control blocks) into the feed,
        which the graph copies itself; device rows into the arena (rows ``[length,
        width)`` filled with pad values), flagged so that the graph keeps them."""
        self._feed_event.synchronize()  # the last replay's copy has left the feed
        if self._handed_host is not None and self._handed_host[0] == FEED:
            self._handed_host = None
        ptrs, zero_copy, staged_np = prep.host_ptrs, prep.zero_copy, self._staged_np[FEED]
        flags, dev = self._feed_flags, []
        for i, (name, t) in enumerate(prep.tensors.items()):
            p = ptrs.get(name)
            if p is not None or not t.is_cuda:
                self._stage(FEED, name, t, p, start, length)
                if not flags[i]:  # the feed's byte first: it is what the graph reads
                    staged_np["__src__"][i] = True
                    flags[i] = True
            else:
                if flags[i]:
                    staged_np["__src__"][i] = False
                    flags[i] = False
                dev.append(name)
        if control:
            for name, v in control.items():
                staged_np[name][:len(v)] = v
        for name in dev:
            if name not in zero_copy:
                self._full[name][:length].copy_(prep.tensors[name][start:start + length], non_blocking=True)
            if width > length:
                self._full[name][length:width].fill_(self.specs[name].pad)

    def unfeed(self) -> None:
        """Fed graphs keep every input's arena rows until the next step (which feeds again):
        for a caller that writes the arena itself and replays a graph directly."""
        if not self.fed or not any(self._feed_flags):
            return
        self._feed_event.synchronize()
        self._staged_np[FEED]["__src__"][:len(self.specs)] = False
        self._feed_flags = [False] * len(self.specs)

    def feed_prologue(self) -> None:
        """The first work of every fed graph (captured with it; see the class docstring)."""
        self.mirror.copy_(self.staging[FEED], non_blocking=True)
        self._feed_event.record()  # external: a node of the graph, waited on by write_fed
        keep = self._mirror_src[self._word_src]
        torch.where(keep, self._mirror_words, self._arena_words, out=self._arena_words)

    def write_control(self, control: Mapping[str, Any]) -> None:
        """Set control blocks only (a commit between steps), through the staging arena."""
        if self.device.type != "cuda":
            for name, v in control.items():
                self._full_np[name][:len(v)] = v
            return
        k = self._next
        self._next = k ^ 1
        self._wait_staging(k)
        if self._handed_host is not None and self._handed_host[0] == k:
            self._handed_host = None
        for name, v in control.items():
            self._staged_np[k][name][:len(v)] = v
        self._copy_host(k, list(control), 0, one_copy=False)
        self._record(k)

    def _copy_host(self, k: int, names: list[str], width: int, one_copy: bool) -> None:
        if one_copy:
            # Latency-bound: one copy of the whole (small) arena beats one per input, and a
            # direct cudaMemcpyAsync costs a fraction of a torch copy_ call.
            rt = self._cudart
            if rt is not None:
                err, = rt.cudaMemcpyAsync(self._arena_ptr, self._staging_ptr[k], self.nbytes, self._h2d,
                                          torch._C._cuda_getCurrentRawStream(self.device.index))
                if err == rt.cudaError_t.cudaSuccess:
                    return
            self.arena.copy_(self.staging[k], non_blocking=True)
            return
        for name in names:
            dst, src = self._full[name], self._staged[k][name]
            if name in self.specs:
                dst, src = dst[:width], src[:width]
            dst.copy_(src, non_blocking=True)
