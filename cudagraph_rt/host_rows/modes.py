"""One object per way of choosing the rows that go to the host.

The runtime talks to a mode through the methods of :class:`RowsMode` and never asks which
mode it holds, or whether it holds one (:class:`NoHostRows` is the mode of a runtime built
without HostRows): a new way of choosing rows is a new subclass here. Each mode owns its
control blocks (where the captured gather reads its row indices, count and slots), its
in-graph gather, its merge of a sliced step's rows, and, for commit, the snapshots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..digest import fingerprint
from ..errors import CapacityError, InputError, StaleRowsError, StepFunctionError, expected
from .config import HostRows, check_host_rows
from .ring import HostRowRing, HostRowsHandle

CTRL = "__ctrl__"  # control block: the Control words
ROWS = "__rows__"  # control block: host-chosen row indices, one per arena row


@dataclass(frozen=True)
class Control:
    """The words of the ``__ctrl__`` block, as the captured gathers read them.

    ``count`` host-chosen rows in ``__rows__``; ``slot`` the ring slot they go to;
    ``snap`` the snapshot slot a commit-mode step writes (or a commit reads); ``T`` the
    step's real rows (rows ``[T, N)`` are padding), 0 in a sliced step's slices."""

    count: int
    slot: int
    snap: int
    T: int

    WORDS = 4

    def words(self) -> tuple[int, int, int, int]:
        return (self.count, self.slot, self.snap, self.T)

    @staticmethod
    def views(block: torch.Tensor) -> "Control":
        """``[1]`` device views of each word of an arena's ``__ctrl__`` block."""
        return Control(block[0:1], block[1:2], block[2:3], block[3:4])


def output(out: Any, key: str | int, what: str) -> torch.Tensor:
    """``out[key]`` (a NamedTuple's field also by name) as a tensor, or StepFunctionError
    naming ``what`` and listing the outputs the step function returned."""
    try:
        t = out[key]
    except (KeyError, IndexError, TypeError):
        if not (isinstance(key, str) and key in getattr(out, "_fields", ())):
            raise StepFunctionError(
                expected(what, f"the step function's output {key!r}", f"the outputs {_output_names(out)}")
            ) from None
        t = getattr(out, key)
    if not isinstance(t, torch.Tensor):
        raise StepFunctionError(expected(what, "a tensor", type(t).__name__))
    return t


def _output_names(out: Any) -> str:
    """The names (a dict's keys, a NamedTuple's fields) or indices a step's outputs offer."""
    if isinstance(out, dict):
        names = list(out)
    elif isinstance(out, (tuple, list)):
        names = list(getattr(out, "_fields", ())) or list(range(len(out)))
    else:
        return f"of a {type(out).__name__}"
    return f"{names} (a {type(out).__name__})"


@dataclass(frozen=True)
class SnapshotTurn:
    """A commit-mode step's snapshot slot, the generation it will carry, and how many
    snapshot writes had begun before it (to tell whether the step wrote its slot)."""

    slot: int
    generation: int
    writes_before: int


class StepTicket:
    """One step's dealings with its host-row mode, from plan to publish (built by
    :meth:`RowsMode.ticket` once the rows are validated and the ring has a free slot:
    nothing written). ``open`` takes the ring slot (when the step ships) and the snapshot
    turn; then ``control``, the slices' ``record``, ``outputs`` or ``gather_sliced``; at
    the end ``publish`` (the handle and the snapshot) or, if the step failed, ``abort``
    (neither turn used up). Lifetime: one step."""

    __slots__ = ("mode", "idx", "ships", "slot", "turn")

    def __init__(self, mode: "RowsMode", idx: torch.Tensor | None, ships: bool):
        self.mode, self.idx, self.ships, self.slot, self.turn = mode, idx, ships, None, None

    def open(self, sliced: bool) -> None:
        mode = self.mode
        self.slot = mode.ring.acquire() if self.ships else None
        self.turn = mode.begin(sliced)

    def control(self, T: int, sliced: bool) -> dict[str, Any] | None:
        return self.mode.step_control(T, sliced, self.idx, self.slot, self.turn)

    def outputs(self, outputs: Any, T: int) -> Any:
        return self.mode.step_outputs(outputs, T)

    def record(self, out: Any, start: int, width: int, length: int) -> Any:
        return self.mode.slice_record(out, start, width, length)

    def gather_sliced(self, outputs: Any, T: int, records: list) -> Any:
        return self.mode.gather_sliced(outputs, self.idx, self.slot, T, records) if self.ships else outputs

    def abort(self) -> None:
        self.mode.abort(self.turn)  # a failed step uses up no snapshot turn where none was written
        if self.slot is not None:
            self.mode.ring.unacquire(self.slot)  # ... and no ring turn

    def publish(self, T: int) -> tuple[HostRowsHandle | None, tuple[int, int] | None]:
        """(the host-row handle or None, the commit snapshot (slot, generation) or None)."""
        handle = self.mode.publish(self.slot, T, self.idx) if self.ships else None
        turn = self.turn
        return handle, ((turn.slot, turn.generation) if turn is not None else None)


class RowsMode:
    """Host rows chosen by the host before the step (``HostRows(mode="host")``); the base
    of the other modes.

    Lifetime: built with the runtime; ``make_buffers`` (the first-use probe) allocates the
    ring once the source's row width and dtype are known; ``close`` drops it."""

    ships_rows = True  # a step may ship rows: the runtime's short path (no host rows) is closed

    def __init__(self, config: HostRows, rows: int, device: torch.device, gather: Callable):
        self.config, self.rows, self.device, self.gather = config, rows, device, gather
        self.capacity = config.capacity or rows
        self.ring: HostRowRing | None = None

    # -- building --------------------------------------------------------------------
    def control_blocks(self) -> dict[str, tuple[int, torch.dtype]]:
        """The arena's control blocks this mode reads: name -> (words, dtype)."""
        return {ROWS: (self.rows, torch.int32), CTRL: (Control.WORDS, torch.int32)}

    def spare_control(self) -> dict[str, tuple]:
        """Control words for warm-up and capture: every gather aimed at spare slots."""
        return {CTRL: Control(0, self.ring.spare, self.config.depth, 0).words()}

    def check_probe(self, out: Any, width: int) -> torch.Tensor:
        """Check the probe's outputs; returns the source ([width, H])."""
        if isinstance(out, torch.Tensor) or not isinstance(out, (dict, tuple, list)):
            raise StepFunctionError(expected("step_fn output", "a dict or tuple when HostRows is used",
                                             type(out).__name__))
        leaves = tree_flatten(out)[0]
        if len(leaves) == 1 and leaves[0] is out:  # a container torch's pytree does not know
            raise StepFunctionError(expected(
                "step_fn output", "a dict, list or tuple torch's pytree takes apart (a NamedTuple, an OrderedDict or "
                "a defaultdict does; register another with torch.utils._pytree.register_pytree_node)",
                type(out).__name__))
        src = output(out, self.config.source, "HostRows.source")
        if src.dim() != 2 or src.shape[0] != width:
            raise StepFunctionError(expected("HostRows.source", f"an output of shape [{width}, H]", tuple(src.shape)))
        return src

    def probe(self, step_fn: Callable, inputs, layout, w: int) -> bool:
        """One eager call at width ``w`` (the widest graph) on padding rows only, before
        anything is captured: checks this mode's outputs, sizes the ring, fixes the output
        structure. Once per runtime (False when the ring exists already)."""
        if self.ring is not None:
            return False
        inputs.reset()
        out = step_fn(inputs.views(w))
        src = self.check_probe(out, w)
        layout.check(w, out)  # before the ring: a refused probe builds nothing, and the next step probes again
        self.make_buffers(src.shape[1], src.dtype)
        return True

    @torch.inference_mode(False)
    def make_buffers(self, H: int, dtype: torch.dtype) -> None:
        # Plain (not inference-mode) tensors: the host writes some of them between steps.
        self.ring = HostRowRing(self.config.depth, self.capacity, H, dtype, self.device)

    def count_leaf(self, out: Any, leaves: list) -> int:
        """Index of the output leaf that is a count (not cut to T rows), or -1."""
        return -1

    def capture_extra(self, capture: Callable[[Callable[[], None]], Any], inputs) -> None:
        """Graphs of this mode's own, captured after the widths with ``capture(fn)`` (the
        capturer's: a CUDA graph in the widths' pool, or an emulated one); none here."""

    def drop_graphs(self) -> None:
        """Forget the graphs of ``capture_extra`` (their pool is being dropped)."""

    def close(self) -> None:
        self.ring = None

    # -- one step ----------------------------------------------------------------------
    def step_rows(self, rows: Any, T: int, first_width: int, sliced: bool) -> torch.Tensor | None:
        """Validate ``rows`` of a step of T rows; the int32 indices, or None. Writes nothing."""
        if rows is None:
            return None
        idx = check_host_rows(rows, T, self.capacity, self.config.allow_duplicates)
        if not sliced and len(idx) > first_width:  # duplicates: one index per row the step runs
            raise CapacityError(expected("rows", f"at most {first_width} indices in a step that runs "
                                         f"{first_width} rows", len(idx)))
        return idx

    def ships(self, idx: torch.Tensor | None) -> bool:
        """Whether the step ships rows (takes a ring slot)."""
        return idx is not None

    def ticket(self, idx: torch.Tensor | None) -> StepTicket:
        """The step's :class:`StepTicket` for the validated rows ``idx`` (``step_rows``);
        HostRingFullError if it ships and every ring slot is held. Writes nothing."""
        ships = self.ships(idx)
        if ships:
            self.ring.check_free()
        return StepTicket(self, idx, ships)

    def begin(self, sliced: bool) -> SnapshotTurn | None:
        """Bookkeeping before the step writes anything of this mode (commit: a snapshot)."""
        return None

    def abort(self, turn: SnapshotTurn | None) -> None:
        """The step failed: undo ``begin`` where nothing was written."""

    def replaying(self) -> None:
        """A graph of the runtime is about to replay (it runs this mode's gather)."""

    def step_control(self, T: int, sliced: bool, idx, slot, turn) -> dict[str, Any]:
        one = not sliced and slot is not None
        count = len(idx) if (one and idx is not None) else 0
        ctrl = {CTRL: Control(count, slot if one else self.ring.spare,
                              turn.slot if turn is not None else self.config.depth, 0 if sliced else T).words()}
        if one and idx is not None:
            ctrl[ROWS] = idx.numpy()
        return ctrl

    def gather_in_graph(self, out: Any, n: int, control: Callable[[str], torch.Tensor]) -> None:
        """The gather of this mode inside the step's graph (or its eager run), width n."""
        src = output(out, self.config.source, "HostRows.source")
        c = Control.views(control(CTRL))
        self.gather(src, control(ROWS)[:n], c.count, self.ring.dst, self.ring.meta, dst_slot=c.slot)

    def step_outputs(self, outputs: Any, T: int) -> Any:
        """A one-slice step's outputs as the step hands them out (as the step function
        returned them, cut to T rows, here)."""
        return outputs

    def slice_record(self, out: Any, start: int, width: int, length: int) -> Any:
        """What a sliced step keeps of each slice for its merge (nothing here). ``out`` is
        the slice's static outputs: the next slice may replay the same graph over them, so
        a record keeps copies, never views."""
        return None

    def gather_sliced(self, outputs: Any, idx, slot: int, T: int, records: list) -> Any:
        """A sliced step ships its rows after the last slice, from the joined outputs."""
        src = output(outputs, self.config.source, "source")
        rows = idx.to(self.device, non_blocking=True)
        count = torch.tensor([idx.numel()], dtype=torch.int32).to(self.device, non_blocking=True)
        self._gather_to_slot(src, rows, count, slot)
        return outputs

    def _gather_to_slot(self, src, rows, count, slot: int) -> None:
        slot_t = torch.tensor([slot], dtype=torch.int32).to(self.device, non_blocking=True)
        self.gather(src, rows, count, self.ring.dst, self.ring.meta, dst_slot=slot_t)

    def publish(self, slot: int, T: int, idx) -> HostRowsHandle:
        return self.ring.publish(slot, T, len(idx) if idx is not None else None)

    # -- after the step -----------------------------------------------------------------
    def check_commit(self) -> None:
        """InputError unless this mode ships rows by ``commit()``."""
        raise InputError(expected("commit()", "a runtime built with HostRows(mode='commit')",
                                  f"mode {self.config.mode!r}"))

    def commit(self, result, rows, T: int, inputs) -> HostRowsHandle:
        self.check_commit()

    def pinned_bytes(self) -> int:
        """Pinned host memory of this mode: its ring once built (0 before, or on a CPU)."""
        ring = self.ring
        return ring.nbytes if ring is not None and ring.pinned else 0

    def digest(self) -> tuple[str, str]:
        """(ring, snapshots) fingerprints for StateDigest ("-": not built)."""
        return (fingerprint(self.ring.digest_parts()) if self.ring is not None else "-", "-")


class DeviceChosen(RowsMode):
    """``HostRows(mode="device")``: the step function's ``rows_output`` / ``count_output``
    choose the rows, on the device, inside the same replay. Padding rows are never
    shipped; a count above the rows the step ran is flagged (DeviceRowIndexError).

    A step's ``rows_output`` / ``count_output`` outputs are what was shipped, in the step
    function's dtypes, one slice or sliced alike: the count without padding rows, and the
    shipped rows' indices first (one slice: in the chooser's order; sliced: row order)."""

    def __init__(self, *a):
        super().__init__(*a)
        self._dtypes = (torch.int32, torch.int32)  # of rows_output and count_output (the probe's)
        self._shipped: tuple[torch.Tensor, torch.Tensor] | None = None

    def check_probe(self, out: Any, width: int) -> torch.Tensor:
        src = super().check_probe(out, width)
        r = output(out, self.config.rows_output, "HostRows.rows_output")
        c = output(out, self.config.count_output, "HostRows.count_output")
        if r.dtype not in (torch.int32, torch.int64) or c.numel() != 1 or c.dtype not in (torch.int32, torch.int64):
            raise StepFunctionError(expected("HostRows.rows_output/count_output",
                                             "integer [N] indices and a [1] count",
                                             f"{r.dtype}{tuple(r.shape)} and {c.dtype}{tuple(c.shape)}"))
        self._dtypes = (r.dtype, c.dtype)
        return src

    @torch.inference_mode(False)
    def make_buffers(self, H, dtype) -> None:
        super().make_buffers(H, dtype)
        rows_dt, count_dt = self._dtypes  # what the gather was given, written inside each replay
        self._shipped = (torch.zeros(self.rows, dtype=rows_dt, device=self.device),
                         torch.zeros(1, dtype=count_dt, device=self.device))

    def close(self) -> None:
        super().close()
        self._shipped = None

    def step_outputs(self, outputs, T):
        rows, count = self._shipped
        return _replace(outputs, {self.config.rows_output: rows[:T], self.config.count_output: count})

    def count_leaf(self, out: Any, leaves: list) -> int:
        c = output(out, self.config.count_output, "HostRows.count_output")
        i = next((i for i, t in enumerate(leaves) if t is c), None)
        if i is None:
            raise StepFunctionError(expected("HostRows.count_output", "an output of the step function's structure",
                                             f"outputs of type {type(out).__name__}"))
        return i

    def step_rows(self, rows, T, first_width, sliced):
        if rows is not None:
            raise InputError(expected("rows", "None unless the runtime has HostRows(mode='host')", "row indices"))
        if sliced and self.config.capacity is None and T > self.capacity:
            raise CapacityError(expected(
                "step inputs", f"at most {self.capacity} rows in HostRows(mode='device') (a step may accept "
                f"every row; the default HostRows.capacity is the runtime's {self.capacity} rows: set it to "
                f"the widest step)", f"{T} rows"))
        return None

    def ships(self, idx) -> bool:
        return True

    def gather_in_graph(self, out, n, control) -> None:
        src = output(out, self.config.source, "HostRows.source")
        rows = output(out, self.config.rows_output, "HostRows.rows_output").reshape(-1)[:n]
        count = output(out, self.config.count_output, "HostRows.count_output").reshape(-1)[:1].to(torch.int32)
        c = Control.views(control(CTRL))
        # Padding rows [T, n) are never shipped: drop them, keep the order of the rest
        # (indices outside [0, n) stay, so the gather still flags them).
        used = torch.arange(rows.numel(), device=rows.device) < count
        pad = used & (rows >= c.T) & (rows < n)
        order = torch.sort(pad.to(torch.int8), stable=True).indices
        # A count above the n rows is kept as it is, so the gather flags it (count > R).
        rows = rows[order]
        count = torch.where(count > n, count, count - pad.sum().to(torch.int32))
        shipped_rows, shipped_count = self._shipped
        shipped_rows[:rows.numel()].copy_(rows)
        shipped_count.copy_(count)
        self.gather(src, rows, count, self.ring.dst, self.ring.meta, dst_slot=c.slot)

    def slice_record(self, out, start, width, length):
        r = output(out, self.config.rows_output, "rows_output")
        c = output(out, self.config.count_output, "count_output")
        # All `width` entries: a chooser may list padding rows first (dropped in the merge),
        # so cutting to the slice's length could lose real rows. Copies: .long() of an int64
        # output is the output itself, which the next slice's replay of this graph rewrites.
        return (start, width, length, r.reshape(-1)[:width].to(torch.int64, copy=True),
                c.reshape(-1)[:1].to(torch.int64, copy=True))

    def gather_sliced(self, outputs, idx, slot, T, records):
        """Each slice's chosen rows merged on the device (no host sync), in row order."""
        dev = self.device
        mask = torch.zeros(T + 1, dtype=torch.int32, device=dev)
        bad = torch.zeros((), dtype=torch.bool, device=dev)  # an index out of range
        bad_count = torch.zeros((), dtype=torch.bool, device=dev)  # a count outside [0, width]
        for start, width, length, r, c in records:
            used = torch.arange(r.numel(), device=dev) < c
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
        rows = torch.where((torch.arange(T + 1, device=dev) == n_ok) & bad, T, rows)
        count = (n_ok + bad.to(torch.int32)).reshape(1)
        count = torch.where(bad_count, -1, count)  # flagged as a bad count, nothing shipped
        rows_dt, count_dt = self._dtypes
        outputs = _replace(outputs, {self.config.rows_output: order.to(rows_dt),
                                     self.config.count_output: n_ok.reshape(1).to(count_dt)})
        self._gather_to_slot(output(outputs, self.config.source, "source"), rows, count, slot)
        return outputs


def _commit_gather(gather: Callable, snap: torch.Tensor, ring: HostRowRing, control: Callable) -> None:
    """A commit's gather: the rows ``__rows__`` of snapshot ``snap`` into ring slot ``slot``."""
    c = Control.views(control(CTRL))
    gather(snap, control(ROWS), c.count, ring.dst, ring.meta, src_slot=c.snap, dst_slot=c.slot)


def _replace(outputs: Any, new: dict) -> Any:
    """``outputs`` with the entries of ``new`` replaced, in the container the step function
    returned: a dict, list or tuple, or another kind torch's pytree takes apart (a
    NamedTuple, its fields by index or by name; an OrderedDict; a defaultdict)."""
    if type(outputs) is dict:
        return {**outputs, **new}
    entries, spec = tree_flatten(outputs, is_leaf=lambda x: x is not outputs)  # one level, rebuilt by its spec
    for key, value in new.items():
        entries[_position(outputs, key)] = value
    return tree_unflatten(entries, spec)


def _position(outputs: Any, key: str | int) -> int:
    """Where ``outputs[key]`` is among its entries (pytree's order: a mapping's keys, a
    sequence's indices)."""
    if isinstance(outputs, dict):
        return list(outputs).index(key)
    if isinstance(key, str):
        return outputs._fields.index(key)  # a NamedTuple's field (output() found it)
    return key % len(outputs)


class Committed(RowsMode):
    """``HostRows(mode="commit")``: every one-slice step snapshots its ``source`` rows on
    the device; ``commit(result, rows)`` ships chosen rows of a step up to ``depth`` steps
    later, from its snapshot, through one captured gather.

    A step that fails before its snapshot is written uses up no turn of the window."""

    def __init__(self, *a):
        super().__init__(*a)
        self.snap: torch.Tensor | None = None
        self._gen: list[int] = []
        self._next = 0
        self._writes = 0  # snapshot gathers begun (a failed step before one keeps its turn)
        self._graph = None

    @torch.inference_mode(False)
    def make_buffers(self, H, dtype) -> None:
        super().make_buffers(H, dtype)
        depth, rows, dev = self.config.depth, self.rows, self.device
        self.snap = torch.empty((depth + 1, rows, H), dtype=dtype, device=dev)
        self._snap_meta = torch.zeros((depth + 1, 2 + rows), dtype=torch.int32, device=dev)
        self._gen = [0] * (depth + 1)
        self._iota = torch.arange(rows, dtype=torch.int32, device=dev)
        self._width_count = {n: torch.tensor([n], dtype=torch.int32, device=dev) for n in range(1, rows + 1)}

    def close(self) -> None:
        super().close()
        self.snap = self._snap_meta = self._iota = self._graph = None
        self._width_count = {}

    def check_commit(self) -> None:
        return None

    def drop_graphs(self) -> None:
        self._graph = None

    def step_rows(self, rows, T, first_width, sliced):
        if rows is not None:
            raise InputError(expected("rows", "None unless the runtime has HostRows(mode='host')", "row indices"))
        return None

    def begin(self, sliced: bool) -> SnapshotTurn | None:
        if sliced:
            return None  # sliced steps keep no snapshot
        snap = self._next
        self._next = (snap + 1) % self.config.depth
        self._gen[snap] += 1
        return SnapshotTurn(snap, self._gen[snap], self._writes)

    def abort(self, turn: SnapshotTurn | None) -> None:
        if turn is not None and self._writes == turn.writes_before:
            self._gen[turn.slot] -= 1  # the snapshot slot was never written: the window
            self._next = turn.slot     # keeps its turn

    def replaying(self) -> None:
        self._writes += 1  # from here on the step's snapshot slot may hold its rows

    def gather_in_graph(self, out, n, control) -> None:
        src = output(out, self.config.source, "HostRows.source")
        self.replaying()
        self.gather(src, self._iota[:n], self._width_count[n], self.snap, self._snap_meta,
                    dst_slot=Control.views(control(CTRL)).snap)

    def _commit_body(self, control) -> None:
        _commit_gather(self.gather, self.snap, self.ring, control)

    def capture_extra(self, capture, inputs) -> None:
        # the body holds the buffers, not this mode: an emulated graph keeps its body, and
        # a cycle through the mode would leave the ring to the garbage collector
        gather, snap, ring, control = self.gather, self.snap, self.ring, inputs.control
        self._graph = capture(lambda: _commit_gather(gather, snap, ring, control))

    def commit(self, result, rows, T: int, inputs) -> HostRowsHandle:
        """Validate, then ship. The runtime checked that ``result`` is its own."""
        if result.snapshot is None:
            raise CapacityError(expected("result", "a one-slice step (sliced steps keep no snapshot)",
                                         f"a step of {len(result.slices)} slices"))
        snap_slot, gen = result.snapshot
        if self._gen[snap_slot] != gen:
            raise StaleRowsError(f"commit: the snapshot of that step was reused by a later step "
                                 f"(commit within {self.config.depth} steps)")
        idx = check_host_rows(rows, T, self.capacity, self.config.allow_duplicates)
        if len(idx) > self.rows:  # duplicates: the index block holds one per arena row
            raise CapacityError(expected("rows", f"at most {self.rows} indices (the runtime's rows)", len(idx)))
        self.ring.check_free()
        # -- nothing was written above --
        slot = self.ring.acquire()
        inputs.write_control({ROWS: idx.numpy(), CTRL: Control(len(idx), slot, snap_slot, 0).words()})
        with torch.inference_mode():
            if self._graph is not None:
                self._graph.replay()
            else:
                self._commit_body(inputs.control)
        return self.ring.publish(slot, T, idx.numel())

    def digest(self) -> tuple[str, str]:
        ring, _ = super().digest()
        if self.snap is None:
            return ring, "-"
        return ring, fingerprint([self.snap, self._snap_meta, self._gen, self._next])


class NoHostRows(RowsMode):
    """No HostRows: a runtime that ships no rows. Every hook of a step does nothing and
    writes nothing; ``rows=`` and ``commit()`` are refused (InputError). It has no ring,
    no control blocks and no gather, and leaves the runtime's short path open
    (``ships_rows`` False)."""

    ships_rows = False

    def __init__(self):  # no config, no gather: nothing to ship
        self.config, self.ring = None, None

    def control_blocks(self) -> dict[str, tuple[int, torch.dtype]]:
        return {}

    def spare_control(self) -> None:
        return None

    def probe(self, step_fn: Callable, inputs, layout, w: int) -> bool:
        return False

    def step_rows(self, rows: Any, T: int, first_width: int, sliced: bool) -> None:
        if rows is not None:
            raise InputError(expected("rows", "None unless the runtime has HostRows(mode='host')", "row indices"))
        return None

    def ships(self, idx) -> bool:
        return False

    def step_control(self, T: int, sliced: bool, idx, slot, turn) -> None:
        return None

    def gather_in_graph(self, out: Any, n: int, control: Callable[[str], torch.Tensor]) -> None:
        """Nothing to gather."""

    def check_commit(self) -> None:
        raise InputError(expected("commit()", "a runtime built with HostRows(mode='commit')", "mode None"))

    def digest(self) -> tuple[str, str]:
        return ("-", "-")


_MODES = {"host": RowsMode, "device": DeviceChosen, "commit": Committed}


def make_rows_mode(config: HostRows | None, rows: int, device: torch.device,
                   gather: Callable | None = None) -> RowsMode:
    """The mode object for ``config`` (its ``mode`` string is read here and nowhere else;
    None: :class:`NoHostRows`); ``gather`` defaults to the row-gather kernel on CUDA, its
    torch reference elsewhere."""
    if config is None:
        return NoHostRows()
    if gather is None:
        if device.type == "cuda":
            from ..kernels.row_gather import gather_rows as gather
        else:
            from ..kernels.row_gather import gather_rows_reference as gather
    return _MODES[config.mode](config, rows, device, gather)
