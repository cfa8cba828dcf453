"""Host rows chosen on the device (``HostRows(mode="device")``): the step function's own
outputs name the rows to ship, inside the same replay."""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import CapacityError, StepFunctionError, expected
from .base import CTRL, Control, RowChoice, output


class DeviceChosenRows(RowChoice):
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
        super().step_rows(rows, T, first_width, sliced)  # refuses rows=
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
