"""GraphRuntime: capture a step function once per width, replay it for steps of any width.

A facade: the lock and the lifecycle, and one step as validate -> plan -> execute ->
publish. The rooms it delegates to: `config` (its arguments), `inputs` (the static
inputs), `capture` (one width), `executor` (one slice), `host_rows` (rows to the host).
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import torch

from .inputs import StaticInputs
from .graphs import Graphs
from .graphs.capture import CaptureReport, CaptureSettings, WatchedTensors, WidthCapture
from .graphs.pieces import StepValues
from .config import RuntimeConfig, StepFn
from .digest import StateDigest, runtime_digest
from .errors import BusyError, CapacityError, CgrtError, InputError, expected
from .direct_step import DirectStep
from .executor import Counters, GraphSlice, OutputLayout, StepBody, eager_executors
from .graphs.policy import WidthParts, capture_widths, modes_of
from .host_rows import HostRows, HostRowsHandle, row_choice_for
from .results import PlannedStep, RuntimeStats, StepResult
from .widths import Planner, Slice

log = logging.getLogger(__name__)


def _from_config(field: str, doc: str | None = None) -> property:
    """A read-only attribute of the runtime that reads ``RuntimeConfig.<field>``."""
    return property(lambda self: getattr(self.config, field), doc=doc or f"``RuntimeConfig.{field}``")


class GraphRuntime:
    """Captures ``step_fn`` once per width of a width set and replays it for any step.

    ``step_fn(inputs)`` takes a dict of ``[N, *shape]`` tensors (one per declared
    ``InputSpec``) and returns a tensor, tuple, list or dict of tensors whose leading
    dimension is N. It must be capturable at every width: no host syncs, no allocation
    of pinned memory, static shapes given N. It may write state (a KV cache) as long as
    padding rows (filled with each input's ``pad``) only touch a scratch slot.

    Lifetimes: static inputs live as long as the runtime; outputs of a step are valid
    until the next step; host-row handles until released. Graphs are replayed on the
    caller's current stream and never concurrently; one host thread at a time may step
    (a second is refused with BusyError).

    ``graphs``: a :class:`~cudagraph_rt.Graphs` member, its value or a bool: ``Graphs.ON``
    (True, "on": CUDA graphs), ``Graphs.OFF`` (False, "off": every width eager over the same
    buffers) or ``Graphs.EMULATE`` ("emulate"): the graph path's code on any device, a CPU
    included, each replay an eager re-run into the width's static outputs (see
    ``graphs.emulation``; what it does not emulate is listed there and in the README).
    ``rt.graphs`` reads back as True, False or "emulate".

    Failure modes: bad inputs raise InputError / CapacityError before anything is
    written; a width that cannot be captured raises CaptureError (or, with
    ``on_capture_error="eager"``, runs eagerly over the same buffers); a tensor listed by
    ``watch`` that moved since capture raises StaleCaptureError until ``recapture()``.
    Arguments are checked by :class:`~cudagraph_rt.config.RuntimeConfig` (InputError).

    ``pieces=True`` (or widths) captures widths as graphs split at calls marked
    ``cudagraph_rt.eager`` (``on_capture_error="pieces"``: where a whole graph fails);
    ``step_values(rows, width)`` gives marked calls per-step host values (``pieces``).
    """

    def __init__(self, step_fn: StepFn, inputs: Mapping[str, Any], *, widths: Iterable[int] | None = None,
                 max_width: int = 64, dynamic_limit: int | None = None, slicing: bool = True, graphs: Graphs | bool | str = True,
                 device: str | torch.device | None = None, dynamic_fn: StepFn | None = None,
                 host_rows: HostRows | None = None, on_capture_error: str = "raise", warmup: int = 2,
                 keep_graphs: bool = False, watch: Callable[[], Iterable[torch.Tensor]] | None = None,
                 pieces: bool | Iterable[int] = False, step_values: Callable | None = None):
        cfg = self.config = RuntimeConfig.build(
            step_fn, inputs, widths=widths, max_width=max_width, dynamic_limit=dynamic_limit, slicing=slicing,
            graphs=graphs, device=device, dynamic_fn=dynamic_fn, host_rows=host_rows, on_capture_error=on_capture_error,
            warmup=warmup, keep_graphs=keep_graphs, watch=watch, pieces=pieces, step_values=step_values)
        hr = self._row_choice = row_choice_for(cfg.host_rows, cfg.rows, cfg.device)  # NoHostRows without HostRows
        backend = self._backend = cfg.backend
        self._inputs = StaticInputs(cfg.inputs, cfg.rows, cfg.device, hr.control_blocks(),
                                    feed_event=backend.feed_event(cfg.device))
        self._layout = OutputLayout(hr.count_leaf)
        self._body = StepBody(cfg.step_fn, self._layout, hr, self._inputs.control, StepValues(cfg.step_values, cfg.inputs))
        self._replaying = hr.replaying
        self._watch = WatchedTensors(cfg.watch)
        self._lock, self._token = threading.Lock(), object()  # the token marks this runtime's StepResults
        self._planner = Planner(cfg.widths, cfg.dynamic_limit, cfg.slicing)
        self._capturer = backend.capturer(CaptureSettings(cfg.device, cfg.warmup, cfg.keep_graphs))
        self._ready, self.capture_report = False, None
        self._counters = Counters()
        self._direct: DirectStep | None = None  # the common step's short path, once captured
        self._eager_executors()

    # -- the arguments, as built (read-only: RuntimeConfig holds them) ------------------
    step_fn = _from_config("step_fn")
    dynamic_fn = _from_config("dynamic_fn")
    input_specs = _from_config("inputs", "the declared inputs (name -> InputSpec)")
    device = _from_config("device", "the resolved device")
    widths = _from_config("widths", "the captured widths, ascending")
    dynamic_limit = _from_config("dynamic_limit")
    slicing = _from_config("slicing")
    graphs = _from_config("graphs", 'True, False or "emulate", whatever Graphs spelling was given')
    host_rows_config = _from_config("host_rows", "the HostRows given, or None")
    on_capture_error = _from_config("on_capture_error")
    warmup = _from_config("warmup")
    keep_graphs = _from_config("keep_graphs")

    # -- public ----------------------------------------------------------------------
    def plan(self, T: int) -> tuple[Slice, ...]:
        """The slices a step of ``T`` rows runs (see ``widths.plan_step``)."""
        return self._planner(T)

    @property
    def graphs_captured(self) -> Mapping[int, torch.cuda.CUDAGraph]:
        """Captured graph per width (empty with graphs off; a ``PiecewiseGraph`` for a width in
        pieces). The runtime's own: replay them by hand if you like (see ``static_inputs``),
        but never ``reset()`` one — steps launch its executable directly and would launch a
        destroyed one; ``recapture()`` instead. With ``graphs="emulate"`` each is an
        ``EmulatedGraph`` (or ``EmulatedPieces``): ``replay()`` re-runs the width into its
        static outputs, ``reset()`` raises CgrtError."""
        return MappingProxyType({w: e.graph for w, e in self._by_width.items() if e.graph is not None})

    @property
    def graph_pool(self):
        """The memory pool this runtime's graphs share (None before capture, graphs off)."""
        return self._capturer.pool

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Capture every width once, largest first, into one shared memory pool.

        Idempotent. With graphs off it only runs the first-use probe, when HostRows is set
        (one eager call that checks the outputs and sizes the ring); else nothing.
        Raises CaptureError (see the class docstring); widths captured before still replay.
        The step function runs on padding rows only (``step_fn_calls`` in the report); the
        arena is put back afterwards, even on failure. Python's automatic garbage
        collection is paused while each width captures (it could free another runtime's
        graphs then, which invalidates a capture); an explicit ``gc.collect()`` in the step
        function is still the caller's to avoid.
        """
        self._check_open("capture")
        if self._ready:
            return self.capture_report
        with self._inputs.rows_kept():
            probed = self._row_choice.probe(self._body.values.on_pads(self.step_fn), self._inputs, self._layout,
                                           self.widths[-1])
            t0, calls = time.perf_counter(), [int(probed)]
            reports, pool = self._capture_graphs(calls) if self._backend.captures else ([], 0)
        self.capture_report = CaptureReport(tuple(reports), time.perf_counter() - t0, pool, calls[0],
                                            self._backend.name)
        log.debug("captured %d widths (%s) in %.2f s", len(reports), self._backend.name,
                  self.capture_report.seconds)
        self._ready = True
        if self._inputs.graph_stager.short_path and not self._row_choice.ships_rows:
            self._direct = DirectStep(self._inputs, self._by_width.get, self._planner, self._layout, self._counters,
                                      self._token, self._watch)
        return self.capture_report

    def recapture(self) -> CaptureReport:
        """Drop every graph and its pool and capture again: call it after a tensor the
        step reads or writes (a weight, a KV pool) was replaced or reallocated."""
        with self._lock:
            self._check_open("recapture")
            self._drop_graphs()
            return self.capture()

    def close(self) -> None:
        """Free graphs, their pool, the arena and the pinned buffers. The runtime cannot
        step afterwards."""
        with self._lock:
            self._drop_graphs()
            self._inputs, self._by_width, self._dynamic, self._body = None, {}, None, None
            self._direct = None
            self._row_choice.close()

    def __enter__(self) -> "GraphRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def step(self, /, rows: Any = None, **inputs: Any) -> StepResult:
        """Run one step of T rows (T = rows of every input).

        ``inputs``: one entry per declared input, CUDA or CPU tensors, numpy arrays or
        lists, each ``[T, *shape]``. ``rows``: with ``HostRows(mode="host")``, the row
        indices in ``[0, T)`` whose ``source`` rows go to the host. Captures on first use
        if ``capture()`` was not called. See StepResult for lifetimes.
        """
        if not self._lock.acquire(blocking=False):  # not _exclusive: a generator costs µs here
            raise BusyError("GraphRuntime.step: another thread is inside step() or commit() of this runtime")
        try:
            direct = self._direct
            if direct is not None and rows is None:
                res = direct(inputs)
                if res is not None:
                    return res
            self._check_open("step")
            return self._execute(self._plan_step(rows, inputs))
        finally:
            self._lock.release()

    def commit(self, result: StepResult, rows: Any) -> HostRowsHandle:
        """``HostRows(mode="commit")``: ship ``rows`` of an earlier step's ``source`` output
        to the host, from its device snapshot. Allowed until ``depth`` later steps have
        run (then StaleRowsError); not for sliced steps (CapacityError)."""
        self._row_choice.check_commit()
        if not isinstance(result, StepResult):
            raise InputError(expected("result", "a StepResult of this runtime", type(result).__name__))
        if result.owner is not self._token:
            raise InputError(expected("result", "a StepResult of this runtime", "one this runtime did not make"))
        with self._exclusive("commit"):
            handle = self._row_choice.commit(result, rows, result.T, self._inputs)
            self._counters.commits += 1
            return handle

    def stats(self) -> RuntimeStats:
        """A snapshot of the counters, and what each width runs as now."""
        c = self._counters
        return RuntimeStats(c.steps, c.slices, c.padding, MappingProxyType(dict(c.replays)),
                            MappingProxyType(dict(c.eager)), MappingProxyType(dict(c.dynamic)), c.commits,
                            self._backend.name, MappingProxyType(modes_of(self._by_width)))

    def reset_stats(self) -> None:
        self._counters.reset()

    def state_digest(self) -> StateDigest:
        """A fingerprint of everything a step, commit or refused call could write: the
        device arena, the pinned staging and feed, the host-row ring, the commit snapshots
        and the counters (see StateDigest). Waits for the device first. Meant for tests
        ("a refused call writes nothing": equal digests before and after) and debugging:
        it copies every buffer to the host, so keep it off a serving loop's hot path. It
        takes no lock (it may watch a step another thread is blocked in) and raises
        CgrtError after ``close()``."""
        self._check_open("state_digest")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # every queued gather has written the ring
        return runtime_digest(self._inputs, self._row_choice, self.stats())

    # -- the runtime's own buffers, handed out: what each is and for how long, in its docstring
    def static_outputs(self, width: int) -> Any:
        """The outputs the graph of ``width`` writes at each replay (the step function's
        structure, ``width`` rows): for a caller replaying ``graphs_captured[width]`` by
        hand. Valid while that graph lives (until ``recapture()`` or ``close()``)."""
        is_int = isinstance(width, int) and not isinstance(width, bool)  # True == 1, 4.0 == 4 as dict keys
        e = self._by_width.get(width) if is_int else None
        if not isinstance(e, GraphSlice):
            raise InputError(expected("width", f"a captured width ({sorted(self.graphs_captured)})", width))
        return e.static_out

    @property
    def fed_graphs(self) -> bool:
        """Whether captured graphs copy their own host rows in (their stager is the feed;
        see StaticInputs)."""
        return self._inputs is not None and self._inputs.fed

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory this runtime holds: staging arenas, feed, host-row ring (0 on
        a CPU, where they are plain memory)."""
        if self._inputs is None:
            return 0
        return sum(b.nbytes for b in self._inputs.staging) + self._row_choice.pinned_bytes()

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
            if direct is not None and direct.runs(T):
                stager = direct.stager
            else:
                s = self._single_slice(T, "host_inputs")
                if not self._ready:
                    self.capture()
                stager = self._executor(s).stager  # the arena stager, or the graph stager (the feed)
            return self._inputs.host_views(T, stager, numpy=numpy)
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
        """T's one slice; CapacityError for a T that would need more, found in O(1) (a
        plan of T rows is O(T / rows) slices: never built only to be refused)."""
        if isinstance(T, int) and T > self.config.rows:
            raise CapacityError(expected(f"{what}(T)", f"T <= {self.config.rows} (one slice)", T))
        return self.plan(T)[0]

    # -- one step: validate and plan (writes nothing), then execute ---------------------
    def _plan_step(self, rows: Any, inputs: Mapping[str, Any]) -> PlannedStep:
        prep = self._inputs.prepare(inputs)
        T = prep.T
        sliced = T > self.config.rows  # more than one slice
        # A sliced step's whole plan (O(T / rows) slices) waits until the checks took it.
        slices = (self._planner.first(T),) if sliced else self._planner(T)
        if prep.zero_copy and sliced:
            raise CapacityError(expected("zero-copy inputs", f"a step of at most {self.config.rows} rows", T))
        hr = self._row_choice
        first = slices[0].width if slices[0].path == "graph" else slices[0].length
        idx = hr.step_rows(rows, T, first, sliced)
        if sliced:
            slices = self._planner(T)
        if not self._ready:
            self.capture()
        self._watch.check()
        return PlannedStep(prep, slices, hr.ticket(idx, T, sliced))

    def _execute(self, step: PlannedStep) -> StepResult:
        ticket, counters = step.ticket, self._counters
        ticket.open()
        try:
            control = ticket.control()
            if step.sliced:
                outputs = self._run_sliced(step, control)
            else:
                s = step.slices[0]
                outputs = ticket.finish(self._executor(s).outputs(step.prep, s, control, self._layout))
        except BaseException:
            ticket.abort()
            raise
        if step.sliced:
            counters.step_ran()
        else:
            counters.step_ran(step.slices[0].padding, 1)
        handle, snap = ticket.publish()
        return StepResult(outputs, step.T, step.slices, handle, snap, self._token)

    def _run_sliced(self, step: PlannedStep, control) -> Any:
        """Each slice's rows are copied out of graph memory before the next slice runs."""
        ticket, bufs = step.ticket, None
        with torch.inference_mode():
            for s in step.slices:
                out = self._executor(s).run(step.prep, s, control)
                self._counters.slice_ran(s.padding)
                bufs = self._layout.join_into(bufs, out, s, step.T)
                ticket.record(out, s)
            return ticket.finish(self._layout.joined(bufs))

    # -- building blocks ---------------------------------------------------------------
    def _executor(self, s: Slice):
        return self._dynamic if s.path == "dynamic" else self._by_width[s.width]

    def _eager_executors(self) -> None:
        self._by_width, self._dynamic = eager_executors(self.widths, self._body, self.dynamic_fn, self._inputs,
                                                        self._counters)

    def _capture_graphs(self, calls: list[int]) -> tuple[list[WidthCapture], int]:
        """Warm-up and capture run the step function for real: on padding rows only, with
        every gather aimed at a spare slot (recapture() comes after real steps; their rows,
        KV slots and held host rows must not be touched again). Each width as the capture
        policy says (``graphs.policy``)."""
        self._inputs.reset(self._row_choice.spare_control())
        cap = self._capturer
        cap.begin()
        parts = WidthParts(self._body, self._inputs, self._counters, self._backend, self._replaying, self.device,
                           self.explain_capture)
        reports = capture_widths(self.config.capture_policy, cap, self._by_width, parts, calls)
        self._row_choice.capture_extra(cap.body, self._inputs)
        self._watch.remember()
        return reports, cap.pool_bytes()

    def explain_capture(self, width: int) -> tuple:
        """The hazard finder run on the step at ``width`` (what a CaptureError lists);
        never raises. Runs the step eagerly once, on padding rows only (a scratch copy of
        the inputs, each row its ``pad``: the arena and live KV cells are not touched); a
        subclass whose step holds collectives overrides it (DistributedRuntime stubs them)."""
        try:
            from .debug.hazards import find_capture_hazards
            return find_capture_hazards(self._body.values.on_pads(self.step_fn), self._inputs.pad_rows(width))
        except Exception:  # noqa: BLE001 - the explanation must never hide the capture error
            return ()

    def _drop_graphs(self) -> None:
        self._direct = None
        self._eager_executors()
        self._row_choice.drop_graphs()
        self._capturer.drop()
        self._ready = False
        self._watch.forget()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    @contextmanager
    def _exclusive(self, what: str):
        """The one step lock, never waited for (BusyError), and the runtime still open."""
        if not self._lock.acquire(blocking=False):
            raise BusyError(f"GraphRuntime.{what}: another thread is inside step() or commit() of this runtime")
        try:
            self._check_open(what)
            yield
        finally:
            self._lock.release()

    def _check_open(self, what: str) -> None:
        if self._inputs is None:
            raise CgrtError(f"GraphRuntime.{what}: the runtime was closed")
