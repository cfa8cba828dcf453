"""``--drafter`` on ``cgrt demo`` and ``cgrt bench`` (``tools/options.py``): each drafter
serves the demo with its check passing and its acceptance per position reported, and bad
values are refused naming the flag (exit 2) before the run."""
from __future__ import annotations

import json

import pytest

from cudagraph_rt import cli
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.speculative import training
from cudagraph_rt.speculative.head import save_head


@pytest.fixture(autouse=True)
def _single_thread(one_thread):  # see conftest.py
    yield


@pytest.fixture(scope="module")
def head_path(tmp_path_factory):
    model = ToyDecoder(ToyConfig.tiny(), "cpu")
    head = training.make_head(model, hidden=16, seed=0)
    return save_head(head, str(tmp_path_factory.mktemp("h") / "head.pt"))


@pytest.mark.parametrize("drafter", ["ngram", "coin", "head"])
def test_demo_serves_with_each_drafter(drafter, head_path, tmp_path, capsys):
    name = f"head:{head_path}" if drafter == "head" else drafter
    out = tmp_path / "d.json"
    rc = cli.main(["demo", "--drafter", name, "--device", "cpu", "--sequences", "3", "--max-new", "12",
                   "--graphs", "off", "--json", str(out), "--quiet"])
    assert rc == 0
    doc = json.load(open(out))
    run = doc["runs"][0]
    assert doc["config"]["drafter"] == name and run["check"]["ok"]
    assert len(run["acceptance_by_position"]) == 4
    assert all(0.0 <= a <= 1.0 for a in run["acceptance_by_position"])
    assert ("test double" in run["drafter_label"]) == (drafter == "coin")
    assert "mean accepted" in capsys.readouterr().out


@pytest.mark.parametrize("value, says", [
    ("bogus", "ngram | head:PATH"),
    ("head:/no/such/head.pt", "draft head file"),
    ("model:/no/such/folder", "checkpoint folder"),
    ("head:", "ngram | head:PATH"),
])
def test_bad_drafters_are_usage_errors(value, says, capsys):
    assert cli.main(["demo", "--drafter", value, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--drafter" in err and says in err


def test_a_head_of_another_vocabulary_is_refused(head_path, capsys):
    pytest.importorskip("transformers")
    assert cli.main(["demo", "--model", "hf:llama", "--drafter", f"head:{head_path}", "--device", "cpu",
                     "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--drafter" in err and "vocab 512" in err


def test_bench_refuses_a_drafter_for_the_toy(capsys):
    assert cli.main(["bench", "--quick", "--drafter", "ngram"]) == 2
    assert "--drafter" in capsys.readouterr().err
