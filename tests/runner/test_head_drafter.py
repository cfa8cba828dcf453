"""The draft head (``speculative/head.py``, ``speculative/head_drafter.py``) and its trainer
(``speculative/training.py``, ``cgrt train-drafter``) on the toy: a short training beats an
untrained head, the runner's output with the head equals plain greedy decoding (graphs off
and emulated), a saved head loads back to the same drafts, and bad arguments are refused
naming themselves before anything is built."""
from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from cudagraph_rt import InputError
from cudagraph_rt import cli
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.speculative import training
from cudagraph_rt.speculative.head import DraftHead, load_head, save_head
from cudagraph_rt.speculative.head_drafter import HeadDrafter
from cudagraph_rt.speculative.runner import Request, SpecRunner

CFG = ToyConfig.tiny(max_len=48, max_seqs=4)
MODEL = ToyDecoder(CFG, "cpu")


@pytest.fixture(autouse=True)
def _single_thread(one_thread):  # see conftest.py
    yield


@pytest.fixture(scope="module")
def trained():
    torch.set_num_threads(1)
    corpus = training.collect(MODEL, training.random_requests(CFG, 16, seed=1, max_new=40))
    train, held = corpus.split(0.25)
    head = training.make_head(MODEL, train, seed=0)
    rep = training.train_head(head, MODEL, train, steps=100, batch=128, lr=3e-3, held_out=held, k=3)
    return head, rep, held


def test_training_beats_an_untrained_head(trained):
    """The held-out estimate (greedy, k=3) before training against after; an untrained
    head starts as "the next row is this row", which drafts nothing right."""
    head, rep, held = trained
    assert rep.before[0] < 0.5 and rep.after[0] > 1.5, (rep.before, rep.after)
    fresh = training.make_head(MODEL, hidden=64, seed=0)
    assert training.estimate_acceptance(fresh, MODEL, held, 3)[0] < rep.after[0]
    assert rep.losses[-1] < rep.losses[0] / 4


def test_acceptance_estimate_counts_leading_matches_only():
    """Positions are cumulative: draft j counts only when drafts 1..j all match."""
    corpus = training.collect(MODEL, training.random_requests(CFG, 3, seed=4, max_new=20))
    head = training.make_head(MODEL, hidden=32, seed=3)
    _, per = training.estimate_acceptance(head, MODEL, corpus, 4)
    assert all(a >= b for a, b in zip(per, per[1:]))


@pytest.mark.parametrize("graphs", [False, "emulate"])
def test_runner_output_is_plain_greedy(trained, graphs):
    """Lossless at temperature 0, and the trained head's drafts are mostly taken."""
    head, _, _ = trained
    MODEL.reset_cache()
    drafter = HeadDrafter(MODEL, head, k=3, graphs=graphs)
    runner = SpecRunner(MODEL, drafter, k=3, lanes=2, slots=3, graphs=graphs)
    reqs = [Request((5, 9, 2), 30), Request((100, 3, 77, 4, 8), 20), Request((1,), 25)]
    runner.submit(reqs)
    rep = runner.run()
    for s in runner.finished:
        assert s.generated == MODEL.greedy_generate(list(s.prompt), s.max_new)
    assert len(runner.finished) == 3 and rep.drafter == "head"
    assert rep.mean_accepted > 1.0, rep.acceptance_by_position
    drafter.close()


def test_save_and_load_round_trip(trained, tmp_path):
    head, _, _ = trained
    path = save_head(head, str(tmp_path / "h.pt"))
    back = load_head(path)
    assert json.load(open(path + ".json"))["vocab"] == CFG.vocab
    assert back.cfg == head.cfg
    for k, v in head.state_dict().items():
        assert torch.equal(back.state_dict()[k], v.cpu()), k
    rows = torch.randn(5, MODEL.hidden_width)
    emb = torch.randn(5, CFG.hidden)
    with torch.no_grad():
        assert torch.equal(back(rows, emb), head.cpu()(rows, emb))


def test_bad_heads_are_refused_naming_head(tmp_path):
    with pytest.raises(InputError, match="head"):
        HeadDrafter(MODEL, str(tmp_path / "missing.pt"))
    (tmp_path / "junk.pt").write_bytes(b"not a head")
    with pytest.raises(InputError, match="head"):
        HeadDrafter(MODEL, str(tmp_path / "junk.pt"))
    other = ToyDecoder(ToyConfig.tiny(vocab=144, hidden=64, max_len=48, max_seqs=4), "cpu")
    with pytest.raises(InputError, match="head.*vocab 144"):
        HeadDrafter(other, training.make_head(MODEL, hidden=16))
    with pytest.raises(InputError, match="k"):
        HeadDrafter(MODEL, training.make_head(MODEL, hidden=16), k=0)


def test_train_drafter_command(tmp_path, capsys):
    out = tmp_path / "head.pt"
    rc = cli.main(["train-drafter", "--steps", "30", "--sequences", "6", "--max-new", "24", "--out", str(out),
                   "--json", str(tmp_path / "r.json"), "--quiet", "--device", "cpu"])
    assert rc == 0
    rep = json.load(open(tmp_path / "r.json"))
    assert rep["acceptance_after"]["mean_accepted"] >= rep["acceptance_before"]["mean_accepted"]
    assert "acceptance estimate" in capsys.readouterr().out
    head = load_head(str(out))
    assert isinstance(head, DraftHead) and head.cfg.vocab == 128


@pytest.mark.parametrize("argv, flag", [
    (["--steps", "0"], "--steps"),
    (["--kind", "medusa"], "--kind"),
    (["--out", "/no/such/folder/h.pt"], "--out"),
    (["--plot", "/no/such/folder"], "--plot"),
    (["--model", "hf:gpt9"], "--model"),
])
def test_train_drafter_bad_arguments(argv, flag, tmp_path, capsys):
    base = {"--out": str(tmp_path / "h.pt"), "--steps": "5"}
    for i in range(0, len(argv), 2):
        base[argv[i]] = argv[i + 1]
    assert cli.main(["train-drafter", *[x for kv in base.items() for x in kv]]) == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "h.pt").exists()


def test_drafts_start_from_each_sequences_last_committed_row(trained):
    """Two sequences observed in one CommittedRows (several rows each): each one's drafts
    are the head unrolled from its own last row and last committed token, computed here
    by hand from the reference's hidden rows."""
    from cudagraph_rt.speculative.drafting import CommittedRows
    from cudagraph_rt.speculative.runner import Sequence
    from cudagraph_rt.speculative.target_parts import target_parts

    head, _, _ = trained
    parts = target_parts(MODEL)
    seqs, rows, want = [], [], []
    for uid, prompt in enumerate([[4, 8, 15], [16, 23, 42, 99]]):
        toks = prompt + MODEL.greedy_generate(prompt, 6)
        seqs.append(Sequence(uid, uid, tuple(prompt), 20, toks))
        hidden = MODEL.reference(toks)[1]
        first = len(prompt) - 1
        rows.append(hidden[first:len(toks) - 1])
        row, tok, out = hidden[len(toks) - 2:len(toks) - 1], torch.tensor([toks[-1]]), []
        with torch.no_grad():
            for _ in range(3):
                row = head(row, parts.embed(tok))
                tok = head.draft_ids[(row @ parts.readout_weight[head.draft_ids].T).argmax(-1)]
                out.append(int(tok))
        want.append(out)
    counts = np.array([r.shape[0] for r in rows])
    fed = np.concatenate([np.array(s.tokens[len(s.prompt) - 1:-1]) for s in seqs])
    com = np.concatenate([np.array(s.tokens[len(s.prompt):]) for s in seqs])
    first = np.array([len(s.prompt) - 1 for s in seqs])
    pos = np.concatenate([np.arange(f, f + n) for f, n in zip(first, counts)])
    c = CommittedRows(seqs, first, counts, torch.cat(rows), fed, com, pos, np.repeat(np.arange(2), counts))
    drafter = HeadDrafter(MODEL, head, k=3)
    drafter.observe(c)
    assert drafter.propose(seqs, 3).tokens.tolist() == want
    drafter.close()


def test_the_held_out_loss_is_the_objective_on_windows_not_trained_on(trained):
    """The report's held-out loss: the training objective on the held-out corpus, which a
    head that memorised its windows would show far above its training loss. Here the toy is
    learnable: it falls with training, and a corpus of other prompts scores near it."""
    head, rep, held = trained
    assert rep.held_out_loss is not None and math.isfinite(rep.held_out_loss)
    fresh = training.make_head(MODEL, training.collect(MODEL, training.random_requests(CFG, 4, seed=1, max_new=40)),
                               seed=0)
    untrained = training.train_head(fresh, MODEL, held, steps=1, batch=8, lr=1e-9, held_out=held, k=3)
    assert rep.held_out_loss < untrained.held_out_loss / 2  # training lowered the held-out objective
    other = training.collect(MODEL, training.random_requests(CFG, 8, seed=7, max_new=40))
    again = training.train_head(copy.deepcopy(head), MODEL, other, steps=1, batch=8, lr=1e-9, held_out=other, k=3)
    assert again.held_out_loss < untrained.held_out_loss / 2  # unseen prompts: learned, not memorised
