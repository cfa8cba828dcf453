"""Tensor-parallel steps: one GraphRuntime per rank, in lockstep, collectives in the graphs.

A tensor-parallel step function (``models/tp.py``) calls ``torch.distributed.all_reduce``
inside; :class:`DistributedRuntime` captures it on every rank of a process group (NCCL on
GPUs, gloo on CPUs, nothing home-made on the wire) and keeps the ranks in step:

* Construction is collective: every rank builds its runtime, then the ranks compare what
  decides the plan (widths, limits, slicing, graphs, inputs, host-row mode) and raise
  :class:`RankMismatchError` on every rank if one differs, or if one rank's constructor
  failed (instead of leaving the others waiting in a collective).
* ``capture()`` is collective: it refuses a current CUDA device that is not the runtime's,
  warms the communicator with one eager all-reduce on the runtime's device (an NCCL
  communicator created inside a capture fails it), captures every width with the widths
  kept going past a failed one (a failed capture runs no collective, so the ranks stay
  matched), and then agrees: if any rank failed, every rank raises the same
  :class:`CaptureError` naming the failed ranks and their causes.
* ``step()`` may check that every rank steps the same T and width (``check_steps``), or pad
  every rank to the widest rank's T (``agree_width``, data-parallel ranks), each with one
  small all-reduce on a host (gloo) group, so no step waits for the device.
* Host rows go to the host from one rank (``rows_rank``): the ranks' hidden rows are the
  same, so the bus carries them once. The others ship nothing (in device mode they run the
  same captured gather on a one-column stand-in and drop it: the same graph, one element a row).
* ``inputs_from``: one rank (the driver) runs the host loop; its inputs are broadcast to the
  other ranks, which run :meth:`DistributedRuntime.follow` until the driver calls
  :meth:`DistributedRuntime.stop_followers`.

Failure modes this does not cover: a step function that raises on one rank between two
collectives (or a step refused by the runtime's own input checks on one rank only) leaves
the other ranks inside a collective until the process group's timeout
(``init_process_group(timeout=...)``; :func:`init_distributed` sets one).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from .errors import CaptureError, CgrtError, InputError, expected
from .host_rows import HostRows, HostRowsHandle
from .runtime import GraphRuntime, StepResult
from .inputs.spec import InputSpec

_STANDIN = "__cgrt_standin_rows__"  # the one-column source a non-shipping rank gathers


class RankMismatchError(CgrtError):
    """Ranks disagreed on what must be equal on all of them (the plan's settings, a step's T
    and width), or one rank failed where the others could not go on. Raised on every rank
    of the group at the same point, naming the ranks and what each had; nothing of the step
    was written."""


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> torch.device:
    """Initialise torch.distributed from torchrun's environment, the safe way round.

    NCCL: ``torch.cuda.set_device(LOCAL_RANK)`` FIRST, then ``init_process_group("nccl",
    device_id=...)`` (the other order binds the communicator to the wrong GPU and hangs).
    gloo: the CPU. ``backend`` None picks NCCL when CUDA is present. ``timeout_s`` bounds
    every collective, so a rank that stops answering ends the job instead of hanging it.
    Returns this rank's device. Idempotent when a group exists (returns the device).
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise InputError(expected("backend", "'nccl' or 'gloo'", repr(backend)))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        if not 0 <= local < torch.cuda.device_count():
            raise InputError(expected("LOCAL_RANK", f"a GPU index in [0, {torch.cuda.device_count()})", local))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        if not dist.is_initialized():
            dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s), device_id=device)
        return device
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return torch.device("cpu")


def check_rank_device(group: dist.ProcessGroup, device: torch.device) -> None:
    """Refuse a runtime device that the group's collectives would not run on.

    With NCCL the device must be CUDA, the current CUDA device, ``LOCAL_RANK``'s GPU when
    torchrun set it, and the group's bound device when it has one: a process that called
    ``init_process_group("nccl")`` before ``torch.cuda.set_device(local_rank)`` still has
    ``cuda:0`` current on every rank, and its collectives hang. Raises InputError that says
    which order to use.
    """
    backend = str(dist.get_backend(group))
    if device.type != "cuda":
        if "nccl" in backend:
            raise InputError(expected("device", "a CUDA device with an NCCL process group", str(device)))
        return
    fix = "call torch.cuda.set_device(local_rank) BEFORE init_process_group('nccl') (or pass device_id=)"
    cur = torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK")
    if local is not None and local.isdigit() and int(local) < torch.cuda.device_count() and cur != int(local):
        raise InputError(expected("torch.cuda.current_device()", f"{local} (LOCAL_RANK) on this rank: {fix}",
                                  cur))
    bound = getattr(group, "bound_device_id", None)
    if bound is not None and torch.device(bound) != device:
        raise InputError(expected("device", f"the process group's device {bound}: {fix}", str(device)))
    if device.index != cur:
        raise InputError(expected("device", f"the current CUDA device cuda:{cur} (collectives run there)",
                                  str(device)))


def _standin(step_fn, source):
    """Wrap ``step_fn`` to also return a one-column stand-in of its ``source`` rows (zeros):
    what a rank that ships no rows gathers, so its graphs hold the same ops and collectives."""
    def fn(inputs):
        out = step_fn(inputs)
        src = out[source]
        rows = src.new_zeros(src.shape[0], 1)
        if isinstance(out, dict):
            return {**out, _STANDIN: rows}
        return type(out)([*out, rows])
    return fn


class DistributedRuntime(GraphRuntime):
    """A :class:`GraphRuntime` on one rank of a tensor-parallel group (see the module doc).

    Build it on every rank of ``group`` (default: the world) with the same arguments; any
    keyword of GraphRuntime passes through. ``rows_rank``: the rank whose host rows reach
    the host (None: every rank's); the other ranks' StepResults carry ``host_rows=None``
    and their ``commit`` returns None. ``check_steps``: one all-reduce per step compares T
    and the first slice's width over the ranks (RankMismatchError naming them).
    ``agree_width``: one all-reduce (max) per step; a rank with fewer rows pads its inputs
    with each input's pad value up to the widest rank's T, so every rank runs the same
    plan; its outputs are cut back to its own T (its inputs take the packing path then, not
    zero-copy). ``inputs_from``: that rank drives, the others :meth:`follow`; its host rows
    are the ones shipped (``rows_rank`` must equal it).
    ``meta_group``: the group for these small host-side agreements; ``"auto"`` uses
    ``group`` when it is gloo, else creates a gloo group over its ranks (a collective call
    every process of the world must make).

    Lifetimes as GraphRuntime's. ``capture()``, ``recapture()`` and every step are
    collective: every rank calls them in the same order. Errors: InputError for a bad
    argument or a device the group cannot use (check_rank_device), RankMismatchError,
    CaptureError on every rank when any rank's capture failed (``on_capture_error="eager"``
    instead keeps each failed width eager on the rank where it failed); after an agreed
    capture failure ``step`` raises CgrtError until ``recapture()``.
    """

    def __init__(self, step_fn, inputs: Mapping[str, InputSpec], *, group: dist.ProcessGroup | None = None,
                 rows_rank: int | None = 0, check_steps: bool = False, agree_width: bool = False,
                 inputs_from: int | None = None, meta_group: Any = "auto", host_rows: HostRows | None = None,
                 on_capture_error: str = "raise", device: str | torch.device | None = None, **kwargs):
        if not dist.is_available() or not dist.is_initialized():
            raise InputError(expected("torch.distributed", "an initialised process group", "none"))
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.meta_group = self._meta(meta_group)
        problem, desc = None, None
        try:  # a local failure is agreed on below, so the other ranks do not wait for it
            desc = self._setup(step_fn, inputs, rows_rank, check_steps, agree_width, inputs_from,
                               host_rows, on_capture_error, device, kwargs)
        except Exception as e:  # noqa: BLE001 - raised below, after the other ranks heard of it
            problem = e
        seen = [None] * self.world
        dist.all_gather_object(seen, (type(problem).__name__ + f": {problem}") if problem else desc,
                               group=self.meta_group)
        if problem is not None:
            raise problem
        failed = {r: s for r, s in enumerate(seen) if isinstance(s, str)}
        if failed:
            raise RankMismatchError("DistributedRuntime: construction failed on rank(s) "
                                    + "; ".join(f"{r}: {m}" for r, m in failed.items()))
        differ = [k for k in desc if any(s[k] != desc[k] for s in seen)]
        if differ:
            raise RankMismatchError("DistributedRuntime: ranks differ in "
                                    + "; ".join(f"{k}: " + ", ".join(f"rank {r} {s[k]!r}" for r, s in enumerate(seen))
                                                for k in differ)
                                    + " (every rank must run the same widths, order and plan)")

    def _meta(self, meta_group):
        if meta_group != "auto":
            return meta_group
        if "gloo" in str(dist.get_backend(self.group)):
            return self.group
        return dist.new_group(dist.get_process_group_ranks(self.group), backend="gloo")

    def _setup(self, step_fn, inputs, rows_rank, check_steps, agree_width, inputs_from, host_rows,
               on_capture_error, device, kwargs) -> dict:
        for name, v in (("rows_rank", rows_rank), ("inputs_from", inputs_from)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < self.world):
                raise InputError(expected(name, f"None or a rank in [0, {self.world})", repr(v)))
        if inputs_from is not None and rows_rank != inputs_from:
            raise InputError(expected("rows_rank", f"inputs_from ({inputs_from}) when inputs_from is set (the driver "
                                      "reads the rows; followers ship none)", repr(rows_rank)))
        if on_capture_error not in ("raise", "eager"):
            raise InputError(expected("on_capture_error", "'raise' or 'eager'", repr(on_capture_error)))
        if host_rows is not None and not isinstance(host_rows, HostRows):
            raise InputError(expected("host_rows", "a HostRows or None", type(host_rows).__name__))
        nccl = "nccl" in str(dist.get_backend(self.group))
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        check_rank_device(self.group, dev)
        self.rows_rank, self.check_steps, self.agree_width = rows_rank, bool(check_steps), bool(agree_width)
        self.inputs_from, self.capture_policy = inputs_from, on_capture_error
        self.ships = rows_rank is None or rows_rank == self.rank
        self.host_rows_shipped = host_rows
        self._standin_key = None
        fn, hr = step_fn, host_rows
        if host_rows is not None and not self.ships:
            self._standin_key = _STANDIN if isinstance(host_rows.source, str) else -1
            fn = _standin(step_fn, host_rows.source)
            if host_rows.chosen_on_device:  # the step function still chooses; one column crosses
                hr = dataclasses.replace(host_rows, source=self._standin_key)
            else:  # host / commit: no rows are ever asked for on this rank
                hr = HostRows(source=self._standin_key, mode="host", capacity=1, depth=2)
        self._dist_ready = False
        self._capture_failed: str | None = None
        self._stopped = False
        self._meta_dev = torch.device("cpu") if "gloo" in str(dist.get_backend(self.meta_group)) else dev
        super().__init__(fn, inputs, host_rows=hr, on_capture_error="eager", device=dev, **kwargs)
        hrs = host_rows
        return {"widths": self.widths, "dynamic_limit": self.dynamic_limit, "slicing": self.slicing,
                "graphs": self.graphs, "warmup": self.warmup,
                "inputs": tuple((k, s.shape, str(s.dtype), s.pad) for k, s in self.input_specs.items()),
                "host_rows": None if hrs is None else (hrs.mode, hrs.source, hrs.capacity, hrs.depth),
                "rows_rank": rows_rank, "check_steps": self.check_steps, "agree_width": self.agree_width,
                "inputs_from": inputs_from, "on_capture_error": on_capture_error, "device_type": dev.type}

    # -- capture ---------------------------------------------------------------------------
    def capture(self):
        """Collective: warm the communicator, capture every width, agree on the outcome.

        Returns this rank's CaptureReport. Raises CaptureError on every rank when any rank
        failed (its message names each failed rank and cause)."""
        self._check_open("capture")
        if self._dist_ready:
            return self.capture_report
        wrong = None
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            wrong = InputError(expected("torch.cuda.current_device()", f"{self.device.index} (the runtime's device, "
                                        "where its capture stream and collectives run)", torch.cuda.current_device()))
        seen = [None] * self.world  # agreed before the first collective on the device
        dist.all_gather_object(seen, str(wrong) if wrong else None, group=self.meta_group)
        if wrong is not None:
            raise wrong
        if any(seen):
            raise RankMismatchError("DistributedRuntime.capture: " + "; ".join(
                f"rank {r}: {m}" for r, m in enumerate(seen) if m))
        self._warm()
        problem, report = None, None
        try:
            report = super().capture()
        except Exception as e:  # noqa: BLE001 - agreed on below, then raised on every rank
            problem = e
        local = f"{type(problem).__name__}: {problem}" if problem is not None else None
        if local is None and self.capture_policy == "raise":
            failed = [w for w in report.widths if w.error]
            if failed:
                local = f"width {failed[0].width}: {failed[0].error}"
        seen = [None] * self.world
        dist.all_gather_object(seen, local, group=self.meta_group)
        bad = {r: m for r, m in enumerate(seen) if m is not None}
        if bad:
            self._capture_failed = "capture failed on rank(s) " + ", ".join(map(str, bad))
            msg = (f"DistributedRuntime.capture (rank {self.rank}): {self._capture_failed}; every rank stops here: "
                   + "; ".join(f"rank {r}: {m.splitlines()[0]}" for r, m in bad.items()))
            raise CaptureError(msg, width=getattr(problem, "width", None), cause=problem) from problem
        self._capture_failed = None
        self._dist_ready = True
        return report

    def recapture(self):
        """Collective: drop every graph and capture again on every rank."""
        self._dist_ready = False
        return super().recapture()

    def explain_capture(self, width: int) -> tuple:
        """GraphRuntime explains a failed capture by running the step eagerly under the
        hazard finder, on this rank alone: its collectives would pair with another width's
        warm-up on the other ranks (a hang, or a mismatched NCCL call). Run it with the
        torch.distributed collectives stubbed out (the explanation needs no sums)."""
        with _no_collectives():
            return super().explain_capture(width)

    def _warm(self) -> None:
        """One eager all-reduce on the runtime's device: creates the NCCL communicator and
        its stream outside any capture, and proves every rank is here."""
        t = torch.ones(1, device=self.device)
        dist.all_reduce(t, group=self.group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if int(t.item()) != self.world:
            raise CgrtError(f"DistributedRuntime: warm-up all-reduce gave {int(t.item())}, expected {self.world}")

    # -- steps -------------------------------------------------------------------------------
    def step(self, rows: Any = None, **inputs: Any) -> StepResult:
        """Collective: one step on every rank (see the class docstring for the options).
        With ``inputs_from``, only that rank calls it (the others are in :meth:`follow`)."""
        if self.inputs_from is not None:
            if self.rank != self.inputs_from:
                raise CgrtError(f"DistributedRuntime.step: rank {self.rank} takes its inputs from rank "
                                f"{self.inputs_from}: call follow() here")
            self._ready_for("step")
            self._send(("step", {k: _portable(v) for k, v in inputs.items()}))
        return self._step_all(rows, inputs)

    def host_inputs(self, T: int, *, numpy: bool = False):
        if self.inputs_from is not None:
            self._ready_for("host_inputs")
        return super().host_inputs(T, numpy=numpy)

    def commit(self, result: StepResult, rows: Any) -> HostRowsHandle | None:
        """As GraphRuntime.commit on the shipping rank; None on the others (local, not collective)."""
        if not self.ships:
            return None
        return super().commit(result, rows)

    def follow(self) -> int:
        """On a rank that takes its inputs from ``inputs_from``: capture (collective), then
        run every step the driver broadcasts until it calls :meth:`stop_followers`. Returns
        the number of steps run; raises CgrtError when the driver stopped with an error."""
        if self.inputs_from is None or self.rank == self.inputs_from:
            raise CgrtError(f"DistributedRuntime.follow: only for ranks other than inputs_from "
                            f"({self.inputs_from}); this is rank {self.rank}")
        self.capture()
        n = 0
        while True:
            msg = [None]
            dist.broadcast_object_list(msg, src=dist.get_global_rank(self.meta_group, self.inputs_from),
                                       group=self.meta_group)
            kind, body = msg[0]
            if kind == "stop":
                if body:
                    raise CgrtError(f"DistributedRuntime.follow: rank {self.inputs_from} stopped with an error: {body}")
                return n
            res = self._step_all(None, body)
            if res.host_rows is not None:  # never read here: free the ring slot
                res.host_rows.release()
            n += 1

    def stop_followers(self, error: str | None = None) -> None:
        """On the ``inputs_from`` rank: end the other ranks' :meth:`follow` (with ``error``,
        they raise it). Call it once, also when the driver's loop failed."""
        if self.inputs_from is None or self.rank != self.inputs_from:
            raise CgrtError("DistributedRuntime.stop_followers: only on the inputs_from rank")
        if not self._stopped:
            self._send(("stop", error))
            self._stopped = True

    def _send(self, msg) -> None:
        if self._stopped:
            raise CgrtError("DistributedRuntime: the followers were stopped")
        dist.broadcast_object_list([msg], src=dist.get_global_rank(self.meta_group, self.rank),
                                   group=self.meta_group)

    def _ready_for(self, what: str) -> None:
        if not self._dist_ready:  # an implicit capture here would not be matched by the followers
            raise CgrtError(f"DistributedRuntime.{what}: with inputs_from, call capture() on every rank first")

    def _step_all(self, rows: Any, inputs: Mapping[str, Any]) -> StepResult:
        if self._capture_failed:
            raise CgrtError(f"DistributedRuntime.step: {self._capture_failed}; call recapture() on every rank")
        T = mine = _rows_of(inputs, self.input_specs)
        if self.agree_width or self.check_steps:
            T = self._agree(mine)
        if T > mine:
            inputs = _pad(inputs, self.input_specs, mine, T)
        res = super().step(rows if self.ships else None, **inputs)
        if T == mine and self._standin_key is None:
            return res  # the common case: nothing to change
        return self._local(res, mine)

    def _agree(self, T: int) -> int:
        """One all-reduce of (T, -T, width, -width, bad) with max: the widest T, and whether
        every rank had the same T and width. A mismatch (with check_steps) or a rank whose
        inputs have no row count raises RankMismatchError on every rank."""
        w = self.plan(T)[0].width if T > 0 else 0
        t = torch.tensor([T, -T, w, -w, int(T < 1)], dtype=torch.int64, device=self._meta_dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.meta_group)
        hi, lo, whi, wlo, bad = t.tolist()
        same = hi == -lo and whi == -wlo
        if bad or (self.check_steps and not self.agree_width and not same):
            got = [None] * self.world
            dist.all_gather_object(got, (T, w), group=self.meta_group)
            what = ", ".join(f"rank {r}: T={a} width {b}" for r, (a, b) in enumerate(got))
            if bad:
                raise RankMismatchError(f"step: a rank's inputs have no row count (T < 1): {what}")
            raise RankMismatchError(f"step: ranks stepped different T or widths ({what}); every rank must "
                                    f"step the same rows, or use agree_width=True")
        return hi

    def _local(self, res: StepResult, T: int) -> StepResult:
        """This rank's view of a step: the stand-in output dropped, its host rows released,
        outputs cut to this rank's own T."""
        out = res.outputs
        if self._standin_key is not None:
            if isinstance(out, dict):
                out = {k: v for k, v in out.items() if k != _STANDIN}
            else:
                out = type(out)(list(out)[:-1])
        if T < res.T:
            out = tree_map(lambda t: t[:T] if t.dim() and t.shape[0] == res.T else t, out)
        handle = res.host_rows
        if handle is not None and not self.ships:
            handle.release()
            handle = None
        return dataclasses.replace(res, outputs=out, T=T, host_rows=handle)


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                "broadcast", "reduce", "all_to_all", "all_to_all_single", "barrier")


@contextlib.contextmanager
def _no_collectives():
    """torch.distributed's collectives as no-ops for the block (this process, this thread's
    doing: the block runs a step function alone on one rank). Functional collectives and
    raw NCCL calls are not covered."""
    saved = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}
    try:
        for n in saved:
            setattr(dist, n, lambda *a, **k: None)
        yield
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)


def _rows_of(inputs: Mapping[str, Any], specs: Mapping[str, InputSpec]) -> int:
    """T of a step's inputs from its first declared input, 0 when it has no length (the
    runtime's own checks then say what is wrong)."""
    for name in specs:
        try:
            return len(inputs[name])
        except (KeyError, TypeError):
            return 0
    return 0


def _pad(inputs: Mapping[str, Any], specs: Mapping[str, InputSpec], T: int, to: int) -> dict[str, Any]:
    """Each input with ``to - T`` rows of its pad value appended (padding rows by contract:
    they write only scratch state and are never read back)."""
    out = dict(inputs)
    for name, spec in specs.items():
        if name not in inputs:
            continue
        t = inputs[name]
        t = t if isinstance(t, torch.Tensor) else torch.as_tensor(t)
        pad = torch.full((to - T, *spec.shape), spec.pad, dtype=spec.dtype, device=t.device)
        out[name] = torch.cat([t, pad.to(torch.promote_types(t.dtype, spec.dtype))])
    return out


def _portable(v: Any) -> Any:
    """An input as a compact CPU value to broadcast (a view of a pinned arena would pickle
    the whole arena)."""
    if isinstance(v, torch.Tensor):
        return v.detach().to("cpu").clone()
    return v
