"""The one interface (`Stager`) of the ways a step's host rows reach the arena:
`CpuStaging` (a CPU: rows straight into the arena), `PinnedStaging` (CUDA: two pinned
arenas, each moved in one host-to-device copy) and `Feed` (fed graphs copy the arena in
themselves). :func:`stagers` picks the two roles once: the arena stager and the graph stager.
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

import torch

from .arena import ONE_COPY_BYTES, ArenaLayout
from .feed import Feed
from .staging import CpuStaging, HostArena, PinnedStaging
from .validate import Prepared


@runtime_checkable
class Stager(Protocol):
    """How host rows reach the arena. Lifetime: the static inputs' (graphs bake in its
    buffers' addresses). Writes raise only what host copies raise (``Validator`` checked the
    rows); an interrupted write leaves bookkeeping that pads every row it may have touched."""

    fed: bool  # graphs copy these rows in themselves (what ``rt.fed_graphs`` reports)
    short_path: bool  # ``write_rows`` / ``all_host`` exist: the short path (DirectStep) may write
    next: int  # the index in ``arenas`` of the host arena the next step's rows go into

    @property
    def arenas(self) -> list[HostArena]:
        """The host arenas ``host_inputs()`` may hand out (indexed by ``next``)."""

    @property
    def pinned(self) -> list[torch.Tensor]:
        """Its pinned host buffers (none on a CPU)."""

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every buffer it owns: memory a step's inputs must stay apart from."""

    def wait(self, k: int) -> None:
        """Until the host may write arena ``k`` (its last copy has left it)."""

    def write(self, prep: Prepared, start: int, length: int, width: int,
              control: Mapping[str, Any] | None) -> None:
        """Rows ``[start, start+length)`` of ``prep`` on their way into arena rows
        ``[0, length)``, pad values into rows ``[length, width)``, control blocks set;
        stream-ordered (or in the next replay's prologue)."""

    def prologue(self) -> None:
        """The first work of every graph captured over it (nothing, unless graphs are fed)."""

    def unfeed(self) -> None:
        """Graphs keep the arena's rows until the next write (a graph replayed by hand)."""

    def reset(self, control: Mapping[str, Any] | None) -> None:
        """Padding only from here on, whatever earlier writes left (capture runs next)."""

    def digest_state(self) -> list:
        """Its bookkeeping, for ``StateDigest`` (the buffers come from ``arenas``)."""


@runtime_checkable
class ArenaStager(Stager, Protocol):
    """A stager that reaches the arena outside a replay too (every runtime has one): it
    also writes the control blocks a commit sets between steps."""

    def take_for_control(self) -> int | None:
        """The host arena ``write_control`` goes through (its handed views are used up),
        or None where control blocks go straight into the arena."""

    def write_control(self, k: int | None, control: Mapping[str, Any]) -> None:
        """Set control blocks only, through arena ``k`` (see ``take_for_control``)."""


def stagers(layout: ArenaLayout, arena: torch.Tensor, full: Mapping[str, torch.Tensor], device: torch.device,
            feed_event) -> tuple[ArenaStager, Stager]:
    """(the arena stager, the graph stager): pinned staging on CUDA, straight writes on a
    CPU; the graph stager is the feed where the graph mode gives a ``feed_event`` and the
    arena crosses in one copy, else the arena stager itself."""
    cuda = device.type == "cuda"
    staging = PinnedStaging(layout, arena, full, device) if cuda else CpuStaging(layout, full)
    if feed_event is None or layout.nbytes > ONE_COPY_BYTES:
        return staging, staging
    return staging, Feed(layout, arena, full, feed_event, pinned=cuda)
