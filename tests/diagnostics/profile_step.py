"""Where step()'s host time goes (issue 15): the bench toy with four host inputs at T = 1,
the whole calls against replay() and a direct launch, then each piece of the short path
timed alone. A diagnosis, not a bench (goals live in ``cgrt bench --sections 3``); needs
CUDA. Run: ``PYTHONPATH=. python3 tests/diagnostics/profile_step.py``.

It times the runtime's own pieces (its lock, counters, short-path plans, the feed), so it
reads private state of GraphRuntime: it lives with the tests, which are never installed,
not in cudagraph_rt.tools (whose modules use the public API only)."""
import ctypes
import statistics
import time

import numpy as np
import torch
from cudagraph_rt import GraphRuntime
from cudagraph_rt.models.toy import ToyConfig, ToyDecoder
from cudagraph_rt.results import StepResult

def main() -> None:
    dev = torch.device("cuda", 0)
    m = ToyDecoder(ToyConfig.bench(), dev)
    assert m.cell_range(0, 0, 4) == [0, 1, 2, 3]  # the rows below: sequence 0, position i, cell i
    specs = {k: v for k, v in m.inputs().items() if k != "want"}
    r = GraphRuntime(lambda x: m.step({**x, "want": torch.ones_like(x["tokens"])}), specs, widths=(1, 64), device=dev)
    r.capture()
    names = list(specs)
    rows = [{n: torch.full((1,), i if n != "seq_ids" else 0, dtype=torch.int64) for n in names} for i in range(4)]
    rnp = [{n: v.numpy() for n, v in d.items()} for d in rows]
    r.step(**rows[0]); r.step(**rows[1]); torch.cuda.synchronize()
    gs = r._by_width[1]
    print("torch", torch.__version__, torch.cuda.get_device_name(), "| width-1 graph launched directly:", gs.launch.raw)

    def host(fn, n=2000):
        xs = []
        for i in range(n + 50):
            torch.cuda.synchronize()
            a = time.perf_counter_ns(); fn(i); b = time.perf_counter_ns()
            if i >= 50:
                xs.append(b - a)
        torch.cuda.synchronize()
        return f"{statistics.median(xs)/1e3:7.2f} us (p10 {np.percentile(xs,10)/1e3:.2f})"

    def pyt(fn, n=20000):
        for i in range(200): fn(i)
        a = time.perf_counter_ns()
        for i in range(n): fn(i)
        return f"{(time.perf_counter_ns()-a)/n/1e3:7.3f} us"

    arrs = {}
    def fill(i):
        arrs.clear(); arrs.update(r.host_inputs(1, numpy=True))
        for n in names: arrs[n][:] = rnp[i & 3][n]
    def whole(i):
        v = r.host_inputs(1, numpy=True)
        src = rnp[i & 3]
        for n in names: v[n][:] = src[n]
        r.step(**v)
    print("replay()              ", host(lambda i: gs.graph.replay()))
    print("GraphLaunch()         ", host(lambda i: gs.launch()))
    print("step(fresh 4)         ", host(lambda i: r.step(**rows[i & 3])))
    xs = []
    for i in range(2000):
        fill(i); torch.cuda.synchronize()
        a = time.perf_counter_ns(); r.step(**arrs); xs.append(time.perf_counter_ns() - a)
    print("step(arrays)          ", f"{statistics.median(xs)/1e3:7.2f} us")
    print("whole                 ", host(whole))
    print("host_inputs(numpy)    ", host(lambda i: r.host_inputs(1, numpy=True)))
    ins, feed, val = r._inputs, r._inputs.graph_stager, r._inputs.validator
    print("-- pieces (no device wait between calls) --")
    print("lock acq/rel          ", pyt(lambda i: (r._lock.acquire(False), r._lock.release())))
    print("kwargs call           ", pyt(lambda i: (lambda **k: k)(**rows[i & 3])))
    print("validator.host_rows   ", pyt(lambda i: val.host_rows(rows[i & 3])))
    a = r.host_inputs(1, numpy=True)
    print("handed_rows(arrays)   ", pyt(lambda i: ins.handed_rows(a)))
    p4 = [rows[0][n].data_ptr() for n in names]
    print("feed.write_rows(ptrs) ", pyt(lambda i: feed.write_rows(p4, 1)))
    print("feed.write_rows(None) ", pyt(lambda i: feed.write_rows(None, 1)))
    print("feed.event.synchronize", pyt(lambda i: feed.event.synchronize()))
    c = r._counters
    print("counters (step_ran)   ", pyt(lambda i: c.step_ran(0, 1)))
    e = r._direct._per_t[1]
    tok = r._token
    print("StepResult(...)       ", pyt(lambda i: StepResult(e.cut.copy(), 1, e.slices, None, None, tok)))
    print("cut.copy              ", pyt(lambda i: e.cut.copy()))
    print("fill 4 arrays         ", pyt(lambda i: [a[n].__setitem__(slice(None), rnp[i & 3][n]) for n in names]))
    print("getCurrentRawStream   ", pyt(lambda i: torch._C._cuda_getCurrentRawStream(0)))
    print("memmove 8B            ", pyt(lambda i: ctypes.memmove(p4[0], p4[1], 8)))


if __name__ == "__main__":
    main()
