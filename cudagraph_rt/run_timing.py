"""How a runner's run is timed: host time split into named phases (:class:`PhaseClock`),
the steps' device time from CUDA events (:class:`DeviceTimer`), and the run's counters
(:class:`RunReport`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


# Host phases of a run, in the order one lane's turn goes through them (names are the
# runner's own methods and calls): admit = _admit; draft = drafter.propose; build = the
# rows' columns (_build minus drafting); stage = host_inputs + fill, or packing the
# tensors of a sliced step; step = rt.step; queue = the tokens' copy to pinned memory and
# the event behind it; wait = the one wait of a step; read = indices, rows and tokens to
# Python, matching rows to sequences, appending tokens, record_rows copies; observe =
# drafter.observe; retire = handle.release and retiring finished sequences; loop = the
# rest of run() (the lane loop, the report).
PHASES = ("admit", "draft", "build", "stage", "step", "queue", "wait", "read", "observe", "retire", "loop")


class PhaseClock:
    """A stopwatch whose laps are charged to named phases: ``mark(name)`` charges the time
    since the previous mark (or ``start``) to ``name``. Every moment between ``start`` and
    the last mark is charged to exactly one phase, so the phases sum to that span (up to
    float rounding). Costs one ``time.perf_counter`` call and a dict update per mark.
    ``clock`` is injectable (tests use a fake one). One host thread; not reentrant."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self._last = 0.0

    def start(self) -> float:
        """Zero every phase and start the first lap now; returns the start time."""
        self.totals = dict.fromkeys(PHASES, 0.0)
        self._last = self.clock()
        return self._last

    def mark(self, name: str) -> float:
        """Charge the lap since the previous mark to ``name``; returns now."""
        now = self.clock()
        self.totals[name] += now - self._last
        self._last = now
        return now


class DeviceTimer:
    """Device time of the steps of one run: a pair of timing CUDA events recorded around
    each ``rt.step`` on the current stream (the runtime's), read once after the run, never
    per step. Event pairs are pooled and reused by later runs (no allocation once the pool
    is as long as a run). A start event recorded on an idle stream also counts step()'s
    host work before its launch, so the figure is an upper bound of the device's busy
    time by at most that much per step. CUDA only (the runner makes none on a CPU)."""

    def __init__(self):
        self._pool: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._n = 0

    def reset(self) -> None:
        self._n = 0

    def begin(self) -> None:
        if self._n == len(self._pool):
            self._pool.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
        self._pool[self._n][0].record()

    def end(self) -> None:
        self._pool[self._n][1].record()
        self._n += 1

    def seconds(self) -> float | None:
        """Sum of the recorded steps' device time (waits for the last one); None if none."""
        if not self._n:
            return None
        self._pool[self._n - 1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self._pool[:self._n]) / 1e3


@dataclass(frozen=True)
class RunReport:
    """Counters since ``reset_stats`` (``seconds``: the ``run`` call): steps launched,
    tokens generated, accepted
    drafts per verify group (``accept_hist[a]`` groups accepted ``a`` drafts), drafts
    proposed and accepted, committed host rows the drafter consumed.

    Of this ``run`` call only: ``run_steps`` launched; ``phases`` = host seconds per
    phase (:data:`PHASES`; they sum to ``seconds`` up to float rounding, see
    :class:`PhaseClock`); ``device_seconds`` = the steps' device time from CUDA events and
    ``gpu_busy`` = ``device_seconds / seconds`` (both None on a CPU, or when the run
    launched no step)."""

    steps: int
    tokens: int
    seconds: float
    accept_hist: tuple[int, ...]
    proposed: int
    accepted: int
    rows: int
    run_steps: int = 0
    phases: dict[str, float] = field(default_factory=dict, hash=False)
    device_seconds: float | None = None
    gpu_busy: float | None = None

    def phase_us_per_step(self) -> dict[str, float]:
        """Host µs per launched step of this call, per phase (empty when none launched)."""
        if not self.run_steps:
            return {}
        return {name: s * 1e6 / self.run_steps for name, s in self.phases.items()}

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0
