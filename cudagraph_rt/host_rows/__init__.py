"""Accepted hidden rows to the host: what to ship (`HostRows`), the pinned ring and its
handles, and one object per way of choosing the rows (`RowChoice`: `host_chosen`,
`device_chosen`, `commit_chosen`; `NoHostRows` without HostRows)."""
from __future__ import annotations

from typing import Callable

import torch

from .base import Control, NoHostRows, NoTicket, RowChoice, StepTicket
from .commit_chosen import CommitChosenRows
from .config import HostRows, Mode, check_host_rows
from .device_chosen import DeviceChosenRows
from .host_chosen import HostChosenRows
from .ring import HostRowRing, HostRowsHandle

__all__ = ["CommitChosenRows", "Control", "DeviceChosenRows", "HostChosenRows", "HostRowRing", "HostRows",
           "HostRowsHandle", "Mode", "NoHostRows", "NoTicket", "RowChoice", "StepTicket", "check_host_rows",
           "row_choice_for"]

_CHOICES = {"host": HostChosenRows, "device": DeviceChosenRows, "commit": CommitChosenRows}


def row_choice_for(config: HostRows | None, rows: int, device: torch.device,
                   gather: Callable | None = None) -> RowChoice:
    """The row choice for ``config`` (its ``mode`` string is read here and nowhere else;
    None: :class:`NoHostRows`); ``gather`` defaults to the row-gather kernel on CUDA, its
    torch reference elsewhere."""
    if config is None:
        return NoHostRows()
    if gather is None:
        if device.type == "cuda":
            from ..kernels.row_gather import gather_rows as gather
        else:
            from ..kernels.row_gather import gather_rows_reference as gather
    return _CHOICES[config.mode](config, rows, device, gather)
