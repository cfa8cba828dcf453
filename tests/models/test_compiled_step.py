"""A compiled step keeps the KV pool out of inductor's graphs (issue 24).

The attention with its K/V write is one opaque op (``cudagraph_rt.models.attention_op``)
that fetches the pool by id, so the compiled code never holds the pool as a tensor and
never copies it. Each model below runs the same steps (widths 18, 9, 1, 2, 4, 1, 3, a
padding row included, fresh random tokens) eagerly and compiled, from identical poisoned
pools; the compiled code is read back from inductor (``run_and_get_code``).

* ``plain-in-graph`` is the regression the op prevents: the pool's ``index_copy_`` traced
  into the graph. Inductor then takes the pool as a graph input and writes a whole copy
  of each layer's cache per step; the no-copy test must fail on it (strict xfail).
* ``hfdecoder-*`` run unchanged against the real HFDecoder once it sits on the paged
  KVPool with the op wired in (skipped until then).

Compile time on a 2-CPU box, cold inductor cache: about 45 s for the whole file (plain
models about 10 s each, the transformers stand-ins 10-15 s each); a warm cache, 15 s.
COMPILE_TEST_SEED=<n> replays a run's inputs.
"""
from __future__ import annotations

import gc
import re
from dataclasses import dataclass, field

import pytest
import torch

from cudagraph_rt import GraphRuntime
from cudagraph_rt.models import attention_op
from cudagraph_rt.models.compiled import CompiledRows
from tests.support.compile_stand_ins import HFStandIn, PlainDecoder, StandInPool
from tests.support.extras import needs, require
from tests.support.seeds import seeded_rng



# ------------------------------------------------------------------------------ models
def _hf_stand_in(family, fuse, small_m=False, **config):
    def make(seed):
        require("transformers")
        return HFStandIn(family, seed=seed, fuse=fuse, small_m=small_m, **config)
    return make


def _hf_decoder(family, fuse):
    """The real HFDecoder (same weights for the same seed), once it has a KVPool."""
    def make(seed):
        require("transformers")
        from cudagraph_rt.models import hf
        m = hf.build(family, "tiny", seed=seed, max_seqs=4, max_len=64)
        if not callable(getattr(getattr(m, "pool", None), "attend", None)):
            pytest.skip("HFDecoder is not on the paged KVPool yet (issue 23)")
        if fuse:
            from cudagraph_rt.models.fused import fuse_projections
            fuse_projections(m.model)
        return m
    return make


FACTORIES = {
    "plain": lambda seed: PlainDecoder(seed=seed),
    "plain-in-graph": lambda seed: PlainDecoder(seed=seed, in_graph=True),
    # one transformers stand-in for every feature (compile time): Qwen3's q/k norms after
    # the projections, with Qwen2's q/k/v biases and a sliding second layer
    "hf-qwen3-fused": _hf_stand_in("qwen3", True, attention_bias=True, use_sliding_window=True,
                                   sliding_window=16, max_window_layers=1),
    # the same with every projection through the small-M kernel (interpreted on the CPU)
    "hf-qwen3-fused-small": _hf_stand_in("qwen3", True, small_m=True, attention_bias=True, use_sliding_window=True,
                                         sliding_window=16, max_window_layers=1),
    "hfdecoder-llama": _hf_decoder("llama", False),
    "hfdecoder-qwen2-fused": _hf_decoder("qwen2", True),
}
THROUGH_THE_OP = [n for n in FACTORIES if n != "plain-in-graph"]
FUSED = [n for n in FACTORIES if n.endswith("-fused")]
SMALL_M = [n for n in FACTORIES if n.endswith("-small")]


# ------------------------------------------------------------------------------ one run
@dataclass
class Run:
    """Eager and compiled outputs of the same steps, the compiled code, the pools."""

    seed: int
    eager: object
    compiled: object
    rows: CompiledRows
    steps: list = field(default_factory=list)  # (inputs, eager outputs, compiled outputs)
    code: list = field(default_factory=list)
    pool_ptrs: tuple = ()


def schedule(rng):
    """(seq, first position, rows) chunks per step; seq -1 is a padding row."""
    return [[(0, 0, 18)], [(1, 0, 5), (2, 0, 3), (0, 18, 1)], [(0, 19, 1)], [(1, 5, 1), (2, 3, 1)],
            [(2, 4, 4)], [(0, 20, 1)], [(1, 6, 1), (2, 8, 1), (-1, 0, 1)]]


def step_inputs(model, chunks, rng):
    cols = dict(tokens=[], positions=[], seq_ids=[], cells=[], want=[])
    for seq, p0, n in chunks:
        for p in range(p0, p0 + n):
            pad = seq < 0
            cols["tokens"].append(0 if pad else rng.randrange(512))
            cols["positions"].append(0 if pad else p)
            cols["seq_ids"].append(seq)
            cols["cells"].append(model.pool.scratch_cell if pad else model.cell_for(seq, p))
            cols["want"].append(0 if pad else rng.randrange(2))
    return {k: torch.tensor(v, dtype=torch.int64, device=model.device) for k, v in cols.items()}


def poison(pool, seed):
    """The same large finite garbage in every cell of both pools (a cell read before it
    is written changes rows by far more than any tolerance)."""
    g = torch.Generator().manual_seed(seed)
    for t in (pool.k, pool.v):
        t.copy_(torch.randn(t.shape, generator=g) * 100)


_RUNS: dict[str, Run] = {}


def run_of(name: str) -> Run:
    """One eager twin and one compiled model per factory, stepped once for all tests."""
    if name not in _RUNS:
        rng = seeded_rng("COMPILE_TEST_SEED")
        seed = rng.randrange(2**31)
        eager, compiled = FACTORIES[name](seed), FACTORIES[name](seed)
        for m in (eager, compiled):
            poison(m.pool, seed)
        run = Run(seed, eager, compiled, compiled.compile_decoder("default", fullgraph=True))
        run.pool_ptrs = (compiled.pool.k.data_ptr(), compiled.pool.v.data_ptr())
        from torch._inductor.utils import run_and_get_code

        @torch.inference_mode()  # as the runtime steps (a model's parameters require grad)
        def steps():
            for chunks in schedule(rng):
                x_e = step_inputs(eager, chunks, rng)
                x_c = {k: v.clone() for k, v in x_e.items()}  # the compiled model's own cells
                x_c["cells"] = torch.tensor([compiled.pool.scratch_cell if s < 0 else compiled.cell_for(s, p)
                                             for s, p in zip(x_c["seq_ids"].tolist(), x_c["positions"].tolist())],
                                            device=compiled.device)
                run.steps.append((x_e, eager.step(x_e), compiled.step(x_c)))
        _, run.code = run_and_get_code(steps)
        _RUNS[name] = run
    return _RUNS[name]


NUMBER = re.compile(r"(?<![\w.])(\d+)L?(?![\w.])")
SHAPE = re.compile(r"\((\d+(?:, \d+)+),?\)")


def pool_traces(code: list[str], pool) -> list[str]:
    """The lines of generated code that name a pool-sized tensor: a number equal to the
    element count of a layer of the K or V pool or of all of it (a kernel's numel, a
    stride, a loop bound), or a shape tuple equal to the pool's or one layer's."""
    sizes = {str(n) for n in (pool.k.numel(), pool.k[0].numel(), pool.v.numel(), pool.v[0].numel())}
    shapes = {tuple(pool.k.shape), tuple(pool.k.shape[1:]), tuple(pool.v.shape), tuple(pool.v.shape[1:])}
    return [line.strip()[:160] for src in code for line in src.splitlines()
            if sizes & set(NUMBER.findall(line))
            or any(tuple(int(d) for d in s.split(", ")) in shapes for s in SHAPE.findall(line))]


# ------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, raises=AssertionError,
                                            reason="the regression this test guards: the pool in the graph"))
    if n == "plain-in-graph" else n for n in FACTORIES])
def test_compiled_code_holds_no_pool_tensor(name):
    """No graph input, buffer, copy or kernel of the pool's size: the op hides the pool."""
    run = run_of(name)
    traces = pool_traces(run.code, run.compiled.pool)
    assert not traces, f"{name} (seed {run.seed}): the compiled code touches pool-sized tensors:\n" + \
        "\n".join(traces[:12])
    layers = run.compiled.pool.k.shape[0]
    calls = sum(src.count("torch.ops.cgrt.attend_cells.default(") for src in run.code)
    assert calls == layers * run.rows.graphs, f"{name}: {calls} op calls for {run.rows.graphs} graphs"


@pytest.mark.parametrize("name", list(FACTORIES))
def test_compiled_step_equals_eager(name):
    """Every step's hidden rows (fp32 tolerance) and tokens (where the margin is clear;
    -1 where not wanted), and afterwards the pools' contents, at their old addresses."""
    run = run_of(name)
    for i, (x, a, b) in enumerate(run.steps):
        where = f"{name} step {i} (width {x['tokens'].numel()}, seed {run.seed})"
        live = x["seq_ids"] >= 0
        torch.testing.assert_close(b["hidden"][live], a["hidden"][live], rtol=1e-4, atol=1e-4, msg=where)
        want = x["want"] == 1
        assert bool((b["tokens"][~want] == -1).all()), where
        with torch.inference_mode():  # the outputs are inference tensors (see run_of)
            clear = run.eager.clear_positions(run.eager.head(a["hidden"]).float()) & want
        assert torch.equal(b["tokens"][clear], a["tokens"][clear]), where
    for pe, pc in ((run.eager.pool.k, run.compiled.pool.k), (run.eager.pool.v, run.compiled.pool.v)):
        torch.testing.assert_close(pc, pe, rtol=1e-4, atol=1e-4, msg=f"{name}: pool contents")
    assert (run.compiled.pool.k.data_ptr(), run.compiled.pool.v.data_ptr()) == run.pool_ptrs


CPP_KERNEL = re.compile(r"(\w+) = async_compile\.cpp_pybinding\(\[([^\]]*)\]")


def store_only_kernels(code: list[str]) -> tuple[int, list[str]]:
    """(kernels, the names of those that read nothing) in inductor's C++ code: a kernel's
    signature marks the pointers it reads ``const``, so one without a ``const`` pointer
    only writes (a ``const int64_t`` is a size, not a buffer)."""
    kernels = [m for src in code for m in CPP_KERNEL.finditer(src)]
    return len(kernels), [m.group(1) for m in kernels if not re.search(r"'const [\w:]+\*'", m.group(2))]


def test_the_store_only_detector_sees_a_fill():
    from torch._inductor.utils import run_and_get_code
    w = torch.randn(8, 8)
    _, code = run_and_get_code(torch.compile(lambda x: (x @ w, torch.zeros(x.shape[0], 8)), fullgraph=True),
                               torch.randn(4, 8))
    n, bad = store_only_kernels(code)
    assert n >= 1 and len(bad) == 1 and "zeros" in bad[0], (n, bad)


@pytest.mark.parametrize("name", THROUGH_THE_OP)
def test_no_compiled_kernel_only_writes(name):
    """Every kernel of the compiled step reads something. Under inductor's dependent
    launches (``triton.enable_pdl`` in ``STEP_OPTIONS``) a kernel waits for the launch
    before it after its first load, or before a store only where that launch touched the
    same buffer; a kernel that only writes never waits, may finish before its predecessor,
    and the launch after it (our op's rotation/write waits at its top) is then ordered
    after it alone and can read the predecessor's output early. The CPU's C++ kernels stand
    in for the GPU's Triton ones (the same fused nodes, another backend)."""
    run = run_of(name)
    n, bad = store_only_kernels(run.code)
    assert n > 0, f"{name}: no C++ kernel found in the compiled code"
    assert not bad, f"{name} (seed {run.seed}): kernels that only write: {bad}"


@pytest.mark.parametrize("name", list(FACTORIES))
def test_two_graphs_serve_every_width(name):
    """Widths 18, 9, 4, 3 and 2 share one graph with a dynamic row dimension; width 1
    has its own (torch specialises size 1): two compiles for seven steps."""
    run = run_of(name)
    assert run.rows.graphs == 2, f"{name}: {run.rows.graphs} graphs compiled for widths 18, 9, 1, 2, 4, 1, 3"
    assert run.rows.compile_s > 0


@pytest.mark.parametrize("name", FUSED)
def test_fused_compiled_step_runs_one_matmul_per_group(name):
    """q/k/v and gate/up merged: four matmuls a layer (qkv, o, gate-up, down) plus the
    head, in each compiled graph, instead of seven a layer."""
    run = run_of(name)
    layers = run.compiled.pool.k.shape[0]
    for src in run.code:
        mms = len(re.findall(r"extern_kernels\.(?:mm|addmm|bmm)\(", src))
        assert mms == 4 * layers + 1, f"{name}: {mms} matmuls in a graph of {layers} layers"


@pytest.mark.parametrize("name", SMALL_M)
def test_small_m_compiled_step_runs_the_kernel_op_once_per_projection(name):
    """Merged and routed through the small-M kernel: per layer one op call each for
    q/k/v, o, gate/up and down, in every compiled graph (one dynamic, one width 1), and
    no extern mm left but the LM head's."""
    run = run_of(name)
    layers = run.compiled.pool.k.shape[0]
    for src in run.code:
        ops = src.count("torch.ops.cgrt.small_m_linear.default(")
        mms = len(re.findall(r"extern_kernels\.(?:mm|addmm|bmm)\(", src))
        assert (ops, mms) == (4 * layers, 1), f"{name}: {ops} small-M ops and {mms} matmuls in a graph"


# ------------------------------------------------------------------------------ the op
def _pool_pair(seed):
    pools = [StandInPool(layers=2, kv_heads=2, head_dim=16, max_seqs=3, max_seq_len=40, seed=seed) for _ in (0, 1)]
    for p in pools:
        poison(p, seed)
    return pools


def _op_inputs(pool, rng):
    n, g = 6, torch.Generator().manual_seed(rng.randrange(2**31))
    seqs = [0, 0, 1, 2, 2, -1]
    pos = [rng.randrange(30) for _ in range(n - 1)] + [0]
    cells = [pool.cell_for(s, p) if s >= 0 else pool.scratch_cell for s, p in zip(seqs, pos)]
    return (torch.randn(n, 4, 16, generator=g), torch.randn(n, 2, 16, generator=g), torch.randn(n, 2, 16, generator=g),
            torch.tensor(seqs), torch.tensor(pos), torch.tensor(cells))


def test_the_op_called_eagerly_equals_pool_attend():
    """torch.ops.cgrt.attend_cells (eager dispatch) and attend() outside compile write the
    same cells and return what pool.attend does, into a poisoned ``out``."""
    rng = seeded_rng("COMPILE_TEST_SEED")
    a, b = _pool_pair(rng.randrange(2**31))
    args = _op_inputs(a, rng)
    want = a.attend(1, *args, scale=0.25, window=7)
    out = torch.full_like(args[0], float("nan"))
    torch.ops.cgrt.attend_cells(*args, out, attention_op.pool_id(b), 1, 0.25, 7, None, 0)
    assert torch.equal(out, want) and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
    again = attention_op.attend(attention_op.pool_id(b), 1, *args, scale=0.25, window=7,
                                out=torch.full_like(out, float("nan")))
    assert torch.equal(again, want)


def test_the_op_passes_torch_library_opcheck():
    """Schema (only ``out`` mutated among the arguments), fake, and the op under
    make_fx/AOT dispatch, as torch checks custom ops."""
    rng = seeded_rng("COMPILE_TEST_SEED")
    pool = _pool_pair(rng.randrange(2**31))[0]
    args = _op_inputs(pool, rng)
    out = torch.empty_like(args[0])
    torch.library.opcheck(torch.ops.cgrt.attend_cells.default,
                          (*args, out, attention_op.pool_id(pool), 0, 0.25, None, None, 0))


def test_the_registry_holds_pools_weakly():
    pool = StandInPool(layers=1, kv_heads=1, head_dim=16, max_seqs=1, max_seq_len=16)
    i = attention_op.pool_id(pool)
    assert attention_op.pool_id(pool) == i and attention_op.pool_by_id(i) is pool
    del pool
    gc.collect()
    with pytest.raises(attention_op.InputError, match="pool id"):
        attention_op.pool_by_id(i)
    with pytest.raises(attention_op.InputError, match="pool"):
        attention_op.pool_id(object())


# ------------------------------------------------------------------------------ compile_step
@pytest.mark.parametrize("mode,options", [("reduce-overhead", None), ("max-autotune", None),
                                          ("default", {"triton.cudagraphs": True}), ("bogus", None), (None, None)])
def test_modes_with_their_own_cuda_graphs_are_refused(mode, options):
    with pytest.raises(attention_op.InputError, match="mode"):
        CompiledRows(lambda x: x, mode=mode, options=options)


def test_step_options_sit_between_the_mode_and_the_callers_options():
    """The mode's settings, then the step's defaults (combo kernels and PDL on), then the caller's."""
    from cudagraph_rt.models.compiled import STEP_OPTIONS, inductor_options

    assert STEP_OPTIONS == {"combo_kernels": True, "triton.enable_pdl": True}
    assert inductor_options("default")["combo_kernels"] is True
    assert inductor_options("default")["triton.enable_pdl"] is True
    assert inductor_options("default", {"combo_kernels": False})["combo_kernels"] is False
    assert inductor_options("default", {"triton.enable_pdl": False})["triton.enable_pdl"] is False
    tuned = inductor_options("max-autotune-no-cudagraphs")
    assert tuned["combo_kernels"] is True and tuned["max_autotune"] is True


@needs("transformers")
def test_hfdecoder_compiles_its_rows_and_refuses_modes_with_cuda_graphs():
    """HFDecoder.compile_decoder: InputError before anything changes; a CompiledRows
    (nothing compiled yet) for a mode without graphs; None and eager again for None."""
    from cudagraph_rt.models import hf

    m = hf.build("llama", "tiny")
    for bad in ("reduce-overhead", "max-autotune"):
        with pytest.raises(attention_op.InputError, match="mode"):
            m.compile_decoder(bad)
        assert m._rows == m._step_rows
    rows = m.compile_decoder("max-autotune-no-cudagraphs")
    assert isinstance(rows, CompiledRows) and rows.graphs == 0 and m._rows is rows
    assert m.compile_decoder(None) is None and m._rows == m._step_rows


@needs("transformers")
def test_sweep_of_the_compiled_decoder_through_the_graph_path(tmp_path):
    """``cgrt sweep --model hf:qwen3 --compile default``: the adapter compiles the decoder,
    every width of the sweep (graph path emulated on a CPU, and graphs off) steps the
    compiled rows and matches the eager reference; the rerun line keeps --compile; the toy
    refuses it (exit 2). qwen3: its q/k norms go through inductor too."""
    import json

    from cudagraph_rt import cli
    from cudagraph_rt.sweep import HFAdapter, run_sweep

    rng = seeded_rng("COMPILE_TEST_SEED")
    adapter = HFAdapter("qwen3", "tiny", device="cpu", widths=(1, 2, 4), compile="default")
    rows = adapter.model._rows
    assert isinstance(rows, CompiledRows) and rows.graphs == 0
    rep = run_sweep(adapter, graphs="emulate", seed=rng.randrange(2**30), repeats=1, extras=(6,))
    assert rep.ok, rep.summary(3)
    assert rows.graphs == 2  # the dynamic graph and width 1's: every step went through them
    assert "--compile default" in " ".join(adapter.cli_args())
    out = tmp_path / "s.json"
    assert cli.main(["sweep", "--model", "hf:llama", "--compile", "default", "--graphs", "off", "--widths", "1,2",
                     "--extras", "4", "--repeats", "1", "--seed", "5", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["ok"]
    assert cli.main(["sweep", "--compile", "default", "--graphs", "off"]) == 2


def test_compiling_is_lazy_and_per_width_when_asked():
    """Nothing compiles when built; ``dynamic=False`` compiles each width once."""
    def rows(x, y):
        return x * 2 + y

    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    c = CompiledRows(rows, dynamic=False)
    assert counters["stats"]["unique_graphs"] == before
    for n in (4, 2, 4, 3, 1):
        x, y = torch.randn(n), torch.randn(n)
        assert torch.equal(c(x, y), x * 2 + y)
    assert c.graphs == 4


def test_models_of_one_class_keep_their_own_graphs():
    """Six models of one class and different shapes each compile their two graphs (one
    dynamic, one for width 1) and get their own results (see compiled._own_frame)."""
    class M:
        def __init__(self, k):
            self.w = torch.randn(8, 8 + k)

        def rows(self, x, y):
            return (x @ self.w + y[:, None]).relu()

    for k in range(6):
        m = M(k)
        c = CompiledRows(m.rows)
        for n in (4, 1, 3):
            x, y = torch.randn(n, 8), torch.randn(n)
            torch.testing.assert_close(c(x, y), m.rows(x, y))
        assert c.graphs == 2, k


@pytest.mark.cuda
def test_runtime_captures_the_compiled_step_bit_for_bit():
    """On CUDA: GraphRuntime over the compiled plain model, graphs on and off from
    identical pools, equal bit for bit at every width; eager within fp32 tolerance."""
    rng = seeded_rng("COMPILE_TEST_SEED")
    seed = rng.randrange(2**31)
    dev = f"cuda:{torch.cuda.current_device()}"
    models = [PlainDecoder(seed=seed, device=dev, max_seqs=8, max_len=64) for _ in range(3)]
    for m in models:
        poison(m.pool, seed)
    on, off, eager = models
    on.compile_decoder("default")
    off.compile_decoder("default")
    rt_on = GraphRuntime(on.step, on.inputs(), graphs=True, device=on.device)
    rt_off = GraphRuntime(off.step, off.inputs(), graphs=False, device=off.device)
    rt_eager = GraphRuntime(eager.step, eager.inputs(), graphs=False, device=eager.device)
    rt_on.capture()
    pos = [0] * 8
    for T in [8, 3, 1, 5, 2, 8, 1, 7]:
        seqs = rng.sample(range(8), T)
        x = dict(tokens=[rng.randrange(512) for _ in seqs], positions=[pos[s] for s in seqs], seq_ids=seqs,
                 cells=[on.cell_for(s, pos[s]) for s in seqs], want=[1] * T)
        for s in seqs:
            pos[s] += 1
        a, b, e = (rt.step(**x).outputs for rt in (rt_on, rt_off, rt_eager))
        assert torch.equal(a["hidden"], b["hidden"]) and torch.equal(a["tokens"], b["tokens"]), T
        torch.testing.assert_close(a["hidden"], e["hidden"], rtol=1e-4, atol=1e-4)
    assert torch.equal(on.pool.k, off.pool.k) and torch.equal(on.pool.v, off.pool.v)
