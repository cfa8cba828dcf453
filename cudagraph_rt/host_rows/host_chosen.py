"""Host rows chosen by the host before the step (``HostRows(mode="host")``): the caller's
``rows=`` indices, validated on the host, written into the ``__rows__`` control block and
gathered inside the step's graph."""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import CapacityError, expected
from .base import CTRL, ROWS, Control, RowChoice, output
from .config import check_host_rows


class HostChosenRows(RowChoice):
    """``HostRows(mode="host")``: ``step(rows=...)`` names the rows to ship (none: the step
    ships nothing); a sliced step ships them after its last slice, from the joined outputs."""

    def step_rows(self, rows: Any, T: int, first_width: int, sliced: bool) -> torch.Tensor | None:
        if rows is None:
            return None
        idx = check_host_rows(rows, T, self.capacity, self.config.allow_duplicates)
        if not sliced and len(idx) > first_width:  # duplicates: one index per row the step runs
            raise CapacityError(expected("rows", f"at most {first_width} indices in a step that runs "
                                         f"{first_width} rows", len(idx)))
        return idx

    def ships(self, idx: torch.Tensor | None) -> bool:
        return idx is not None

    def gather_in_graph(self, out: Any, n: int, control: Callable[[str], torch.Tensor]) -> None:
        src = output(out, self.config.source, "HostRows.source")
        c = Control.views(control(CTRL))
        self.gather(src, control(ROWS)[:n], c.count, self.ring.dst, self.ring.meta, dst_slot=c.slot)

    def gather_sliced(self, outputs: Any, idx, slot: int, T: int, records: list) -> Any:
        src = output(outputs, self.config.source, "source")
        rows = idx.to(self.device, non_blocking=True)
        count = torch.tensor([idx.numel()], dtype=torch.int32).to(self.device, non_blocking=True)
        self._gather_to_slot(src, rows, count, slot)
        return outputs
