"""Shared pieces of ``cgrt bench``: the clock, random valid toy inputs, the mixed trace and
the hand-written baselines (eager feed, bare CUDA graphs) the runtime is compared with.
The torch.compile variants (``compile_setups``, in child processes) time themselves with the
same helpers (:func:`measure`, :func:`measure_trace`) over the same inputs.

Timing rule for every number: before each timed call the device is idle (synchronized);
``time_calls`` then measures one call with the host clock, either up to a second
synchronize (latency: host work + launches + device work + the sync's wake-up) or up to
the call's return (host time to issue it). Medians over many calls after warm-up, inputs
rotated among several pre-generated random sets, never zeros.
"""
from __future__ import annotations

import functools
import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from cudagraph_rt.models.toy import ToyDecoder

N_SETS = 8  # input sets rotated through per measured case


def sync_fn(device: torch.device) -> Callable[[], None]:
    """A device-wide synchronize for CUDA, a no-op on the CPU."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


def summarize(ns: list[int]) -> dict:
    """Median and 10th/90th percentiles in microseconds of per-call nanoseconds."""
    xs = sorted(ns)
    n = len(xs)

    def q(p: float) -> float:
        return xs[min(n - 1, round(p * (n - 1)))] / 1e3

    return {"median_us": statistics.median(xs) / 1e3, "p10_us": q(0.1), "p90_us": q(0.9), "n": n}


def time_calls(call: Callable[[int], Any], *, repeats: int, warmup: int, sync: Callable[[], None],
               prepare: Callable[[int], Any] | None = None, include_sync: bool = True) -> dict:
    """Per-call host-clock timing, the device idle before each call.

    ``prepare(i)`` runs untimed before call ``i`` (placing inputs). ``include_sync``: stop
    the clock after a synchronize (latency) or right when ``call`` returns (host time; use
    it too for calls that end by waiting for their own result). GC is off while timing.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        for i in range(warmup):
            if prepare is not None:
                prepare(i)
            call(i)
            sync()
        out = [_timed_call(call, prepare, i, sync, include_sync) for i in range(repeats)]
    finally:
        if was:
            gc.enable()
    return summarize(out)


def _timed_call(call, prepare, i: int, sync: Callable[[], None], include_sync: bool) -> int:
    """Nanoseconds of ``call(i)`` from an idle device: ``prepare(i)`` untimed first; the
    clock stops after a synchronize (latency) or when the call returns (host time)."""
    if prepare is not None:
        prepare(i)
    sync()
    t0 = time.perf_counter_ns()
    call(i)
    if include_sync:
        sync()
    ns = time.perf_counter_ns() - t0
    if not include_sync:
        sync()
    return ns


def time_interleaved(variants: dict[str, tuple[Callable[[int], Any], Callable[[int], Any] | None]], *,
                     repeats: int, warmup: int, sync: Callable[[], None], include_sync: bool = True,
                     raw: dict[str, list[int]] | None = None) -> dict:
    """:func:`time_calls` of several variants side by side: each round times every variant
    once, in a rotating order, so drift of the machine (clocks, neighbours) hits all of
    them alike. ``variants``: name -> (call, untimed prepare or None). Returns name ->
    summary, plus ``"_deltas"``: name -> median over rounds of (variant - first variant).
    ``raw``, if given, gets each variant's per-call nanoseconds appended (round order), so
    a caller can pool several runs."""
    names = list(variants)
    was = gc.isenabled()
    gc.disable()
    try:
        for i in range(warmup):
            for name in names:
                call, prep = variants[name]
                if prep is not None:
                    prep(i)
                call(i)
                sync()
        times = {name: [] for name in names}
        for i in range(repeats):
            for j in range(len(names)):
                name = names[(i + j) % len(names)]
                times[name].append(_timed_call(*variants[name], i, sync, include_sync))
    finally:
        if was:
            gc.enable()
    if raw is not None:
        for name, ts in times.items():
            raw.setdefault(name, []).extend(ts)
    out = {name: summarize(ts) for name, ts in times.items()}
    first = times[names[0]]
    out["_deltas"] = {name: statistics.median(a - b for a, b in zip(times[name], first)) / 1e3
                      for name in names[1:]}
    return out


def time_pipelined(call: Callable[[int], Any], *, repeats: int, warmup: int, sync: Callable[[], None]) -> float:
    """Microseconds per call of ``repeats`` back-to-back calls with one synchronize at the
    end: host work of a call overlaps the device work of the ones before it."""
    for i in range(warmup):
        call(i)
    n = max(repeats, 1)
    return time_total(lambda: [call(i) for i in range(n)], sync) / n * 1e6


def time_total(run: Callable[[], Any], sync: Callable[[], None]) -> float:
    """Seconds for ``run()`` from an idle device to an idle device."""
    was = gc.isenabled()
    gc.disable()
    try:
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        return time.perf_counter() - t0
    finally:
        if was:
            gc.enable()


def measure(call: Callable[[int], Any], *, repeats: int, warmup: int, sync: Callable[[], None],
            prepare: Callable[[int], Any] | None = None, inference: bool = False) -> tuple[dict, float]:
    """Section 1's figures of one variant at one width, the same in the bench process and in
    a compile child: (latency summary of :func:`time_calls`, µs per call of
    :func:`time_pipelined`), both under ``torch.inference_mode(inference)``."""
    with torch.inference_mode(inference):
        lat = time_calls(call, prepare=prepare, repeats=repeats, warmup=warmup, sync=sync)
        pipe = time_pipelined(call, repeats=repeats, warmup=warmup, sync=sync)
    return lat, pipe


def measure_trace(run: Callable[[Any], Any], trace: Trace, passes: int, sync: Callable[[], None]) -> dict:
    """Section 2's figure of one variant: ``run(indices)`` steps through the trace; one
    untimed step per distinct T, then the median of ``passes`` timed whole passes."""
    run(trace.first_of_each_width())
    totals = [time_total(functools.partial(run, range(len(trace.Ts))), sync) for _ in range(passes)]
    total = statistics.median(totals)
    return {"status": "ok", "total_ms": total * 1e3, "mean_step_us": total / len(trace.Ts) * 1e6,
            "passes_ms": [t * 1e3 for t in totals]}


# ----------------------------------------------------------------------------- inputs
class ToyRows:
    """Random valid step rows for a :class:`ToyDecoder`, packed as int64 ``[n_inputs, T]``
    in ``model.inputs()`` order: distinct (sequence, position) pairs within a step,
    positions within ``max_len``, each row's own cell, ``want = 1``, random tokens. Any
    number of repeated steps stays valid (cells are simply rewritten).

    Cells: the first ToyRows of a model reserves every position of every sequence in its
    fresh pool, in sequence order, which lays sequence ``s`` out at cells ``s * span ..``
    (``span`` = the block table's positions): the same layout in every process that builds
    the same model (the compile children step the parent's rows), so packed rows need no
    pool of their own. RuntimeError when the pool was used before in another way."""

    def __init__(self, model: ToyDecoder, seed: int):
        self.specs = model.inputs()
        self.names = list(self.specs)
        self.pads = torch.tensor([int(s.pad) for s in self.specs.values()], dtype=torch.int64)
        self.cfg = model.config
        self.gen = torch.Generator().manual_seed(seed)
        self.span = model.pool.max_blocks * model.pool.block_size
        for s in range(self.cfg.max_seqs):
            if model.cell_range(s, 0, self.cfg.max_len) != list(range(s * self.span, s * self.span + self.cfg.max_len)):
                raise RuntimeError(f"ToyRows: sequence {s} of the model's pool does not sit at cells {s} * "
                                   f"{self.span}: its pool was used before (reset_cache() first)")

    def rows(self, T: int) -> torch.Tensor:
        S, L = self.cfg.max_seqs, self.cfg.max_len
        nseq = min(T, S)
        per = -(-T // nseq)
        if per > L:
            raise ValueError(f"{T} rows do not fit {S} sequences x {L} positions")
        seqs = torch.randperm(S, generator=self.gen)[:nseq]
        base = torch.randint(0, L - per + 1, (nseq,), generator=self.gen)
        i = torch.arange(T)
        seq, pos = seqs[i % nseq], base[i % nseq] + i // nseq
        cols = {"tokens": torch.randint(0, self.cfg.vocab, (T,), generator=self.gen), "positions": pos,
                "seq_ids": seq, "cells": seq * self.span + pos, "want": torch.ones(T, dtype=torch.int64)}
        return torch.stack([cols[n] for n in self.names])

    def padded(self, packed: torch.Tensor, width: int) -> torch.Tensor:
        T = packed.shape[1]
        return torch.cat([packed, self.pads[:, None].expand(-1, width - T)], 1)

    def host(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-input pageable CPU rows: what a Python host runner hands to ``step``."""
        return {n: packed[i].clone() for i, n in enumerate(self.names)}


def pack(tensors: list[torch.Tensor], pin: bool) -> list[torch.Tensor]:
    """Copies of ``tensors`` carved from one (pinned) buffer: one allocation, not thousands."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.int64, pin_memory=pin)
    out, off = [], 0
    for t in tensors:
        v = flat[off:off + t.numel()].view(t.shape)
        v.copy_(t)
        out.append(v)
        off += t.numel()
    return out


class Feed:
    """The best input path a hand-written runner has: a packed, pinned ``[n, W]`` host
    tensor reaches a per-width device buffer in one non-blocking copy; the step reads row
    views of that buffer."""

    def __init__(self, names: list[str], device: torch.device):
        self.names, self.device = names, device
        self._bufs: dict[int, tuple[torch.Tensor, dict[str, torch.Tensor]]] = {}

    def __call__(self, packed: torch.Tensor) -> dict[str, torch.Tensor]:
        W = packed.shape[1]
        if W not in self._bufs:
            with torch.inference_mode(False):  # a normal tensor: written in and out of inference mode
                b = torch.empty((len(self.names), W), dtype=torch.int64, device=self.device)
            self._bufs[W] = (b, {n: b[i] for i, n in enumerate(self.names)})
        buf, views = self._bufs[W]
        buf.copy_(packed, non_blocking=True)
        return views


# ----------------------------------------------------------------------------- bare graphs
@dataclass
class BareGraph:
    """A hand-captured graph of the step at one width over its own static inputs."""

    width: int
    graph: Any
    static: torch.Tensor  # [n_inputs, width] int64 on the device
    outputs: Any


def capture_bare(step_fn: Callable, rows: ToyRows, widths: tuple[int, ...], device: torch.device
                 ) -> tuple[dict[int, BareGraph], float]:
    """torch.cuda.CUDAGraph per width, largest first, one shared pool, warm-up on a side
    stream: the textbook recipe with nothing around it. Returns (graphs, seconds)."""
    t0 = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream(device)
    out: dict[int, BareGraph] = {}
    for w in sorted(widths, reverse=True):
        with torch.inference_mode(False):  # a normal tensor: the bench rewrites it in place
            static = rows.pads[:, None].expand(-1, w).contiguous().to(device)
        views = {n: static[i] for i, n in enumerate(rows.names)}
        with torch.inference_mode():
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    step_fn(views)
            torch.cuda.current_stream(device).wait_stream(side)
            torch.cuda.synchronize(device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                outs = step_fn(views)
            out[w] = BareGraph(w, g, static, outs)
    torch.cuda.synchronize(device)
    return out, time.perf_counter() - t0


# ----------------------------------------------------------------------------- mixed trace
@dataclass
class Trace:
    """The mixed trace: ``Ts[i]`` rows at step i, as the runtime gets them (``host``:
    pageable per-input tensors) and as the hand-written runners get them (``packed``:
    pinned [n, T]; ``padded``: pinned [n, N] at the default width set)."""

    Ts: list[int]
    host: list[dict[str, torch.Tensor]]
    packed: list[torch.Tensor]
    padded: list[torch.Tensor]

    def first_of_each_width(self) -> list[int]:
        seen: dict[int, int] = {}
        for i, T in enumerate(self.Ts):
            seen.setdefault(T, i)
        return sorted(seen.values())


def build_trace(raw: list[torch.Tensor], rows: ToyRows, widths: tuple[int, ...], pin: bool) -> Trace:
    """The trace's views from its packed ``[n, T]`` steps (the bench process and the compile
    children build theirs from the same ``raw``)."""
    return Trace([p.shape[1] for p in raw], [rows.host(p) for p in raw], pack(raw, pin),
                 pack([rows.padded(p, padded_width(p.shape[1], widths)) for p in raw], pin))


def trace_widths(n: int, seed: int, max_width: int = 64) -> list[int]:
    """A serving mix: 70% decode-like 1..8, 22% verification 16..40, 8% 33..max_width."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u = rng.random()
        lo, hi = (1, 8) if u < 0.70 else (16, 40) if u < 0.92 else (33, max_width)
        out.append(rng.randint(lo, min(hi, max_width)))
    return out


def padded_width(T: int, widths: tuple[int, ...]) -> int:
    """The narrowest width of ``widths`` that holds T rows (T <= the widest)."""
    return next(w for w in widths if w >= T)


def step_time_us(model, rt, T: int, repeats: int) -> float:
    """Median per-step time of ``repeats`` back-to-back steps of T decode rows (synchronized
    once per batch of steps), fixed inputs, in microseconds. ``model``: a cell decoder (``config``, ``cell_range``,
    ``cell_for``, ``device``), ``rt`` its runtime. Every row's context (positions 0 to its own) holds
    blocks of its sequence, as a served sequence's does: a position without one would read
    the scratch block, which every such position shares (fewer distinct cells than a real
    context of that length)."""
    sync = sync_fn(model.device)
    S = min(T, model.config.max_seqs)
    seqs = [i % S for i in range(T)]
    pos = [model.config.max_len // 2 + i // S for i in range(T)]
    for s in set(seqs):
        model.cell_range(s, 0, max(p for q, p in zip(seqs, pos) if q == s) + 1)
    kw = dict(tokens=[1] * T, positions=pos, seq_ids=seqs, cells=[model.cell_for(s, p) for s, p in zip(seqs, pos)],
              want=[1] * T)  # every block is taken here, before the timed steps
    for _ in range(3):
        rt.step(**kw)
    times = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(repeats):
            rt.step(**kw)
        sync()
        times.append((time.perf_counter() - t0) / repeats * 1e6)
    return statistics.median(times)
