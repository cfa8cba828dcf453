"""GraphRuntime: capture a step function once per width, replay it for steps of any width.

One object owns everything a replay touches: the static input arena (buffers.py), the
graphs and their one memory pool, the static outputs, and the host-row ring.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .buffers import StaticInputs
from .capture import CaptureReport, WidthCapture, capture_width
from .digest import StateDigest, fingerprint
from .errors import (
    BusyError,
    CapacityError,
    CaptureError,
    CgrtError,
    InputError,
    StaleCaptureError,
    StaleRowsError,
    StepFunctionError,
    expected,
)
from .host_rows import HostRowRing, HostRows, HostRowsHandle, check_host_rows
from .specs import InputSpec
from .widths import (
    Slice,
    check_widths,
    default_dynamic_limit,
    default_widths,
    plan_step,
)

StepFn = Callable[[Mapping[str, torch.Tensor]], Any]


@dataclass(frozen=True)
class StepResult:
    """What one ``step`` returns.

    ``outputs`` has the structure the step function returns, cut to the step's ``T`` real
    rows. For a one-slice step they are views of graph-owned memory, valid until the next
    ``step`` (or ``commit``) of the same runtime: clone what you keep. ``slices`` says
    which paths and widths ran; ``host_rows`` is the handle to the rows shipped to the
    host (None when the step shipped none).
    """

    outputs: Any
    T: int
    slices: tuple[Slice, ...]
    host_rows: HostRowsHandle | None = None
    snapshot: tuple[int, int] | None = field(default=None, repr=False)  # (slot, generation)
    owner: object = field(default=None, repr=False, compare=False)  # the runtime's token


@dataclass(frozen=True)
class RuntimeStats:
    """Counters since construction (or ``reset_stats``): graph replays and eager calls per
    width (eager: graphs off, or a width that fell back), dynamic calls per row count."""

    steps: int
    slices: int
    padding_rows: int
    graph_replays: Mapping[int, int]
    eager_calls: Mapping[int, int]
    dynamic_calls: Mapping[int, int]
    commits: int


def _key_get(out: Any, key: str | int, what: str) -> torch.Tensor:
    try:
        t = out[key]
    except (KeyError, IndexError, TypeError):
        raise StepFunctionError(
            expected(what, f"the step function's output {key!r}", f"outputs of type {type(out).__name__}")
        ) from None
    if not isinstance(t, torch.Tensor):
        raise StepFunctionError(expected(what, "a tensor", type(t).__name__))
    return t


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

    Failure modes: bad inputs raise InputError / CapacityError before anything is
    written; a width that cannot be captured raises CaptureError (or, with
    ``on_capture_error="eager"``, runs eagerly over the same buffers); a tensor listed by
    ``watch`` that moved since capture raises StaleCaptureError until ``recapture()``.
    """

    def __init__(
        self,
        step_fn: StepFn,
        inputs: Mapping[str, InputSpec],
        *,
        widths: Iterable[int] | None = None,
        max_width: int = 64,
        dynamic_limit: int | None = None,
        slicing: bool = True,
        graphs: bool = True,
        device: str | torch.device | None = None,
        dynamic_fn: StepFn | None = None,
        host_rows: HostRows | None = None,
        on_capture_error: str = "raise",
        warmup: int = 2,
        keep_graphs: bool = False,
        watch: Callable[[], Iterable[torch.Tensor]] | None = None,
    ):
        if not callable(step_fn):
            raise InputError(expected("step_fn", "a callable", type(step_fn).__name__))
        if dynamic_fn is not None and not callable(dynamic_fn):
            raise InputError(expected("dynamic_fn", "a callable or None", type(dynamic_fn).__name__))
        if watch is not None and not callable(watch):
            raise InputError(expected("watch", "a callable returning tensors, or None", type(watch).__name__))
        if not isinstance(inputs, Mapping) or not inputs:
            raise InputError(expected("inputs", "a non-empty dict of name -> InputSpec", repr(inputs)))
        for name, spec in inputs.items():
            if not isinstance(name, str) or not name.isidentifier() or name == "rows" or name.startswith("__"):
                raise InputError(expected("inputs", "identifier names other than 'rows'", repr(name)))
            if not isinstance(spec, InputSpec):
                raise InputError(expected(f"inputs[{name!r}]", "an InputSpec", type(spec).__name__))
        self.widths = check_widths(widths) if widths is not None else default_widths(max_width)
        if dynamic_limit is None:
            dynamic_limit = default_dynamic_limit(self.widths)
        if isinstance(dynamic_limit, bool) or not isinstance(dynamic_limit, int) or dynamic_limit < self.widths[-1]:
            raise InputError(
                expected("dynamic_limit", f"an int >= the widest graph ({self.widths[-1]})", repr(dynamic_limit))
            )
        if on_capture_error not in ("raise", "eager"):
            raise InputError(expected("on_capture_error", "'raise' or 'eager'", repr(on_capture_error)))
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise InputError(expected("warmup", "an int >= 0", repr(warmup)))
        if host_rows is not None and not isinstance(host_rows, HostRows):
            raise InputError(expected("host_rows", "a HostRows or None", type(host_rows).__name__))
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError):
            raise InputError(expected("device", "a torch device", repr(device))) from None
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise InputError(expected("device", "a device this machine has", f"{device} (no CUDA here)"))
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
        elif graphs:
            raise InputError(expected("graphs", "False on a CPU device (CUDA graphs need a GPU)", True))
        elif self.device.type != "cpu":
            raise InputError(expected("device", "'cuda' or 'cpu'", str(self.device)))

        self.step_fn, self.dynamic_fn = step_fn, dynamic_fn
        self.dynamic_limit, self.slicing, self.graphs = dynamic_limit, slicing, graphs
        self.input_specs = MappingProxyType(dict(inputs))
        self.host_rows_config = host_rows
        self.on_capture_error, self.warmup, self.keep_graphs = on_capture_error, warmup, keep_graphs
        self._watch = watch
        self._rows = max(self.widths[-1], dynamic_limit)
        self._capacity = (host_rows.capacity if host_rows is not None else None) or self._rows
        control = {}
        if host_rows is not None:
            control = {"__rows__": (self._rows, torch.int32), "__ctrl__": (4, torch.int32)}
        self._inputs = StaticInputs(inputs, self._rows, self.device, control, feed=graphs)
        self._lock = threading.Lock()
        self._token = object()  # marks the StepResults this runtime made (commit checks it)
        self._plans: dict[int, tuple[Slice, ...]] = {}
        self._cuts: dict[int, tuple[Any, Any]] = {}  # T -> (static outputs, their rows [:T])
        self._spec = None  # output tree structure, fixed by the first call
        self._count_leaf_index = -1
        self._flat_dict = False
        self._ring: HostRowRing | None = None
        self._snap: torch.Tensor | None = None
        self._snap_gen: list[int] = []
        self._snap_next = 0
        self._snap_writes = 0  # snapshot gathers begun (a failed step before one keeps its turn)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._static_out: dict[int, Any] = {}
        self._eager_widths: set[int] = set()
        self._commit_graph = None
        self._pool = None
        self._stream = None  # the capture stream, shared by every width
        self._watched: list[tuple[int, tuple]] | None = None
        self._ready = False
        self.capture_report: CaptureReport | None = None
        self.reset_stats()
        if self.device.type == "cuda":
            from .kernels.row_gather import gather_rows
        else:
            from .kernels.row_gather import gather_rows_reference as gather_rows
        self._gather = gather_rows

    # -- public ----------------------------------------------------------------------
    def plan(self, T: int) -> tuple[Slice, ...]:
        """The slices a step of ``T`` rows runs (see ``widths.plan_step``)."""
        return plan_step(T, self.widths, self.dynamic_limit, self.slicing)

    @property
    def graphs_captured(self) -> Mapping[int, torch.cuda.CUDAGraph]:
        """Captured graph per width (empty with graphs off)."""
        return MappingProxyType(self._graphs)

    def static_inputs(self, width: int) -> dict[str, torch.Tensor]:
        """The device views a graph of ``width`` reads: rows ``[:width]`` of the arena.

        For writing them by hand and replaying ``graphs_captured[width]`` directly: a
        graph normally copies the last step's host rows in first (fed graphs, see
        StaticInputs); after this call it keeps the arena's rows as they are, until the
        next ``step``."""
        with self._exclusive("static_inputs"):
            if isinstance(width, bool) or not isinstance(width, int) or (width not in self.widths and not (self.widths[-1] < width <= self._rows)):
                raise InputError(expected("width", f"one of {self.widths} or a dynamic width", width))
            self._inputs.unfeed()
            return self._inputs.views(width)

    def host_inputs(self, T: int) -> dict[str, torch.Tensor]:
        """Zero-copy host path, the fastest way in: pinned rows ``[:T]`` of the staging
        arena the next step will use. Fill them in place (numpy on ``.numpy()`` is cheapest)
        and pass the same view objects, unchanged, to the next ``step``: it recognises them
        by identity, skips every check and the packing, and one host-to-device copy remains.

        Lifetime: good for the next step only. Views kept past it, or cut, are refused with
        InputError (their arena may hold an older step's rows by then). Captures first if
        ``capture()`` was not called (a capture would reset the rows handed out). Refused
        with BusyError while another thread is inside ``step``."""
        with self._exclusive("host_inputs"):
            self._check_single_slice(T, "host_inputs")
            if not self._ready:
                self.capture()
            return self._inputs.host_views(T, fed=self._fed_graph(self.plan(T)[0]) is not None)

    def device_inputs(self, T: int) -> dict[str, torch.Tensor]:
        """Zero-copy device path: rows ``[:T]`` of the static device arena. Write them with
        your own device ops on the current stream and pass the views to ``step``: no
        copy is made, only the padding rows are filled. Rows written here before the first
        step survive the capture that step runs (capture works on padding rows and puts
        the arena back). Refused with BusyError while another thread is inside ``step``."""
        with self._exclusive("device_inputs"):
            self._check_single_slice(T, "device_inputs")
            return self._inputs.device_views(T)

    @contextmanager
    def _exclusive(self, what: str):
        """The step lock, not waited for (BusyError), and the runtime still open."""
        if not self._lock.acquire(blocking=False):
            raise BusyError(f"GraphRuntime.{what}: another thread is inside step() of this runtime")
        try:
            self._check_open(what)
            yield
        finally:
            self._lock.release()

    def _fed_graph(self, s: Slice):
        """The graph that runs slice ``s`` when it is a fed graph (it copies its own host
        rows in: see StaticInputs), else None."""
        if not self._inputs.fed or s.path != "graph":
            return None
        return self._graphs.get(s.width)

    def _check_open(self, what: str) -> None:
        if self._inputs is None:
            raise CgrtError(f"GraphRuntime.{what}: the runtime was closed")

    def _check_single_slice(self, T: int, what: str) -> None:
        if len(self.plan(T)) > 1:
            raise CapacityError(expected(f"{what}(T)", f"T <= {self._rows} (one slice)", T))

    @torch.inference_mode()
    def capture(self) -> CaptureReport:
        """Capture every width once, largest first, into one shared memory pool.

        Idempotent. With graphs off it only checks the step function's output structure.
        Raises CaptureError (see the class docstring); widths captured before still replay.
        """
        self._check_open("capture")
        if self._ready:
            return self.capture_report
        # The probe, warm-up and capture run on padding rows; rows the caller wrote into the
        # arena (device_inputs, static_inputs) are put back afterwards, even on failure.
        with self._inputs.rows_kept():
            return self._capture_widths()

    def _capture_widths(self) -> CaptureReport:
        t0 = time.perf_counter()
        calls = [int(self._probe())]  # step_fn runs, every one on padding rows
        reports = []
        if self.graphs:
            # Warm-up and capture run the step function for real: on padding rows only, with
            # every gather pointed at the spare ring / snapshot slot (recapture() comes after
            # real steps; their rows, KV slots and held host rows must not be touched again).
            spare = None
            if self.host_rows_config is not None:
                spare = {"__ctrl__": [0, self._ring.spare, self.host_rows_config.depth, 0]}
            self._inputs.reset(spare)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            base = torch.cuda.memory_reserved(self.device)
            self._pool = torch.cuda.graph_pool_handle()
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            for w in sorted(self.widths, reverse=True):
                if w in self._graphs:
                    continue
                views = self._inputs.views(w)

                def run(w=w, views=views):
                    calls[0] += 1
                    if self._inputs.fed:
                        self._inputs.feed_prologue()
                    return self._body(w, views, self.step_fn)
                try:
                    g, out, tw, tc = capture_width(
                        w, run, pool=self._pool, stream=self._stream,
                        warmup=self.warmup, keep_graph=self.keep_graphs,
                        explain=lambda: self._explain(w),
                    )
                except CaptureError as e:
                    # The failed capture may have spoiled its stream and pool: later widths
                    # get fresh ones (they no longer share memory with the widths before).
                    self._stream, self._pool = torch.cuda.Stream(self.device), torch.cuda.graph_pool_handle()
                    if self.on_capture_error == "raise":
                        raise
                    self._eager_widths.add(w)
                    reports.append(WidthCapture(w, 0.0, 0.0, 0, error=str(e)))
                    continue
                self._graphs[w], self._static_out[w] = g, out
                torch.cuda.empty_cache()
                reports.append(WidthCapture(w, tw, tc, torch.cuda.memory_reserved(self.device) - base))
            if self.host_rows_config is not None and self.host_rows_config.mode == "commit":
                self._capture_commit()
            self._watched = self._watch_now()
            pool = torch.cuda.memory_reserved(self.device) - base
        else:
            pool = 0
        self.capture_report = CaptureReport(tuple(reports), time.perf_counter() - t0, pool, calls[0])
        self._ready = True
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
            self._inputs = None
            self._ring = None
            self._snap = self._snap_meta = self._iota = None
            self._width_count = {}

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
        if not self._lock.acquire(blocking=False):
            raise BusyError("GraphRuntime.step: another thread is inside step() of this runtime")
        try:
            if self._inputs is None:
                raise CgrtError("GraphRuntime.step: the runtime was closed")
            return self._step(rows, inputs)
        finally:
            self._lock.release()

    def commit(self, result: StepResult, rows: Any) -> HostRowsHandle:
        """``HostRows(mode="commit")``: ship ``rows`` of an earlier step's ``source`` output
        to the host, from its device snapshot. Allowed until ``depth`` later steps have
        run (then StaleRowsError); not for sliced steps (CapacityError)."""
        hr = self.host_rows_config
        if hr is None or hr.mode != "commit":
            raise InputError(expected("commit()", "a runtime built with HostRows(mode='commit')",
                                      f"mode {hr.mode if hr else None!r}"))
        if not isinstance(result, StepResult):
            raise InputError(expected("result", "a StepResult of this runtime", type(result).__name__))
        if result.owner is not self._token:
            raise InputError(expected("result", "a StepResult of this runtime", "one this runtime did not make"))
        if not self._lock.acquire(blocking=False):
            raise BusyError("GraphRuntime.commit: another thread is inside this runtime")
        try:
            self._check_open("commit")
            if result.snapshot is None:
                raise CapacityError(expected("result", "a one-slice step (sliced steps keep no snapshot)",
                                             f"a step of {len(result.slices)} slices"))
            snap_slot, gen = result.snapshot
            if self._snap_gen[snap_slot] != gen:
                raise StaleRowsError(f"commit: the snapshot of that step was reused by a later step "
                                     f"(commit within {hr.depth} steps)")
            idx = check_host_rows(rows, result.T, self._capacity, hr.allow_duplicates)
            if len(idx) > self._rows:  # duplicates: the index block holds one per arena row
                raise CapacityError(expected("rows", f"at most {self._rows} indices (the runtime's rows)", len(idx)))
            slot = self._ring.check_free()
            # -- nothing was written above --
            slot = self._ring.acquire()
            self._inputs.write_control({"__rows__": idx.numpy(), "__ctrl__": (len(idx), slot, snap_slot, 0)})
            with torch.inference_mode():
                if self._commit_graph is not None:
                    self._commit_graph.replay()
                else:
                    self._commit_body()
            self._commits += 1
            return self._ring.publish(slot, result.T, idx.numel())
        finally:
            self._lock.release()

    def stats(self) -> RuntimeStats:
        """A snapshot of the counters."""
        return RuntimeStats(
            self._steps, self._slices, self._padding,
            MappingProxyType(dict(self._replays)), MappingProxyType(dict(self._eager)),
            MappingProxyType(dict(self._dynamic)), self._commits,
        )

    def state_digest(self) -> StateDigest:
        """A fingerprint of everything a step, commit or refused call could write: the
        device arena, the pinned staging and feed, the host-row ring, the commit snapshots
        and the counters (see StateDigest). Waits for the device first. Meant for tests
        ("a refused call writes nothing": equal digests before and after) and debugging:
        it copies every buffer to the host, so keep it off a serving loop's hot path."""
        with self._exclusive("state_digest"):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            arena, staging = self._inputs.digest_parts()
            ring = fingerprint(self._ring.digest_parts()) if self._ring is not None else "-"
            snaps = "-"
            if self._snap is not None:
                snaps = fingerprint([self._snap, self._snap_meta, self._snap_gen, self._snap_next])
            st = self.stats()
            counters = (st.steps, st.slices, st.padding_rows, tuple(sorted(st.graph_replays.items())),
                        tuple(sorted(st.eager_calls.items())), tuple(sorted(st.dynamic_calls.items())), st.commits)
            return StateDigest(fingerprint(arena), fingerprint(staging), ring, snaps, counters)

    def reset_stats(self) -> None:
        self._steps = self._slices = self._padding = self._commits = 0
        self._replays, self._eager, self._dynamic = Counter(), Counter(), Counter()

    # -- the step ----------------------------------------------------------------------
    def _step(self, rows: Any, inputs: Mapping[str, Any]) -> StepResult:
        prep = self._inputs.prepare(inputs)
        T = prep.T
        slices = self._plans.get(T) or self._plan_cached(T)
        multi = len(slices) > 1
        if prep.zero_copy and multi:
            raise CapacityError(expected("zero-copy inputs", f"a step of at most {self._rows} rows", T))
        hr = self.host_rows_config
        idx = None
        if rows is not None:
            if hr is None or hr.mode != "host":
                raise InputError(expected("rows", "None unless the runtime has HostRows(mode='host')", "row indices"))
            idx = check_host_rows(rows, T, self._capacity, hr.allow_duplicates)
            n = slices[0].width if slices[0].path == "graph" else slices[0].length
            if not multi and len(idx) > n:  # duplicates: one index per row the step runs, at most
                raise CapacityError(expected("rows", f"at most {n} indices in a step that runs {n} rows", len(idx)))
        if multi and hr is not None and hr.mode == "device" and hr.capacity is None and T > self._capacity:
            raise CapacityError(expected(
                "step inputs", f"at most {self._capacity} rows in HostRows(mode='device') (a step may accept "
                f"every row; the default HostRows.capacity is the runtime's {self._capacity} rows: set it to "
                f"the widest step)", f"{T} rows"))
        if not self._ready:
            self.capture()
        if self._watched is not None:
            self._check_watched()
        ships = hr is not None and (hr.mode == "device" or idx is not None)
        if ships:
            self._ring.check_free()
        # -- nothing was written above this line --
        slot = self._ring.acquire() if ships else None
        try:
            return self._step_body(prep, T, slices, multi, hr, idx, ships, slot)
        except BaseException:
            if slot is not None:
                self._ring.unacquire(slot)  # a failed step does not use up a ring turn
            raise

    def _step_body(self, prep, T, slices, multi, hr, idx, ships, slot) -> StepResult:
        snap = None
        if hr is not None and hr.mode == "commit" and not multi:
            snap = self._snap_next
            self._snap_next = (snap + 1) % hr.depth
            self._snap_gen[snap] += 1
            writes = self._snap_writes
            try:
                return self._step_run(prep, T, slices, multi, hr, idx, ships, slot, snap)
            except BaseException:
                if self._snap_writes == writes:  # the snapshot slot was never written:
                    self._snap_gen[snap] -= 1    # the commit window keeps its turn
                    self._snap_next = snap
                raise
        return self._step_run(prep, T, slices, multi, hr, idx, ships, slot, snap)

    def _step_run(self, prep, T, slices, multi, hr, idx, ships, slot, snap) -> StepResult:
        control = None
        if hr is not None:
            one = not multi and ships
            count = len(idx) if (one and idx is not None) else 0
            control = {"__ctrl__": (count, slot if one else self._ring.spare,
                                    snap if snap is not None else hr.depth, 0 if multi else T)}
            if one and idx is not None:
                control["__rows__"] = idx.numpy()
        if not multi:
            s = slices[0]
            w = s.width
            g = self._graphs.get(w) if s.path == "graph" else None
            if g is not None and self._inputs.fed:
                self._inputs.write_fed(prep, 0, T, w, control)
            else:
                self._inputs.write(prep, 0, T, w, control)
            if g is not None:
                self._replays[w] += 1
                self._snap_writes += 1
                g.replay()
                # Replays return the same static tensors every time: cut them once per T.
                out = self._static_out[w]
                cut = self._cuts.get(T)
                if cut is None or cut[0] is not out:
                    cut = self._cuts[T] = (out, self._cut(out, T))
                outputs = cut[1].copy() if type(cut[1]) is dict else cut[1]
            else:
                outputs = self._cut(self._run_slice(s), T)
            self._slices += 1
            self._padding += w - T
        else:
            with torch.inference_mode():
                outputs = self._run_sliced(prep, slices, control, idx, slot, ships)
        self._steps += 1
        handle = self._ring.publish(slot, T, len(idx) if idx is not None else None) if ships else None
        return StepResult(outputs, T, slices, handle,
                          (snap, self._snap_gen[snap]) if snap is not None else None, self._token)

    def _plan_cached(self, T: int) -> tuple[Slice, ...]:
        plan = self.plan(T)
        if T <= 4 * self._rows:  # bounded: the cache never outgrows a few hundred entries
            self._plans[T] = plan
        return plan

    def _run_sliced(self, prep, slices, control, idx, slot, ships) -> Any:
        """Each slice's rows are copied out of graph memory before the next slice runs."""
        T, acc = prep.T, None
        for s in slices:
            width = s.width if s.path == "graph" else s.length
            if self._fed_graph(s) is not None:
                self._inputs.write_fed(prep, s.start, s.length, width, control)
            else:
                self._inputs.write(prep, s.start, s.length, width, control)
            out = self._run_slice(s)
            self._slices += 1
            self._padding += s.padding
            acc = self._accumulate(acc, out, s, T)
        outputs = tree_unflatten(acc[0], acc[1])
        if ships:
            outputs = self._gather_sliced(outputs, idx, slot, T, acc[2])
        return outputs

    def _run_slice(self, s: Slice) -> Any:
        g = self._graphs.get(s.width) if s.path == "graph" else None
        if g is not None:
            self._replays[s.width] += 1
            g.replay()
            return self._static_out[s.width]
        with torch.inference_mode():
            if s.path == "dynamic":
                self._dynamic[s.length] += 1
                return self._body(s.length, self._inputs.views(s.length), self.dynamic_fn or self.step_fn)
            self._eager[s.width] += 1
            return self._body(s.width, self._inputs.views(s.width), self.step_fn)

    def _cut(self, out: Any, T: int) -> Any:
        if self._flat_dict:  # the common case (a dict of tensors), fast
            return {k: v[:T] for k, v in out.items()}
        if type(out) is torch.Tensor:
            return out[:T]
        leaves, spec = tree_flatten(out)
        cnt = self._count_leaf_index
        return tree_unflatten([t if i == cnt else t[:T] for i, t in enumerate(leaves)], spec)

    def _accumulate(self, acc, out: Any, s: Slice, T: int):
        """Copy a slice's rows out of graph memory (the next slice overwrites it)."""
        leaves, spec = tree_flatten(out)
        if acc is None:
            bufs = [t.clone() if i == self._count_leaf_index else
                    torch.empty((T, *t.shape[1:]), dtype=t.dtype, device=t.device)
                    for i, t in enumerate(leaves)]
            acc = (bufs, spec, [])
        bufs = acc[0]
        for i, t in enumerate(leaves):
            if i == self._count_leaf_index:
                continue
            bufs[i][s.start:s.start + s.length].copy_(t[:s.length])
        if self.host_rows_config is not None and self.host_rows_config.mode == "device":
            hr = self.host_rows_config
            r = _key_get(out, hr.rows_output, "rows_output")
            c = _key_get(out, hr.count_output, "count_output")
            width = s.width if s.path == "graph" else s.length
            # All `width` entries: a chooser may list padding rows first (they are dropped
            # in the merge), so cutting to the slice's length could lose real rows.
            acc[2].append((s.start, width, s.length, r.reshape(-1)[:width].long(), c.reshape(-1)[:1].long()))
        return acc

    def _gather_sliced(self, outputs: Any, idx, slot: int, T: int, slice_rows: list) -> Any:
        """A sliced step ships its rows after the last slice, from the joined outputs.
        Device-chosen rows of each slice are merged on the device (no host sync)."""
        hr = self.host_rows_config
        src = _key_get(outputs, hr.source, "source")
        if hr.mode == "host":
            rows = idx.to(self.device, non_blocking=True)
            count = torch.tensor([idx.numel()], dtype=torch.int32).to(self.device, non_blocking=True)
        else:
            mask = torch.zeros(T + 1, dtype=torch.int32, device=self.device)
            bad = torch.zeros((), dtype=torch.bool, device=self.device)  # an index out of range
            bad_count = torch.zeros((), dtype=torch.bool, device=self.device)  # a count outside [0, width]
            for start, width, length, r, c in slice_rows:
                j = torch.arange(r.numel(), device=self.device)
                used = j < c
                ok = used & (r >= 0) & (r < length)  # rows [length, width) are padding: dropped
                bad = bad | (used & ((r < 0) | (r >= width))).any()
                bad_count = bad_count | (c < 0).any() | (c > width).any()
                mask.index_fill_(0, torch.where(ok, r + start, T), 1)
            mask = mask[:T]
            order = torch.sort(1 - mask, stable=True).indices.to(torch.int32)
            n_ok = mask.sum().to(torch.int32)
            # A bad index in any slice: one out-of-range sentinel after the good rows, so the
            # gather flags it (DeviceRowIndexError on read) exactly as a one-slice step does.
            rows = torch.cat([order, order.new_full((1,), T)])
            rows = torch.where((torch.arange(T + 1, device=self.device) == n_ok) & bad, T, rows)
            count = (n_ok + bad.to(torch.int32)).reshape(1)
            count = torch.where(bad_count, -1, count)  # flagged as a bad count, nothing shipped
            if isinstance(outputs, dict):
                outputs = dict(outputs)
                outputs[hr.rows_output], outputs[hr.count_output] = order, n_ok.reshape(1)
            elif type(outputs) in (list, tuple):
                out = list(outputs)
                out[hr.rows_output], out[hr.count_output] = order, n_ok.reshape(1)
                outputs = type(outputs)(out)
        slot_t = torch.tensor([slot], dtype=torch.int32).to(self.device, non_blocking=True)
        self._gather(src, rows, count, self._ring.dst, self._ring.meta, dst_slot=slot_t)
        return outputs

    # -- building blocks ---------------------------------------------------------------
    def _body(self, n: int, views: dict[str, torch.Tensor], fn: StepFn) -> Any:
        """Run the step function at width ``n`` and the host-row work that belongs to the
        same replay. Captured as is; also the eager path."""
        out = fn(views)
        self._check_structure(n, out)
        hr = self.host_rows_config
        if hr is None:
            return out
        src = _key_get(out, hr.source, "HostRows.source")
        ctrl = self._inputs.control("__ctrl__")
        if hr.mode == "host":
            self._gather(src, self._inputs.control("__rows__")[:n], ctrl[0:1],
                         self._ring.dst, self._ring.meta, dst_slot=ctrl[1:2])
        elif hr.mode == "device":
            rows = _key_get(out, hr.rows_output, "HostRows.rows_output").reshape(-1)[:n]
            count = _key_get(out, hr.count_output, "HostRows.count_output").reshape(-1)[:1].to(torch.int32)
            # Padding rows [T, n) are never shipped: drop them, keep the order of the rest
            # (indices outside [0, n) stay, so the gather still flags them). ctrl[3] = T.
            used = torch.arange(rows.numel(), device=rows.device) < count
            pad = used & (rows >= ctrl[3]) & (rows < n)
            order = torch.sort(pad.to(torch.int8), stable=True).indices
            # A count above the n rows is kept as it is, so the gather flags it (count > R).
            rows = rows[order]
            count = torch.where(count > n, count, count - pad.sum().to(torch.int32))
            self._gather(src, rows, count, self._ring.dst, self._ring.meta, dst_slot=ctrl[1:2])
        else:
            self._snap_writes += 1  # from here on the snapshot slot may hold this step's rows
            self._gather(src, self._iota[:n], self._width_count[n], self._snap, self._snap_meta,
                         dst_slot=ctrl[2:3])
        return out

    def _commit_body(self) -> None:
        ctrl = self._inputs.control("__ctrl__")
        self._gather(self._snap, self._inputs.control("__rows__"), ctrl[0:1], self._ring.dst,
                     self._ring.meta, src_slot=ctrl[2:3], dst_slot=ctrl[1:2])

    def _capture_commit(self) -> None:
        g = torch.cuda.CUDAGraph()
        side = self._stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._commit_body()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(g, pool=self._pool, stream=side):
            self._commit_body()
        self._commit_graph = g

    def _check_structure(self, n: int, out: Any) -> None:
        leaves, spec = tree_flatten(out)
        if not leaves:
            raise StepFunctionError(expected("step_fn output", "at least one tensor", repr(out)))
        cnt = self._count_index(out, leaves)
        for i, t in enumerate(leaves):
            if not isinstance(t, torch.Tensor):
                raise StepFunctionError(expected(f"step_fn output leaf {i}", "a tensor", type(t).__name__))
            if i != cnt and (t.dim() == 0 or t.shape[0] != n):
                raise StepFunctionError(
                    expected(f"step_fn output leaf {i}", f"leading dimension {n} (the step width)",
                             f"shape {tuple(t.shape)}")
                )
        if self._spec is None:
            self._spec, self._count_leaf_index = spec, cnt
            self._flat_dict = cnt < 0 and type(out) is dict and all(type(v) is torch.Tensor for v in out.values())
        elif spec != self._spec:
            raise StepFunctionError(
                expected("step_fn output", f"the same structure at every width ({self._spec})", f"{spec} at width {n}")
            )

    def _count_index(self, out: Any, leaves: list) -> int:
        hr = self.host_rows_config
        if hr is None or hr.mode != "device":
            return -1
        c = _key_get(out, hr.count_output, "HostRows.count_output")
        return next(i for i, t in enumerate(leaves) if t is c)

    def _probe(self) -> bool:
        """One eager call at the widest width on padding rows only: fixes the output
        structure and sizes the host-row ring before anything is captured. True if it ran."""
        hr = self.host_rows_config
        if hr is None or self._ring is not None:
            return False
        w = self.widths[-1]
        self._inputs.reset()  # padding rows only, whatever was written into the arena before
        out = self.step_fn(self._inputs.views(w))
        if isinstance(out, torch.Tensor) or not isinstance(out, (dict, tuple, list)):
            raise StepFunctionError(expected("step_fn output", "a dict or tuple when HostRows is used", type(out).__name__))
        src = _key_get(out, hr.source, "HostRows.source")
        if src.dim() != 2 or src.shape[0] != w:
            raise StepFunctionError(expected("HostRows.source", f"an output of shape [{w}, H]", tuple(src.shape)))
        if hr.mode == "device":
            r = _key_get(out, hr.rows_output, "HostRows.rows_output")
            c = _key_get(out, hr.count_output, "HostRows.count_output")
            if r.dtype not in (torch.int32, torch.int64) or c.numel() != 1 or c.dtype not in (torch.int32, torch.int64):
                raise StepFunctionError(expected("HostRows.rows_output/count_output",
                                                 "integer [N] indices and a [1] count",
                                                 f"{r.dtype}{tuple(r.shape)} and {c.dtype}{tuple(c.shape)}"))
        H = src.shape[1]
        self._make_host_buffers(H, src.dtype)
        self._check_structure(w, out)
        return True

    @torch.inference_mode(False)
    def _make_host_buffers(self, H: int, dtype: torch.dtype) -> None:
        # Plain (not inference-mode) tensors: the host writes some of them between steps.
        hr = self.host_rows_config
        src = torch.empty(0, dtype=dtype)
        self._ring = HostRowRing(hr.depth, self._capacity, H, src.dtype, self.device)
        if hr.mode == "commit":
            self._snap = torch.empty((hr.depth + 1, self._rows, H), dtype=src.dtype, device=self.device)
            self._snap_meta = torch.zeros((hr.depth + 1, 2 + self._rows), dtype=torch.int32, device=self.device)
            self._snap_gen = [0] * (hr.depth + 1)
            self._iota = torch.arange(self._rows, dtype=torch.int32, device=self.device)
            self._width_count = {n: torch.tensor([n], dtype=torch.int32, device=self.device)
                                 for n in range(1, self._rows + 1)}

    def _explain(self, width: int) -> tuple:
        try:
            from .inspect import find_capture_hazards
        except ImportError:
            return ()
        try:
            return find_capture_hazards(self.step_fn, self._inputs.views(width))
        except Exception:  # noqa: BLE001 - the explanation must never hide the capture error
            return ()

    def _watch_now(self):
        if self._watch is None:
            return None
        return [(t.data_ptr(), tuple(t.shape)) for t in self._watch()]

    def _check_watched(self) -> None:
        if self._watched is None:
            return
        now = self._watch_now()
        if now != self._watched:
            raise StaleCaptureError(
                "a tensor listed by watch() moved or changed shape since capture; replaying would "
                "use the old memory: call recapture()"
            )

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._cuts.clear()
        self._static_out.clear()
        self._commit_graph = None
        self._eager_widths.clear()
        self._pool = None
        self._ready = False
        self._watched = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
