"""What a step hands back (`StepResult`), the counters (`RuntimeStats`), and one planned
step before anything is written (`PlannedStep`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple

from .inputs import Prepared
from .host_rows import HostRowsHandle, NoTicket, StepTicket
from .widths import Slice


@dataclass(frozen=True, init=False)
class StepResult:
    """What one ``step`` returns.

    ``outputs`` has the structure the step function returns, cut to the step's ``T`` real
    rows. For a one-slice step they are views of graph-owned memory, valid until the next
    ``step`` (or ``commit``) of the same runtime: clone what you keep. ``slices`` says
    which paths and widths ran; ``host_rows`` is the handle to the rows shipped to the
    host (None when the step shipped none).
    """

    outputs: Any
    T: int
    slices: tuple[Slice, ...]
    host_rows: HostRowsHandle | None = None
    snapshot: tuple[int, int] | None = field(default=None, repr=False)  # (slot, generation)
    owner: object = field(default=None, repr=False, compare=False)  # the runtime's token

    def __init__(self, outputs: Any, T: int, slices: tuple[Slice, ...], host_rows: HostRowsHandle | None = None,
                 snapshot: tuple[int, int] | None = None, owner: object = None):
        # Frozen, yet built in one dict update: the generated __init__ sets each field
        # through object.__setattr__, on every step's path. A new field goes here too
        # (tests/core/test_direct_step.py compares the parameters with the fields).
        self.__dict__.update(outputs=outputs, T=T, slices=slices, host_rows=host_rows, snapshot=snapshot, owner=owner)


@dataclass(frozen=True)
class RuntimeStats:
    """Counters since construction (or ``reset_stats``): graph replays and eager calls per
    width (eager: graphs off, or a width that fell back), dynamic calls per row count.
    ``graph_mode`` says what a replay is: ``"cuda"``, ``"emulated"`` (``graphs="emulate"``:
    an eager re-run into the width's static outputs) or ``"off"`` (no replays). A width
    captured in pieces counts a replay per step (its pieces and marked calls).
    ``width_modes``: what each width runs as now: ``"graph"``, ``"pieces"`` or ``"eager"``
    (graphs off, before capture, or a width whose capture fell back)."""

    steps: int
    slices: int
    padding_rows: int
    graph_replays: Mapping[int, int]
    eager_calls: Mapping[int, int]
    dynamic_calls: Mapping[int, int]
    commits: int
    graph_mode: str = "cuda"
    width_modes: Mapping[int, str] = field(default_factory=dict)


class PlannedStep(NamedTuple):
    """One validated step, before anything is written: its inputs, slices and host-row ticket.
    (A NamedTuple, not a frozen dataclass: one is built on every step's path.)"""

    prep: Prepared
    slices: tuple[Slice, ...]
    ticket: StepTicket | NoTicket  # the host-row choice's part of the step (rows validated, a ring slot free)

    @property
    def T(self) -> int:
        return self.prep.T

    @property
    def sliced(self) -> bool:
        return len(self.slices) > 1
