"""Step plans of a width sweep: which step widths run, in which order, and which rows.

Everything here is a pure function of the seed, the options and the model's sequence
capacity (plus the model's greedy continuation of each prompt), so the same seed gives the
same steps on any machine, in both graph modes, and ``only_step`` can replay a prefix of
them exactly. Nothing here touches a runtime or a device.

A plan teacher-forces every sequence: its tokens are a random prompt followed by the
reference's greedy continuation, fed in consecutive chunks, one chunk per step at most.
Sequence ids are a fixed set of slots (``Capacity.max_seqs``); a sequence that reached its
end (or stopped early, see STOP_EARLY) is retired and a new one (new prompt) takes over its
id and feeds its cells again from position 0 — the reuse that exposes stale-buffer bugs.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Sequence

from ..errors import InputError, expected

# Half of the sequences stop early (a cancelled request, a stop token): after each of their
# steps with this chance, and their id goes to a new sequence at once. Young sequences
# retired this way leave stale rows at low positions that the id's next sequence passes
# within a step or two, so a runtime that replays stale rows is caught within a few dozen
# steps (measured on the toy: without early stops 1 sweep in 6 of one repeat missed it,
# with them 3 in 150; with two repeats none in 150). The other half run to their end, so
# positions up to max_len are still fed.
STOP_EARLY = 1 / 4
WANT_MODES = ("all", "last", "none", "random")  # decode/verify, end of prefill, mid-prefill, mixed


@dataclass(frozen=True)
class Capacity:
    """What a model can hold: ``max_seqs`` sequence ids, ``max_len`` positions each, token
    ids in ``[0, vocab)``. Sequence lengths are drawn from ``[short_len, max_len]``, or
    from ``[min_len, max_len]`` when a wide step needs the room."""

    max_seqs: int
    max_len: int
    vocab: int

    def __post_init__(self) -> None:
        for name in ("max_seqs", "max_len", "vocab"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(expected(f"adapter.capacity.{name}", "a positive int", repr(v)))

    @property
    def min_len(self) -> int:
        """Shortest sequence drawn when a step needs room: half of ``max_len``, so that
        every step width up to ``max_step`` fits once all ids hold fresh sequences."""
        return (self.max_len + 1) // 2

    @property
    def short_len(self) -> int:
        """Shortest sequence drawn when capacity allows: a quarter of ``max_len``."""
        return max(1, self.max_len // 4)

    @property
    def max_step(self) -> int:
        """The widest step a plan can always fill (every id fresh, each at least min_len)."""
        return self.max_seqs * self.min_len


@dataclass(frozen=True)
class SweepOptions:
    """What to sweep. Immutable; checked on construction (InputError names the option).

    ``repeats`` steps of every width ``1..max_width+1`` and of every ``extras`` width, in a
    shuffled order; ``only_step`` replays steps ``[0, only_step)`` unchecked (they are the
    history a failure may depend on: stale rows, reused cells) and checks that one step.
    ``check_pad_rows`` reads the static input rows past T after each step (a direct check
    of the pad fill; turn it off to see that the output comparison catches it too).
    """

    repeats: int = 6
    extras: tuple[int, ...] = (96, 97)
    only_step: int | None = None
    check_pad_rows: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise InputError(expected("repeats", "a positive int", repr(self.repeats)))
        try:
            extras = tuple(self.extras)
        except TypeError:
            raise InputError(expected("extras", "a sequence of positive ints", repr(self.extras))) from None
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in extras):
            raise InputError(expected("extras", "positive ints", repr(extras)))
        object.__setattr__(self, "extras", extras)
        o = self.only_step
        if o is not None and (isinstance(o, bool) or not isinstance(o, int) or o < 0):
            raise InputError(expected("only_step", "None or a step index >= 0", repr(o)))


@dataclass(frozen=True)
class SeqPlan:
    """One occupant of a sequence id: ``tokens`` = prompt + greedy continuation."""

    uid: int
    seq: int
    tokens: tuple[int, ...]
    prompt_len: int


@dataclass(frozen=True)
class Chunk:
    """Consecutive positions ``[start, start + len(tokens))`` of sequence ``uid`` (id ``seq``)
    fed in one step; ``want[i]``: row i asks for its next token."""

    uid: int
    seq: int
    start: int
    tokens: tuple[int, ...]
    want: tuple[bool, ...]

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class StepPlan:
    """Step ``index``: ``T`` rows, the chunks in row order. ``released`` lists the sequence
    ids whose previous occupant was retired just before this step (the adapter's
    ``release`` runs for each before the step; the new occupant starts at position 0)."""

    index: int
    T: int
    chunks: tuple[Chunk, ...]
    released: tuple[int, ...] = ()

    # Per-row columns, in row order: what an adapter turns into step inputs.
    @property
    def seq_ids(self) -> tuple[int, ...]:
        return tuple(c.seq for c in self.chunks for _ in c.tokens)

    @property
    def positions(self) -> tuple[int, ...]:
        return tuple(c.start + i for c in self.chunks for i in range(c.length))

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(t for c in self.chunks for t in c.tokens)

    @property
    def want(self) -> tuple[bool, ...]:
        return tuple(w for c in self.chunks for w in c.want)

    def row(self, i: int) -> tuple[Chunk, int]:
        """The chunk of row ``i`` and the row's position."""
        for c in self.chunks:
            if i < c.length:
                return c, c.start + i
            i -= c.length
        raise IndexError(i)


@dataclass(frozen=True)
class SweepPlan:
    """The steps of one sweep and every sequence they feed (``sequences[uid]``).
    ``order`` is the full shuffled list of step widths, even when only a prefix of the
    steps was built (``only_step``)."""

    seed: int
    order: tuple[int, ...]
    steps: tuple[StepPlan, ...]
    sequences: tuple[SeqPlan, ...]


def step_order(max_width: int, extras: Sequence[int], repeats: int, rng: random.Random) -> tuple[int, ...]:
    """Every width ``1..max_width+1`` and every extra, ``repeats`` times each, shuffled.

    ``max_width + 1`` is the first width past the widest graph (the dynamic path); extras
    reach the dynamic limit and past it (slicing). Extras already in range are not doubled.
    """
    widths = sorted(set(range(1, max_width + 2)) | set(extras))
    order = [t for t in widths for _ in range(repeats)]
    rng.shuffle(order)
    return tuple(order)


Continuation = Callable[[list[int], int], list[int]]


def make_plan(seed: int, max_width: int, options: SweepOptions, capacity: Capacity,
              continuation: Continuation) -> SweepPlan:
    """Build the steps of a sweep (through ``options.only_step`` when set).

    ``continuation(prompt, n)`` returns the ``n`` greedy tokens the reference model appends
    to ``prompt``; it is called once per sequence, in plan order. Raises InputError when a
    step width cannot be filled from ``capacity`` or the continuation is malformed.
    """
    too_wide = [t for t in (max_width + 1, *options.extras) if t > capacity.max_step]
    if too_wide:
        raise InputError(expected(
            "step widths", f"at most {capacity.max_step} rows (max_seqs * max_len/2 of the model: "
            f"{capacity.max_seqs} x {capacity.min_len})", f"{sorted(set(too_wide))}"))
    rng = random.Random(seed)
    order = step_order(max_width, options.extras, options.repeats, rng)
    last = len(order) if options.only_step is None else options.only_step + 1
    if last > len(order):
        raise InputError(expected("only_step", f"a step index in [0, {len(order)})", options.only_step))
    seqs: list[SeqPlan] = []
    live: list[SeqPlan | None] = [None] * capacity.max_seqs
    fed = [0] * capacity.max_seqs
    stop = [0.0] * capacity.max_seqs

    def fresh(s: int, long: bool) -> None:
        n = rng.randint(capacity.min_len if long else capacity.short_len, capacity.max_len)
        p = rng.randint(1, n)
        prompt = [rng.randrange(capacity.vocab) for _ in range(p)]
        cont = _checked(continuation(list(prompt), n - p), n - p, capacity.vocab)
        if live[s] is not None:
            released.append(s)
        live[s] = SeqPlan(len(seqs), s, tuple(prompt + cont), p)
        stop[s] = STOP_EARLY if rng.random() < 0.5 else 0.0  # stop-prone or not
        seqs.append(live[s])
        fed[s] = 0

    def left(s: int) -> int:
        return 0 if live[s] is None else len(live[s].tokens) - fed[s]

    ids = range(capacity.max_seqs)

    def room(renew: list[int]) -> int:  # rows surely available once `renew` get short fresh sequences
        return sum(left(s) for s in ids if s not in renew) + len(renew) * capacity.short_len

    steps = []
    for index, T in enumerate(order[:last]):
        released: list[int] = []  # fresh() appends the ids whose occupant it replaces
        renew = [s for s in ids if left(s) == 0]
        # Too few rows left for T: retire the emptiest early too; if even fresh sequences on
        # every id might not hold T, all get long ones (>= min_len each: T <= max_step fits).
        while room(renew) < T and len(renew) < capacity.max_seqs:
            renew.append(min((s for s in ids if s not in renew), key=left))
        long = room(renew) < T
        for s in renew:
            fresh(s, long)
        chosen = rng.sample(ids, rng.randint(1, min(T, capacity.max_seqs)))
        others = [s for s in ids if s not in chosen]
        rng.shuffle(others)
        while sum(left(s) for s in chosen) < T:
            chosen.append(others.pop())
        chunks = []
        for s, n in zip(chosen, _split(T, [left(s) for s in chosen], rng)):
            mode = rng.choice(WANT_MODES)
            want = tuple(mode == "all" or (mode == "last" and i == n - 1) or (mode == "random" and rng.random() < 0.5)
                         for i in range(n))
            seq = live[s]
            chunks.append(Chunk(seq.uid, s, fed[s], seq.tokens[fed[s]:fed[s] + n], want))
            fed[s] += n
        steps.append(StepPlan(index, T, tuple(chunks), tuple(released)))
        for s in ids:
            if left(s) and rng.random() < stop[s]:
                fed[s] = len(live[s].tokens)  # stops early: retired before the next step
    return SweepPlan(seed, order, tuple(steps), tuple(seqs))


def _split(T: int, caps: list[int], rng: random.Random) -> list[int]:
    """T rows over len(caps) chunks, each in [1, cap]. Skewed random weights give a mix of
    long prefill-like chunks and one-row decode-like ones rather than equal shares."""
    sizes = [1] * len(caps)
    weights = [rng.random() ** 3 + 1e-3 for _ in caps]
    for _ in range(T - len(caps)):
        room = [i for i, c in enumerate(caps) if sizes[i] < c]
        i = rng.choices(room, [weights[i] for i in room])[0]
        sizes[i] += 1
    return sizes


def _checked(cont, n: int, vocab: int) -> list[int]:
    try:
        out = [int(t) for t in cont]
    except (TypeError, ValueError):
        raise InputError(expected("adapter.continuation(prompt, n)", "a list of n token ids", repr(cont))) from None
    if len(out) != n or any(not 0 <= t < vocab for t in out):
        raise InputError(expected("adapter.continuation(prompt, n)", f"{n} token ids in [0, {vocab})", out))
    return out
