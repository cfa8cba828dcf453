"""``DraftModelDrafter`` (``speculative/draft_model.py``): the runner's output with it equals
plain greedy decoding, and every proposal (after rejections rolled its KV back) equals a
fresh run of the draft model's own greedy decoding of the sequence so far."""
from __future__ import annotations

import pytest

from cudagraph_rt import InputError
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.speculative.draft_model import DraftModelDrafter
from cudagraph_rt.speculative.runner import Request, SpecRunner

CFG = ToyConfig.tiny(max_len=48, max_seqs=4)
TARGET = ToyDecoder(CFG, "cpu")


@pytest.fixture(autouse=True)
def _single_thread(one_thread):  # see conftest.py
    yield


class _Checked(DraftModelDrafter):
    """Checks each proposal against the draft model's eager greedy decoding."""

    checked = 0

    def propose(self, seqs, k):
        p = super().propose(seqs, k)
        for s, row in zip(seqs, p.tokens.tolist()):
            assert row == self.draft.greedy_generate(list(s.tokens), k), f"sequence {s.uid} at {len(s.tokens)}"
            self.checked += 1
        return p


@pytest.mark.parametrize("draft_seed, graphs", [(0, False), (1, False), (0, "emulate")])
def test_lossless_and_rollback(draft_seed, graphs):
    """Seed 0: the draft is the target's twin (every draft right); seed 1: another toy
    (most drafts wrong, so nearly every round rolls the draft's KV back)."""
    TARGET.reset_cache()
    draft = ToyDecoder(ToyConfig.tiny(max_len=48, max_seqs=4, seed=draft_seed), "cpu")
    drafter = _Checked(TARGET, draft, k=3, graphs=graphs)
    runner = SpecRunner(TARGET, drafter, k=3, lanes=2, slots=3, graphs=graphs)
    runner.submit([Request((5, 9, 2), 20), Request((100, 3, 77, 4, 8), 14), Request((1,), 17), Request((7, 7), 9)])
    rep = runner.run()
    assert len(runner.finished) == 4 and drafter.checked > 10
    for s in runner.finished:
        assert s.generated == TARGET.greedy_generate(list(s.prompt), s.max_new)
    if draft_seed == 0:
        assert rep.accepted == rep.proposed
    else:
        assert rep.accepted < rep.proposed
    assert not drafter._slot  # every sequence forgotten, its draft sequence id free again
    drafter.close()


def test_bad_draft_models_are_refused_naming_draft():
    with pytest.raises(InputError, match="draft"):
        DraftModelDrafter(TARGET, object())
    with pytest.raises(InputError, match="draft.*vocab"):
        DraftModelDrafter(TARGET, ToyDecoder(ToyConfig.tiny(vocab=144, max_len=48, max_seqs=4), "cpu"))
    with pytest.raises(InputError, match="draft"):
        DraftModelDrafter(TARGET, ToyDecoder(ToyConfig.tiny(max_len=16, max_seqs=4), "cpu"))
    with pytest.raises(InputError, match="k"):
        DraftModelDrafter(TARGET, ToyDecoder(CFG, "cpu"), k=0)


def test_train_drafter_kind_model_writes_a_checkpoint_the_demo_drafts_with(tmp_path):
    pytest.importorskip("transformers")
    from cudagraph_rt import cli
    out = tmp_path / "dm"
    assert cli.main(["train-drafter", "--model", "hf:llama", "--kind", "model", "--steps", "5", "--sequences", "4",
                     "--max-new", "16", "--out", str(out), "--quiet", "--device", "cpu"]) == 0
    assert (out / "config.json").is_file()
    assert cli.main(["demo", "--model", "hf:llama", "--drafter", f"model:{out}", "--device", "cpu", "--sequences", "2",
                     "--max-new", "8", "--graphs", "off", "--quiet"]) == 0
