"""Compile the cell-attention kernels for an H100/H200 (sm_90) without a GPU.

The interpreter accepts programs the compiler rejects (and says nothing about speed), so
CPU CI compiles the launches that matter offline, with the constants the launcher would
use (``kernel_constants``) and the specialisation a real launch gets (pointers and the
strides of these shapes are multiples of 16), and checks that the K/V tiles of the main
loop are loaded asynchronously into at least two buffers (software-pipelined, a tile in
flight while one is used): a lost alignment, a loop the pipeliner cannot handle, or a
load inside the loop that the K/V addresses depend on (a block-table load costs the
pipeline a stage: one buffer) shows here as "not pipelined". Prints one line per kernel
and exits 1 on any failure. Run as a child process: TRITON_INTERPRET must not be set.
"""
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cudagraph_rt.kernels import attention as ca  # noqa: E402
from cudagraph_rt.kernels.attention import kernel as ca_kernel  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
FLOAT_ARGS = {"scale2"}
ALIGNED = {"s_qn", "s_qh", "s_kc", "s_kh", "s_vc", "s_vh", "s_on", "s_oh", "s_bt"}  # multiples of 16 here


def compile_kernel(kernel, pointers: dict, constants: dict, options: dict):
    names = kernel.arg_names
    sig = {n: "constexpr" if n in constants else pointers.get(n, "fp32" if n in FLOAT_ARGS else "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constants and (sig[n].startswith("*") or n in ALIGNED)}
    return triton.compile(ASTSource(kernel, sig, constants, attrs), target=TARGET, options=options)


def attention(N, Hq, Hkv, D, dtype, *, block_size=16, window=False, bias=False, splits=None, pdl=False):
    plan = ca.plan_attention(N, Hq, Hkv, D, splits=splits)
    meta = {**ca.kernel_constants(plan, Hq, Hkv, D, block_size, dtype, window, bias), "PDL": pdl}
    t = TYPES[dtype]
    pointers = dict(q_ptr=f"*{t}", k_ptr=f"*{t}", v_ptr=f"*{t}", bt_ptr="*i32", seq_ptr="*i64", pos_ptr="*i64",
                    slope_ptr="*fp32", out_ptr=f"*{t}", pm_ptr="*fp32", pacc_ptr=f"*{t}", cnt_ptr="*i32")
    options = dict(num_warps=plan.config.num_warps, num_stages=plan.config.num_stages, launch_pdl=pdl)
    return plan, compile_kernel(ca_kernel.cell_attention_kernel, pointers, meta, options)


def waits(kernel, want: int, triggers: int) -> bool:
    """The PTX of a dependent launch: ``want`` griddepcontrol.wait and ``triggers``
    griddepcontrol.launch_dependents instructions (without PDL: none of either)."""
    ptx = kernel.asm["ptx"]
    return ptx.count("griddepcontrol.wait") == want and ptx.count("griddepcontrol.launch_dependents") == triggers


def main() -> int:
    failed = 0
    cases = [  # (label, N, Hq, Hkv, D, dtype, extra): the Llama-1B launches, windows + bias, the toy's shapes
        ("1B width 1", 1, 32, 8, 64, torch.bfloat16, {}),
        ("1B width 8, window, bias", 8, 32, 8, 64, torch.bfloat16, dict(window=True, bias=True)),
        ("1B width 64", 64, 32, 8, 64, torch.bfloat16, {}),
        ("D 128 width 96", 96, 32, 8, 128, torch.bfloat16, {}),
        ("toy fp32 D 16 G 1", 8, 4, 4, 16, torch.float32, dict(block_size=4)),
        ("toy bf16 width 1 G 1, bias", 1, 4, 4, 16, torch.bfloat16, dict(block_size=4, bias=True)),
        ("1B width 1, dependent launch", 1, 32, 8, 64, torch.bfloat16, dict(pdl=True)),
        ("1B width 8, dependent launch", 8, 32, 8, 64, torch.bfloat16, dict(pdl=True)),
    ]
    for label, N, Hq, Hkv, D, dtype, extra in cases:
        try:
            plan, k = attention(N, Hq, Hkv, D, dtype, **extra)
        except Exception as e:  # report every case, then fail
            print(f"FAILED {label}: {type(e).__name__}: {str(e).splitlines()[:1]}")
            failed += 1
            continue
        ttgir = k.asm["ttgir"]
        shape = rf"{plan.config.tile_n}x{max(16, 1 << (D - 1).bit_length())}x"  # a K or V buffer: [n, tile_n, BLOCK_D]
        depth = min((int(n) for n in re.findall(rf"local_alloc : \(\) -> !ttg.memdesc<(\d+)x{shape}", ttgir)), default=0)
        pipelined = ttgir.count("async_copy_global_to_local") >= 2 and depth >= 2
        ok = pipelined or dtype == torch.float32  # fp32 (ieee dot) takes the FMA path, not cp.async
        pdl = extra.get("pdl", False)
        ordered = waits(k, 1 if pdl else 0, 0)  # one wait, never a trigger
        if pdl and ordered:  # every store and K/V copy after the wait in the code (none on the way to it)
            # Text order only: this sees a store hoisted above the wait, not a wait under the
            # wrong condition (a program that skips the wait reaches stores placed after it in
            # the text). tests/kernels/test_dependent_launch_order.py checks each program's
            # order in the interpreter.
            ptx = k.asm["ptx"]
            at = ptx.index("griddepcontrol.wait")
            ordered = all(op not in ptx or ptx.find(op) > at for op in ("st.global", "cp.async", "atom.global"))
        ok = ok and ordered
        failed += not ok
        print(f"{'ok' if ok else 'FAILED'} {label}: plan {plan}, shared {k.metadata.shared} B, "
              f"{'pipelined' if pipelined else 'not pipelined'} ({depth} K/V buffers)"
              f"{'' if ordered else ', griddepcontrol not as expected'}")
    write = compile_kernel(ca_kernel.write_cells_kernel, dict(k_ptr="*bf16", v_ptr="*bf16", kc_ptr="*bf16",
                                                              vc_ptr="*bf16", cells_ptr="*i64"),
                           dict(HKV=8, D=64, BLOCK_H=8, BLOCK_D=64), {})
    print(f"ok write_cells ({write.metadata.shared} B shared)")
    from cudagraph_rt.kernels import rotary_cells as rc

    for Hq, Hkv, D, t, pdl in ((32, 8, 64, "bf16", False), (16, 4, 128, "bf16", False), (4, 4, 16, "fp32", False),
                               (32, 8, 64, "bf16", True)):
        rotary = compile_kernel(rc._rotary_write_kernel, dict(q_ptr=f"*{t}", k_ptr=f"*{t}", v_ptr=f"*{t}",
                                                             cos_ptr=f"*{t}", sin_ptr=f"*{t}", qo_ptr=f"*{t}",
                                                             kc_ptr=f"*{t}", vc_ptr=f"*{t}", cells_ptr="*i64"),
                                {**rc._meta(Hq, Hkv, D), "PDL": pdl}, dict(launch_pdl=pdl))
        ptx = rotary.asm["ptx"]
        # with PDL the wait comes first, before any load, then the trigger (the next launch may
        # start only once this one's predecessor is done: the attention reads its rows before its wait)
        ordered = waits(rotary, 1, 1) and ptx.index("griddepcontrol.wait") < min(
            ptx.index("ld.global"), ptx.index("griddepcontrol.launch_dependents")) if pdl else waits(rotary, 0, 0)
        failed += not ordered
        print(f"{'ok' if ordered else 'FAILED'} rotary_write_cells Hq {Hq} Hkv {Hkv} D {D} {t}"
              f"{' dependent launch' if pdl else ''} ({rotary.metadata.shared} B shared)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
