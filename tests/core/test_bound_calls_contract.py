"""The edges of the bound replays' contract (``cudagraph_rt.eager(fn, bind=...)``, the
kernels' bound launches, ``KVPool.bind_attend``; the main cases are in test_bound_calls.py):
which marking a bind belongs to, nested marked calls, bad binds and bad scratch refused at
capture or bind time, replayed outputs of another shape refused, layers checked. CPU only:
``graphs="emulate"`` replays and the Triton interpreter."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # normally tests/conftest.py's job; must precede triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import cudagraph_rt  # noqa: E402
from cudagraph_rt import CaptureError, CgrtError, GraphRuntime, InputError, InputSpec  # noqa: E402
from cudagraph_rt.kernels import attention as ca  # noqa: E402
from cudagraph_rt.kernels import common  # noqa: E402
from cudagraph_rt.pieces import is_marked  # noqa: E402
from tests.support.extras import kernel_skip  # noqa: E402

NAN = float("nan")


def tripled(x, out):
    return torch.mul(x, 3.0, out=out)


def _binder(log: list, tag: str):
    def bind(x, out):
        def run():
            log.append(tag)
            return torch.mul(x, 3.0, out=out)
        return run
    return bind


def _runtime(marked):
    def step(x):
        h = x["x"] + 1.0
        return {"y": marked(h, torch.empty_like(h)) * 2.0}
    return GraphRuntime(step, {"x": InputSpec((), torch.float32, 0.0)}, widths=(1, 4), graphs="emulate",
                        pieces=True, device="cpu")


def _steps(rt):
    for x in ([1.0], [1.0, 2.0, 3.0]):
        y = rt.step(x=x).outputs["y"]
        assert y.tolist() == [(v + 1.0) * 6.0 for v in x]


# -- a bind belongs to its marking, not to the raw function -----------------------------------
def test_a_marking_without_bind_does_not_inherit_another_markings_bind():
    log: list = []
    cudagraph_rt.eager(tripled, bind=_binder(log, "other"))
    rt = _runtime(cudagraph_rt.eager(tripled))
    rt.capture()
    _steps(rt)
    assert log == [] and not any(c.bound for w in rt.widths for c in rt.graphs_captured[w].calls)


def test_marking_a_function_again_keeps_the_first_markings_bind():
    log: list = []
    first = cudagraph_rt.eager(tripled, bind=_binder(log, "first"))
    cudagraph_rt.eager(tripled, bind=_binder(log, "second"))
    rt = _runtime(first)
    rt.capture()
    _steps(rt)
    assert log == ["first", "first"]


class SlotCall:
    """A callable object that cannot be weakly referenced."""
    __slots__ = ()

    def __call__(self, x, out):
        return tripled(x, out)


class EqCall:
    """A callable object that cannot be hashed (``__eq__`` without ``__hash__``)."""

    def __eq__(self, other):
        return isinstance(other, EqCall)

    def __call__(self, x, out):
        return tripled(x, out)


@pytest.mark.parametrize("make", [SlotCall, EqCall], ids=["no-weakref", "unhashable"])
def test_any_callable_can_be_marked_with_a_bind(make):
    log: list = []
    rt = _runtime(cudagraph_rt.eager(make(), bind=_binder(log, "bound")))
    rt.capture()
    _steps(rt)
    assert log == ["bound", "bound"]
    assert [rt.graphs_captured[w].layout[1] for w in rt.widths] == [f"eager {make.__name__}"] * 2


def test_bind_names_the_marked_function_in_layouts_and_errors():
    rt = _runtime(cudagraph_rt.eager(tripled, bind=_binder([], "bound")))
    rt.capture()
    assert rt.graphs_captured[1].layout == ("piece 1", "eager tripled", "piece 2")


# -- decorator forms and marking a marked function ------------------------------------------
def test_decorator_forms():
    log: list = []

    @cudagraph_rt.eager
    def a(x, out):
        return tripled(x, out)

    @cudagraph_rt.eager()
    def b(x, out):
        return tripled(x, out)

    @cudagraph_rt.eager(bind=_binder(log, "c"))
    def c(x, out):
        return tripled(x, out)

    d = cudagraph_rt.eager(tripled, bind=_binder(log, "d"))
    assert all(is_marked(f) for f in (a, b, c, d))
    for f in (a, b, c, d):
        rt = _runtime(f)
        rt.capture()
        _steps(rt)
    assert log == ["c", "c", "d", "d"]


def test_eager_of_none_is_refused():
    with pytest.raises(InputError, match=r"eager\(fn\): expected a callable, got NoneType"):
        cudagraph_rt.eager(None)


def test_a_bad_bind_is_refused_in_the_decorator_form_too():
    with pytest.raises(InputError, match=r"eager\(bind=\): expected None or a callable, got int"):
        cudagraph_rt.eager(bind=3)


def test_a_bind_added_to_a_marked_function():
    """``eager(eager(f), bind=b)``: one marked call per call (the inner marking runs as a
    plain call inside the outer one), replayed through ``b``."""
    log: list = []
    rt = _runtime(cudagraph_rt.eager(cudagraph_rt.eager(tripled), bind=_binder(log, "outer")))
    rt.capture()
    assert len(rt.graphs_captured[1].calls) == 1
    _steps(rt)
    assert log == ["outer", "outer"]


def test_a_marked_call_inside_a_marked_call_is_a_plain_call():
    inner = cudagraph_rt.eager(tripled)

    @cudagraph_rt.eager
    def outer(x, out):
        return inner(x, out)

    rt = _runtime(outer)
    rt.capture()
    assert rt.graphs_captured[4].layout == ("piece 1", "eager test_a_marked_call_inside_a_marked_call_is_a_plain_call."
                                            "<locals>.outer", "piece 2")
    _steps(rt)


# -- what bind returns ----------------------------------------------------------------------
def test_a_bind_returning_a_non_callable_fails_the_capture():
    rt = _runtime(cudagraph_rt.eager(tripled, bind=lambda x, out: out))
    with pytest.raises(CaptureError, match=r"marked call 1 \(tripled\) raised: InputError: eager\(bind=\) of "
                                           r"tripled: expected a zero-argument callable as its result, got Tensor"):
        rt.capture()


def test_a_bound_call_returning_another_shape_is_refused_not_broadcast():
    def bind(x, out):
        return lambda: torch.zeros(1)  # one element where the call returned x's rows

    rt = _runtime(cudagraph_rt.eager(tripled, bind=bind))
    rt.capture()
    with pytest.raises(CgrtError, match=r"marked call tripled: output 0 is \(1,\) at replay, \(4,\) at capture"):
        rt.step(x=[1.0, 2.0])


# -- the kernels' bound launches ------------------------------------------------------------
def _problem(device="cpu", rows=((0, 9), (1, 5), (-1, 0)), Hq=4, Hkv=2, D=16, bs=4, S=3, MB=6):
    g = torch.Generator().manual_seed(5)
    blocks = S * MB + 2
    table = torch.randperm(blocks, generator=g)[: S * MB].view(S, MB).int()
    k = torch.randn(blocks * bs, Hkv, D, generator=g)
    v = torch.randn(blocks * bs, Hkv, D, generator=g)
    q = torch.randn(len(rows), Hq, D, generator=g)
    seq = torch.tensor([s for s, _ in rows])
    pos = torch.tensor([p for _, p in rows])
    return q, k, v, table, seq, pos


PLAN = ca.AttentionPlan(4, 1, 2, ca.AttentionConfig(tile_n=16, min_chunk=16))  # two splits: the scratch is used
interpreter_only = kernel_skip(common.triton_backend() != "interpreter", "the Triton interpreter")


@interpreter_only
@pytest.mark.parametrize("bad, got", [
    ("small", r"torch.float32 \(23,\) on cpu, torch.float32 \(384,\) on cpu"),
    ("dtype", r"torch.float16 \(24,\) on cpu, torch.float32 \(384,\) on cpu"),
    ("strided", r"torch.float32 \(24,\) on cpu strides \(2,\), torch.float32 \(384,\) on cpu"),
    ("tuple", r"torch.float32 \(24,\) on cpu"),
])
def test_a_bad_shared_scratch_is_refused_at_bind_time(bad, got, monkeypatch):
    monkeypatch.setattr(common, "CPU_RUNS_KERNELS", True)
    q, k, v, table, seq, pos = _problem()

    def scratch(lse, part, dtype):
        if bad == "small":
            return torch.empty(lse - 1), torch.empty(part)
        if bad == "dtype":
            return torch.empty(lse, dtype=torch.float16), torch.empty(part)
        if bad == "strided":
            return torch.empty(2 * lse)[::2], torch.empty(part)
        return torch.empty(lse)
    out = torch.full_like(q, NAN)
    with pytest.raises(InputError, match=r"^scratch: expected two flat contiguous tensors on cpu of at least 24 "
                                         rf"float32 and 384 float32 elements, got {got}$"):
        ca.plan_cell_attention(q, k, v, table, seq, pos, block_size=4, scale=0.3, out=out, plan=PLAN, scratch=scratch)
    assert out.isnan().all()


def test_bind_attend_refuses_a_layer_outside_the_pool():
    from cudagraph_rt.models.pool import KVPool
    pool = KVPool(layers=2, kv_heads=2, head_dim=16, dtype=torch.float32, device="cpu", cells=64, max_seqs=3,
                  max_seq_len=24, block_size=4)
    q = torch.randn(3, 4, 16)
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    seq, pos, cells = torch.tensor([0, 1, -1]), torch.tensor([0, 0, 0]), torch.tensor([0, 4, pool.scratch_cell])
    for layer in (2, -1, 1.0):
        with pytest.raises(InputError, match=r"^layer: expected an int in \[0, 2\)"):
            pool.bind_attend(layer, q, k, v, seq, pos, cells, scale=0.25, out=torch.empty_like(q))
