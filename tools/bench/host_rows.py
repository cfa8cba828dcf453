"""Section 6 of ``cgrt bench``: chosen hidden rows to the host.

A simple source step (one embedding lookup and one matmul: ``[T, H]`` bf16) isolates the
transfer. Timed from the replay's start to the chosen rows being readable on the host:

* ``captured_gather``: one graph = source step + ``gather_rows`` into a pinned slot; wait
  on an event; the rows are a view of the slot.
* ``runtime_device`` / ``runtime_host``: ``GraphRuntime.step`` with ``HostRows`` in device
  mode (the step picks the rows) or host mode (``rows=`` from the host), then
  ``handle.rows()``; includes step()'s host work (staging the inputs).
* ``copy_all`` (a): graph = source step; copy all T rows, the row list and the count to
  pinned memory (non-blocking), wait, select the rows on the host.
* ``item_select`` (b): graph = source step; ``count.item()`` (a sync), ``index_select`` on
  the device, copy those rows to pinned memory, wait.
"""
from __future__ import annotations

from typing import Any

import torch

from cudagraph_rt import HostRows, InputSpec

from .common import N_SETS, time_calls
from .context import Context

H, T_MAIN = 4096, 64
ACCEPTED = (1, 8, 32, 64)
T_SWEEP = (8, 64, 256)
K_IN, VOCAB = 256, 1024


class Rig:
    """Static buffers and two captured graphs (source + gather, source alone) at one T."""

    def __init__(self, T: int, emb: torch.Tensor, w: torch.Tensor, device: torch.device):
        from cudagraph_rt.kernels.row_gather import gather_rows

        dt, i32 = emb.dtype, torch.int32
        self.T, self.emb, self.w = T, emb, w
        self.tok = torch.zeros(T, dtype=torch.int64, device=device)
        self.rows = torch.zeros(T, dtype=i32, device=device)
        self.count = torch.ones(1, dtype=i32, device=device)
        self.slot = torch.zeros(1, dtype=i32, device=device)
        self.dst = torch.empty(2, T, H, dtype=dt, pin_memory=True)
        self.meta = torch.zeros(2, 2 + T, dtype=i32, pin_memory=True)
        self.all_h = torch.empty(T, H, dtype=dt, pin_memory=True)
        self.sel_h = torch.empty(T, H, dtype=dt, pin_memory=True)
        self.rows_h = torch.empty(T, dtype=i32, pin_memory=True)
        self.count_h = torch.empty(1, dtype=i32, pin_memory=True)
        self.ev = torch.cuda.Event()

        def gathered(validate: bool = True):
            gather_rows(self.src(), self.rows, self.count, self.dst, self.meta, dst_slot=self.slot,
                        validate=validate)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # compile the kernel and warm cuBLAS outside capture
            gathered()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        self.g_gather, self.g_src = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.g_gather):
            gathered(validate=False)  # checked by the warm-up call; no host queries while capturing
        with torch.cuda.graph(self.g_src):
            self.src_out = self.src()
        torch.cuda.synchronize(device)

    def src(self) -> torch.Tensor:
        return self.emb.index_select(0, self.tok) @ self.w

    # Each method returns the chosen rows, readable on the host.
    def captured_gather(self) -> torch.Tensor:
        self.g_gather.replay()
        self.ev.record()
        self.ev.synchronize()
        return self.dst[0, :int(self.meta[0, 0])]

    def copy_all(self) -> torch.Tensor:
        self.g_src.replay()
        self.all_h.copy_(self.src_out, non_blocking=True)
        self.rows_h.copy_(self.rows, non_blocking=True)
        self.count_h.copy_(self.count, non_blocking=True)
        self.ev.record()
        self.ev.synchronize()
        return self.all_h.index_select(0, self.rows_h[:int(self.count_h[0])].long())

    def item_select(self) -> torch.Tensor:
        self.g_src.replay()
        n = int(self.count.item())
        self.sel_h[:n].copy_(self.src_out.index_select(0, self.rows[:n]), non_blocking=True)
        self.ev.record()
        self.ev.synchronize()
        return self.sel_h[:n]


def _choose_step(emb, w):
    def step(x):  # HostRows device mode: rows with accept != 0, packed at the front, no host sync
        h = emb.index_select(0, x["tokens"]) @ w
        keep = x["accept"] != 0
        n = keep.shape[0]
        r = torch.arange(n, device=keep.device)
        dest = torch.where(keep, torch.cumsum(keep.to(torch.int32), 0) - 1, n + r)
        packed = torch.zeros(2 * n, dtype=torch.int32, device=keep.device)
        packed.scatter_(0, dest, r.to(torch.int32))
        return {"hidden": h, "accept_rows": packed[:n], "accept_count": keep.sum().to(torch.int32).reshape(1)}
    return step


def _sets(T: int, n: int, gen: torch.Generator, device) -> list[dict[str, Any]]:
    out = []
    for _ in range(N_SETS):
        tok = torch.randint(0, VOCAB, (T,), generator=gen)
        idx = torch.randperm(T, generator=gen)[:n].sort().values
        rows = torch.zeros(T, dtype=torch.int32)
        rows[:n] = idx.to(torch.int32)
        accept = torch.zeros(T, dtype=torch.int32)
        accept[idx] = 1
        out.append({"tok": tok, "idx": idx, "accept": accept, "n": n,
                    "tok_d": tok.to(device), "rows_d": rows.to(device)})
    return out


def _time_rig(rig: Rig, sets, kw) -> dict:
    """captured_gather, copy_all and item_select of one rig over the rotated sets."""
    def prepare(i):  # untimed: what the device would have chosen, placed on the device
        s = sets[i % N_SETS]
        rig.tok.copy_(s["tok_d"])
        rig.rows.copy_(s["rows_d"])
        rig.count.fill_(s["n"])

    methods = {"captured_gather": rig.captured_gather, "copy_all": rig.copy_all, "item_select": rig.item_select}
    out = {name: time_calls(lambda i, f=f: f(), prepare=prepare, include_sync=False, **kw)
           for name, f in methods.items()}
    # Every method must hand the host the chosen rows of the source (bf16 tolerance: the
    # eager matmul may pick another kernel than the captured one); poisoned first, so a
    # row nothing wrote shows up as NaN.
    prepare(1)
    for buf in (rig.dst, rig.all_h, rig.sel_h):
        buf.fill_(float("nan"))
    got = [f().float() for f in methods.values()]
    want = rig.src()[sets[1]["rows_d"][:sets[1]["n"]].long()].float().cpu()
    out["rows_agree"] = all(g.shape == want.shape and torch.allclose(g, want, rtol=2e-2, atol=2e-2) for g in got)
    return out


def _time_runtimes(rt_dev, rt_host, sets, kw) -> dict:
    """step() with HostRows in device and host mode, until handle.rows() returns."""
    def device_mode(i):
        s = sets[i % N_SETS]
        res = rt_dev.step(tokens=s["tok"], accept=s["accept"])
        res.host_rows.rows()
        res.host_rows.release()

    def host_mode(i):
        s = sets[i % N_SETS]
        res = rt_host.step(tokens=s["tok"], rows=s["idx"])
        res.host_rows.rows()
        res.host_rows.release()

    return {"runtime_device": time_calls(device_mode, include_sync=False, **kw),
            "runtime_host": time_calls(host_mode, include_sync=False, **kw)}


def host_rows(ctx: Context) -> dict:
    """6. Chosen rows to the host, per accepted count at T = 64 and per T at 8 accepted."""
    if not ctx.graphs:
        return {"status": "skipped", "reason": "needs CUDA (pinned memory and a captured gather)"}
    dev, gen = ctx.device, torch.Generator().manual_seed(ctx.seed + 6)
    emb = torch.randn(VOCAB, K_IN, generator=gen).to(dev, torch.bfloat16)
    w = (torch.randn(K_IN, H, generator=gen) / K_IN ** 0.5).to(dev, torch.bfloat16)
    kw = {"repeats": ctx.repeats, "warmup": ctx.warmup, "sync": ctx.sync}
    rig = Rig(T_MAIN, emb, w, dev)
    rt_dev = ctx.make_runtime(widths=(T_MAIN,), step_fn=_choose_step(emb, w),
                              inputs={"tokens": InputSpec(pad=0), "accept": InputSpec(dtype=torch.int32, pad=0)},
                              host_rows=HostRows(source="hidden", mode="device"))
    rt_host = ctx.make_runtime(widths=(T_MAIN,), step_fn=lambda x: {"hidden": emb.index_select(0, x["tokens"]) @ w},
                               inputs={"tokens": InputSpec(pad=0)}, host_rows=HostRows(source="hidden", mode="host"))
    try:
        rt_dev.capture()
        rt_host.capture()
        rows_out = []
        for n in ACCEPTED:
            ctx.note(f"host rows: accepted {n}")
            sets = _sets(T_MAIN, n, gen, dev)
            rows_out.append({"accepted": n, "T": T_MAIN, **_time_rig(rig, sets, kw),
                             **_time_runtimes(rt_dev, rt_host, sets, kw)})
    finally:
        rt_dev.close()
        rt_host.close()
    sweep = []
    for T in T_SWEEP:
        ctx.note(f"host rows: T {T}")
        rig_t = rig if T == T_MAIN else Rig(T, emb, w, dev)
        sweep.append({"T": T, "accepted": 8, **_time_rig(rig_t, _sets(T, 8, gen, dev), kw)})
    return {
        "status": "ok", "H": H, "T": T_MAIN, "dtype": "bfloat16", "rows": rows_out, "T_sweep": sweep,
        "kernel_alone": _kernel_alone(),
        "method": "host clock from replay (or step()) start until the chosen rows are readable on the host, "
                  f"device idle before each call; median of {ctx.repeats} calls, {N_SETS} random sets "
                  "(tokens, chosen rows) rotated. Source step: embedding lookup + one matmul -> [T, H] bf16. "
                  "captured_gather: graph = source + gather_rows into a pinned slot, event wait, view of the "
                  "slot. runtime_device/runtime_host: GraphRuntime.step with HostRows device/host mode, then "
                  "handle.rows() (includes step()'s host work). copy_all (a): graph = source; all T rows, the "
                  "row list and count to pinned memory, wait, select on the host. item_select (b): graph = "
                  "source; count.item(), index_select, copy the rows to pinned memory, wait.",
    }


def _kernel_alone() -> Any:
    """The gather kernel's own bench helper (device time per replay), when it has one."""
    try:
        from cudagraph_rt.kernels.row_gather import bench_gather
    except ImportError:
        return None
    try:
        return [vars(bench_gather(H=H, rows=T_MAIN, count=n)) for n in ACCEPTED]
    except Exception as e:  # noqa: BLE001 - informational only
        return {"error": f"{type(e).__name__}: {e}"[:200]}
