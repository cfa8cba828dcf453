"""The GraphRuntime methods that hand out its own buffers: rows to fill in place for the
next step (zero copy), and a captured graph's static inputs and outputs for a caller that
replays it by hand. What each hands out, and for how long it is good, is in its docstring."""
from __future__ import annotations

from typing import Any

import torch

from .errors import BusyError, CapacityError, InputError, expected
from .executor import GraphSlice
from .widths import Slice


class HandedBuffers:
    """Mixed into GraphRuntime (which owns ``_inputs``, ``_by_width``, the lock helpers)."""

    def static_outputs(self, width: int) -> Any:
        """The outputs the graph of ``width`` writes at each replay (the step function's
        structure, ``width`` rows): for a caller replaying ``graphs_captured[width]`` by
        hand. Valid while that graph lives (until ``recapture()`` or ``close()``)."""
        e = self._by_width.get(width)
        if not isinstance(e, GraphSlice):
            raise InputError(expected("width", f"a captured width ({sorted(self.graphs_captured)})", width))
        return e.static_out

    @property
    def fed_graphs(self) -> bool:
        """Whether captured graphs copy their own host rows in (see StaticInputs)."""
        return self._inputs is not None and self._inputs.fed

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory this runtime holds: staging arenas, feed, host-row ring (0 on
        a CPU, where they are plain memory)."""
        if self._inputs is None:
            return 0
        ring = self._rows_mode.ring
        return sum(b.nbytes for b in self._inputs.staging) + (ring.nbytes if ring is not None and ring.pinned else 0)

    def static_inputs(self, width: int) -> dict[str, torch.Tensor]:
        """The device views a graph of ``width`` reads: rows ``[:width]`` of the arena.

        For writing them by hand and replaying ``graphs_captured[width]`` directly: a
        graph normally copies the last step's host rows in first (fed graphs, see
        StaticInputs); after this call it keeps the arena's rows as they are, until the
        next ``step``."""
        with self._exclusive("static_inputs"):
            is_int = isinstance(width, int) and not isinstance(width, bool)
            if not is_int or not (width in self.widths or self.widths[-1] < width <= self.config.rows):
                raise InputError(expected("width", f"one of {self.widths} or a dynamic width", width))
            self._inputs.unfeed()
            return self._inputs.views(width)

    def host_inputs(self, T: int, *, numpy: bool = False) -> dict[str, Any]:
        """Zero-copy host path, the fastest way in: pinned rows ``[:T]`` of the staging
        arena the next step will use. Fill them in place and pass the same objects,
        unchanged, to the next ``step``: it recognises them by identity, skips every check
        and the packing, and one host-to-device copy remains (none on the host, for a
        graph step: the graph copies its rows in). ``numpy=True`` hands out the same rows
        as numpy arrays (no ``.numpy()`` per step: the cheapest to fill; bfloat16 and
        other dtypes numpy lacks stay tensors); pass those to ``step`` instead. Rows
        written in place are taken as they are: numpy converts what you assign into the
        input's dtype without a word (1.7 into int64 is 1; out-of-range values wrap), where
        ``step`` with a list or array of another dtype raises InputError.

        Lifetime: good for the next step only (whatever that step wrote), from this
        thread. Views kept past it, or cut, are refused with InputError (their arena may
        hold an older step's rows by then); written after it, they write the next step's
        staging, which no check can see (padding rows are padded on every step all the
        same). Until this thread steps them, another thread's ``host_inputs`` and ``step``
        raise BusyError (the views of a thread that ended are free). Captures first if
        ``capture()`` was not called (a capture would reset the rows handed out). Refused
        with BusyError while another thread is inside ``step``."""
        if numpy is not True and numpy is not False:
            raise InputError(expected("host_inputs(numpy=)", "True or False", repr(numpy)))
        if not self._lock.acquire(blocking=False):  # not _exclusive: a generator costs µs here
            raise BusyError("GraphRuntime.host_inputs: another thread is inside step() or commit() of this runtime")
        try:
            self._check_open("host_inputs")
            direct = self._direct
            fed = direct is not None and direct.runs(T)
            if not fed:
                s = self._single_slice(T, "host_inputs")
                if not self._ready:
                    self.capture()
                fed = isinstance(self._executor(s), GraphSlice)
            return self._inputs.host_views(T, fed=fed, numpy=numpy)
        finally:
            self._lock.release()

    def device_inputs(self, T: int) -> dict[str, torch.Tensor]:
        """Zero-copy device path: rows ``[:T]`` of the static device arena. Write them with
        your own device ops on the current stream and pass the views to ``step``: no
        copy is made, only the padding rows are filled. Rows written here before the first
        step survive the capture that step runs (capture works on padding rows and puts
        the arena back). Refused with BusyError while another thread is inside ``step``."""
        with self._exclusive("device_inputs"):
            self._single_slice(T, "device_inputs")
            return self._inputs.device_views(T)

    def _single_slice(self, T: int, what: str) -> Slice:
        plan = self.plan(T)
        if len(plan) > 1:
            raise CapacityError(expected(f"{what}(T)", f"T <= {self.config.rows} (one slice)", T))
        return plan[0]
