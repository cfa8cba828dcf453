"""Compile the small-M linear kernel for an H100/H200 (sm_90) without a GPU.

The interpreter accepts programs the compiler rejects (and says nothing about speed), so
CPU CI compiles the launches that matter offline: the planned configs of the 1B Llama's
layer shapes and every candidate of ``tools/bench/projections.py --tune``, with the
constants the launcher would use (``_launch_constants``) and the specialisation a real
launch gets (pointers, N, K and the row strides multiples of 16, K's stride 1). It checks
in the PTX that the weight tiles are read with 16-byte loads (``cp.async`` of 16 bytes
where the loop is software-pipelined, ``ld.global.v4`` otherwise) and that a split launch
has its acq_rel counter atomic. One line per kernel; exits 1 on any failure. Run as a
child process: TRITON_INTERPRET must not be set.
"""
import os
import re
import sys
from dataclasses import replace

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cudagraph_rt.kernels import small_linear as sl  # noqa: E402
from cudagraph_rt.tools.bench.projections import CANDIDATES  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
ALIGNED = {"N", "K", "k_per_split", "s_xm", "s_wn", "s_om"}  # multiples of 16 for these shapes
ONES = {"s_xk", "s_wk", "s_on"}  # specialised to 1 by a real launch
SHAPES = {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192)}


def compile_launch(config: sl.LinearConfig, m: int, k: int, dtype, bias: bool):
    t = TYPES[dtype]
    constants = dict(sl._launch_constants(config, m, k, dtype), HAS_BIAS=bias)
    constants.update({n: 1 for n in ONES})
    split = config.split_k > 1
    pointers = dict(x_ptr=f"*{t}", w_ptr=f"*{t}", bias_ptr=f"*{t}", out_ptr=f"*{t}",
                    part_ptr="*fp32" if split else f"*{t}", count_ptr="*i32" if split else f"*{t}")
    names = sl._small_gemv_kernel.arg_names
    sig = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constants and (n in pointers or n in ALIGNED)}
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    return triton.compile(ASTSource(sl._small_gemv_kernel, sig, constants, attrs), target=TARGET, options=options)


def inspect(kernel, config: sl.LinearConfig) -> tuple[bool, str]:
    """(ok, what was found): 16-byte weight loads; the counter atomic where split."""
    ptx = kernel.asm["ptx"]
    wide = len(re.findall(r"cp\.async\.cg\.shared\.global(?:\.L2::\w+)? \[[^\]]+\], \[[^\]]+\], 0x10", ptx)) + \
        len(re.findall(r"cp\.async\.cg\.shared\.global\S* \[[^\]]+\], \[[^\]]+\], 16", ptx))
    vec = len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", ptx))
    atomic = bool(re.search(r"atom\.global(?:\.gpu)?\.acq_rel(?:\.gpu)?\.add", ptx))
    ok = (wide or vec) and (atomic or config.split_k == 1)
    return bool(ok), (f"{'cp.async 16 B x%d' % wide if wide else 'ld.v4 x%d' % vec if vec else 'NO 16-byte loads'}"
                      f"{', counter atomic' if atomic else ', NO acq_rel atomic' if config.split_k > 1 else ''}")


def cases():
    """(label, config, M, K, dtype, bias): the plans at M 1 and 16, then every candidate."""
    for name, (n, k) in SHAPES.items():
        for m in (1, 16):
            plan = sl.plan_linear(m, n, k, torch.bfloat16, "cpu")
            yield f"{name} M={m} plan", plan, m, k, torch.bfloat16, name == "qkv"
    n, k = SHAPES["down"]
    for label, kw, _ in CANDIDATES:
        c = sl.LinearConfig(**kw)
        c = c if c.split_k is not None else replace(c, split_k=sl.default_split(n, k, c))
        yield f"down candidate {label}", c, 1 if not c.dot else 4, k, torch.bfloat16, False
    yield "o fp32 plan", sl.plan_linear(2, *SHAPES["o"], torch.float32, "cpu"), 2, SHAPES["o"][1], torch.float32, True


def main() -> int:
    failed = 0
    for label, config, m, k, dtype, bias in cases():
        shared = "-"
        try:
            kernel = compile_launch(config, m, k, dtype, bias)
            ok, found = inspect(kernel, config)
            shared = kernel.metadata.shared
        except Exception as e:  # report every case, then fail
            ok, found = False, f"{type(e).__name__}: {str(e).splitlines()[:1]}"
        failed += not ok
        print(f"{'ok' if ok else 'FAILED'} {label}: {config}, shared {shared} B, {found}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
