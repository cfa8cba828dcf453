"""Merged q/k/v and gate/up projections (cudagraph_rt.models.fused) against the unfused
model: same outputs, the same parameters on one storage per group, no second copy.
(The compiled step's one matmul per group: tests/models/test_compiled_step.py.)"""
from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from tests.support.extras import require

require("transformers")

import transformers  # noqa: E402

from cudagraph_rt.models import hf  # noqa: E402
from cudagraph_rt.models.fused import MergedLinear, fuse_projections  # noqa: E402
from tests.support.seeds import seeded_rng  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def pair(family, seed):
    """(unfused, fused) copies of one random-init tiny model."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_config(hf.hf_config(family, "tiny")).eval()
    fused = copy.deepcopy(base)
    assert fuse_projections(fused) == 2 * base.config.num_hidden_layers
    return base, fused


def groups(model):
    attn = [(m.q_proj, m.k_proj, m.v_proj) for m in model.modules() if hasattr(m, "q_proj")]
    return attn + [(m.gate_proj, m.up_proj) for m in model.modules() if hasattr(m, "gate_proj")]


@pytest.fixture
def rng():
    return seeded_rng("FUSED_TEST_SEED")


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_fused_model_computes_what_the_unfused_does(family, rng):
    """Logits of the model's own forward within fp32 tolerance; greedy generate() equal
    (in fp64, after ``.to()``, so no near-tie can flip)."""
    base, fused = pair(family, rng.randrange(2**31))
    ids = torch.tensor([[rng.randrange(512) for _ in range(12)]])
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, base(ids).logits, rtol=1e-5, atol=1e-5)
    base, fused = base.double(), fused.double()
    kw = dict(do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    assert torch.equal(fused.generate(ids, **kw), base.generate(ids, **kw))


@pytest.mark.parametrize("family", hf.FAMILIES)
def test_fusing_keeps_the_parameters_on_one_storage_per_group(family, rng):
    """Same names, shapes, values and bytes; each group's members are consecutive rows of
    one storage; the replaced weights are freed; no storage beyond the parameters'."""
    base, fused = pair(family, rng.randrange(2**31))
    assert list(base.state_dict()) == list(fused.state_dict())
    for (k, a), b in zip(base.state_dict().items(), fused.state_dict().values()):
        assert torch.equal(a, b), k
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    assert nbytes(fused) == nbytes(base)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in fused.parameters()}
    assert sum(storages.values()) == nbytes(fused), "a storage holds more than the parameters on it"
    for members in groups(fused):
        assert all(isinstance(m, MergedLinear) for m in members)
        ptr = members[0].weight.untyped_storage().data_ptr()
        row = members[0].weight.element_size() * members[0].in_features
        offset = 0
        for m in members:
            assert m.weight.untyped_storage().data_ptr() == ptr
            assert m.weight.data_ptr() == ptr + offset
            offset += m.out_features * row
    old = weakref.ref(next(m for m in base.modules() if hasattr(m, "q_proj")).q_proj.weight)
    fuse_projections(base)  # base fused in place: its old weights must go
    gc.collect()
    assert old() is None, "a replaced weight is still alive"


def test_load_state_dict_and_to_write_and_move_the_merged_weights(rng):
    """load_state_dict writes through the views into the merged product; .to(dtype) moves
    the merged tensor and keeps the members on it."""
    family = rng.choice(hf.FAMILIES)
    base, fused = pair(family, rng.randrange(2**31))
    new = {k: torch.randn_like(v) * 0.05 for k, v in base.state_dict().items()}
    base.load_state_dict(new)
    fused.load_state_dict(new)
    ids = torch.tensor([[rng.randrange(512) for _ in range(9)]])
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, base(ids).logits, rtol=1e-5, atol=1e-5)
        base, fused = base.double(), fused.double()
        for members in groups(fused):
            assert len({m.weight.untyped_storage().data_ptr() for m in members}) == 1
            assert members[0].merged.weight.dtype == torch.float64
        torch.testing.assert_close(fused(ids).logits, base(ids).logits, rtol=1e-12, atol=1e-12)


def test_a_member_recomputes_for_another_input_or_an_in_place_change(rng):
    """The merged product is shared only for the same tensor at the same version."""
    _, fused = pair("qwen2", rng.randrange(2**31))  # q/k/v with biases
    q, k, v = groups(fused)[0]
    x = torch.randn(3, q.in_features)
    with torch.no_grad():
        torch.testing.assert_close(q(x), F.linear(x, q.weight, q.bias))
        x.add_(1.0)
        torch.testing.assert_close(k(x), F.linear(x, k.weight, k.bias))
        y = torch.randn(2, q.in_features)
        torch.testing.assert_close(v(y), F.linear(y, v.weight, v.bias))
        z = torch.randn(4, q.in_features)
        for m in (k, v, q):  # any order: the first computes, the others take their rows
            torch.testing.assert_close(m(z), F.linear(z, m.weight, m.bias))
    assert q.merged._pending is None, "the product outlived the group's last member"


def test_fusing_again_or_a_model_without_groups_merges_nothing():
    _, fused = pair("llama", 0)
    assert fuse_projections(fused) == 0
    assert fuse_projections(torch.nn.Sequential(torch.nn.Linear(4, 4))) == 0
