"""Issue 12: a GraphRuntime and torch.compile(mode="reduce-overhead") in one process.

Steps the toy decoder (8 layers, bf16, KV by index_copy_) through a GraphRuntime with
graphs on, checking 120 steps bit for bit against a graphs-off runtime over an identical
model; then compiles the same model's step with mode="reduce-overhead" (weights and KV
marked static, dynamic shapes left to torch: a static compile at the first width, an
automatic dynamic recompile at the second) and runs it at widths 64..1; then steps the
runtime again and checks it. Prints "ok" and exits 0, or exits 1 with what differed.

``--without-fix`` turns cudagraph_rt's cuBLAS-workspace release off (the diagnosis run:
it shows the failure the fix removes). Run it as a child process: a failure may be an
illegal memory access, fatal to the CUDA context.
"""
import random
import sys

import torch

import cudagraph_rt.graphs.capture as capture
from cudagraph_rt import GraphRuntime
from cudagraph_rt.models.toy import ToyConfig, ToyDecoder

if "--without-fix" in sys.argv:
    capture.release_blas_workspaces = lambda: None


def inputs(models, T, rng):
    """T rows of a random sequence from position 0; their cells reserved in every model's
    pool (each runtime steps its own model: the same calls hand out the same cells)."""
    model = models[0]
    seq = rng.randrange(model.config.max_seqs)
    cells = [m.cell_range(seq, 0, T) for m in models]
    assert all(c == cells[0] for c in cells), "the models' pools hold different cells"
    cols = dict(tokens=[rng.randrange(model.config.vocab) for _ in range(T)], positions=list(range(T)),
                seq_ids=[seq] * T, cells=cells[0], want=[1] * T)
    return {k: torch.tensor(v, dtype=torch.int64) for k, v in cols.items()}


def check(rt, rt_off, models, rng, n, widths):
    for i in range(n):
        T = rng.choice(widths)
        x = inputs(models, T, rng)
        a, b = rt.step(**x).outputs, rt_off.step(**x).outputs
        torch.cuda.synchronize()
        for k in a:
            if not torch.equal(a[k], b[k]):
                print(f"step {i} (T={T}): output {k!r} differs from graphs off")
                sys.exit(1)


def main():
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    cfg = ToyConfig.bench(layers=8)
    model, twin = ToyDecoder(cfg, device="cuda"), ToyDecoder(cfg, device="cuda")
    rt = GraphRuntime(model.step, model.inputs(), graphs=True)
    rt_off = GraphRuntime(twin.step, twin.inputs(), graphs=False)
    rt.capture()
    check(rt, rt_off, (model, twin), rng, 120, list(range(1, 65)))

    static = [v for v in (*vars(model).values(), *vars(model.pool).values())  # weights, KV, block table
              if isinstance(v, torch.Tensor)]
    for t in static:
        torch._dynamo.mark_static_address(t)
    compiled = torch.compile(model.step, mode="reduce-overhead")
    spec = model.inputs()
    for w in [64, 32, 16, 8, 4, 2, 1]:
        for _ in range(3):  # cudagraph trees warm up, then record, then replay
            compiled({k: torch.full((w,), s.pad, dtype=torch.int64, device="cuda") for k, s in spec.items()})
    torch.cuda.synchronize()
    check(rt, rt_off, (model, twin), rng, 60, [64, 33, 5, 1, 64])
    print("ok")


if __name__ == "__main__":
    main()
