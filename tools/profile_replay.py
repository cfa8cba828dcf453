"""Where one captured width's device time goes: the kernels of ``--replays`` replays of a
model's graph at ``--width``, by total device time (torch.profiler, CUDA activity).

    python -m cudagraph_rt.tools.profile_replay --model hf:llama --size 1b --width 1 [--compile default]

Prints the replay's median time (CUDA events) and the top kernels with their share; CUDA
only. For the toy, ``--model toy`` (the bench size)."""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from cudagraph_rt import GraphRuntime


def _model(name: str, size: str):
    if name == "toy":
        from cudagraph_rt.models import ToyConfig, ToyDecoder
        return ToyDecoder(ToyConfig.bench(), "cuda")
    from cudagraph_rt.models.hf import build, parse_model
    return build(parse_model(name), size, device=torch.device("cuda"))


def _sdpa(name: str | None):
    from contextlib import nullcontext

    if name is None:
        return nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}[name])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cudagraph_rt.tools.profile_replay", description=__doc__)
    p.add_argument("--model", default="hf:llama")
    p.add_argument("--size", default="1b")
    p.add_argument("--width", type=int, default=1)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--compile", default=None, help="hf models: compile_decoder(MODE) before capture")
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--sdpa", default=None, choices=("flash", "efficient", "cudnn", "math"),
                   help="capture under torch.nn.attention.sdpa_kernel(this backend) (an experiment: the "
                        "backend is chosen when the graph is captured)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_replay: expected a CUDA device, got none", file=sys.stderr)
        return 2
    model = _model(a.model, a.size)
    if a.compile:
        model.compile_decoder(a.compile)
    rt = GraphRuntime(model.step, model.inputs(), widths=(a.width,), graphs=True, device=model.device)
    with _sdpa(a.sdpa):
        rt.capture()
    x = {name: torch.full((a.width,), spec.pad, dtype=torch.int64) for name, spec in model.inputs().items()}
    x["tokens"] = torch.randint(0, model.config.vocab, (a.width,))
    for _ in range(3):
        rt.step(**x)
    times = []
    for _ in range(a.replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        rt.step(**x)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.replays):
            rt.step(**x)
        torch.cuda.synchronize()
    events = [ev for ev in prof.key_averages() if ev.device_type.name == "CUDA" or getattr(ev, "self_device_time_total", 0)]
    total = sum(getattr(ev, "self_device_time_total", 0) for ev in events) or 1
    print(f"{a.model} {a.size} width {a.width}{' compiled ' + a.compile if a.compile else ''}"
          f"{' sdpa ' + a.sdpa if a.sdpa else ''}: step median "
          f"{statistics.median(times):.1f} us (events), profiled device time {total / a.replays:.1f} us per step")
    for ev in sorted(events, key=lambda ev: -getattr(ev, "self_device_time_total", 0))[:a.top]:
        t = getattr(ev, "self_device_time_total", 0)
        print(f"{100 * t / total:5.1f}%  {t / a.replays:8.1f} us/step  x{ev.count // a.replays:<4} {ev.key[:110]}")
    rt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
