"""Plans, workspaces and launches of the sampler's Triton kernels (``triton_path.py``,
``search_kernels.py``).

A plan is a pure function of (rows, vocabulary, device): no device value and no call-time
autotune, so the launches are capturable in a CUDA graph once compiled (the first launch
of each specialisation compiles: warm up outside capture, as the runtime does). Changing
the plan never changes a token, only where the work happens (up to the rounding of the
kept mass summed in another order, see ``torch_path.py``).

The workspace (row states, per-chunk partials, one ticket per row) is allocated once per
(device, rows, chunks, candidates) and kept: a captured graph bakes its address in. Its
tickets are 0 between launches (each row's last program puts its ticket back). Launches
sharing a workspace must be stream-ordered: two sampler calls of the same shape running at
once on two streams would mix their partials (give each stream its own
:class:`SamplingWorkspace`).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from cudagraph_rt.errors import CaptureError, InputError, expected
from cudagraph_rt.kernels.common import triton_backend  # noqa: F401 - the sampler's callers ask here
from cudagraph_rt.kernels.sampling import search_kernels as sk
from cudagraph_rt.kernels.sampling import triton_path as tp
from cudagraph_rt.kernels.sampling.philox import Stream
from cudagraph_rt.kernels.sampling.settings import SamplingSettings

__all__ = ["SamplingPlan", "SamplingWorkspace", "launch_sampler", "plan_sampling"]

MAX_CHUNK, PASSES = 4096, 3  # the default plan's widest chunk and search passes
_TILE_ELEMS = 4096  # search_block * candidates: the [tile, candidates] comparison of one search step


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@dataclass(frozen=True)
class SamplingPlan:
    """Where a launch does its work: ``chunk`` vocabulary entries per program (a multiple
    of ``block``), tiles of ``block`` entries (``search_block`` in the search launches),
    ``candidates`` thresholds tested per search step (a power of two), ``search_passes``
    search launches over all programs (>= 1; the last one's reducer finishes any row still
    searching on its own), ``num_warps`` per program."""

    chunk: int
    block: int
    search_block: int
    candidates: int
    search_passes: int
    num_warps: int = 4

    def chunks(self, vocab: int) -> int:
        """Programs per row."""
        return _cdiv(vocab, self.chunk)

    def launches(self, full_q: bool = False, probs: bool = False) -> int:
        """Kernel launches of one call: stats, the search passes, final (+ residual, probs)."""
        return 2 + self.search_passes + int(full_q) + int(probs)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_sampling(rows: int, vocab: int, device: torch.device, sm_count: int | None = None) -> SamplingPlan:
    """The default plan: about two programs per multiprocessor over all rows, in chunks of at
    most ``MAX_CHUNK`` entries (one row of a 128k vocabulary in ~128 chunks of 1024, 64 rows
    in chunks of 4096), 16 candidates per search step, 3 search passes (the fastest of the
    H200 sweeps, ``kernels/sampling/bench.py --sweep``: the last pass's reducer finishes a
    row's search alone over the whole row, so too few passes cost 4x at 4 rows and more at
    64; at one row 2 and 3 passes were within 1 %).
    ``sm_count``: the device's multiprocessors (default: asked of the device)."""
    device = torch.device(device)
    block = 1024 if device.type == "cuda" else 64
    want = max(1, _cdiv(2 * (sm_count or _sm_count(device)), max(rows, 1)))
    chunk = max(block, min(MAX_CHUNK, _cdiv(_cdiv(vocab, want), block) * block))
    candidates = 16 if device.type == "cuda" else 8
    return SamplingPlan(chunk, block, min(block, _TILE_ELEMS // candidates), candidates, search_passes=PASSES)


def _check_plan(plan: SamplingPlan) -> None:
    for name in ("block", "search_block", "candidates"):
        v = getattr(plan, name)
        if v < 4 or v & (v - 1):
            raise InputError(expected(f"plan.{name}", "a power of two >= 4", v))
    if plan.chunk < 1 or plan.chunk % plan.block or plan.block % plan.search_block:
        raise InputError(expected("plan", "chunk a multiple of block, block a multiple of search_block", plan))
    if plan.search_passes < 1:
        raise InputError(expected("plan.search_passes", ">= 1", plan.search_passes))


def partial_words(candidates: int) -> tuple[int, int]:
    """(int32, float32) words of one program's partial results: a search step's counts
    [MC] and masses, successors, predecessors [MC] each plus the bracket's top."""
    return max(candidates, 2), max(3 * candidates + 1, 4)


def launch_constants(plan: SamplingPlan, vocab: int) -> dict:
    """The compile-time constants every launch of ``plan`` shares (the partials' layout and
    the reducers' chunks per block)."""
    iw, fw = partial_words(plan.candidates)
    return dict(IW=iw, FW=fw, CB=min(_pow2(plan.chunks(vocab)), max(1, 1024 // plan.candidates)))


class SamplingWorkspace:
    """Row states (int32 / float32 [N, 8]), per-chunk partials and tickets (int32 [N], 0
    between launches) of one (device, rows, chunks, candidates); kept for as long as any
    graph captured over it may replay. :meth:`get` of the module's :data:`WORKSPACES`
    raises CaptureError when a new shape would be allocated during a capture."""

    def __init__(self, device: torch.device, rows: int, chunks: int, candidates: int):
        self.key = (device, rows, chunks, candidates)
        self.iw, self.fw = partial_words(candidates)
        self.istate = torch.zeros(rows, tp.I_WORDS, dtype=torch.int32, device=device)
        self.fstate = torch.zeros(rows, tp.F_WORDS, dtype=torch.float32, device=device)
        self.ipart = torch.zeros(rows * chunks * self.iw, dtype=torch.int32, device=device)
        self.fpart = torch.zeros(rows * chunks * self.fw, dtype=torch.float32, device=device)
        self.tickets = torch.zeros(rows, dtype=torch.int32, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the zeroed tickets, before any stream's launch

    @classmethod
    def for_logits(cls, logits: Tensor, plan: SamplingPlan | None = None) -> "SamplingWorkspace":
        """A workspace of one's own for calls on ``logits``' shape and device under ``plan``
        (default: :func:`plan_sampling`'s): one per stream that samples at the same time as
        another. Allocate it outside any capture."""
        n, v = logits.shape
        plan = plan or plan_sampling(n, v, logits.device)
        return cls(logits.device, n, plan.chunks(v), plan.candidates)


class _Workspaces:
    def __init__(self):
        self._by_key: dict[tuple, SamplingWorkspace] = {}

    def get(self, device: torch.device, rows: int, chunks: int, candidates: int) -> SamplingWorkspace:
        key = (device, rows, chunks, candidates)
        ws = self._by_key.get(key)
        if ws is None:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise CaptureError(f"sampler: the first call with {rows} rows in {chunks} chunks came during a "
                                   "capture; call it once outside capture first (its workspace must outlive graphs)")
            ws = self._by_key[key] = SamplingWorkspace(device, rows, chunks, candidates)
        return ws

    def all(self) -> list[SamplingWorkspace]:
        """Every workspace allocated so far (tests check their tickets are back at 0)."""
        return list(self._by_key.values())


WORKSPACES = _Workspaces()


@dataclass(frozen=True)
class _Call:
    """One call's arguments, as the launches take them."""

    logits: Tensor
    settings: SamplingSettings
    draft: Tensor | None
    q: Tensor | None
    tokens: Tensor
    p_draft: Tensor
    stream: int
    plan: SamplingPlan
    ws: SamplingWorkspace

    def common(self) -> dict:
        return launch_constants(self.plan, self.logits.shape[1])


def launch_sampler(logits: Tensor, settings: SamplingSettings, tokens: Tensor, p_draft: Tensor, *,
                   draft: Tensor | None = None, q: Tensor | None = None, probs: Tensor | None = None,
                   stream: int = Stream.SAMPLE, plan: SamplingPlan | None = None,
                   workspace: SamplingWorkspace | None = None) -> None:
    """Launch the kernels of one call (arguments checked by the caller): tokens [N] and p(d)
    [N] written, ``probs`` [N, V] too when given. Asynchronous, capturable once compiled."""
    n, v = logits.shape
    plan = plan or plan_sampling(n, v, logits.device)
    _check_plan(plan)
    if workspace is None:
        workspace = WORKSPACES.get(logits.device, n, plan.chunks(v), plan.candidates)
    elif workspace.key != (logits.device, n, plan.chunks(v), plan.candidates):
        raise InputError(expected("workspace", f"one of {(logits.device, n, plan.chunks(v), plan.candidates)}",
                                  workspace.key))
    if n == 0:
        return
    call = _Call(logits, settings, draft, q, tokens, p_draft, int(stream), plan, workspace)
    cuda = logits.device.type == "cuda"
    with torch.cuda.device(logits.device) if cuda else contextlib.nullcontext():
        _launch_all(call, probs, {"num_warps": plan.num_warps} if cuda else {})


def _launch_all(call: _Call, probs: Tensor | None, opts: dict) -> None:
    logits, s, ws, plan = call.logits, call.settings, call.ws, call.plan
    n, v = logits.shape
    grid = (plan.chunks(v), n)
    draft = call.draft if call.draft is not None else call.tokens  # a placeholder never read
    q = call.q if call.q is not None else call.p_draft
    stride_q = call.q.stride(0) if call.q is not None else 0
    flags = dict(HAS_DRAFT=call.draft is not None, FULL_Q=call.q is not None)
    head = (logits, logits.stride(0), v)
    tail = (ws.ipart, ws.fpart, ws.tickets, plan.chunk, grid[0])
    tp._stats_kernel[grid](*head, s.temperature, s.top_k, s.top_p, s.min_p, s.seed, s.position, draft, q, stride_q,
                           call.tokens, call.p_draft, ws.istate, ws.fstate, *tail, call.stream,
                           BLOCK=plan.block, **call.common(), **flags, **opts)
    for i in range(plan.search_passes):
        sk._search_kernel[grid](*head, s.temperature, s.top_p, ws.istate, ws.fstate, *tail, BLOCK=plan.search_block,
                                MC=plan.candidates, LAST=i == plan.search_passes - 1, **call.common(), **opts)
    tp._final_kernel[grid](*head, s.temperature, s.seed, s.position, draft, q, stride_q, call.tokens, call.p_draft,
                           ws.istate, ws.fstate, *tail, call.stream, BLOCK=plan.block, **call.common(), **flags,
                           **opts)
    if call.q is not None:
        tp._residual_kernel[grid](*head, s.temperature, s.seed, s.position, draft, q, stride_q, call.tokens,
                                  ws.istate, ws.fstate, *tail, BLOCK=plan.block, **call.common(), **opts)
    if probs is not None:
        tp._probs_kernel[grid](*head, s.temperature, probs, probs.stride(0), ws.istate, ws.fstate, plan.chunk,
                               BLOCK=plan.block, **opts)
