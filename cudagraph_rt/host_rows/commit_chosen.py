"""Host rows chosen after the step (``HostRows(mode="commit")``): every one-slice step keeps
a device snapshot of its ``source`` rows; ``commit()`` ships chosen rows from it."""
from __future__ import annotations

from typing import Callable

import torch

from ..digest import fingerprint
from ..errors import CapacityError, StaleRowsError, expected
from .base import CTRL, ROWS, Control, RowChoice, SnapshotTurn, output
from .config import check_host_rows
from .ring import HostRowRing, HostRowsHandle


def _commit_gather(gather: Callable, snap: torch.Tensor, ring: HostRowRing, control: Callable) -> None:
    """A commit's gather: the rows ``__rows__`` of snapshot ``snap`` into ring slot ``slot``."""
    c = Control.views(control(CTRL))
    gather(snap, control(ROWS), c.count, ring.dst, ring.meta, src_slot=c.snap, dst_slot=c.slot)


class CommitChosenRows(RowChoice):
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
        # the body holds the buffers, not this object: an emulated graph keeps its body,
        # and a cycle through it would leave the ring to the garbage collector
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
