"""One round's pieces, and the loop over rounds run by the host (emulated conditional nodes).

:class:`RoundBody` is what the WHILE node's body holds: ``plan()`` (the round's drafts and
:func:`~.planner.plan_round`), the SWITCH's value (``rows.width_index``) and the WHILE's
(``rows.go``), and ``step(i)`` / ``commit(i)``: width ``i``'s graph, then
:func:`~.commit.commit_round` over its outputs (copied into the widest width's rows).
:class:`HostRounds` runs those semantics with the host reading the two values between the
pieces: under ``graphs="emulate"`` the graph path on a CPU, and on a GPU without conditional
nodes the host-driven fallback (one read per round). :mod:`.conditional` puts the very same
pieces into one CUDA graph.
"""
from __future__ import annotations

import functools
import logging
import types
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import InputError, expected
from .commit import commit_round
from .planner import plan_round
from .state import LoopRing, LoopShape, LoopState, RoundRows

log = logging.getLogger(__name__)


@functools.cache
def _compile_failures() -> tuple[type, ...]:
    import torch._dynamo.exc as exc  # imported once compiled ops fail: dynamo is slow to import
    return tuple(getattr(exc, n) for n in ("TorchDynamoException", "FailOnRecompileLimitHit") if hasattr(exc, n))


def check_drafts(drafter, drafts, want: torch.Tensor) -> None:
    """InputError unless ``drafts`` (``drafter``'s answer) is int64 ``want``-shaped on its device."""
    if not (isinstance(drafts, torch.Tensor) and drafts.shape == want.shape and drafts.dtype == torch.int64
            and drafts.device == want.device):
        got = (f"{drafts.dtype} {tuple(drafts.shape)} on {drafts.device}" if isinstance(drafts, torch.Tensor)
               else type(drafts).__name__)
        raise InputError(expected(f"{type(drafter).__name__}(state, k)", f"an int64 tensor "
                                  f"{tuple(want.shape)} on {want.device} (a row of k drafts per slot)", got))


def _plan(drafter, st, rows, arena, block_table, ring, shape, widths) -> None:
    drafts = drafter(st, shape.k)
    check_drafts(drafter, drafts, rows.drafts)  # eager: each round's answer (a Python drafter may change)
    rows.drafts.copy_(drafts)
    plan_round(st, rows, arena, block_table, ring, shape, widths)


def _plan_fused(drafter, st, rows, arena, block_table, ring, shape, widths) -> None:
    rows.drafts.copy_(drafter(st, shape.k))  # checked once, by RoundBody; a replay repeats the same ops
    plan_round(st, rows, arena, block_table, ring, shape, widths)


@dataclass(frozen=True)
class RoundOps:
    """How a round's plan (drafts and :func:`~.planner.plan_round`) and commit
    (:func:`~.commit.commit_round`) run: torch's ops one by one (``EAGER_ROUNDS``), or
    fused by ``torch.compile`` into a few kernels (``compiled_rounds()``), which is what a
    round costs on a GPU beside its step: each op is a kernel of a few microseconds, and a
    plan and commit are about a hundred of them."""

    name: str
    plan: Callable
    commit: Callable


EAGER_ROUNDS = RoundOps("eager", _plan, commit_round)


def _own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own: torch.compile keeps its compiled graphs (and
    counts recompiles against its limit) per code object, so each loop's stay its own."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compiled_rounds() -> RoundOps:
    """The plan and commit compiled (fullgraph, static shapes), new for each call: one
    loop's shapes and drafter do not count against another's recompiles. They compile at
    their first call, which the loop makes before any capture; inductor's cache makes a
    second loop of the same shapes quick. Where compiling fails (a drafter torch.compile
    cannot trace, a drafter whose Python attributes change between rounds), the loop's
    :class:`RoundBody` runs its rounds eagerly from then on and logs why."""
    fuse = functools.partial(torch.compile, fullgraph=True, dynamic=False)
    return RoundOps("compiled", fuse(_own_code(_plan_fused)), fuse(_own_code(commit_round)))


class RoundBody:
    """The pieces of one round over a captured runtime ``rt`` (its widths replayed by hand,
    its arena written by the plan). ``drafter(state, k)`` draws the round's drafts on the
    device; ``ops`` runs the plan and commit (:class:`RoundOps`). Each width's outputs are
    copied into one buffer of the widest width's rows before the commit, so one commit
    serves every width. Lifetime: the runtime's graphs (a ``recapture()`` needs a new body).
    Raises InputError when the drafter's answer is not ``[slots, k]`` int64 drafts on the
    loop's device (here, and at each eager plan)."""

    def __init__(self, rt, state: LoopState, rows: RoundRows, ring: LoopRing, shape: LoopShape, block_table,
                 drafter: Callable, ops: RoundOps = EAGER_ROUNDS):
        self.rt, self.state, self.rows, self.ring, self.shape = rt, state, rows, ring, shape
        self.block_table, self.drafter, self.ops = block_table, drafter, ops
        self.widths = torch.tensor(shape.widths, dtype=torch.int64, device=state.uid.device)
        self.arena = rt.static_inputs(shape.rows)  # every width reads a prefix of these rows
        self.graphs = [rt.graphs_captured[w] for w in shape.widths]
        self.outputs = [rt.static_outputs(w) for w in shape.widths]
        widest = self.outputs[-1]
        self.staged = {name: torch.zeros_like(widest[name]) for name in ("tokens", "committed", "hidden")}
        self._check_drafter()

    def _check_drafter(self) -> None:
        check_drafts(self.drafter, self.drafter(self.state, self.shape.k), self.rows.drafts)

    def unfeed(self) -> None:
        """Graphs keep the arena's rows as the plan writes them (until the runtime's next
        ``step``, e.g. a prefill: call this again before the next launch)."""
        self.arena = self.rt.static_inputs(self.shape.rows)

    def plan(self) -> None:
        args = (self.drafter, self.state, self.rows, self.arena, self.block_table, self.ring, self.shape, self.widths)
        self._run(lambda ops: ops.plan(*args))

    def step(self, i: int) -> None:
        """Width ``i``'s graph (the SWITCH's branch ``i``, first half)."""
        self.graphs[i].replay()

    def commit(self, i: int) -> None:
        """The commit of width ``i``'s outputs (branch ``i``, second half), then the ring's
        mirror (where the loop streams rounds to the host)."""
        out, n = self.outputs[i], self.shape.widths[i]
        for name, buf in self.staged.items():
            buf[:n].copy_(out[name])
        self._run(lambda ops: ops.commit(self.state, self.rows, self.staged, self.ring, self.shape))
        self.ring.mirror.publish(self.ring)

    def _run(self, call: Callable[[RoundOps], None]) -> None:
        """``call(self.ops)``; where compiled ops fail to compile (before any of their
        kernels ran), the eager ops from then on, with a log message."""
        if self.ops is EAGER_ROUNDS:
            return call(self.ops)
        try:
            return call(self.ops)
        except Exception as e:
            if not isinstance(e, _compile_failures()):  # tracing, guards or inductor: none of its kernels ran
                raise
            log.warning("device loop: the rounds' %s ops failed to compile (%s: %s); they run eagerly from now on",
                        self.ops.name, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.ops = EAGER_ROUNDS
            return call(self.ops)


def outline(widths, *, setter: bool) -> list[str]:
    """The loop's structure, one line per node (the outer graph's where ``setter``: its
    set-handles kernel; the host's reads otherwise), each SWITCH branch named by its width."""
    piece, graph = ("child graph", "child graph") if setter else ("launched by the host", "replayed by the host")
    head = ["WHILE(go: 1 at launch, then the plan's verdict)",
            f"  body: plan: the round's drafts, rows, positions, cells and width ({piece})"]
    head.append("  body: set_handles: go and width_index into the two handles (kernel)" if setter else
                "  body: the host reads go and width_index (two device values)")
    head.append(f"  body: SWITCH(width_index) over {len(widths)} branches (width_index {len(widths)}: none runs)")
    return head + [f"    branch {i}: width {w}'s captured graph ({graph}) -> commit ({piece})"
                   for i, w in enumerate(widths)]


class EventSpans:
    """Device time of spans of GPU work: CUDA events around each (``begin`` / ``end``), the
    sum read once at ``seconds()``; nothing and None off CUDA. The host's gaps between
    spans (its reads and launches) are not counted: what the GPU was busy with."""

    def __init__(self, device: torch.device):
        self.pairs: list | None = [] if device.type == "cuda" else None

    def begin(self):
        if self.pairs is None:
            return None
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def end(self, start) -> None:
        if self.pairs is not None:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.pairs.append((start, e))

    def seconds(self) -> float | None:
        if self.pairs is None:
            return None
        if self.pairs:
            self.pairs[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self.pairs) / 1e3


class HostRounds:
    """WHILE(go) { plan; SWITCH(width_index) { i: step(i); commit(i) } } with the host
    reading ``go`` and ``width_index`` (a value past the last branch runs none, as CUDA's
    SWITCH). ``launches`` counts the host's launches of graphs and plans (what one outer
    graph launch replaces)."""

    name = "host"

    def __init__(self, body: RoundBody):
        self.body = body
        self.launches = 0
        self.description = outline(body.shape.widths, setter=False)

    def run(self, poll: Callable[[], None] = lambda: None) -> float | None:
        """The rounds of one launch; their device time (the plans, steps and commits, not
        the host's reads between them; None off CUDA). ``poll()`` after each round."""
        body, n = self.body, len(self.body.shape.widths)
        spans = EventSpans(body.state.uid.device)
        while True:
            with torch.inference_mode():
                t = spans.begin()
                body.plan()
                spans.end(t)
                go, i = int(body.rows.go), int(body.rows.width_index)
                if i < n:
                    t = spans.begin()
                    body.step(i)
                    body.commit(i)
                    spans.end(t)
            self.launches += 1 + 2 * (i < n)
            poll()
            if not go:
                return spans.seconds()
