"""``python -m cudagraph_rt.dispatch.selftest``: the device loop's outer graph, built and run
once on this machine's GPU, checked against the host-driven rounds and the host runner.

It prints each stage as it goes (what it found, what it built, what it compared) and ends
with ``SELFTEST PASS`` (exit 0), ``SELFTEST FALLBACK: <what is missing>`` (exit 2: the loop
would run its rounds host-driven here) or ``SELFTEST FAIL: <stage>: <error>`` (exit 1).
"""
from __future__ import annotations

import sys
import time


def _serve(loop, reqs):
    import torch
    loop.submit(reqs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loop.run()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(q.generated) for q in loop.finished)
    return {q.uid: q.tokens for q in loop.finished}, tokens, seconds


def _streaming(model, reqs, k: int, rounds: int, ref: dict):
    """Stage 5: the ring streamed to the host while the launch runs (``on_tokens``): the
    tokens served, whether every token was heard once and in order, and the stage's line."""
    from ..speculative.loop_drafter import CoinRounds
    from .loop import DeviceLoop

    model.reset_cache()
    heard, during = {}, []

    def on_tokens(uid, toks):
        heard.setdefault(uid, []).extend(toks)
        during.append(len(streaming.launches))

    streaming = DeviceLoop(model, CoinRounds(model, 0.7, 1), k=k, graphs=True, rounds=rounds, on_tokens=on_tokens)
    streamed, _, _ = _serve(streaming, reqs)
    heard_all = all(heard.get(u) == toks[len(r.prompt):] for (u, toks), r in zip(sorted(streamed.items()), reqs))
    early = sum(n == 0 for n in during) - len(reqs)  # the first tokens (the prompts' step) come before too
    return streamed, heard_all, (f"[5/5] streaming: tokens equal: {streamed == ref}; every token heard once, in "
                                 f"order: {heard_all}; {early} of {len(during) - len(reqs)} rounds' deliveries came "
                                 "before the first launch returned (read from the mirror while it ran)")


def run(k: int = 4, rounds: int = 32) -> int:
    from .support import conditional_support
    support = conditional_support()
    print(f"[1/5] versions: {support}")
    if not support.ok:
        print(f"SELFTEST FALLBACK: {support.message}")
        return 2
    import torch
    from ..models import ToyConfig, ToyDecoder
    from ..speculative.device_drafter import DeviceDrafter
    from ..speculative.loop_drafter import CoinRounds
    from ..speculative.runner import Request, SpecRunner
    from .conditional import ConditionalRounds, compile_set_handles
    from .loop import DeviceLoop
    from cuda.bindings import nvrtc
    stage = "nvrtc"
    try:
        ptx = compile_set_handles(nvrtc, "compute_%d%d" % torch.cuda.get_device_capability())
        print(f"[2/5] NVRTC compiled the set-handles kernel: {len(ptx)} bytes of PTX")
        stage = "build"
        model = ToyDecoder(ToyConfig.tiny(max_len=128, max_seqs=4), "cuda")
        reqs = [Request((1 + i, 2 + i, 3), 60 + 7 * i) for i in range(3)]
        loop = DeviceLoop(model, CoinRounds(model, 0.7, 1), k=k, graphs=True, rounds=rounds)
        if not isinstance(loop.runner, ConditionalRounds):
            raise RuntimeError(f"the loop chose {type(loop.runner).__name__}, not the outer graph")
        print("[3/5] outer graph built and instantiated:\n      " + "\n      ".join(loop.runner.description))
        stage = "run"
        got, tokens, seconds = _serve(loop, reqs)
        model.reset_cache()
        host_loop = DeviceLoop(model, CoinRounds(model, 0.7, 1), k=k, graphs=True, rounds=rounds, conditional=False)
        ref, _, host_seconds = _serve(host_loop, reqs)
        model.reset_cache()
        runner = SpecRunner(model, DeviceDrafter(model, 0.7, 1, k=k), k=k, lanes=1, graphs=True)
        runner.submit(reqs)
        runner.run()
        spec = {s.uid: s.tokens for s in runner.finished}
        stage = "stream"
        streamed, heard_all, stream_line = _streaming(model, reqs, k, rounds, ref)
    except Exception as e:  # noqa: BLE001 - the self-test reports every failure as one line
        print(f"SELFTEST FAIL: {stage}: {type(e).__name__}: {e}")
        return 1
    launches = loop.runner.launches
    print(f"[4/5] device loop: {tokens} tokens in {launches} launches ({64 * launches / tokens:.2f} per 64 tokens), "
          f"{tokens / seconds:.0f} tokens/s; host-driven rounds: {host_loop.runner.launches} launches, "
          f"{tokens / host_seconds:.0f} tokens/s")
    print(stream_line)
    same = got == ref == spec == streamed and heard_all
    print(f"      tokens equal: device loop == host-driven rounds: {got == ref}; == SpecRunner: {got == spec}")
    print("SELFTEST PASS" if same else "SELFTEST FAIL: compare: the device loop's tokens differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(run())
