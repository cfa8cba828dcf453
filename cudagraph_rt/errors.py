"""The one exception family of cudagraph_rt.

Every error the runtime raises on purpose derives from :class:`CgrtError`, so an engine
can catch the whole family in one place. Each is raised before any static buffer, KV
cell, staging buffer or host-row slot is written, unless its docstring says otherwise.
"""
from __future__ import annotations


class CgrtError(Exception):
    """Base class of every error cudagraph_rt raises on purpose."""


class InputError(CgrtError, ValueError):
    """A caller passed something the runtime cannot accept (shape, dtype, device, rows).

    Raised before anything is written; the runtime stays usable and unchanged.
    """


class StepFunctionError(CgrtError, TypeError):
    """The user's step function returned something the runtime cannot replay: an output
    without the leading width dimension, or a structure that differs between widths."""


class CaptureError(CgrtError, RuntimeError):
    """Capturing one width failed. ``width`` names it, ``piece`` the piece of a width
    captured in pieces (1-based; None otherwise), ``hazards`` lists what the hazard finder
    saw (operation and source line), ``cause`` is the original exception.

    After it is raised the capture stream is no longer capturing, widths captured before
    still replay, and the runtime may retry or run that width eagerly.
    """

    def __init__(self, message: str, *, width: int | None = None, hazards=(), cause=None, piece: int | None = None):
        super().__init__(message)
        self.width, self.piece = width, piece
        self.hazards = tuple(hazards)
        self.cause = cause


class StaleCaptureError(CaptureError):
    """A tensor the graphs were captured over (a weight, a KV pool) moved to a new address
    since capture; replaying would read or write the old memory. Call ``recapture()``."""


class BusyError(CgrtError):
    """``step`` was called from a second thread while another thread was inside it, or
    held the views ``host_inputs()`` handed it for its next step.

    A runtime serves one host thread at a time; the call is refused, nothing is written."""


class CapacityError(CgrtError):
    """A step or a host-row request exceeds a configured limit (step width with slicing
    off, host-row capacity, a host-row ring with every slot still held)."""


class StaleRowsError(CgrtError):
    """A host-row handle was read after its ring slot was reused by a later step."""


class DeviceRowIndexError(CgrtError, IndexError):
    """Row indices chosen on the device were out of range (or more than the capacity).

    The gather wrote nothing for those rows; the flag is raised when the handle is read.
    """


def expected(arg: str, want: str, got) -> str:
    """Message helper: ``"<arg>: expected <want>, got <got>"``."""
    return f"{arg}: expected {want}, got {got}"
