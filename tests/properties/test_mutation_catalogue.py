"""The mutation catalogue (tests/mutations/catalogue.py) is well formed and still applies to
the tree: every planted line occurs exactly once where it says, each mutation changes its
line, ids are 1..n. The campaign itself (tests/mutations/run.py) is slow and not run here."""
from __future__ import annotations

import pytest

from tests.mutations.catalogue import CATALOGUE
from tests.mutations.run import locate, mutate_text, parse_only, target_line
from tests.support import ROOT



def test_ids_areas_and_tests_are_well_formed():
    assert [m.id for m in CATALOGUE] == list(range(1, len(CATALOGUE) + 1))
    assert len(CATALOGUE) >= 30 and sum(m.graph_path for m in CATALOGUE) >= 6
    for m in CATALOGUE:
        assert m.area and m.why and m.tests, m.id
        assert m.original.strip() != m.mutated.strip(), m.id
        for t in m.tests:
            assert (ROOT / t).is_file(), (m.id, t)


@pytest.mark.parametrize("m", CATALOGUE, ids=lambda m: f"{m.id}-{m.area}")
def test_each_mutation_applies_to_exactly_one_line(m):
    path = locate(ROOT, m)
    text = path.read_text()
    target_line(text.split("\n"), m)  # ValueError unless exactly once
    mutated = mutate_text(text, m)
    diff = [(a, b) for a, b in zip(text.split("\n"), mutated.split("\n")) if a != b]
    assert len(diff) == 1 and diff[0][1].strip() == m.mutated.strip(), diff
    compile(mutated, str(path), "exec")  # a mutant that does not even parse catches nothing


def test_a_missing_or_repeated_line_is_refused():
    m = CATALOGUE[0]
    with pytest.raises(ValueError, match="found 0 times"):
        target_line(["x = 1"], m)
    with pytest.raises(ValueError, match="found 2 times"):
        target_line([m.original, "  " + m.original], m)
    assert parse_only("3,10-12") == [3, 10, 11, 12]
