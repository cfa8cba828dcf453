"""Every public constructor's and entry point's bad arguments, drawn (issue 35).

One call at a time: a good call of a target (GraphRuntime, InputSpec, HostRows, KVPool,
ToyConfig / ToyDecoder and its references, SpecRunner, the drafters, the kernels'
launchers, host_inputs / device_inputs / static_outputs / static_inputs / plan) with ONE
argument replaced by a drawn value: bools for ints, floats (integral, fractional, NaN,
inf) for ints, numpy scalars, negative, zero and huge values, strings, None, containers,
tensors, devices this machine lacks, wrong dtypes. Either

* it raises InputError / CapacityError whose message names that argument, and nothing
  observable changed (the runtime's StateDigest and stats, the pool's blocks, table and
  caches, a kernel's caches and ``out``), or
* it is accepted, and the value has a plain equivalent of the argument's kind (a numpy
  integer for an int, numpy's bool for a flag, ...) with which the call is accepted too
  and gives the same observable result. A value with no plain equivalent (a bool or a
  float for an int, a string for a device) must be refused.

Any other exception fails. "Huge" is drawn only where no allocation follows from the
value (T, k, chunk, seeds, the pool's cells, ...): a buffer past the machine's memory is
torch's allocation error, not an argument check.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cudagraph_rt import CapacityError, GraphRuntime, Graphs, HostRows, InputError, InputSpec
from cudagraph_rt.kernels import attention as ca
from cudagraph_rt.kernels import common
from cudagraph_rt.kernels import rotary_cells as rc
from cudagraph_rt.models import KVPool, ToyConfig, ToyDecoder
from cudagraph_rt.speculative.device_drafter import DeviceDrafter
from cudagraph_rt.speculative.runner import ReferenceDrafter, Request, SpecRunner, ToyDrafter

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

NONE = object()  # no plain equivalent: the value must be refused
CPU = torch.device("cpu")

# ----------------------------------------------------------------------------- drawn values
NUMPY_INTS = st.builds(lambda t, v: t(v), st.sampled_from([np.int64, np.int32, np.int16, np.uint8]),
                       st.integers(0, 12))
NUMPY_FLOATS = st.builds(lambda t, v: t(v), st.sampled_from([np.float64, np.float32]),
                         st.sampled_from([0.0, 1.0, 0.5, 4.0, -1.0]))
JUNK = st.sampled_from([None, "2", "cpu", [2], (2,), {"a": 1}, torch.tensor(2), torch.tensor([2]), np.array(2),
                        np.array([2]), object(), 2 + 0j, np.True_, np.False_])
FLOATS = st.one_of(st.sampled_from([2.0, 0.5, -1.0, 1e30, float("nan"), float("inf")]),
                   st.floats(-1e3, 1e3, allow_nan=False))
HUGE = st.sampled_from([2**31, 2**63, 10**18, 2**80])
INTS = st.one_of(st.integers(-3, 12), st.booleans(), NUMPY_INTS, FLOATS, JUNK)
INTS_AND_HUGE = st.one_of(INTS, HUGE)
REALS = st.one_of(st.integers(-2, 3), st.floats(-2, 2), st.sampled_from([float("nan"), float("inf"), -0.0]),
                  st.booleans(),
                  NUMPY_FLOATS, NUMPY_INTS, JUNK, HUGE)
FLAGS = st.one_of(st.booleans(), st.sampled_from([np.True_, np.False_, 0, 1, "yes", "", None, 1.0, [True]]))
DEVICES = st.sampled_from(["cpu", CPU, None, "gpu", "cuda:99", 99, "meta", "mps", 1.5, True, "", object(),
                           "cuda", "cuda:0", 0, np.int64(0), torch.device("cuda", 0)])
DTYPES = st.sampled_from([torch.float32, torch.float16, torch.float64, torch.int64, torch.bool, torch.complex64,
                          np.float32, "float32", None, 1])
TOKENS = st.one_of(st.lists(st.integers(0, 127), min_size=1, max_size=5), st.sampled_from([
    [1.5, 2], [1, 2.0], [True, 2], [1, None], (3, np.float64(2.0)), "12", 7, [], [128], [-1, 2],
    np.array([1.0, 2.0]), np.array([[1, 2]]), torch.tensor([1.5]), torch.tensor([True]), torch.tensor(3),
    np.array([1, 2], np.int32), torch.tensor([4, 5]), (np.int64(3), 4), range(2, 5)]))
GRAPHS = st.one_of(FLAGS, st.sampled_from(["emulate", "on", "off", "both", "ON", 2, -1, *Graphs]))
SCALARS = st.one_of(REALS, st.booleans(), st.sampled_from([np.True_, np.int8(-3), np.float16(0.5)]))
CELLS = st.sampled_from([torch.tensor([4, 0, 9]), torch.tensor([4, 0, 9], dtype=torch.int32), torch.tensor([4.0, 0, 9]),
                         torch.tensor([4, 0]), torch.tensor([[4, 0, 9]]), torch.tensor([True, False, True]),
                         torch.tensor([4, 0, 9], dtype=torch.int16), [4, 0, 9], np.array([4, 0, 9]), None])
# a block size for _problem's caches (24 cells, a table of blocks 0..5): one that cuts them in whole
# blocks the table's ids stay inside of, or a partial last block (refused), never a table past them
BLOCK_SIZES = st.one_of(st.integers(-3, 12).filter(lambda b: b not in (6, 8, 12)), st.booleans(), NUMPY_INTS, FLOATS,
                        JUNK)
STRATEGIES = {"int": INTS, "int!": INTS_AND_HUGE, "bs": BLOCK_SIZES, "real": REALS, "flag": FLAGS, "device": DEVICES,
              "dtype": DTYPES, "tokens": TOKENS, "graphs": GRAPHS, "scalar": SCALARS, "cells": CELLS}


def plain(kind: str, v: Any) -> Any:
    """The plain value ``v`` stands for in an argument of ``kind``, or NONE. A kind ending
    in "?" takes None too (an optional argument); "!" draws huge values too."""
    if "?" in kind and v is None:
        return None
    kind = kind.replace("?", "")
    if kind in ("int", "int!", "bs"):
        ok = isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))
        return int(v) if ok else NONE
    if kind == "real":
        ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
        return (v if type(v) in (int, float) else float(v)) if ok and math.isfinite(float(v)) else NONE
    if kind == "flag":
        return bool(v) if isinstance(v, (bool, np.bool_)) else NONE
    if kind == "device":
        if v is None:
            return None
        if isinstance(v, (str, torch.device)) and v != "" and str(v).split(":")[0] == "cpu":
            return v
        if torch.cuda.is_available() and isinstance(v, (str, torch.device, int, np.integer)) \
                and not isinstance(v, bool) and (str(v).startswith("cuda") or isinstance(v, (int, np.integer))):
            return v if int(str(v).rpartition(":")[2] or 0) < torch.cuda.device_count() else NONE
        return NONE
    if kind == "dtype":
        return v if isinstance(v, torch.dtype) else NONE
    if kind == "graphs":  # GraphRuntime's graphs: a Graphs member, its value, True, False (0 and 1 too)
        if isinstance(v, Graphs):  # read back as True, False or "emulate"
            v = v.value
        if isinstance(v, str):
            return {"on": True, "off": False, "emulate": "emulate"}.get(v, NONE)
        return bool(v) if isinstance(v, (bool, np.bool_)) or (type(v) is int and v in (0, 1)) else NONE
    if kind == "scalar":  # a pad: a Python bool, int or float, or a numpy scalar of one
        if isinstance(v, (np.bool_, np.integer, np.floating)):
            return v.item()
        return v if type(v) in (bool, int, float) else NONE
    if kind == "cells":  # a 1-D tensor of int32 or int64 indices, one per row
        ok = isinstance(v, torch.Tensor) and v.dtype in (torch.int32, torch.int64) and v.shape == (3,)
        return v.long() if ok else NONE
    if kind == "tokens":
        if isinstance(v, (np.ndarray, torch.Tensor)):
            integer = v.dtype.kind in "iu" if isinstance(v, np.ndarray) else v.dtype in (torch.int32, torch.int64)
            return [int(t) for t in v.tolist()] if integer and v.ndim == 1 else NONE
        if isinstance(v, (list, tuple, range)) and all(
                isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in v):
            return [int(t) for t in v]
        return NONE
    raise AssertionError(kind)


def same(a, b) -> bool:
    """Equal values of equal types, tensors by dtype, shape and contents (NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


# ----------------------------------------------------------------------------- targets
@dataclass
class Target:
    """``call(kw)`` with ``good()``'s arguments; ``args``: argument -> kind; ``named``:
    argument -> the regex its errors start with (default: the argument's name);
    ``observe(result)``: what must match the plain call's; ``state(kw)``: what a refused
    call must leave as it was (besides the arguments themselves)."""

    call: Callable[[dict], Any]
    good: Callable[[], dict]
    args: dict[str, str]
    named: dict[str, str] = field(default_factory=dict)
    observe: Callable[[Any], Any] = lambda r: None
    state: Callable[[dict], Any] = lambda kw: None


def tensors_of(kw: dict) -> list:
    return [v.clone() for v in kw.values() if isinstance(v, torch.Tensor)]


def drive(target: Target, arg: str, value: Any) -> None:
    """The property, for one argument of one target and one drawn value."""
    kind = target.args[arg]
    kw = target.good()
    kw[arg] = value
    before = target.state(kw)
    try:
        got = target.call(kw)
    except (InputError, CapacityError) as e:
        pattern = target.named.get(arg, rf"^{re.escape(arg)}\b")
        assert re.search(pattern, str(e)), f"{arg}={value!r}: the error does not name {arg}: {e}"
        assert same(before, target.state(kw)), f"{arg}={value!r} was refused after changing state"
        return
    p = plain(kind, value)
    assert p is not NONE, f"{arg}={value!r} accepted: it has no plain equivalent of kind {kind}"
    if same(p, value):
        return  # a plain value of the kind, in range: nothing to compare with
    kw = target.good()
    kw[arg] = p
    try:
        want = target.call(kw)
    except (InputError, CapacityError) as e:
        raise AssertionError(f"{arg}={value!r} accepted, its plain equivalent {p!r} refused: {e}") from None
    assert same(target.observe(got), target.observe(want)), f"{arg}={value!r} does not behave as {p!r}"


def run_target(targets: dict, data) -> None:
    name = data.draw(st.sampled_from(sorted(targets)), label="target")
    target = targets[name]
    arg = data.draw(st.sampled_from(sorted(target.args)), label="argument")
    value = data.draw(STRATEGIES[target.args[arg].replace("?", "")], label="value")
    drive(target, arg, value)


FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- the runtime
def _step(x):
    return {"y": x["a"] * 2, "hidden": x["a"].float()[:, None].repeat(1, 4)}


def _runtime_config(rt) -> tuple:
    c = rt.config
    return (c.widths, c.dynamic_limit, c.slicing, c.graphs, c.device, c.warmup, c.keep_graphs)


RUNTIME = {
    "GraphRuntime": Target(
        call=lambda kw: GraphRuntime(_step, {"a": InputSpec((), torch.int64, 0)}, **kw),
        good=lambda: dict(max_width=8, dynamic_limit=12, warmup=1, device="cpu", graphs=False, slicing=True),
        args=dict(max_width="int", dynamic_limit="int?", warmup="int!", device="device", graphs="graphs",
                  slicing="flag"),
        observe=_runtime_config),
    "InputSpec": Target(
        call=lambda kw: InputSpec(**kw),
        good=lambda: dict(shape=(3,), dtype=torch.float32, pad=0.0),
        args=dict(dtype="dtype", pad="scalar"), named=dict(dtype=r"^InputSpec\.dtype", pad=r"^InputSpec\.pad"),
        observe=lambda s: (s.shape, s.dtype, s.pad)),
    "InputSpec.shape": Target(
        call=lambda kw: InputSpec(shape=(kw["n"],)),
        good=lambda: dict(n=3), args=dict(n="int"), named=dict(n=r"^InputSpec\.shape"),
        observe=lambda s: s.shape),
    "HostRows": Target(
        call=lambda kw: HostRows(**kw),
        good=lambda: dict(capacity=4, depth=3, allow_duplicates=False),
        args=dict(capacity="int?!", depth="int!", allow_duplicates="flag"),
        named={a: rf"^HostRows\.{a}" for a in ("capacity", "depth", "allow_duplicates")},
        observe=lambda h: (h.capacity, h.depth, h.allow_duplicates)),
}


@given(data=st.data())
@FUZZ
def test_runtime_constructors_take_or_refuse_each_argument(data):
    run_target(RUNTIME, data)


class _Handed:
    """A runtime to hand out buffers from (graphs off or emulated), and its digest."""

    def __init__(self, graphs):
        self.rt = GraphRuntime(_step, {"a": InputSpec((), torch.int64, 0)}, max_width=8, dynamic_limit=12,
                               graphs=graphs, device="cpu")
        self.rt.step(a=torch.arange(3))

    def state(self, kw):
        return self.rt.state_digest(), self.rt.stats()


@pytest.mark.parametrize("graphs", [False, "emulate"])
@given(data=st.data())
@FUZZ
def test_handed_buffers_take_or_refuse_each_argument(graphs, data):
    h = _Handed(graphs)
    rt = h.rt
    t_named = r"^(T \(rows in the step\)|host_inputs\(T\)|device_inputs\(T\))"
    views = lambda got: {k: (tuple(v.shape), v.dtype) for k, v in got.items()}  # noqa: E731
    targets = {
        "host_inputs": Target(call=lambda kw: rt.host_inputs(kw["T"], numpy=kw["numpy"]),
                              good=lambda: dict(T=3, numpy=False), args=dict(T="int!", numpy="flag"),
                              named=dict(T=t_named, numpy=r"^host_inputs\(numpy=\)"),
                              observe=lambda got: {k: np.shape(v) for k, v in got.items()}, state=h.state),
        "device_inputs": Target(call=lambda kw: rt.device_inputs(kw["T"]), good=lambda: dict(T=3),
                                args=dict(T="int!"), named=dict(T=t_named), observe=views, state=h.state),
        "static_outputs": Target(call=lambda kw: rt.static_outputs(kw["width"]), good=lambda: dict(width=4),
                                 args=dict(width="int!"), observe=views, state=h.state),
        "static_inputs": Target(call=lambda kw: rt.static_inputs(kw["width"]), good=lambda: dict(width=4),
                                args=dict(width="int!"), observe=views, state=h.state),
        "plan": Target(call=lambda kw: rt.plan(kw["T"]), good=lambda: dict(T=3), args=dict(T="int"),
                       named=dict(T=t_named), observe=lambda p: p, state=h.state),
    }
    if not graphs:
        del targets["static_outputs"]  # graphs off captures no width: every width is refused
    name = data.draw(st.sampled_from(sorted(targets)), label="target")
    target = targets[name]
    arg = data.draw(st.sampled_from(sorted(target.args)), label="argument")
    drive(target, arg, data.draw(STRATEGIES[target.args[arg].replace("?", "")], label="value"))
    rt.step(a=torch.arange(5))  # still usable; any views handed out are used up


# ----------------------------------------------------------------------------- the pool and the toy
def _pool_attrs(p: KVPool) -> tuple:
    try:
        cells = p.cell_range(0, 0, 3)  # the cells it hands out, and their types
    except (InputError, CapacityError) as e:
        cells = str(e)
    return (p.device, p.k.shape, p.k.dtype, p.block_table.shape, p.block_size, p.num_blocks, p.max_seqs,
            p.max_seq_len, p.scratch_cell, p.free_blocks, cells)


MODELS = {
    "KVPool": Target(
        call=lambda kw: KVPool(**kw),
        good=lambda: dict(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device="cpu", cells=16,
                          max_seqs=2, max_seq_len=8, block_size=4),
        args=dict(layers="int", kv_heads="int", head_dim="int", cells="int!", max_seqs="int", max_seq_len="int",
                  block_size="int", dtype="dtype", device="device"),
        named={a: rf"^KVPool\.{a}" for a in ("layers", "kv_heads", "head_dim", "cells", "max_seqs", "max_seq_len",
                                            "block_size", "dtype", "device")},
        observe=_pool_attrs),
    "ToyConfig": Target(
        call=lambda kw: ToyConfig.tiny(**kw),
        good=lambda: dict(vocab=128, hidden=64, layers=2, heads=4, max_seqs=4, max_len=32, seed=3, block_size=8,
                          cells=64, dtype=torch.float32),
        args=dict(vocab="int", hidden="int!", layers="int!", heads="int!", max_seqs="int!", max_len="int!",
                  seed="int!", block_size="int!", cells="int?!", dtype="dtype"),
        named={**{a: rf"^ToyConfig\.{a}" for a in ("vocab", "hidden", "layers", "heads", "max_seqs", "max_len",
                                                   "seed", "block_size", "cells", "dtype")},
               # vocab, hidden and heads share constraints (the codes and a head's width): any may be named
               "vocab": r"^ToyConfig\.(vocab|hidden|heads)", "hidden": r"^ToyConfig\.(hidden|heads)",
               "layers": r"^ToyConfig\.(layers|taps)"},
        observe=lambda c: c),
    "ToyConfig.taps": Target(
        call=lambda kw: ToyConfig.tiny(taps=(0, kw["tap"])), good=lambda: dict(tap=1), args=dict(tap="int!"),
        named=dict(tap=r"^ToyConfig\.taps"), observe=lambda c: c),
}

TOY = ToyDecoder(ToyConfig.tiny(max_seqs=4, max_len=32), "cpu")


def _toy_state(kw) -> tuple:
    p = TOY.pool
    return p.free_blocks, [p.blocks(s) for s in range(p.max_seqs)], p.block_table.clone(), p.k.clone(), p.v.clone()


TOY_CALLS = {
    "ToyDecoder": Target(
        call=lambda kw: ToyDecoder(ToyConfig.tiny(layers=1, taps=(0,), hidden=32, vocab=16), **kw),
        good=lambda: dict(device="cpu"), args=dict(device="device"),
        observe=lambda m: (m.device, m.pool.k.shape, m.wout)),
    "reference": Target(call=lambda kw: TOY.reference(kw["tokens"]), good=lambda: dict(tokens=[1, 2]),
                        args=dict(tokens="tokens"), observe=lambda r: (r[0].tolist(), r[1].tolist()),
                        state=_toy_state),
    "greedy_generate": Target(call=lambda kw: TOY.greedy_generate(kw["prompt"], kw["n"]),
                              good=lambda: dict(prompt=[1, 2], n=2), args=dict(prompt="tokens", n="int!"),
                              named=dict(n=r"^(n|prompt \+ n)\b"), observe=lambda r: r, state=_toy_state),
    "cell_range": Target(call=lambda kw: TOY.cell_range(kw["seq"], kw["pos0"], kw["n"]),
                         good=lambda: dict(seq=3, pos0=0, n=2), args=dict(seq="int!", pos0="int!", n="int!"),
                         named=dict(pos0=r"^pos0\b", n=r"^(n|pos0 \+ n)\b"),
                         observe=lambda cells: [type(c) for c in cells], state=_toy_state),
}


@given(data=st.data())
@FUZZ
def test_pool_and_toy_constructors_take_or_refuse_each_argument(data):
    run_target(MODELS, data)


@given(data=st.data())
@settings(FUZZ, max_examples=150)
def test_toy_entry_points_take_or_refuse_each_argument(data):
    TOY.reset_cache()
    run_target(TOY_CALLS, data)


# ----------------------------------------------------------------------------- the runner and its drafters
RUNNER_MODEL = ToyDecoder(ToyConfig.tiny(max_seqs=4, max_len=24), "cpu")


def _runner_state(kw) -> tuple:
    p = RUNNER_MODEL.pool
    return p.free_blocks, p.block_table.clone()


def _runner_attrs(r: SpecRunner) -> tuple:
    return (r.k, r.chunk, r.record_rows, [ln.cap for ln in r.lanes], [ln.tokens_host.shape for ln in r.lanes],
            r.rt.config.host_rows, r.rt.graphs)


def _run_once(r: SpecRunner):
    r.submit([Request((1, 2, 3), 4)])
    r.run()
    return [s.generated for s in r.finished]


def _drafts(d) -> tuple:
    rule = d.rule
    tables = tuple(list(map(int, t)) for t in (rule.pi_a, rule.pi_b))
    return (d.p, d.seed, getattr(d, "k", None), getattr(d, "depth", None), tables, rule.b, rule.vocab,
            rule.threshold, rule.seed_key)


SPEC = {
    "SpecRunner": Target(
        call=lambda kw: SpecRunner(RUNNER_MODEL, ToyDrafter(RUNNER_MODEL, 0.5, 1), **kw),
        good=lambda: dict(k=2, slots=3, lanes=2, chunk=5, record_rows=False, graphs=False),
        args=dict(k="int!", slots="int?!", lanes="int!", chunk="int!", record_rows="flag", graphs="graphs"),
        named=dict(slots=r"^(slots|lanes: expected an int in \[1, slots = )", k=r"^k\b"),
        observe=_runner_attrs, state=_runner_state),
    "SpecRunner.run": Target(  # a few accepted runs end to end: the same tokens as the plain arguments
        call=lambda kw: _run_once(SpecRunner(RUNNER_MODEL, ToyDrafter(RUNNER_MODEL, 0.5, 1), **kw)),
        good=lambda: dict(k=2, lanes=1), args=dict(k="int", lanes="int"), observe=lambda r: r,
        state=_runner_state),
    "submit": Target(
        call=lambda kw: SpecRunner(RUNNER_MODEL, ToyDrafter(RUNNER_MODEL, 0.5, 1), k=1).submit(
            [Request(kw["prompt"], kw["max_new"])]),
        good=lambda: dict(prompt=(1, 2), max_new=3), args=dict(prompt="tokens", max_new="int!"),
        named=dict(prompt=r"^requests\[0\](\.prompt)?: ", max_new=r"^requests\[0\](\.max_new)?: "),
        observe=lambda uids: uids, state=_runner_state),
    "ToyDrafter": Target(call=lambda kw: ToyDrafter(RUNNER_MODEL, **kw), good=lambda: dict(accept_prob=0.5, seed=1),
                         args=dict(accept_prob="real", seed="int!"), observe=_drafts),
    "ReferenceDrafter": Target(call=lambda kw: ReferenceDrafter(RUNNER_MODEL, **kw),
                               good=lambda: dict(accept_prob=0.5, seed=1), args=dict(accept_prob="real", seed="int!"),
                               observe=lambda d: (d.p, d.seed)),
    "DeviceDrafter": Target(
        call=lambda kw: DeviceDrafter(RUNNER_MODEL, **kw),
        good=lambda: dict(accept_prob=0.5, seed=1, k=2, hidden=8, graphs=False, depth=3),
        args=dict(accept_prob="real", seed="int!", k="int", hidden="int", depth="int!", graphs="graphs"),
        observe=lambda d: (_drafts(d), d._w1.shape, d._w1.tolist(), d.rt.graphs)),
}


@given(data=st.data())
@settings(FUZZ, max_examples=200)
def test_runner_and_drafters_take_or_refuse_each_argument(data):
    RUNNER_MODEL.reset_cache()
    run_target(SPEC, data)


# ----------------------------------------------------------------------------- the kernels' launchers
def _problem(seed=0, bs=4, blocks=6, S=2, MB=2, N=3, Hq=4, Hkv=2, D=16) -> dict:
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(blocks, generator=g)[:S * MB].view(S, MB).int()
    return dict(q=torch.randn(N, Hq, D, generator=g), k_cache=torch.randn(blocks * bs, Hkv, D, generator=g),
                v_cache=torch.randn(blocks * bs, Hkv, D, generator=g), block_table=table,
                seq_ids=torch.tensor([0, 1, -1]), positions=torch.tensor([5, 2, 0]), block_size=bs, scale=0.5,
                out=torch.full((N, Hq, D), float("nan")))


def _attend(fn):
    def call(kw):
        kw = dict(kw)
        return fn(**kw).clone()
    return call


def _planned(kw):
    kw = dict(kw)
    return ca.plan_cell_attention(**kw).run().clone()


def _write_problem() -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(k=torch.randn(3, 2, 16, generator=g), v=torch.randn(3, 2, 16, generator=g),
                k_cache=torch.zeros(12, 2, 16), v_cache=torch.zeros(12, 2, 16), cells=torch.tensor([4, 0, 9]))


def _write(fn):
    def call(kw):
        fn(kw["k"], kw["v"], kw["k_cache"], kw["v_cache"], kw["cells"])
        return kw["k_cache"].clone(), kw["v_cache"].clone()
    return call


ATTENTION_ARGS = dict(block_size="bs", window="int?!", bias_shift="int!", scale="real")
ATTENTION_NAMES = dict(block_size=r"^(block_size|k_cache: expected whole blocks of block_size)\b")
RUNS_KERNEL = common.triton_backend() == "interpreter"  # the Triton launchers on these CPU tensors
KERNELS = {
    "cell_attention": Target(call=_attend(ca.cell_attention), good=_problem, args=dict(ATTENTION_ARGS, splits="int?"),
                             named=ATTENTION_NAMES, observe=lambda o: o, state=tensors_of),
    "cell_attention_reference": Target(call=_attend(ca.cell_attention_reference), good=_problem,
                                       args=dict(ATTENTION_ARGS, dependent="flag"), named=ATTENTION_NAMES,
                                       observe=lambda o: o,
                                       state=tensors_of),
    "write_cells": Target(call=_write(ca.write_cells), good=_write_problem, args=dict(cells="cells"),
                          observe=lambda r: r, state=tensors_of),
    "new_attention_counters": Target(call=lambda kw: ca.new_attention_counters(**kw),
                                     good=lambda: dict(device="cpu", entries=8),
                                     args=dict(device="device", entries="int"),
                                     observe=lambda t: (t.device, t.shape, t.dtype)),
}
if RUNS_KERNEL:  # the Triton launchers (the interpreter on a CPU)
    KERNELS.update({
        "cell_attention_triton": Target(call=_attend(ca.cell_attention_triton), good=_problem,
                                        args=dict(ATTENTION_ARGS, splits="int?", dependent="flag"),
                                        named=ATTENTION_NAMES, observe=lambda o: o, state=tensors_of),
        "plan_cell_attention": Target(call=_planned, good=_problem, args=dict(ATTENTION_ARGS), named=ATTENTION_NAMES,
                                      observe=lambda o: o,
                                      state=tensors_of),
        "write_cells_triton": Target(call=_write(ca.write_cells_triton), good=_write_problem,
                                     args=dict(cells="cells"), observe=lambda r: r, state=tensors_of),
    })


@given(data=st.data())
@settings(FUZZ, max_examples=150)
def test_kernel_launchers_take_or_refuse_each_argument(data):
    run_target(KERNELS, data)


BAD_TENSORS = {  # argument -> ways to spoil it (each must be refused, naming it)
    "q": [lambda t: t.double(), lambda t: t.long(), lambda t: t[0], lambda t: t.tolist(),
          lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)[..., :8]],
    "k_cache": [lambda t: t.double(), lambda t: t.long(), lambda t: t[:, :, :8], lambda t: None],
    "v_cache": [lambda t: t.double(), lambda t: t[:, :1], lambda t: t.unsqueeze(0)],
    "block_table": [lambda t: t.long(), lambda t: t.float(), lambda t: t[0], lambda t: t.t()],
    "seq_ids": [lambda t: t.float(), lambda t: t[:2], lambda t: t.bool(), lambda t: t.tolist(), lambda t: t[None]],
    "positions": [lambda t: t.double(), lambda t: t[:1], lambda t: t.to(torch.int16)],
    "out": [lambda t: t.double(), lambda t: t[:2], lambda t: t.tolist()],
}
TENSOR_LAUNCHERS = {"cell_attention": ca.cell_attention, "cell_attention_reference": ca.cell_attention_reference}
if RUNS_KERNEL:
    TENSOR_LAUNCHERS["cell_attention_triton"] = ca.cell_attention_triton


@given(launcher=st.sampled_from(sorted(TENSOR_LAUNCHERS)), arg=st.sampled_from(sorted(BAD_TENSORS)),
       data=st.data())
@settings(FUZZ, max_examples=80)
def test_kernel_launchers_refuse_wrong_tensors_naming_them(launcher, arg, data):
    kw = _problem()
    spoil = data.draw(st.sampled_from(BAD_TENSORS[arg]), label="spoil")
    kw[arg] = spoil(kw[arg])
    before = tensors_of(kw)
    with pytest.raises(InputError, match=rf"^{arg}: expected"):
        TENSOR_LAUNCHERS[launcher](**kw)
    assert same(before, tensors_of(kw))


ROTARY_SPOILS = {"cos": [lambda t: t.double(), lambda t: t[:, :8], lambda t: t.long()],
                 "q_out": [lambda t: t.double(), lambda t: None, lambda t: t[:1]],
                 "cells": [lambda t: t.float(), lambda t: t[:1], lambda t: t.tolist()],
                 "k": [lambda t: t.double(), lambda t: t[:, :, :8], lambda t: t[:1]]}


@given(arg=st.sampled_from(sorted(ROTARY_SPOILS)), data=st.data())
@settings(FUZZ, max_examples=30)
def test_rotary_write_refuses_wrong_tensors_naming_them(arg, data):
    g = torch.Generator().manual_seed(2)
    kw = dict(q=torch.randn(3, 4, 16, generator=g), k=torch.randn(3, 2, 16, generator=g),
              v=torch.randn(3, 2, 16, generator=g), cos=torch.rand(3, 16, generator=g),
              sin=torch.rand(3, 16, generator=g), k_cache=torch.zeros(12, 2, 16), v_cache=torch.zeros(12, 2, 16),
              cells=torch.tensor([1, 5, 7]), q_out=torch.full((3, 4, 16), float("nan")))
    kw[arg] = data.draw(st.sampled_from(ROTARY_SPOILS[arg]), label="spoil")(kw[arg])
    before = tensors_of(kw)
    with pytest.raises(InputError, match=rf"^{arg}: expected"):
        rc.rotary_write_cells(**kw)
    assert same(before, tensors_of(kw))
