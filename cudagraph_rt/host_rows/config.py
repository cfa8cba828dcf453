"""What a runtime ships to the host (`HostRows`) and the check of host-chosen indices."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from ..errors import CapacityError, InputError, expected

Mode = Literal["host", "device", "commit"]


@dataclass(frozen=True)
class HostRows:
    """Which output's rows go to the host, and who chooses them.

    - ``mode="host"``: the host passes ``rows=[...]`` (row indices of the step) to
      ``step``; they are staged with the inputs and gathered inside the replay.
    - ``mode="device"``: the step function chooses: its outputs ``rows_output`` ([N]
      int32 indices, packed at the front) and ``count_output`` ([1] int32) are read by the
      captured gather, so one replay verifies, accepts and ships the rows.
    - ``mode="commit"``: the host decides after the step and calls
      ``runtime.commit(result, rows)``; each step snapshots ``source`` on the device so
      later steps may run before the commit (up to ``depth`` steps later).

    ``source`` names the output ([N, H]) whose rows are shipped: a dict key, or a tuple
    or list index (negative from the end), or a NamedTuple's field name; so do
    ``rows_output`` and ``count_output``. The outputs may come in any container torch's
    pytree takes apart (dict, list, tuple, NamedTuple, OrderedDict, defaultdict), and a
    step hands them out in that container; another is refused at capture
    (StepFunctionError naming the step function's output), before the ring is built. ``capacity`` is the most rows one step ships (default: the runtime's dynamic
    limit); ``depth`` the number of ring slots (at least 2, so the host reads step k
    while step k+1 runs).
    """

    source: str | int = "hidden"
    mode: Mode = "host"
    capacity: int | None = None
    depth: int = 3
    rows_output: str | int = "accept_rows"
    count_output: str | int = "accept_count"
    allow_duplicates: bool = False

    @property
    def chosen_on_device(self) -> bool:
        """The step function chooses the rows (its outputs feed the gather)."""
        return self.mode == "device"

    def __post_init__(self):
        if self.mode not in ("host", "device", "commit"):
            raise InputError(expected("HostRows.mode", "'host', 'device' or 'commit'", repr(self.mode)))
        if isinstance(self.depth, bool) or not isinstance(self.depth, int) or self.depth < 2:
            raise InputError(expected("HostRows.depth", "an int >= 2", repr(self.depth)))
        if self.capacity is not None and (
            isinstance(self.capacity, bool) or not isinstance(self.capacity, int) or self.capacity < 1
        ):
            raise InputError(expected("HostRows.capacity", "a positive int or None", repr(self.capacity)))
        for name in ("source", "rows_output", "count_output"):  # an output: a dict key or a tuple index
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (str, int)):
                raise InputError(expected(f"HostRows.{name}", "an output's name (str) or index (int)", repr(v)))
        if not isinstance(self.allow_duplicates, (bool, np.bool_)):
            raise InputError(expected("HostRows.allow_duplicates", "True or False", repr(self.allow_duplicates)))
        object.__setattr__(self, "allow_duplicates", bool(self.allow_duplicates))


def check_host_rows(rows: Any, T: int, capacity: int, allow_duplicates: bool) -> torch.Tensor:
    """Validate host-chosen row indices of a step of ``T`` rows; returns int32 CPU tensor.

    Raises InputError (type, range, duplicates) or CapacityError (too many) before any
    buffer is written.
    """
    t = _rows_tensor(rows, T, capacity)
    if t.dim() != 1:
        raise InputError(expected("rows", "a 1-D list of row indices", f"shape {tuple(t.shape)}"))
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex:
        raise InputError(expected("rows", "integer row indices", f"dtype {t.dtype}"))
    if t.dtype in (torch.uint16, torch.uint32, torch.uint64):  # min()/max() lack these
        a = t.numpy()
        if a.size and int(a.max()) >= T:
            raise InputError(expected("rows", f"indices in [0, {T})", f"index {int(a.max())}"))
        t = torch.from_numpy(a.astype(np.int64))
    if t.numel() > capacity:
        raise CapacityError(expected("rows", f"at most {capacity} rows (HostRows.capacity)", f"{t.numel()} rows"))
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= T:
            bad = lo if lo < 0 else hi
            raise InputError(expected("rows", f"indices in [0, {T})", f"index {bad}"))
        if not allow_duplicates and torch.unique(t).numel() != t.numel():
            raise InputError(expected("rows", "distinct indices (HostRows.allow_duplicates=False)", "duplicates"))
    return t.to(torch.int32)


def _rows_tensor(rows: Any, T: int, capacity: int) -> torch.Tensor:
    """``rows`` as a dense CPU tensor, not checked beyond what reading it needs."""
    if isinstance(rows, torch.Tensor):
        t = rows.detach()
        if t.device.type != "cpu":
            raise InputError(expected("rows", "host row indices (list, numpy or CPU tensor)", f"a tensor on {t.device}"))
        if t.layout is not torch.strided or t.is_quantized:
            raise InputError(expected("rows", "a dense tensor of integer row indices",
                                      f"layout {t.layout}, dtype {t.dtype}"))
        return t
    if isinstance(rows, np.ndarray):
        return _numpy_rows(rows, T)
    if isinstance(rows, (list, tuple, range)):
        if len(rows) > capacity:  # before any element is looked at: range(10**7) is cheap to refuse
            raise CapacityError(expected("rows", f"at most {capacity} rows (HostRows.capacity)", f"{len(rows)} rows"))
        if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in rows):
            raise InputError(expected("rows", "integer row indices", f"{list(rows)[:8]}"))
        try:
            return torch.tensor(list(rows), dtype=torch.int64)
        except (OverflowError, RuntimeError, ValueError, TypeError):
            raise InputError(expected("rows", f"indices in [0, {T})", "an index beyond int64")) from None
    raise InputError(expected("rows", "a list, numpy array or CPU tensor of row indices", type(rows).__name__))


def _numpy_rows(rows: np.ndarray, T: int) -> torch.Tensor:
    if rows.dtype.kind not in "biuf":
        raise InputError(expected("rows", "integer row indices", f"numpy dtype {rows.dtype}"))
    if not rows.dtype.isnative:  # big-endian: read by value, as step inputs are
        rows = rows.astype(rows.dtype.newbyteorder("="))
    if rows.dtype.kind == "u" and rows.size and int(rows.max()) >= T:
        raise InputError(expected("rows", f"indices in [0, {T})", f"index {int(rows.max())}"))
    rows = rows.astype(np.int64) if rows.dtype.kind == "u" else rows
    try:
        return torch.from_numpy(np.ascontiguousarray(rows) if rows.ndim else rows.copy())
    except TypeError:  # longdouble: no torch dtype (and no integer anyway)
        raise InputError(expected("rows", "integer row indices", f"numpy dtype {rows.dtype}")) from None
