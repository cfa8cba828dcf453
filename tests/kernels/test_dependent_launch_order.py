"""The programmatic dependent launch's order inside the kernels, program by program, in
the interpreter (CPU): what each program reads and writes before its ``gdc_wait``.

The offline sm_90 compile (tests/support/compile_cell_attention.py) checks that the PTX
text has its wait before the first store; that cannot see a wait under the wrong
condition (the stores of a program that skipped the wait still come after the wait's
block in the text). Here the interpreter runs every program of real launches with
``PDL=True`` and records, per program, each load, store and atomic (which tensor it
touches) and the wait: before its wait a program may read only ``seq_ids`` and
``positions`` (the launch before it may still be writing anything else); a program that
writes anything or reads anything else must have waited first.
"""
import contextlib
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudagraph_rt.kernels import attention as ca
from cudagraph_rt.kernels import common
from cudagraph_rt.kernels.attention import launch as ca_launch
from cudagraph_rt.kernels import rotary_cells as rc
from tests.support.extras import kernel_skip
from tests.support.step_rows import draw_step_rows

pytestmark = kernel_skip(common.triton_backend() != "interpreter", "the interpreter's trace (CPU)")


@contextlib.contextmanager
def traced(named: dict):
    """Record (program, event, tensor name) for every load, store, atomic and GDC call of
    the interpreted kernels run inside; ``named``: name -> tensor (the launch's buffers)."""
    from triton.runtime import interpreter as it

    B = it.InterpreterBuilder
    ranges = []
    for name, t in named.items():
        s = t.untyped_storage()
        ranges.append((s.data_ptr(), s.data_ptr() + s.nbytes(), name))
    events: list[tuple] = []

    def where(ptrs, mask) -> set:
        addrs = ptrs.data[mask.data] if mask is not None else ptrs.data.ravel()
        out = set()
        for a in set(int(x) for x in addrs.ravel()):
            hit = [n for lo, hi, n in ranges if lo <= a < hi]
            out.add(hit[0] if hit else f"unknown {a:#x}")
        return out

    def log(kind, names):
        b = it.interpreter_builder
        for n in names:
            events.append((b.grid_idx, kind, n))

    saved = {k: getattr(B, k) for k in ("create_masked_load", "create_masked_store", "create_atomic_rmw",
                                        "create_atomic_cas")}

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        log("load", where(ptrs, mask))
        return saved["create_masked_load"](self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        log("store", where(ptrs, mask))
        return saved["create_masked_store"](self, ptrs, value, mask, cache_policy)

    def atomic_rmw(self, op, ptr, val, mask, sem, scope):
        log("atomic", where(ptr, mask))
        return saved["create_atomic_rmw"](self, op, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        log("atomic", where(ptr, None))
        return saved["create_atomic_cas"](self, ptr, cmp, val, sem, scope)

    B.create_masked_load, B.create_masked_store = masked_load, masked_store
    B.create_atomic_rmw, B.create_atomic_cas = atomic_rmw, atomic_cas
    import triton.language.extra.cuda as cuda  # the interpreter runs these as plain calls: log them

    gdc = (cuda.gdc_wait, cuda.gdc_launch_dependents)
    cuda.gdc_wait = lambda *a, **kw: log("wait", ["-"])
    cuda.gdc_launch_dependents = lambda *a, **kw: log("trigger", ["-"])
    try:
        yield events
    finally:
        cuda.gdc_wait, cuda.gdc_launch_dependents = gdc
        for k, f in saved.items():
            setattr(B, k, f)


def per_program(events):
    progs: dict = {}
    for g, kind, name in events:
        progs.setdefault(g, []).append((kind, name))
    return progs


def check_order(events, early_ok: set):
    """Every program: before its first wait, loads of ``early_ok`` only; no store or atomic
    before it. Returns the programs and whether each waited."""
    progs = per_program(events)
    assert not any(n.startswith("unknown") for _, _, n in events), "an access outside the launch's buffers"
    waited = {}
    for g, evs in progs.items():
        kinds = [k for k, _ in evs]
        w = kinds.index("wait") if "wait" in kinds else len(evs)
        early = evs[:w]
        bad = [(k, n) for k, n in early if k != "load" or n not in early_ok]
        assert not bad, f"program {g}: {bad} before its griddepcontrol.wait"
        waited[g] = w < len(evs)
    return progs, waited


def dependent_attention(monkeypatch, pb_args, *, out, plan, **kw):
    # The pool's launch as on Hopper: dependent=True puts PDL=True in the launch (the
    # CPU's _launch_options is empty: here it passes the constexpr as CUDA's does).
    monkeypatch.setattr(ca_launch, "_launch_options",
                        lambda config, device, dependent=False: {"PDL": bool(dependent)})
    return ca.cell_attention_triton(*pb_args, out=out, plan=plan, dependent=True, **kw)


def problem(rng, rows, S=4, MB=8, bs=4, Hq=4, Hkv=2, D=16):
    blocks = S * MB + 2
    table = torch.randperm(blocks, generator=torch.Generator().manual_seed(rng.randrange(2**31)))[: S * MB]
    block_table = table.view(S, MB).int().clone()
    k = torch.randn(blocks * bs, Hkv, D)
    v = torch.randn(blocks * bs, Hkv, D)
    seq_ids = torch.tensor([s for s, _ in rows], dtype=torch.int64)
    positions = torch.tensor([p for _, p in rows], dtype=torch.int64)
    q = torch.randn(len(rows), Hq, D)
    return q, k, v, block_table, seq_ids, positions


CASES = [  # (rows (seq, pos), plan): decode rows, padding, a verify tile, ids past the table, idle splits
    ([(0, 9), (1, 30), (-1, 0), (2, 3)], dict(rows=2, programs=1, splits=4)),
    ([(0, 20), (0, 21), (0, 22), (-1, 0)], dict(rows=4, programs=1, splits=4)),
    ([(0, 5), (1, 31), (2, 0), (3, 12), (9, 4), (-1, 0)], dict(rows=4, programs=2, splits=3)),
    ([(1, 31)], dict(rows=1, programs=1, splits=8, min_chunk=16)),
    ([(0, 2), (1, 3)], dict(rows=2, programs=2, splits=1)),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_attention_program_waits_before_it_writes_or_reads_the_step(monkeypatch, case):
    rows, plan_kw = CASES[case]
    check_dependent_attention(monkeypatch, random.Random(case), rows, plan_kw)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_steps_keep_the_order_of_a_dependent_attention(monkeypatch, data):
    """The same per-program order on random steps: up to 6 rows of up to 4 sequences (runs
    of positions, padding, ids past the table), tiles of 1 to 4 rows served by 1 to R
    programs, 1 to 8 splits, short or long chunks."""
    rows = draw_step_rows(data, max_rows=6, max_seq=4)  # sequence 4: past the table
    R = data.draw(st.sampled_from([1, 2, 4]), label="rows per tile")
    plan_kw = dict(rows=R, programs=data.draw(st.integers(1, R), label="programs"),
                   splits=data.draw(st.integers(1, 8), label="splits"),
                   min_chunk=data.draw(st.sampled_from([1, 16]), label="min_chunk"),
                   short_n=data.draw(st.sampled_from([16, 256]), label="short_n"))
    check_dependent_attention(monkeypatch, random.Random(data.draw(st.integers(0, 2**31 - 1), label="seed")), rows,
                              plan_kw)
    monkeypatch.undo()


def check_dependent_attention(monkeypatch, rng, rows, plan_kw):
    """One dependent launch traced: the plain launch's bits, counters back at zero, and no
    program touching more than its rows before its wait."""
    from tests.kernels.test_cell_attention import small

    args = problem(rng, rows)
    q, k, v, bt, seq_ids, positions = args
    plan = small(**plan_kw)
    out = torch.full_like(q, float("nan"))
    counters = ca.new_attention_counters("cpu")
    N, Hq, D = q.shape
    pm = torch.full((N, Hq, plan.splits), float("nan"))
    pacc = torch.full((N, Hq, plan.splits, D), float("nan"))
    # the split scratch as the launcher would allocate it, named for the trace
    monkeypatch.setattr(ca_launch, "_split_scratch",
                        lambda *a, **kw: (pm, pacc, counters) if plan.splits > 1 else (out, out, out))
    named = dict(q=q, k=k, v=v, block_table=bt, seq_ids=seq_ids, positions=positions, out=out, counters=counters,
                 pm=pm, pacc=pacc)
    with traced(named) as events:
        dependent_attention(monkeypatch, args, out=out, plan=plan, block_size=4, scale=0.25, counters=counters)
    want = torch.full_like(q, float("nan"))
    monkeypatch.undo()  # the plain launch (PDL=False, the launcher's own scratch) computes the same bits
    ca.cell_attention_triton(*args, out=want, plan=plan, block_size=4, scale=0.25, counters=counters)
    assert torch.equal(out, want)
    assert not counters.any()
    progs, waited = check_order(events, {"seq_ids", "positions"})
    for g, evs in progs.items():
        touches = {(kd, n) for kd, n in evs if kd != "wait"}
        step_work = {x for x in touches if x[0] != "load" or x[1] not in ("seq_ids", "positions")}
        if step_work:
            assert waited[g], f"program {g} touched {sorted(step_work)} and never waited"
    assert any(waited.values()), "some program of every launch waits (the next launch's transitivity)"


@pytest.mark.parametrize("rows", [1, 5])
def test_the_rotary_write_waits_before_any_access_and_triggers_after(monkeypatch, rows):
    N, Hq, Hkv, D, cells_n = rows, 4, 2, 16, 64
    q, k, v = torch.randn(N, Hq, D), torch.randn(N, Hkv, D), torch.randn(N, Hkv, D)
    cos, sin = torch.rand(N, D), torch.rand(N, D)
    kc, vc = torch.zeros(cells_n, Hkv, D), torch.zeros(cells_n, Hkv, D)
    cells = torch.randperm(cells_n)[:N]
    q_out = torch.empty_like(q)
    named = dict(q=q, k=k, v=v, cos=cos, sin=sin, kc=kc, vc=vc, cells=cells, q_out=q_out)
    with traced(named) as events:
        rc._rotary_write_kernel[(N,)](*rc._args(q, k, v, cos, sin, kc, vc, cells, q_out), **rc._meta(Hq, Hkv, D),
                                      PDL=True)
    progs, waited = check_order(events, set())
    assert len(progs) == N and all(waited.values())
    for evs in progs.values():
        kinds = [kd for kd, _ in evs]
        assert kinds[:2] == ["wait", "trigger"]


def test_launch_pdl_is_named_only_for_a_dependent_launch(monkeypatch):
    """Triton's ``launch_pdl`` option only where the launch is a dependent one: a Triton
    without the option (torch 2.6's 3.2) raises KeyError for the keyword even when False,
    so naming it on every CUDA launch broke every attention there. The kernel's own ``PDL``
    constexpr is always named (the bound launch's direct path needs every constexpr)."""
    cfg = ca.plan_attention(8, 32, 8, 64).config
    cuda = torch.device("cuda", 0)
    plain = ca_launch._launch_options(cfg, cuda, dependent=False)
    assert "launch_pdl" not in plain and plain["PDL"] is False
    monkeypatch.setattr(common, "pdl_launch", lambda device: False)  # not Hopper, or no gdc in this Triton
    off = ca_launch._launch_options(cfg, cuda, dependent=True)
    assert "launch_pdl" not in off and off["PDL"] is False
    monkeypatch.setattr(common, "pdl_launch", lambda device: True)
    on = ca_launch._launch_options(cfg, cuda, dependent=True)
    assert on["launch_pdl"] is True and on["PDL"] is True
    assert ca_launch._launch_options(cfg, torch.device("cpu"), dependent=True) == {}
