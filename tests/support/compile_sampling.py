"""Compile the sampler's kernels (kernels/sampling) for an H100/H200 (sm_90) without a GPU.

The interpreter accepts programs the compiler rejects (a global that is not constexpr, an
integer argument of 1 specialised to a constant, branches yielding different types), so CPU
CI compiles the launches of the default plans offline: 128,256 logits at 1 and 64 rows in
bf16, 1 row in fp32 (and a vocabulary of 1), every kernel with the constants the launcher
uses (``launch.launch_constants``), for a sample and for a full-q verify. It checks in the
PTX that each reducing launch has its acq_rel ticket atomic, that 1 / T is a
round-to-nearest division (``div.rn``, the torch path's IEEE division: the scaled logits are
the same bits), and that ``log`` is libdevice's (not ``lg2.approx``, whose error near u = 1
would make the Gumbel noise of a uniform close to 1 infinite). One line per kernel; exits 1
on any failure. Run as a child process: TRITON_INTERPRET must not be set.
"""
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cudagraph_rt.kernels.sampling import launch  # noqa: E402
from cudagraph_rt.kernels.sampling import search_kernels as sk  # noqa: E402
from cudagraph_rt.kernels.sampling import triton_path as tp  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
H200_SMS = 132
POINTERS = dict(temp_ptr="*fp32", topk_ptr="*i64", topp_ptr="*fp32", minp_ptr="*fp32", seed_ptr="*i64",
                pos_ptr="*i64", draft_ptr="*i64", q_ptr="*fp32", tok_ptr="*i64", pd_ptr="*fp32", ist_ptr="*i32",
                fst_ptr="*fp32", ipart_ptr="*i32", fpart_ptr="*fp32", ticket_ptr="*i32", probs_ptr="*fp32")
TICKETED = ("_stats_kernel", "_search_kernel", "_final_kernel", "_residual_kernel")


def compile_kernel(kernel, logits: str, constants: dict, ones=()):
    """``kernel`` for sm_90 with ``constants``; integer arguments in ``ones`` specialised to 1."""
    names = kernel.arg_names
    constants = {**{n: v for n, v in constants.items() if n in names}, **{n: 1 for n in ones if n in names}}
    sig = {n: "constexpr" if n in constants else POINTERS.get(n, f"*{logits}" if n == "logits_ptr" else "i32")
           for n in names}
    return triton.compile(ASTSource(kernel, sig, constants), target=TARGET, options=dict(num_warps=4))


def inspect(name: str, ptx: str) -> tuple[bool, str]:
    """(ok, what was found): the ticket atomic where the launch reduces; div.rn and no
    lg2.approx where the kernel scales logits or draws noise."""
    atomic = bool(re.search(r"atom\.global(?:\.gpu)?\.acq_rel(?:\.gpu)?\.add", ptx))
    div_rn = "div.rn.f32" in ptx
    approx_log = "lg2.approx" in ptx
    ok = (atomic or name not in TICKETED) and div_rn and not approx_log
    return ok, (f"{'ticket atomic' if atomic else 'no atomic'}, {'div.rn' if div_rn else 'NO div.rn'}"
                f"{', lg2.approx (approximate log)' if approx_log else ''}")


def cases():
    """(label, kernel, logits dtype, constants, ones) for the default plans' launches."""
    for rows, dtype in ((1, "bf16"), (64, "bf16"), (1, "fp32")):
        vocab = 128256
        plan = launch.plan_sampling(rows, vocab, torch.device("cuda"), sm_count=H200_SMS)
        base = dict(launch.launch_constants(plan, vocab), MC=plan.candidates)
        label = f"N={rows} {dtype} V={vocab}"
        for draft, full_q in ((False, False), (True, True)):
            flags = dict(HAS_DRAFT=draft, FULL_Q=full_q, BLOCK=plan.block)
            yield f"{label} stats {flags}", tp._stats_kernel, dtype, {**base, **flags}, ()
            yield f"{label} final {flags}", tp._final_kernel, dtype, {**base, **flags}, ()
        for last in (False, True):
            yield f"{label} search LAST={last}", sk._search_kernel, dtype, \
                {**base, "BLOCK": plan.search_block, "LAST": last}, ()
        yield f"{label} residual", tp._residual_kernel, dtype, {**base, "BLOCK": plan.block}, ()
        yield f"{label} probs", tp._probs_kernel, dtype, {"BLOCK": plan.block}, ()
    plan = launch.plan_sampling(1, 1, torch.device("cuda"), sm_count=H200_SMS)
    base = dict(launch.launch_constants(plan, 1), MC=plan.candidates, HAS_DRAFT=True, FULL_Q=True)
    for kernel in (tp._stats_kernel, sk._search_kernel, tp._final_kernel, tp._residual_kernel):
        block = plan.search_block if kernel is sk._search_kernel else plan.block
        yield f"V=1 {kernel.__name__}", kernel, "fp32", {**base, "BLOCK": block, "LAST": True}, \
            ("V", "stride_l", "n_chunks")


def main() -> int:
    failed = 0
    for label, kernel, dtype, constants, ones in cases():
        try:
            compiled = compile_kernel(kernel, dtype, constants, ones)
            ok, found = inspect(kernel.__name__, compiled.asm["ptx"])
            found += f", shared {compiled.metadata.shared} B"
        except Exception as e:  # report every case, then fail
            ok, found = False, f"{type(e).__name__}: {str(e).splitlines()[:2]}"
        failed += not ok
        print(f"{'ok' if ok else 'FAILED'} {label}: {found}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
