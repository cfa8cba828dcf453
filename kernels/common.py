"""What the Triton kernels of this folder share, written once: whether Triton runs here and
how (:func:`triton_backend`), which tensors the dispatching entry points send to a kernel
(:func:`runs_kernel`), the launch's device scope and its programmatic-dependent-launch
options, and the small helpers of their argument checks and launch plans.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import Tensor

from cudagraph_rt.errors import InputError, expected

try:  # Triton is optional: without it every path runs the torch references.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

__all__ = ["CPU_RUNS_KERNELS", "DEPENDENT_LAUNCH", "check_tensor", "describe", "device_scope", "next_pow2",
           "pdl_launch", "pdl_options", "prev_pow2", "runs_kernel", "tl", "triton", "triton_backend"]

if triton is not None:

    @triton.jit
    def _probe():
        """Never launched: its type says what ``triton.jit`` makes in this process."""
        pass

    _BACKEND = "interpreter" if type(_probe).__name__ == "InterpretedFunction" else "compiled"
else:  # pragma: no cover
    _BACKEND = "unavailable"


def triton_backend() -> str:
    """How the Triton kernels run in this process: ``"compiled"`` (CUDA tensors),
    ``"interpreter"`` (``TRITON_INTERPRET=1`` was set before the kernels were imported: CPU
    tensors, no bf16, not capturable) or ``"unavailable"`` (no triton). Fixed at import:
    ``triton.jit`` chooses when a kernel is defined, so changing the environment afterwards
    changes nothing."""
    return _BACKEND


# CGRT_CPU_KERNELS=1 (with TRITON_INTERPRET=1) makes the dispatching entry points (cell_attention,
# write_cells, rotary_write_cells) run the Triton kernels on CPU tensors in the interpreter,
# e.g. to drive a model through them.
CPU_RUNS_KERNELS = os.environ.get("CGRT_CPU_KERNELS", "") == "1"


def runs_kernel(t) -> bool:
    """Whether a dispatching entry point sends ``t``'s call to the Triton kernel (else the
    torch reference): a CUDA tensor with compiled kernels, or a CPU tensor in the
    interpreter with :data:`CPU_RUNS_KERNELS`. Not a tensor: False (the reference's checks
    name it)."""
    if not isinstance(t, Tensor):
        return False
    backend = triton_backend()
    if t.device.type == "cuda":
        return backend == "compiled"
    return backend == "interpreter" and CPU_RUNS_KERNELS


# --------------------------------------------------------------------------------------
# Argument checks and launch plans (metadata only: no device values, safe during capture)
# --------------------------------------------------------------------------------------
def describe(t, *, pinned: bool = False) -> str:
    """``t`` in an error message: dtype, shape and device (with ``pinned``, whether host
    memory is page-locked, where CUDA can tell), or the type of a non-tensor."""
    if not isinstance(t, Tensor):
        return type(t).__name__
    where = ""
    if pinned and t.device.type == "cpu" and torch.cuda.is_available():
        where = ", pinned" if t.is_pinned() else ", not pinned"
    return f"{t.dtype} {tuple(t.shape)} on {t.device}{where}"


def check_tensor(name: str, t, dims: int, dtypes, device=None) -> None:
    """InputError naming ``name`` unless ``t`` is a ``dims``-D tensor of one of ``dtypes``
    (on ``device`` when given)."""
    if not isinstance(t, Tensor) or t.dim() != dims:
        raise InputError(expected(name, f"a {dims}-D tensor", describe(t)))
    if t.dtype not in dtypes:
        raise InputError(expected(name, f"dtype in {[str(x) for x in dtypes]}", t.dtype))
    if device is not None and t.device != device:
        raise InputError(expected(name, f"a tensor on {device} (the rows' device)", t.device))


def next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def prev_pow2(n: int) -> int:
    """The greatest power of two <= n (1 for n <= 1)."""
    return 1 << (max(1, int(n)).bit_length() - 1)


# --------------------------------------------------------------------------------------
# Launch options
# --------------------------------------------------------------------------------------
def device_scope(t: Tensor):
    """Triton launches on the current CUDA device: make it the tensor's (multi-GPU hosts)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


DEPENDENT_LAUNCH = True  # False: later launches and plans of these kernels use no PDL (captured graphs keep theirs)


def pdl_launch(device: torch.device) -> bool:
    """Whether a launch on ``device`` may use programmatic dependent launch (PDL): compiled
    kernels on Hopper or later, a Triton with ``gdc_wait``, and :data:`DEPENDENT_LAUNCH`."""
    return DEPENDENT_LAUNCH and device.type == "cuda" and triton_backend() == "compiled" \
        and hasattr(tl.extra.cuda, "gdc_wait") and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_options(device: torch.device, dependent: bool = True) -> dict:
    """A launch's PDL options: the kernel's ``PDL`` constexpr (always named: a bound
    launch's direct path needs every constexpr) and Triton's ``launch_pdl`` only where the
    launch is a dependent one: a Triton without that option (torch 2.6's Triton 3.2, in
    pyproject's range) refuses the keyword even when False."""
    pdl = bool(dependent) and pdl_launch(device)
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
