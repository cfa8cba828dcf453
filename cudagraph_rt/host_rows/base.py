"""What every way of choosing the rows that go to the host shares: the control words, the
step's ticket, the base :class:`RowChoice`, and :class:`NoHostRows` (a runtime without
HostRows).

The runtime talks to its row choice through the methods of :class:`RowChoice` and never
asks which one it holds, or whether it holds one: a new way of choosing rows is a new
subclass (beside ``host_chosen``, ``device_chosen`` and ``commit_chosen``), built by
``row_choice_for``. Each owns its control blocks (where the captured gather reads its row
indices, count and slots), its in-graph gather, its merge of a sliced step's rows, and,
for commit, the snapshots.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from ..digest import fingerprint
from ..errors import InputError, StepFunctionError, expected
from .config import HostRows
from .ring import HostRowRing, HostRowsHandle

CTRL = "__ctrl__"  # control block: the Control words
ROWS = "__rows__"  # control block: host-chosen row indices, one per arena row


@dataclass(frozen=True)
class Control:
    """The words of the ``__ctrl__`` block, as the captured gathers read them.

    ``count`` host-chosen rows in ``__rows__``; ``slot`` the ring slot they go to;
    ``snap`` the snapshot slot a step writes (commit-chosen rows; or the one a commit
    reads); ``T`` the step's real rows (rows ``[T, N)`` are padding), 0 in a sliced step's
    slices."""

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
    """A step's snapshot slot (commit-chosen rows), the generation it will carry, and how
    many snapshot writes had begun before it (to tell whether the step wrote its slot)."""

    slot: int
    generation: int
    writes_before: int


class StepTicket:
    """One step's part in its row choice, from plan to publish: it holds the step's rows
    (``idx``), its ring slot and snapshot turn and its slices' records, and does the
    step's host-row work that every row choice shares (the control words, the ring turn,
    the handle); the row choice does only what is its own (``begin``/``abort`` of a
    snapshot, ``step_outputs``, ``slice_record``, ``gather_sliced``).

    Built by :meth:`RowChoice.ticket` once the rows are validated and the ring has a free
    slot: nothing written. ``open`` takes the ring slot (when the step ships) and the
    snapshot turn; then ``control``, each slice's ``record`` (a sliced step), ``finish``;
    at the end ``publish`` or, if the step failed, ``abort`` (neither turn used up).
    Lifetime: one step."""

    __slots__ = ("choice", "idx", "T", "sliced", "ships", "slot", "turn", "records")

    def __init__(self, choice: "RowChoice", idx: torch.Tensor | None, T: int, sliced: bool, ships: bool):
        self.choice, self.idx, self.T, self.sliced, self.ships = choice, idx, T, sliced, ships
        self.slot, self.turn, self.records = None, None, []

    def open(self) -> None:
        choice = self.choice
        self.slot = choice.ring.acquire() if self.ships else None
        self.turn = choice.begin(self.sliced)

    def control(self) -> dict[str, Any]:
        """The step's control words: a one-slice step that ships gathers its rows in the
        replay (``__rows__`` when the host chose them); any other aims at the spare slot."""
        choice, idx, turn = self.choice, self.idx, self.turn
        one = not self.sliced and self.slot is not None
        count = len(idx) if (one and idx is not None) else 0
        ctrl = {CTRL: Control(count, self.slot if one else choice.ring.spare,
                              turn.slot if turn is not None else choice.config.depth,
                              0 if self.sliced else self.T).words()}
        if one and idx is not None:
            ctrl[ROWS] = idx.numpy()
        return ctrl

    def record(self, out: Any, s) -> None:
        """Keep what the row choice needs of slice ``s`` (its static outputs ``out``) for
        the merge after the last slice."""
        width = s.width if s.path == "graph" else s.length
        self.records.append(self.choice.slice_record(out, s.start, width, s.length))

    def finish(self, outputs: Any) -> Any:
        """The step's outputs as the step hands them out: a one-slice step's as its row
        choice gives them; a sliced step's after shipping its rows from the joined outputs."""
        if not self.sliced:
            return self.choice.step_outputs(outputs, self.T)
        if not self.ships:
            return outputs
        return self.choice.gather_sliced(outputs, self.idx, self.slot, self.T, self.records)

    def abort(self) -> None:
        self.choice.abort(self.turn)  # a failed step uses up no snapshot turn where none was written
        if self.slot is not None:
            self.choice.ring.unacquire(self.slot)  # ... and no ring turn

    def publish(self) -> tuple[HostRowsHandle | None, tuple[int, int] | None]:
        """(the host-row handle or None, the commit snapshot (slot, generation) or None)."""
        idx, turn = self.idx, self.turn
        handle = self.choice.ring.publish(self.slot, self.T, len(idx) if idx is not None else None) \
            if self.ships else None
        return handle, ((turn.slot, turn.generation) if turn is not None else None)


class NoTicket:
    """The ticket of a runtime without HostRows: one object for every step (no state),
    every method does nothing (``finish`` hands the outputs back as they are)."""

    __slots__ = ()

    def open(self) -> None:
        pass

    def control(self) -> None:
        return None

    def record(self, out: Any, s) -> None:
        pass

    def finish(self, outputs: Any) -> Any:
        return outputs

    def abort(self) -> None:
        pass

    def publish(self) -> tuple[None, None]:
        return None, None


NO_TICKET = NoTicket()


class RowChoice:
    """A way of choosing the rows of a step's ``source`` output that go to the host: what
    every one shares (the ring, the probe, the control words, the ticket), and the default
    of each hook: a step takes no ``rows=`` and ships nothing, ``commit()`` is refused.

    Lifetime: built with the runtime; ``make_buffers`` (the first-use probe) allocates the
    ring once the source's row width and dtype are known; ``close`` drops it."""

    ships_rows = True  # a step may ship rows: the runtime's short path (no host rows) is closed

    def __init__(self, config: HostRows, rows: int, device: torch.device, gather: Callable):
        self.config, self.rows, self.device, self.gather = config, rows, device, gather
        self.capacity = config.capacity or rows
        self.ring: HostRowRing | None = None

    # -- building --------------------------------------------------------------------
    def control_blocks(self) -> dict[str, tuple[int, torch.dtype]]:
        """The arena's control blocks this row choice reads: name -> (words, dtype)."""
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
        anything is captured: checks this row choice's outputs, sizes the ring, fixes the
        output structure. Once per runtime (False when the ring exists already)."""
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
        """Graphs of this row choice's own, captured after the widths with ``capture(fn)``
        (the capturer's: a CUDA graph in the widths' pool, or an emulated one); none here."""

    def drop_graphs(self) -> None:
        """Forget the graphs of ``capture_extra`` (their pool is being dropped)."""

    def close(self) -> None:
        self.ring = None

    # -- one step ----------------------------------------------------------------------
    def step_rows(self, rows: Any, T: int, first_width: int, sliced: bool) -> torch.Tensor | None:
        """Validate ``rows`` of a step of T rows; the int32 indices, or None. Writes nothing.
        Here: ``rows=`` is refused (only host-chosen rows take it)."""
        if rows is not None:
            raise InputError(expected("rows", "None unless the runtime has HostRows(mode='host')", "row indices"))
        return None

    def ships(self, idx: torch.Tensor | None) -> bool:
        """Whether the step ships rows (takes a ring slot)."""
        return False

    def ticket(self, idx: torch.Tensor | None, T: int, sliced: bool) -> StepTicket:
        """The :class:`StepTicket` of a step of T rows for the validated rows ``idx``
        (``step_rows``); HostRingFullError if it ships and every ring slot is held. Writes
        nothing."""
        ships = self.ships(idx)
        if ships:
            self.ring.check_free()
        return StepTicket(self, idx, T, sliced, ships)

    def begin(self, sliced: bool) -> SnapshotTurn | None:
        """Bookkeeping before the step writes anything of this row choice (commit: a snapshot)."""
        return None

    def abort(self, turn: SnapshotTurn | None) -> None:
        """The step failed: undo ``begin`` where nothing was written."""

    def replaying(self) -> None:
        """A graph of the runtime is about to replay (it runs this row choice's gather)."""

    def gather_in_graph(self, out: Any, n: int, control: Callable[[str], torch.Tensor]) -> None:
        """The gather of this row choice inside the step's graph (or its eager run), width n."""
        raise NotImplementedError

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
        """A sliced step that ships: its rows to ring ``slot`` after the last slice, from the
        joined outputs; returns the outputs the step hands out."""
        raise NotImplementedError

    def _gather_to_slot(self, src, rows, count, slot: int) -> None:
        slot_t = torch.tensor([slot], dtype=torch.int32).to(self.device, non_blocking=True)
        self.gather(src, rows, count, self.ring.dst, self.ring.meta, dst_slot=slot_t)

    # -- after the step -----------------------------------------------------------------
    def check_commit(self) -> None:
        """InputError unless this row choice ships rows by ``commit()``."""
        raise InputError(expected("commit()", "a runtime built with HostRows(mode='commit')",
                                  f"mode {self.config.mode!r}"))

    def commit(self, result, rows, T: int, inputs) -> HostRowsHandle:
        self.check_commit()

    def pinned_bytes(self) -> int:
        """Pinned host memory of this row choice: its ring once built (0 before, or on a CPU)."""
        ring = self.ring
        return ring.nbytes if ring is not None and ring.pinned else 0

    def digest(self) -> tuple[str, str]:
        """(ring, snapshots) fingerprints for StateDigest ("-": not built)."""
        return (fingerprint(self.ring.digest_parts()) if self.ring is not None else "-", "-")


class NoHostRows(RowChoice):
    """No HostRows: a runtime that ships no rows. Every hook of a step does nothing and
    writes nothing; ``rows=`` and ``commit()`` are refused (InputError). It has no ring,
    no control blocks and no gather, one ticket for every step (``NO_TICKET``), and
    leaves the runtime's short path open (``ships_rows`` False)."""

    ships_rows = False

    def __init__(self):  # no config, no gather: nothing to ship
        self.config, self.ring = None, None

    def control_blocks(self) -> dict[str, tuple[int, torch.dtype]]:
        return {}

    def spare_control(self) -> None:
        return None

    def probe(self, step_fn: Callable, inputs, layout, w: int) -> bool:
        return False

    def ticket(self, idx: None, T: int, sliced: bool) -> NoTicket:
        return NO_TICKET

    def gather_in_graph(self, out: Any, n: int, control: Callable[[str], torch.Tensor]) -> None:
        """Nothing to gather."""

    def check_commit(self) -> None:
        raise InputError(expected("commit()", "a runtime built with HostRows(mode='commit')", "mode None"))

    def digest(self) -> tuple[str, str]:
        return ("-", "-")
