"""``cgrt bench --sections pieces`` (tools/bench/pieces.py) runs its whole path on a CPU:
the tiny Llama, the runtimes' CUDA graphs replaced by emulated ones (the section itself
needs CUDA). The figures mean nothing here; what is checked is what the H200 run reports:
every T timed in every variant, the pieces per width, the whole graph of the varlen
attention refused at capture, the goals computed, the table printed."""
from __future__ import annotations

import types

import pytest

from tests.support.extras import require

require("transformers")

from cudagraph_rt import GraphRuntime  # noqa: E402
from cudagraph_rt.models import hf  # noqa: E402
from cudagraph_rt.tools.bench import pieces as bench_pieces  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


class _Emulated(GraphRuntime):
    """A GraphRuntime whose ``graphs=True`` means emulated graphs (this CPU has no CUDA)."""

    def __init__(self, *a, graphs=True, **kw):
        super().__init__(*a, graphs="emulate" if graphs is True else graphs, **kw)


def test_the_pieces_section_reports_every_figure(monkeypatch, capsys):
    monkeypatch.setattr(bench_pieces, "GraphRuntime", _Emulated)
    ctx = types.SimpleNamespace(graphs=True, model=hf.build("llama", "tiny", max_seqs=16, max_len=64), repeats=1)
    sec = bench_pieces.sec_pieces(ctx)
    assert sec["status"] == "ok"
    ep, vl = sec["eager_piece"], sec["varlen"]
    assert [r["T"] for r in ep["rows"]] == [r["T"] for r in vl["rows"]] == list(bench_pieces.WIDTHS)
    for r in ep["rows"]:
        assert min(r["pieces_us"], r["whole_us"], r["eager_us"]) > 0
        assert r["pieces_over_whole"] == pytest.approx(r["pieces_us"] / r["whole_us"])
        assert r["eager_over_pieces"] == pytest.approx(r["eager_us"] / r["pieces_us"])
    layers = ctx.model.config.layers
    assert ep["capture"]["pieces"]["pieces"] == {w: layers + 1 for w in bench_pieces.WIDTHS}
    assert ep["capture"]["whole"]["pieces"] == {w: 1 for w in bench_pieces.WIDTHS}
    assert vl["capture"]["pieces"] == {w: layers + 1 for w in bench_pieces.WIDTHS}
    assert "step_values() was read while a graph captures" in vl["whole_graph_capture_error"]
    names = [g[0] for g in bench_pieces.goals(sec)]
    assert len(names) == 3 and all(isinstance(g[1], float) for g in bench_pieces.goals(sec))
    from cudagraph_rt.tools.console import make_console
    bench_pieces.print_section(make_console(), sec)
    out = capsys.readouterr().out
    assert "pieces: step time" in out and "capture varlen in pieces" in out
    assert bench_pieces.sec_pieces(types.SimpleNamespace(graphs=False))["status"] == "skipped"
    assert bench_pieces.goals({"status": "skipped"}) == []
