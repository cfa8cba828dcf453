"""Planted bugs in the core: each test plants one small mutation (as an edit of the source
would, see planting.py) and asserts that a public check catches it. The sweep's own
bug-injection tests (test_sweep.py) break the runtime on purpose to test the harness;
these break the library to test that the suite's checks see what they claim to.

The checks, all public behaviour against an eager reference:

* ``sweep``: ``run_sweep`` on the toy decoder, one repeat (every width once);
* ``host rows``: a runtime with ``HostRows(mode=...)`` on the toy, random steps of one
  sequence (one wider than the dynamic limit: sliced), random rows shipped; the handle's
  indices must be those rows and its rows the eager reference's hidden rows;
* ``spec decode``: the speculative-decoding runner (``SpecRunner``): tokens equal plain
  greedy decoding, the shipped hidden rows equal the reference's.

Each check first passes on the clean core (``test_the_checks_pass_on_the_clean_core``), so
a failure under a plant is the plant's doing. Mutations patch public module attributes
(``widths.plan_step``, ``widths.Slice.padding``, the gather's torch reference in
``kernels.row_gather``, the shared acceptance ``models.accept.greedy_accept``); the one that needs a private core function
(the pad fill) comes last and says so. Random steps are fresh each run; seeds are printed.
"""
from __future__ import annotations

import random

import pytest
import torch

import cudagraph_rt.kernels.row_gather as row_gather
import cudagraph_rt.models.accept as accept
import cudagraph_rt.widths as widths_mod
from cudagraph_rt import GraphRuntime, HostRows, Slice
from cudagraph_rt.models import ToyDecoder
from cudagraph_rt.speculative.runner import Request, SpecRunner, ToyDrafter
from cudagraph_rt.sweep import ToyAdapter, run_sweep
from cudagraph_rt.sweep.checks import Tolerance
from tests.support.planting import plan_one_width_wider, plant
from tests.support.seeds import seeded_rng

TOL = Tolerance.for_dtype(torch.float32)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture
def rng() -> random.Random:
    return seeded_rng("PLANTED_TEST_SEED")


# ----------------------------------------------------------------------------- the checks
def sweep_problems(rng: random.Random) -> list[str]:
    report = run_sweep(ToyAdapter(device="cpu"), repeats=1, seed=rng.randrange(2**31))
    return [m for f in report.failures for m in f.messages]


def host_rows_problems(rng: random.Random, mode: str) -> list[str]:
    """Random chunks of one sequence through a host-row runtime; every shipped row is
    compared with the eager reference. Commit mode takes one-slice steps only."""
    model = ToyDecoder(device="cpu")
    hr = HostRows(source="hidden", mode=mode)
    rt = GraphRuntime(model.step, model.inputs(), graphs=False, device="cpu", host_rows=hr)
    rt.capture()
    L = model.config.max_len - rng.randrange(8)
    tokens = [rng.randrange(model.config.vocab) for _ in range(L)]
    _, ref = model.reference(tokens)
    first = rng.randint(rt.dynamic_limit + 1, L - 10) if mode == "host" else rng.randint(rt.widths[-1] + 1,
                                                                                        rt.dynamic_limit)
    problems, pos = [], 0
    while pos < L:
        T = first if pos == 0 else min(rng.randint(1, 16), L - pos)
        rows = sorted(rng.sample(range(T), rng.randint(1, min(T, rt.dynamic_limit))))  # capacity: more is a CapacityError
        x = dict(tokens=tokens[pos:pos + T], positions=list(range(pos, pos + T)), seq_ids=[0] * T,
                 cells=[model.cell_for(0, p) for p in range(pos, pos + T)], want=[0] * T)
        if mode == "host":
            h = rt.step(rows=rows, **x).host_rows
        else:
            h = rt.commit(rt.step(**x), rows)
        got_rows, got = h.indices().tolist(), h.rows(copy=True)
        h.release()
        if got_rows != rows:
            problems.append(f"step at {pos} (T={T}): shipped rows {got_rows}, asked for {rows}")
        else:
            err, bound = TOL.errors(got, ref[[pos + r for r in rows]])
            bad = [rows[i] for i in (err > bound).nonzero().flatten().tolist()]
            if bad:
                problems.append(f"step at {pos} (T={T}): shipped rows {bad} differ from the reference")
        pos += T
    rt.close()
    return problems


def spec_decode_problems(rng: random.Random) -> list[str]:
    model = ToyDecoder(device="cpu")
    V = model.config.vocab
    reqs = [Request(tuple(rng.randrange(V) for _ in range(rng.randint(1, 30))), rng.randint(4, 16))
            for _ in range(5)]
    runner = SpecRunner(model, ToyDrafter(model, 0.6, rng.randrange(1000)), k=4, graphs=False, record_rows=True)
    runner.submit(reqs)
    try:
        runner.run()
    except Exception as e:  # noqa: BLE001 - a plant may make the runtime refuse: a finding
        return [f"the run raised {type(e).__name__}: {e}"]
    problems = []
    for seq in runner.finished:
        want = model.greedy_generate(list(seq.prompt), seq.max_new)
        if seq.generated != want:
            problems.append(f"sequence {seq.uid}: tokens {seq.generated}, greedy {want}")
            continue
        _, hidden = model.reference(seq.tokens)
        p0 = len(seq.prompt) - 1
        got = torch.cat(seq.rows) if seq.rows else torch.zeros(0, model.hidden_width)
        if got.shape[0] != seq.max_new:
            problems.append(f"sequence {seq.uid}: {got.shape[0]} hidden rows, expected {seq.max_new}")
        elif (lambda e, b: bool((e > b).any()))(*TOL.errors(got, hidden[p0:p0 + seq.max_new])):
            problems.append(f"sequence {seq.uid}: hidden rows differ from the reference")
    if len(runner.finished) != len(reqs):
        problems.append(f"{len(runner.finished)} of {len(reqs)} sequences finished")
    return problems


CHECKS = {
    "sweep": sweep_problems,
    "host rows (host mode)": lambda rng: host_rows_problems(rng, "host"),
    "host rows (commit mode)": lambda rng: host_rows_problems(rng, "commit"),
    "spec decode": spec_decode_problems,
}


@pytest.mark.parametrize("check", list(CHECKS))
def test_the_checks_pass_on_the_clean_core(check, rng):
    assert CHECKS[check](rng) == []


# ----------------------------------------------------------------------------- the plants
def plan_last_slice_one_short(monkeypatch):
    """plan_step's last slice ends one row early (a count off by one): row T-1 never runs."""
    original = widths_mod.plan_step

    def mutant(T, widths, limit, slicing=True):
        out = original(T, widths, limit, slicing)
        s = out[-1]
        if s.length > 1:
            w = s.width if s.path == "graph" else s.length - 1
            out = out[:-1] + (Slice(s.path, w, s.start, s.length - 1),)
        return out
    plant(monkeypatch, widths_mod, "plan_step", mutant)


def gather_leaves_last_row_stale(monkeypatch):
    """The gather (CPU path) reports every row but leaves the last one's slot as it was."""
    original = row_gather.gather_rows_reference

    def mutant(src, rows, count, dst, meta, **kw):
        d = int(kw["dst_slot"].item()) if kw.get("dst_slot") is not None else 0
        n = min(max(int(count.item()), 0), dst.shape[1], rows.shape[0])
        keep = dst[d, n - 1].clone() if n > 0 and 0 <= d < dst.shape[0] else None
        original(src, rows, count, dst, meta, **kw)
        if keep is not None:
            dst[d, n - 1] = keep
    plant(monkeypatch, row_gather, "gather_rows_reference", mutant)


def gather_drops_last_row(monkeypatch):
    """The gather (CPU path) ships one row fewer than it was asked for."""
    original = row_gather.gather_rows_reference

    def mutant(src, rows, count, dst, meta, **kw):
        original(src, rows, (count - 1).clamp_min(0), dst, meta, **kw)
    plant(monkeypatch, row_gather, "gather_rows_reference", mutant)


def accept_count_one_short(monkeypatch):
    """The shared acceptance counts one committed row fewer (the bonus row is lost)."""
    original = accept.greedy_accept

    def mutant(*args, **kw):
        out = original(*args, **kw)
        return {**out, "accept_count": (out["accept_count"] - 1).clamp_min(0)}
    plant(monkeypatch, accept, "greedy_accept", mutant)


def accept_count_one_over(monkeypatch):
    """The shared acceptance counts one row more than it committed."""
    original = accept.greedy_accept

    def mutant(*args, **kw):
        out = original(*args, **kw)
        return {**out, "accept_count": out["accept_count"] + 1}
    plant(monkeypatch, accept, "greedy_accept", mutant)


def padding_count_one_over(monkeypatch):
    """``Slice.padding`` counts one padding row more than the slice has (the runtime's
    ``padding_rows`` counter adds it up)."""
    monkeypatch.setattr(Slice, "padding", property(lambda s: s.width - s.length + 1))


# (plant, the check that must catch it, a word its report must contain)
PLANTS = {
    "plan one width wider": (plan_one_width_wider, "sweep", "slices"),
    "plan's last slice one row short": (plan_last_slice_one_short, "sweep", ""),
    "gather leaves the last row stale (host mode)": (gather_leaves_last_row_stale, "host rows (host mode)",
                                                     "differ from the reference"),
    "gather leaves the last row stale (commit mode)": (gather_leaves_last_row_stale, "host rows (commit mode)",
                                                       "differ from the reference"),
    "gather drops the last row": (gather_drops_last_row, "host rows (host mode)", "shipped rows"),
    "gather drops the last row (spec decode)": (gather_drops_last_row, "spec decode", "sequence"),
    "accept count one short": (accept_count_one_short, "spec decode", "sequence"),
    "accept count one over": (accept_count_one_over, "spec decode", ""),
    "padding count one over": (padding_count_one_over, "sweep", "counters: "),
}


@pytest.mark.parametrize("name", list(PLANTS))
def test_planted_bug_is_caught(name, monkeypatch, rng):
    mutate, check, word = PLANTS[name]
    mutate(monkeypatch)
    problems = CHECKS[check](rng)
    assert problems, f"planted {name!r}: the {check} check saw nothing"
    assert word in "\n".join(problems), problems[:3]


# ----------------------------------------------------------------------------- private
def test_pad_fill_that_does_nothing_is_caught_by_the_sweep(monkeypatch, rng):
    """PRIVATE: the pad fill has no public function to plant in. This patches the arena's
    row writer (``StaticInputs.write`` in ``cudagraph_rt.inputs``) to leave rows past the
    real ones as they were; when the core moves it, move this plant with it (a missing
    attribute fails here, it never skips)."""
    from cudagraph_rt.inputs import StaticInputs

    write = StaticInputs.write
    monkeypatch.setattr(StaticInputs, "write", lambda self, prep, start, length, width, control=None:
                        write(self, prep, start, length, length, control))
    problems = sweep_problems(rng)
    assert any(p.startswith("pad rows:") for p in problems), problems[:3]
