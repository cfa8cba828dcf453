"""The cell attention's host side: the split counters and scratch, the launchers
(:func:`cell_attention_triton`, :func:`write_cells_triton`), and the planned calls a model
repeats every step (:func:`plan_cell_attention`, :func:`plan_write_cells`: everything checked,
planned and allocated once, then :meth:`PlannedCall.run` is one launch), as FlashInfer's
``plan`` / ``run``. The contract: :mod:`cudagraph_rt.kernels.attention`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from cudagraph_rt.checks import as_int, resolve_device
from cudagraph_rt.errors import CaptureError, InputError, expected

from ..common import describe, device_scope, next_pow2, pdl_options, runs_kernel, triton_backend
from .checks import check_attention_args, check_plan, check_write_args
from .kernel import cell_attention_kernel, write_cells_kernel
from .reference import cell_attention_reference, write_cells_reference
from .tuning import AttentionConfig, AttentionPlan, kernel_constants, plan_attention

__all__ = ["BoundLaunch", "COUNTERS", "PlannedCall", "attention_counters", "cell_attention_triton",
           "new_attention_counters", "plan_cell_attention", "plan_write_cells", "write_cells_triton"]

LOG2E = 1.4426950408889634
COUNTERS = 1 << 16  # arrival counters per buffer: (tile, program, KV head, row slot) of grids up to 65,536


# --------------------------------------------------------------------------------------
# The split counters and scratch
# --------------------------------------------------------------------------------------
def new_attention_counters(device, entries: int = COUNTERS) -> Tensor:
    """A zeroed arrival-counter buffer of ``entries`` int32 counters: enough for split
    launches of up to that many (tile, program, KV head, row slot of a tile: the power of
    two >= rows per tile) counters. The kernel leaves it zero after every launch. Its
    owner passes it as ``counters=`` (:class:`~cudagraph_rt.models.pool.KVPool` owns one);
    this process's shared buffers (:func:`attention_counters`) are made here too. Keep it
    alive (and at its address) as long as any graph that captured a launch with it;
    launches that may run at the same time (other streams) each need their own. InputError
    for a device this machine lacks (:func:`cudagraph_rt.checks.resolve_device`) or
    ``entries`` < 1."""
    return torch.zeros(as_int("entries", entries, 1), dtype=torch.int32, device=resolve_device(device))


_COUNTER_BUFFERS: dict[torch.device, list[Tensor]] = {}


def attention_counters(device, need: int = 1, counters: Tensor | None = None) -> Tensor:
    """The arrival counters a split launch of ``need`` counters on ``device`` uses:
    ``counters`` when its caller owns them (InputError when it holds fewer), else this
    process's shared buffer of the device, allocated zeroed on first use and replaced by
    a bigger one when a launch needs more. Old buffers stay alive (graphs captured with
    them keep replaying them). Raises CaptureError when it would have to allocate while
    the current stream captures (a buffer allocated in a capture belongs to the graph):
    make one launch of the widest grid before capturing, or pass ``counters``. InputError
    for a device this machine lacks."""
    if counters is not None:
        if counters.numel() < need:
            raise InputError(expected("counters", f"at least {need} entries (tiles x programs x KV heads x row "
                                      "slots)", counters.numel()))
        return counters
    bufs = _COUNTER_BUFFERS.get(device) if isinstance(device, torch.device) else None
    dev = device
    if bufs is None:  # a device not seen before (a launch's are): checked once, then a key
        dev = resolve_device(device)
        bufs = _COUNTER_BUFFERS.setdefault(dev, [])
    if bufs and bufs[-1].numel() >= need:
        return bufs[-1]
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise CaptureError(f"cell_attention: the split counters of {dev} ({need} entries) are allocated outside "
                           "graph capture: launch once before capturing, or pass counters=")
    bufs.append(new_attention_counters(dev, max(COUNTERS, next_pow2(need))))
    return bufs[-1]


def _split_scratch(q: Tensor, out: Tensor, plan: AttentionPlan, counters: Tensor | None, need: int):
    """The split partials (log-sum-exp fp32, outputs in out's dtype) and the counters
    (:func:`attention_counters`); for one split, dummies the kernel never touches."""
    if plan.splits == 1:
        return out, out, out
    counters = attention_counters(q.device, need, counters)
    N, Hq, D = q.shape
    pm = torch.empty((N, Hq, plan.splits), dtype=torch.float32, device=q.device)
    pacc = torch.empty((N, Hq, plan.splits, D), dtype=out.dtype, device=q.device)
    return pm, pacc, counters


# --------------------------------------------------------------------------------------
# Launch arguments and the launchers
# --------------------------------------------------------------------------------------
def _launch_options(config: AttentionConfig, device: torch.device, dependent: bool = False) -> dict:
    """The launch's options on CUDA: warps, stages and the PDL options
    (:func:`~cudagraph_rt.kernels.common.pdl_options`)."""
    if device.type != "cuda":
        return {}
    return {"num_warps": config.num_warps, "num_stages": config.num_stages, **pdl_options(device, dependent)}


def _attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, slopes, out, scratch, plan, block_size,
                    scale, bias_shift, window) -> tuple:
    """The attention kernel's runtime arguments, in its signature's order."""
    N, Hq, _ = q.shape
    pm, pacc, cnt = scratch
    return (q, k_cache, v_cache, block_table, seq_ids, positions, q if slopes is None else slopes, out, pm, pacc, cnt,
            N, Hq, plan.splits, max(1, plan.config.min_chunk), block_table.shape[0], k_cache.shape[0] // block_size,
            block_table.shape[1], float(scale) * LOG2E, int(bias_shift), int(window or 0), q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), block_table.stride(0),
            seq_ids.stride(0), positions.stride(0), out.stride(0), out.stride(1))


def _write_args(k, v, k_cache, v_cache, cells) -> tuple:
    """The K/V write kernel's runtime arguments, in its signature's order."""
    return (k, v, k_cache, v_cache, cells, k_cache.shape[0], cells.stride(0), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))


def _write_meta(Hkv: int, D: int) -> dict:
    return dict(HKV=Hkv, D=D, BLOCK_H=next_pow2(Hkv), BLOCK_D=next_pow2(D))


def cell_attention_triton(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_ids: Tensor,
                          positions: Tensor, *, block_size: int, scale: float, window: int | None = None,
                          slopes: Tensor | None = None, bias_shift: int = 0, out: Tensor | None = None,
                          splits: int | None = None, plan: AttentionPlan | None = None,
                          counters: Tensor | None = None, dependent: bool = False) -> Tensor:
    """The contract (:mod:`cudagraph_rt.kernels.attention`) on the Triton kernel, one launch
    (CUDA tensors; CPU tensors under ``TRITON_INTERPRET=1``). ``plan`` overrides
    :func:`plan_attention` (tests, tuning). ``counters``: the splits' arrival counters (see
    :func:`new_attention_counters`; None: this process's buffer of the device, see
    :func:`attention_counters`).

    ``dependent=True`` (where :func:`~cudagraph_rt.kernels.common.pdl_launch` allows it): a
    programmatic dependent launch; it starts while the launch before it is still finishing
    and waits for it (``griddepcontrol.wait``) before it reads q, the caches, the block
    table or the scratch or writes anything. Before the wait it reads ``seq_ids`` and ``positions``: the launch
    just before must not write those and must be ordered after what did (an ordinary
    launch, or a dependent one that waits before it lets this one start, as the K/V writes
    of :func:`write_cells_triton` and of :mod:`~cudagraph_rt.kernels.rotary_cells`, which
    :meth:`KVPool.attend` launches just before it). False: an ordinary launch, after
    everything before it.

    Asynchronous on the current stream and capturable: no host read of a device value;
    the split scratch comes from ``torch.empty`` (the graph's pool during capture). The
    first launch of each specialisation compiles: make it outside capture. Returns ``out``
    (or a new tensor), valid once the stream reaches it. Raises InputError before
    launching anything when an argument breaks the contract. Device values outside the
    contract give undefined numbers but never an access out of bounds: a sequence id past
    the block table reads nothing (its row comes out 0), and positions past the table's
    width or blocks outside the caches read nothing."""
    check_attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, block_size, window, slopes,
                         out, splits, counters, dependent, scale, bias_shift)
    if triton_backend() == "unavailable":
        raise RuntimeError("cell_attention_triton: triton is not installed; use cell_attention_reference")
    N, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    plan = plan_attention(N, Hq, Hkv, D, splits=splits) if plan is None else plan
    check_plan(plan)
    grid = (-(-N // plan.rows_per_tile) * plan.programs_per_tile, Hkv, plan.splits)
    with device_scope(q):
        out = torch.empty_like(q) if out is None else out
        if N == 0:
            return out
        pm, pacc, cnt = _split_scratch(q, out, plan, counters, grid[0] * grid[1] * next_pow2(plan.rows_per_tile))
        meta = kernel_constants(plan, Hq, Hkv, D, block_size, k_cache.dtype, window is not None, slopes is not None)
        cell_attention_kernel[grid](
            *_attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, slopes, out, (pm, pacc, cnt), plan,
                             block_size, scale, bias_shift, window),
            **meta, **_launch_options(plan.config, q.device, dependent))
    return out


def write_cells_triton(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cells: Tensor) -> None:
    """``k_cache[cells] = k`` and ``v_cache[cells] = v`` in one launch (CUDA tensors; CPU
    tensors under ``TRITON_INTERPRET=1``). Asynchronous and capturable (cells are read on
    the device); a cell outside the caches writes nothing; a cell given by several rows
    (the scratch cell of padding rows) gets each element from one of them, which one
    unspecified. Raises InputError before writing anything when an argument breaks the
    contract."""
    check_write_args(k, v, k_cache, v_cache, cells)
    if triton_backend() == "unavailable":
        raise RuntimeError("write_cells_triton: triton is not installed; use write_cells_reference")
    N, Hkv, D = k.shape
    if N == 0:
        return
    with device_scope(k):
        write_cells_kernel[(N,)](*_write_args(k, v, k_cache, v_cache, cells), **_write_meta(Hkv, D))


# --------------------------------------------------------------------------------------
# Planned calls: checked, planned and allocated once; then one launch a call
# --------------------------------------------------------------------------------------
class BoundLaunch:
    """One Triton kernel launch with every argument fixed, repeated by ``__call__`` on the
    current stream. The first call launches through Triton's ``kernel[grid](...)``
    (compiling if needed, outside any capture) and keeps the compiled kernel; later calls
    go straight to its launcher with the arguments in signature order, skipping the
    argument binding and the cache lookup (host time that outweighs the launch itself with
    the attention kernel's 38 arguments). Where that is unavailable (the interpreter, a Triton whose
    compiled kernel lacks the launcher) every call takes the first call's path.

    Lifetime: the tensors it holds stay alive with it; their contents may change between
    calls (a piece rewrites them), never their storage."""

    __slots__ = ("_kernel", "_grid", "_args", "_meta", "_device", "_fast", "_all")

    def __init__(self, kernel, grid: tuple, args: tuple, meta: dict, device: torch.device):
        self._kernel, self._grid, self._args, self._meta, self._device = kernel, grid, args, meta, device
        self._fast, self._all = None, ()

    @property
    def direct(self) -> bool:
        """Whether calls now go straight to the compiled kernel's launcher (after the first
        call, on CUDA, with a Triton that offers it)."""
        return self._fast is not None

    def __call__(self) -> None:
        fast = self._fast
        if fast is not None and torch.cuda.current_device() == self._device.index:
            fast(*self._all)
            return
        with torch.cuda.device(self._device) if self._device.type == "cuda" else contextlib.nullcontext():
            compiled = self._kernel[self._grid](*self._args, **self._meta)
        if fast is None and self._device.type == "cuda":
            self._fast, self._all = _fast_launcher(self._kernel, compiled, self._grid, self._args, self._meta)


def _fast_launcher(kernel, compiled, grid: tuple, args: tuple, meta: dict):
    """``(compiled[grid], every argument in the kernel's signature order)``, or ``(None, ())``
    when this Triton offers no such launcher (then each launch binds its arguments)."""
    names = getattr(kernel, "arg_names", None)
    if compiled is None or names is None or not hasattr(type(compiled), "__getitem__"):
        return None, ()
    values = dict(zip(names, args))
    for name in names[len(args):]:
        if name not in meta:
            return None, ()
        values[name] = meta[name]
    try:
        return compiled[tuple(grid) + (1,) * (3 - len(grid))], tuple(values[n] for n in names)
    except Exception:  # noqa: BLE001 - an older or newer launcher API: keep the binding path
        return None, ()


@dataclass(frozen=True, slots=True)
class PlannedCall:
    """A call planned once (:func:`plan_cell_attention`, :func:`plan_write_cells`): ``run()``
    makes it on the planned tensors, each time one kernel launch with nothing else on the
    host (or the torch reference, where the dispatching entry point would run it), and
    returns what the call returns (``out`` for the attention, None for the write).
    ``launch``: that :class:`BoundLaunch`, None where the reference runs or nothing is
    launched (no rows). Lifetime: as long as its tensors; their contents may change
    between runs (read on the device at each), never their storage."""

    run: Callable[[], Tensor | None]
    launch: BoundLaunch | None = None


def plan_cell_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, seq_ids: Tensor,
                        positions: Tensor, *, block_size: int, scale: float, out: Tensor, window: int | None = None,
                        slopes: Tensor | None = None, bias_shift: int = 0, plan: AttentionPlan | None = None,
                        counters: Tensor | None = None, scratch=None, dependent: bool = False) -> PlannedCall:
    """``cell_attention(...)`` on these very tensors, planned once: validation, the plan and
    the split scratch are done here; each :meth:`PlannedCall.run` then writes ``out``
    (required) and returns it, one launch (:class:`BoundLaunch`) with nothing else on the
    host: a marked eager call's replay between two graph pieces. Where
    :func:`~cudagraph_rt.kernels.attention.cell_attention` would run the reference, each
    run runs the reference.

    ``scratch`` (optional): ``scratch(lse_elements, out_elements, dtype)`` returns two flat
    contiguous buffers (float32 and ``dtype``, on q's device) of at least that many
    elements for the split partials, shared by planned calls that never run at the same
    time (one model's layers: :meth:`KVPool.bind_attend`); None: this call's own.
    Buffers that cannot hold them are an InputError, here.

    ``dependent``: as :func:`cell_attention_triton`'s (the launch before each run must
    not write ``seq_ids`` or ``positions`` and must be ordered after what did). Raises
    InputError here, before anything runs, when an argument breaks the contract."""
    if out is None:
        raise InputError(expected("out", "a tensor like q (a bound launch writes in place)", "None"))
    check_attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, block_size, window, slopes, out,
                         None, counters, dependent, scale, bias_shift)
    N, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    plan = plan_attention(N, Hq, Hkv, D) if plan is None else plan
    check_plan(plan)  # where the reference runs too: the argument is checked either way
    if not runs_kernel(q):
        kw = dict(block_size=block_size, scale=scale, window=window, slopes=slopes, bias_shift=bias_shift, out=out)
        return PlannedCall(lambda: cell_attention_reference(q, k_cache, v_cache, block_table, seq_ids, positions, **kw))
    if N == 0:
        return PlannedCall(lambda: out)
    grid = (-(-N // plan.rows_per_tile) * plan.programs_per_tile, Hkv, plan.splits)
    with device_scope(q):
        pm, pacc, cnt = _split_scratch(q, out, plan, counters, grid[0] * grid[1] * next_pow2(plan.rows_per_tile))
        if scratch is not None and plan.splits > 1:  # the same layout in shared memory
            pm, pacc = _in_shared_scratch(scratch, pm, pacc)
    meta = kernel_constants(plan, Hq, Hkv, D, block_size, k_cache.dtype, window is not None, slopes is not None)
    args = _attention_args(q, k_cache, v_cache, block_table, seq_ids, positions, slopes, out, (pm, pacc, cnt), plan,
                           block_size, scale, bias_shift, window)
    launch = BoundLaunch(cell_attention_kernel, grid, args,
                         {**meta, **_launch_options(plan.config, q.device, dependent)}, q.device)

    def attend() -> Tensor:
        launch()
        return out
    return PlannedCall(attend, launch)


def _in_shared_scratch(scratch, pm: Tensor, pacc: Tensor) -> tuple[Tensor, Tensor]:
    """``pm`` and ``pacc``'s layouts at the start of the buffers ``scratch`` gives (the
    kernel indexes them as contiguous), or InputError when they cannot hold them."""
    got = scratch(pm.numel(), pacc.numel(), pacc.dtype)
    want = (f"two flat contiguous tensors on {pm.device} of at least {pm.numel()} float32 and {pacc.numel()} "
            f"{str(pacc.dtype).replace('torch.', '')} elements")
    if not isinstance(got, (tuple, list)) or len(got) != 2 or not all(
            isinstance(b, Tensor) and b.dim() == 1 and b.is_contiguous() and b.device == pm.device
            and b.dtype == a.dtype and b.numel() >= a.numel() for a, b in zip((pm, pacc), got)):
        what = ", ".join(describe(b) + ("" if not isinstance(b, Tensor) or b.is_contiguous()
                                        else f" strides {b.stride()}")
                         for b in (got if isinstance(got, (tuple, list)) else (got,)))
        raise InputError(expected("scratch", want, what))
    lse, part = got
    return lse[:pm.numel()].view(pm.shape), part[:pacc.numel()].view(pacc.shape)


def plan_write_cells(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, cells: Tensor) -> PlannedCall:
    """``write_cells(k, v, k_cache, v_cache, cells)`` on these very tensors, planned once:
    checked here (InputError before anything is written), then one launch a
    :meth:`PlannedCall.run` (:class:`BoundLaunch`), or the reference where ``write_cells``
    would run it. Lifetime as :class:`PlannedCall`'s."""
    check_write_args(k, v, k_cache, v_cache, cells)
    if not runs_kernel(k):
        return PlannedCall(lambda: write_cells_reference(k, v, k_cache, v_cache, cells))
    N, Hkv, D = k.shape
    if N == 0:
        return PlannedCall(lambda: None)
    launch = BoundLaunch(write_cells_kernel, (N,), _write_args(k, v, k_cache, v_cache, cells), _write_meta(Hkv, D),
                         k.device)
    return PlannedCall(launch, launch)
