"""What the outer graph of conditional nodes needs, detected; and the message naming what is
missing where it cannot be built (the loop then runs its rounds host-driven).

Needs: a CUDA device; a driver of CUDA 12.4+ for conditional WHILE nodes and 12.8+ for
SWITCH nodes (``cuDriverGetVersion`` >= 12080); cuda-python's ``cuda.bindings`` (driver and
NVRTC modules; the ``dev`` / ``gpu`` extras) with an NVRTC library to compile the kernel that
sets the nodes' values; torch whose ``CUDAGraph(keep_graph=True)`` hands out the captured
graph (``raw_cuda_graph()``, torch 2.5+), so the widths' graphs can be child graphs.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

SWITCH_DRIVER = 12080  # CUDA 12.8: conditional SWITCH nodes (12.4: IF and WHILE)


@dataclass(frozen=True)
class Support:
    """What was found (``driver`` as cuDriverGetVersion reports it, or None) and, per
    missing piece, a line naming it; ``ok`` when nothing is missing."""

    cuda: bool
    driver: int | None
    bindings: str | None
    nvrtc: str | None
    torch: str
    raw_graph: bool

    @property
    def missing(self) -> tuple[str, ...]:
        out = []
        if not self.cuda:
            out.append("a CUDA device (torch.cuda.is_available() is False)")
        if self.bindings is None:
            out.append("cuda-python's cuda.bindings (pip install 'cuda-python>=12.8')")
        elif self.nvrtc is None:
            out.append("an NVRTC library for cuda.bindings.nvrtc (pip install nvidia-cuda-nvrtc-cu12)")
        if self.cuda and self.bindings is not None and (self.driver or 0) < SWITCH_DRIVER:
            out.append(f"a driver of CUDA 12.8+ for conditional SWITCH nodes (found {_cuda_version(self.driver)})")
        if not self.raw_graph:
            out.append(f"torch.cuda.CUDAGraph(keep_graph=True).raw_cuda_graph() (torch 2.5+; found {self.torch})")
        return tuple(out)

    @property
    def ok(self) -> bool:
        return not self.missing

    @property
    def message(self) -> str:
        if self.ok:
            return (f"conditional nodes available: driver {_cuda_version(self.driver)}, cuda.bindings "
                    f"{self.bindings}, NVRTC {self.nvrtc}, torch {self.torch}")
        return "device dispatch needs " + "; ".join(self.missing)


def _cuda_version(v: int | None) -> str:
    return "none" if not v else f"CUDA {v // 1000}.{v % 1000 // 10}"


def torch_hands_out_graphs(torch) -> bool:
    """Whether this torch's CUDAGraph keeps its captured graph and hands it out."""
    graph = getattr(getattr(torch, "cuda", None), "CUDAGraph", None)
    if graph is None or not hasattr(graph, "raw_cuda_graph"):
        return False
    try:
        return "keep_graph" in inspect.signature(graph.__init__).parameters or \
            "keep_graph" in inspect.signature(graph.__new__).parameters
    except (TypeError, ValueError):  # a C type without a signature: the method is what counts
        return True


def conditional_support() -> Support:
    """The facts of this process (never raises; imports cuda.bindings only if present)."""
    import torch
    cuda = torch.cuda.is_available()
    bindings = nvrtc_version = driver = None
    try:
        import cuda.bindings as cb
        from cuda.bindings import driver as drv, nvrtc
        bindings = getattr(cb, "__version__", "unknown")
        err, major, minor = nvrtc.nvrtcVersion()
        nvrtc_version = f"{major}.{minor}" if int(err) == 0 else None
        if cuda:
            torch.cuda.init()
            err, v = drv.cuDriverGetVersion()
            driver = int(v) if int(err) == 0 else None
    except Exception:  # noqa: BLE001 - a missing library reads as missing, whatever it raised
        pass
    return Support(cuda, driver, bindings, nvrtc_version, torch.__version__, torch_hands_out_graphs(torch))
