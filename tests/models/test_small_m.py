"""A model's projections through the small-M kernel (cudagraph_rt.models.small_m) against the
unfused model: same outputs, the same parameters, the kernel where M <= 16 and F.linear
past it, one opaque op per projection under torch.compile with a dynamic row dimension.
On a CPU-only box the products run the interpreted kernel (``interpret_on_cpu=True``); on
a GPU machine the same tests run fp32 models on CUDA through the compiled kernel. (The
compiled step on the KV pool: tests/models/test_compiled_step.py's ``*-small`` model.)"""
from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from tests.support.extras import require

require("transformers")

import transformers  # noqa: E402

from cudagraph_rt.errors import InputError  # noqa: E402
from cudagraph_rt.kernels import common  # noqa: E402
from cudagraph_rt.kernels import small_linear as sl  # noqa: E402
from cudagraph_rt.models import hf, small_m  # noqa: E402
from cudagraph_rt.models.compiled import CompiledRows  # noqa: E402
from cudagraph_rt.models.fused import MergedLinear, fuse_projections  # noqa: E402
from tests.support.seeds import seeded_rng  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py
FAMILIES = ("llama", "qwen2", "qwen3")  # qwen2: q/k/v biases; qwen3: q/k norms on the slices
DEV = torch.device("cuda" if common.triton_backend() == "compiled" and torch.cuda.is_available() else "cpu")
TOL = dict(rtol=1e-5, atol=1e-5) if DEV.type == "cpu" else dict(rtol=1e-4, atol=1e-4)  # cuBLAS vs kernel order


@pytest.fixture
def rng():
    return seeded_rng("SMALL_M_TEST_SEED")


@pytest.fixture
def launches(monkeypatch):
    """Counts the kernel's launches (the op's body looks the kernel up at each call)."""
    calls = []
    real = sl.small_linear

    def counted(x, weight, bias=None, out=None, **kw):
        calls.append((tuple(x.shape), tuple(weight.shape)))
        return real(x, weight, bias, out, **kw)
    monkeypatch.setattr(sl, "small_linear", counted)
    return calls


def tiny(family, seed, device=DEV, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = hf.hf_config(family, "tiny")
    return transformers.AutoModelForCausalLM.from_config(cfg).eval().to(device, dtype)


def small_pair(family, seed, fuse=True, **kw):
    """(unfused, copy routed through the kernel, fused first when ``fuse``)."""
    base = tiny(family, seed, **kw)
    model = copy.deepcopy(base)
    if fuse:
        fuse_projections(model)
    small_m.use_small_m_kernel(model, interpret_on_cpu=model.device.type == "cpu")
    return base, model


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_small_m_model_computes_what_the_unfused_does(family, rng, launches):
    """Logits of the model's own forward within fp32 tolerance: through the kernel (four
    launches a layer: q/k/v, o, gate/up, down) at 1..16 tokens, through F.linear past 16."""
    base, model = small_pair(family, rng.randrange(2**31))
    layers = base.config.num_hidden_layers
    for t in (rng.randrange(1, 17), 16, 17, 23):
        ids = torch.tensor([[rng.randrange(512) for _ in range(t)]], device=DEV)
        launches.clear()
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, base(ids).logits, **TOL, msg=f"{t} tokens")
        assert len(launches) == (4 * layers if t <= 16 else 0), f"{t} tokens: {len(launches)} launches"


def test_unfused_projections_are_routed_on_their_own_parameters(rng, launches):
    """Without fusing: the seven projections of a layer become SmallMLinear on the same
    Parameter objects (state_dict unchanged, nothing copied); the head stays nn.Linear."""
    base, model = small_pair("qwen2", rng.randrange(2**31), fuse=False)
    params = {k: p for k, p in copy.deepcopy(model).named_parameters()}
    assert [k for k, _ in model.named_parameters()] == [k for k, _ in base.named_parameters()]
    routed = [m for m in model.modules() if isinstance(m, small_m.SmallMLinear)]
    assert len(routed) == 7 * base.config.num_hidden_layers
    assert type(model.get_output_embeddings()) is nn.Linear
    for (k, a), b in zip(base.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), k
    assert set(params) == {k for k, _ in model.named_parameters()}
    ids = torch.tensor([[rng.randrange(512) for _ in range(5)]], device=DEV)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, **TOL)
    assert len(launches) == 7 * base.config.num_hidden_layers


def test_routing_again_changes_nothing_and_fused_groups_count_once(rng):
    _, model = small_pair("llama", rng.randrange(2**31))
    before = [type(m) for m in model.modules()]
    assert small_m.use_small_m_kernel(model, interpret_on_cpu=DEV.type == "cpu") == 4 * model.config.num_hidden_layers
    assert [type(m) for m in model.modules()] == before
    merged = {id(m.merged) for m in model.modules() if isinstance(m, MergedLinear)}
    assert all(isinstance(m.merged.product, small_m.SmallMProduct) for m in model.modules()
               if isinstance(m, MergedLinear)) and len(merged) == 2 * model.config.num_hidden_layers


def test_fuse_projections_with_the_kernel_and_the_cpu_default(rng, launches):
    """fuse_projections then use_small_m_kernel merges and routes; on a CPU (interpret_on_cpu
    False, the default) every product runs F.linear."""
    base = tiny("qwen3", rng.randrange(2**31), device="cpu")
    model = copy.deepcopy(base)
    assert fuse_projections(model) == 2 * base.config.num_hidden_layers
    small_m.use_small_m_kernel(model)
    assert sum(isinstance(m, small_m.SmallMLinear) for m in model.modules()) == 2 * base.config.num_hidden_layers
    ids = torch.tensor([[rng.randrange(512) for _ in range(6)]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=1e-5, atol=1e-5)
    assert launches == []


def test_interpreting_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(common, "triton_backend", lambda: "compiled")
    model = tiny("llama", 0)
    with pytest.raises(InputError, match="interpret_on_cpu"):
        small_m.use_small_m_kernel(model, interpret_on_cpu=True)
    assert not any(isinstance(m, small_m.SmallMLinear) for m in model.modules())


def test_compiled_projections_are_one_op_each_and_dispatch_on_m_at_run_time(rng, launches):
    """A layer's MLP (merged gate/up, down) compiled with a dynamic row dimension: two op
    calls and no extern mm in the code; widths 3, 9, 20, 2 share one graph, and the
    kernel runs at 3, 9 and 2 rows, F.linear at 20; equal to the unfused MLP."""
    from torch._inductor.utils import run_and_get_code

    base, model = small_pair("llama", rng.randrange(2**31))
    mlp, ref = model.model.layers[0].mlp, base.model.layers[0].mlp
    rows = CompiledRows(lambda x: mlp(x), fullgraph=True)
    widths = (3, 9, 20, 2)
    xs = [torch.randn(w, base.config.hidden_size, device=DEV) for w in widths]

    def run():
        with torch.no_grad():
            return [rows(x) for x in xs]
    ys, code = run_and_get_code(run)
    for w, x, y in zip(widths, xs, ys):
        torch.testing.assert_close(y, ref(x).detach(), **TOL, msg=f"width {w}")
    assert rows.graphs == 1
    src = "\n".join(code)
    assert src.count("torch.ops.cgrt.small_m_linear.default(") == 2
    assert not re.findall(r"extern_kernels\.(?:mm|addmm|bmm)\(", src)
    assert [s[0][0] for s in launches] == [3, 3, 9, 9, 2, 2]


def test_the_op_passes_torch_library_opcheck(rng):
    x, w, b = torch.randn(3, 40), torch.randn(24, 40), torch.randn(24)
    for interpret in (False, True):
        torch.library.opcheck(torch.ops.cgrt.small_m_linear.default, (x, w, b, interpret))
        torch.library.opcheck(torch.ops.cgrt.small_m_linear.default, (x, w, None, interpret))


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_bf16_small_m_model_matches_the_unfused(family, rng):
    """On CUDA in bf16: logits within bf16 matmul tolerance of the unfused model, at
    widths the kernel serves."""
    base, model = small_pair(family, rng.randrange(2**31), device="cuda", dtype=torch.bfloat16)
    for t in (1, 4, 16):
        ids = torch.tensor([[rng.randrange(512) for _ in range(t)]], device="cuda")
        with torch.no_grad():
            a, b = model(ids).logits.float(), base(ids).logits.float()
        torch.testing.assert_close(a, b, rtol=0, atol=3e-2 * b.abs().max().item(), msg=f"{family} {t} tokens")
