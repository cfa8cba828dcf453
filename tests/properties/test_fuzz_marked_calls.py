"""Stateful fuzz of calls marked ``cudagraph_rt.eager`` (issue 35): what a marked call
writes into its arguments and what it returns, graphs off against ``graphs="emulate"``,
in pieces or in whole graphs, through random step sequences.

Each run draws one step function: its marked call writes some of its arguments in place
(a tensor of a list it was given, overwritten or added to; a column view passed by
keyword), reads an argument made with ``expand()``, returns a fresh tensor and maybe a
host value (an int of ``step_values()``, or a float read from a tensor), and maybe
replaces an entry of a dict it was given. The code after the call reads only those
arguments and outputs. Three runtimes over it: graphs off, emulated in pieces and
emulated in whole graphs (``on_capture_error`` "raise" or "eager"), through steps of 1..20
rows (one graph, dynamic, sliced) and ``recapture()``.

What must hold: a capture refuses exactly what no replay can honour (in pieces: a host
value returned, an argument's entry replaced; in a whole graph: ``step_values()`` read
while it captures), with CaptureError naming the call, or runs those widths eagerly; and
every step's outputs under emulation equal graphs off's bit for bit, and the reference
written out here (integer-valued rows: exact in float32).

Seeds: each run prints what it drew; hypothesis prints the failing rule sequence (and
the ``@reproduce_failure`` blob); ``--hypothesis-seed=N`` replays a run. About 15 s on
two CPU cores.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

import cudagraph_rt
from cudagraph_rt import CaptureError, GraphRuntime, InputSpec

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
WIDTHS = (1, 2, 4, 8)
DYNAMIC = 12  # steps of 9..12 rows run the dynamic path, wider ones are sliced
SPECS = {"x": InputSpec((), torch.float32, 0.0)}
WRITES = ("overwrite", "accumulate", "keyword_view")


def _slice_sums(x: torch.Tensor) -> int:
    return int(x.sum()) if len(x) else 0


def make_step(writes: frozenset, host: str | None, replaces: bool):
    """A step function whose marked call does what was drawn, and its reference
    ``reference(x, slices)`` (``slices``: the step's (start, length) pieces, for the host
    value, which is per slice)."""
    @cudagraph_rt.eager
    def marked(x, outs, mask, extra, *, col):
        if "overwrite" in writes:
            outs[0].copy_(x * 2 + 1)
        if "accumulate" in writes:
            outs[1].add_(x)
        if "keyword_view" in writes:
            col.copy_(x - 1)
        if replaces:
            extra["v"] = x * 4
        fresh = x * 5 + mask.sum(0)
        if host == "step_values":
            return fresh, cudagraph_rt.step_values()
        if host == "host_read":
            return fresh, float(x.sum())
        return fresh, None

    def step(v):
        x = v["x"]
        a = torch.full_like(x, float("nan"))
        b = x * 0 + 3
        buf = torch.stack([torch.full_like(x, float("nan")) if "keyword_view" in writes else x * 0, x], 1)
        extra = {"v": x * 1}
        fresh, value = marked(x, [a, b], (x * 2)[None, :].expand(3, -1), extra, col=buf[:, 0])
        y = fresh + extra["v"] + buf.sum(1)
        if "overwrite" in writes:
            y = y + a * 10
        if "accumulate" in writes:
            y = y + b
        if value is not None:
            y = y + value
        return {"y": y}

    def reference(x: torch.Tensor, slices) -> torch.Tensor:
        y = x * 5 + x * 6 + (x * 4 if replaces else x) + (((x - 1) if "keyword_view" in writes else 0) + x)
        if "overwrite" in writes:
            y = y + (x * 2 + 1) * 10
        if "accumulate" in writes:
            y = y + (x + 3)
        if host is not None:
            y = y + torch.cat([torch.full((n,), float(_slice_sums(x[s:s + n]))) for s, n in slices])
        return y

    return step, reference


# a host value returned and a replaced entry are refused in pieces: drawn less often than
# not, so that most runs replay their pieces
HOSTS = st.integers(0, 5).map(lambda i: ("step_values", "host_read")[i] if i < 2 else None)
SOMETIMES = st.integers(0, 3).map(lambda i: i == 0)


class MarkedCallMachine(RuleBasedStateMachine):
    """Graphs off, emulated in pieces and emulated whole, over one drawn step function;
    see the module docstring."""

    @initialize(writes=st.frozensets(st.sampled_from(WRITES)), host=HOSTS, replaces=SOMETIMES,
                on_error=st.sampled_from(["raise", "eager"]), seed=st.integers(0, 2**31 - 1))
    def build(self, writes, host, replaces, on_error, seed):
        print(f"writes={sorted(writes)} host={host} replaces={replaces} on_error={on_error} seed={seed}")
        self.step_fn, self.reference = make_step(writes, host, replaces)
        self.gen = torch.Generator().manual_seed(seed)
        values = (lambda rows, width: _slice_sums(rows["x"])) if host == "step_values" else None
        self.kw = dict(widths=WIDTHS, dynamic_limit=DYNAMIC, device="cpu", step_values=values)
        self.off = GraphRuntime(self.step_fn, SPECS, graphs=False, **self.kw)
        # what a capture must refuse: in pieces, a host value returned or an entry replaced;
        # in a whole graph (the call inline), step_values() read while it captures
        in_pieces = (r"marked call 1 \(.*marked\) returned (int|float) as output 1" if host is not None else
                     r"marked call 1 \(.*marked\) replaced argument \d+ \(a Tensor\)" if replaces else None)
        whole = r"step_values\(\) was read while a graph captures" if host == "step_values" else None
        self.emulated = [self.emulate(True, on_error, in_pieces), self.emulate(False, on_error, whole)]
        self.steps = 0

    def emulate(self, pieces: bool, on_error: str, refusal: str | None) -> GraphRuntime:
        """The emulated runtime, captured: refused (CaptureError naming the call) where
        ``refusal`` says, then run eagerly; else every width in pieces or whole."""
        rt = GraphRuntime(self.step_fn, SPECS, graphs="emulate", pieces=pieces, on_capture_error=on_error, **self.kw)
        if refusal is not None and on_error == "raise":
            with pytest.raises(CaptureError, match=r"width 8: " + refusal):
                rt.capture()
            rt = GraphRuntime(self.step_fn, SPECS, graphs="emulate", pieces=pieces, on_capture_error="eager",
                              **self.kw)
        rep = rt.capture()
        want = "eager" if refusal is not None else ("pieces" if pieces else "graph")
        assert {w.mode for w in rep.widths} == {want}, [(w.mode, w.error) for w in rep.widths]
        assert all(bool(w.error) == (refusal is not None) for w in rep.widths)
        return rt

    @rule(T=st.one_of(st.integers(1, 8), st.integers(9, DYNAMIC), st.integers(DYNAMIC + 1, 20)))
    def step(self, T):
        x = torch.randint(-20, 21, (T,), generator=self.gen).to(torch.float32)
        a = self.off.step(x=x)
        slices = [(s.start, s.length) for s in a.slices]
        want = self.reference(x, slices)
        assert torch.equal(a.outputs["y"], want), (T, a.outputs["y"], want)
        for rt in self.emulated:
            b = rt.step(x=x)
            assert [(s.start, s.length) for s in b.slices] == slices
            assert torch.equal(b.outputs["y"], want), (T, rt.stats().width_modes, b.outputs["y"], want)
        self.steps += 1

    @precondition(lambda self: self.steps > 0)
    @rule(which=st.sampled_from([0, 1]))
    def recapture(self, which):
        rt = self.emulated[which]
        modes = dict(rt.stats().width_modes)
        rt.recapture()
        assert dict(rt.stats().width_modes) == modes


TestMarkedCallFuzz = MarkedCallMachine.TestCase
TestMarkedCallFuzz.settings = settings(
    max_examples=100, stateful_step_count=12, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow])
