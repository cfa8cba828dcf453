"""What a stager offers: the one interface of the ways a step's host rows reach the arena.

Three stagers, one interface (`Stager`): `CpuStaging` (graphs off or eager slices on a
CPU: rows straight into the arena), `PinnedStaging` (CUDA: two pinned arenas that steps
alternate between, each moved in one host-to-device copy) and `Feed` (fed graphs: one
arena each captured graph copies in itself, in its prologue). `StaticInputs` holds two
roles, chosen once by :func:`stagers`: the arena stager (eager and dynamic slices, and the
control blocks a commit writes between steps; an `ArenaStager`) and the graph stager
(graph slices: the feed where graphs are fed, else the arena stager itself). The rooms
ask the stager they hold; none asks whether the graphs are fed.
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
    """How host rows reach the arena. Lifetime: the static inputs' (the graphs bake in
    the addresses of its buffers). Its writes raise only what the host copies raise (the
    rows were checked before, by ``Validator``); an interrupted write leaves bookkeeping
    that pads every row it may have touched."""

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
        """Every buffer it owns (host arenas, any device copy): memory a step's inputs
        must stay apart from."""

    def wait(self, k: int) -> None:
        """Until the host may write arena ``k`` (its last copy has left it)."""

    def write(self, prep: Prepared, start: int, length: int, width: int,
              control: Mapping[str, Any] | None) -> None:
        """Rows ``[start, start+length)`` of ``prep`` on their way into arena rows
        ``[0, length)``, pad values into rows ``[length, width)``, control blocks set;
        stream-ordered (or in the next replay's prologue)."""

    def prologue(self) -> None:
        """The first work of every graph captured over this stager (nothing, unless the
        graph copies its rows in itself)."""

    def unfeed(self) -> None:
        """Graphs keep the arena's rows as they are until the next write (a caller wrote
        them by hand and replays a graph directly)."""

    def reset(self, control: Mapping[str, Any] | None) -> None:
        """Padding only from here on, whatever earlier writes left (capture runs next)."""

    def digest_state(self) -> list:
        """Its bookkeeping, for ``StateDigest`` (the buffers come from ``arenas``)."""


@runtime_checkable
class ArenaStager(Stager, Protocol):
    """A stager that reaches the arena outside a replay as well: the one every runtime
    has, which also writes the control blocks a commit sets between steps."""

    def take_for_control(self) -> int | None:
        """The host arena ``write_control`` goes through (its handed views are used up),
        or None where control blocks go straight into the arena."""

    def write_control(self, k: int | None, control: Mapping[str, Any]) -> None:
        """Set control blocks only, through arena ``k`` (see ``take_for_control``)."""


def stagers(layout: ArenaLayout, arena: torch.Tensor, full: Mapping[str, torch.Tensor], device: torch.device,
            feed_event) -> tuple[ArenaStager, Stager]:
    """(the arena stager, the graph stager): pinned staging on CUDA, straight writes on a
    CPU; the feed for graph slices where the graph mode gives a ``feed_event`` and the
    arena is small enough to cross in one copy (else graphs are not fed: the graph
    stager is the arena stager)."""
    cuda = device.type == "cuda"
    staging = PinnedStaging(layout, arena, full, device) if cuda else CpuStaging(layout, full)
    if feed_event is None or layout.nbytes > ONE_COPY_BYTES:
        return staging, staging
    return staging, Feed(layout, arena, full, feed_event, pinned=cuda)
