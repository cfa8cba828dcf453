"""Prompt lookup (``speculative/ngram.py``): its drafts against a plain-Python reference (fixed
cases and a hypothesis property), its arguments, and the runner's output with it equal to
plain greedy decoding (lossless at temperature 0)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cudagraph_rt import InputError
from cudagraph_rt.models import ToyConfig, ToyDecoder
from cudagraph_rt.speculative.ngram import NgramDrafter, ngram_drafts
from cudagraph_rt.speculative.proposal import Proposal
from cudagraph_rt.speculative.runner import Request, Sequence, SpecRunner

MODEL = ToyDecoder(ToyConfig.tiny(max_len=48, max_seqs=4), "cpu")


@pytest.fixture(autouse=True)
def _single_thread(one_thread):  # see conftest.py
    yield


def reference(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Prompt lookup written the obvious way: the longest n first, the latest earlier
    occurrence of the last n tokens, then copy token by token (the copy may run into the
    drafts themselves); no match: the last token k times."""
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        tail = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == tail:
                ext = list(tokens)
                for j in range(k):
                    ext.append(ext[i + n + j])
                return ext[len(tokens):]
    return [tokens[-1]] * k


@pytest.mark.parametrize("tokens, k, want", [
    ([1, 2, 3, 1, 2], 3, [3, 1, 2]),          # "1 2" seen at 0: copy 3, then the copy runs on
    ([5, 6, 7, 9, 6, 7], 2, [9, 6]),          # the longest match (6 7), not the last token's
    ([1, 2, 3, 4], 2, [4, 4]),                # no match: the fallback
    ([7], 3, [7, 7, 7]),                      # one token: nothing to match
    ([4, 4, 4], 3, [4, 4, 4]),                # a run: the latest earlier occurrence
    ([1, 2, 9, 1, 2, 8, 1, 2], 2, [8, 1]),    # the latest occurrence, not the first
])
def test_drafts_of_fixed_sequences(tokens, k, want):
    assert ngram_drafts(tokens, k, 3, 1) == want == reference(tokens, k, 3, 1)


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), min_size=1, max_size=40), k=st.integers(0, 6),
       n_max=st.integers(1, 5), n_min=st.integers(1, 5))
def test_drafts_equal_the_reference(tokens, k, n_max, n_min):
    """Random short-alphabet sequences (many repeats, many partial matches)."""
    n_min = min(n_min, n_max)
    assert ngram_drafts(tokens, k, n_max, n_min) == reference(tokens, k, n_max, n_min)


def test_propose_is_a_deterministic_proposal_per_sequence():
    d = NgramDrafter(n_max=2)
    seqs = [Sequence(0, 0, (1, 2), 8, [1, 2, 3, 1, 2]), Sequence(1, 1, (9,), 8, [9])]
    p = d.propose(seqs, 3)
    assert isinstance(p, Proposal) and p.q is None
    assert p.tokens.tolist() == [[3, 1, 2], [9, 9, 9]] and p.tokens.dtype.name == "int64"


@pytest.mark.parametrize("kw, name", [({"n_max": 0}, "n_max"), ({"n_min": 0}, "n_min"),
                                      ({"n_max": 2, "n_min": 3}, "n_min"), ({"n_max": 2.0}, "n_max")])
def test_bad_arguments_name_themselves(kw, name):
    with pytest.raises(InputError, match=name):
        NgramDrafter(**kw)


@pytest.mark.parametrize("k", [1, 4])
def test_runner_output_is_plain_greedy(k):
    """Lossless: whatever prompt lookup drafts, the served tokens are greedy decoding's.
    The first prompt holds its own greedy continuation (P, greedy(P), P), so lookup is
    right there: accepted > 0 shows the drafts are used, not only ignored."""
    MODEL.reset_cache()
    p = [3, 4, 5, 9]
    echo = tuple(p + MODEL.greedy_generate(p, 12) + p)
    reqs = [Request(echo, 12), Request((7, 1), 25), Request(tuple(range(10, 20)), 20)]
    runner = SpecRunner(MODEL, NgramDrafter(), k=k, lanes=2, slots=3)
    runner.submit(reqs)
    rep = runner.run()
    assert len(runner.finished) == 3
    for s in runner.finished:
        assert s.generated == MODEL.greedy_generate(list(s.prompt), s.max_new)
    assert rep.accepted > 0 and rep.drafter == "ngram"
    assert len(rep.acceptance_by_position) == k and rep.proposed_at[0] > 0
