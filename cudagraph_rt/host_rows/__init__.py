"""Accepted hidden rows to the host: what to ship (`HostRows`), the pinned ring and its
handles, and one object per way of choosing the rows (`modes`)."""
from .config import HostRows, Mode, check_host_rows
from .modes import Control, NoHostRows, RowsMode, StepTicket, make_rows_mode
from .ring import HostRowRing, HostRowsHandle

__all__ = ["Control", "HostRowRing", "HostRows", "HostRowsHandle", "Mode", "NoHostRows", "RowsMode", "StepTicket", "check_host_rows",
           "make_rows_mode"]
