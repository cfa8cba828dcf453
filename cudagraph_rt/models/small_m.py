"""A decoder layer's projections through the small-M kernel (kernels/small_linear.py) at decode widths.

cuBLAS serves the 1B Llama's layer matmuls at one to sixteen rows at 1.3-3.5x their
weight-read floor (tiles that leave most SMs idle); the kernel splits them over every SM.
:func:`use_small_m_kernel` routes a model's decoder-layer projections through it:

* every plain ``nn.Linear`` named in :data:`PROJECTIONS` (``q/k/v/o_proj``,
  ``gate/up/down_proj``) becomes a :class:`SmallMLinear` on the SAME parameters (same
  names, storage and ``state_dict()``; nothing is copied), and every merged group of
  :func:`~.fused.fuse_projections` computes its one product the same way. The LM head
  and anything else stay on cuBLAS (the head is a wide matmul, near its floor already);
* at run time, a product of M <= 16 rows (x's leading dimensions flattened) on CUDA runs
  the kernel; anything wider, and every product on a CPU, runs ``F.linear``. On a CPU the
  interpreted kernel runs instead when the product was made with ``interpret_on_cpu=True``
  (tests; needs ``TRITON_INTERPRET=1`` before the kernel module is imported);
* under ``torch.compile`` each product is ONE opaque op, ``torch.ops.cgrt.small_m_linear``
  (``torch.library.custom_op``, no mutated arguments; its fake gives [M, N] for a
  symbolic M), so a compiled step with a dynamic row dimension has one op call per
  projection, no extern mm for them and no graph break, and the M <= 16 choice is made
  inside the op, at run time, for every width one graph serves.

Numerics: the kernel accumulates in fp32 and rounds once, as cuBLAS does, but sums in
another order: results agree within the dtype's matmul tolerance, not bit for bit.
Inference only (the op has no autograd formula). The kernel's split scratch is shared by
launches of one shape: run the model's steps on one stream at a time (see the kernel).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import InputError, expected

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OP = "cgrt::small_m_linear"


def _kernel():
    from cudagraph_rt.kernels import small_linear
    return small_linear


def _triton_backend() -> str:
    from cudagraph_rt.kernels import common
    return common.triton_backend()


def _product(x: Tensor, weight: Tensor, bias: Optional[Tensor], interpret_on_cpu: bool) -> Tensor:
    """x [M, K] -> [M, N]: the kernel where it serves (M <= 16 on CUDA, or on a CPU when
    asked, in a dtype it takes), else F.linear (which also reports what it cannot take)."""
    k = _kernel()
    kernel_here = _triton_backend() == ("compiled" if x.device.type == "cuda" else "interpreter")
    if 0 < x.shape[0] <= k.MAX_ROWS and kernel_here and (x.device.type == "cuda" or interpret_on_cpu) \
            and x.dtype in k.SUPPORTED_DTYPES and weight.dtype == x.dtype:
        return k.small_linear(x, weight, bias)
    return F.linear(x, weight, bias)


@torch.library.custom_op(OP, mutates_args=())
def _small_m_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], interpret_on_cpu: bool) -> Tensor:
    return _product(x, weight, bias, interpret_on_cpu)


@_small_m_linear.register_fake
def _small_m_linear_fake(x, weight, bias, interpret_on_cpu):
    return x.new_empty(x.shape[0], weight.shape[0])


@dataclass(frozen=True)
class SmallMProduct:
    """``F.linear(x, weight, bias)`` for x [..., K], the small-M kernel where it serves (see
    the module doc). A strategy object: :class:`~.fused.MergedWeights` and
    :class:`SmallMLinear` hold one. ``interpret_on_cpu``: CPU products of M <= 16 run the
    interpreted kernel (tests)."""

    interpret_on_cpu: bool = False

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        rows = x.reshape(-1, k)
        if torch.compiler.is_compiling():
            y = torch.ops.cgrt.small_m_linear(rows, weight, bias, self.interpret_on_cpu)
        else:  # eager: no dispatcher in between (host time), the same function
            y = _product(rows, weight, bias, self.interpret_on_cpu)
        return y.view(*lead, weight.shape[0])


class SmallMLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is a :class:`SmallMProduct`, on the parameters of
    the linear it replaces (the same Parameter objects: same names, values and storage).
    Lives as long as the model holds it."""

    def __init__(self, linear: nn.Linear, product: SmallMProduct):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias, self.product = linear.weight, linear.bias, product

    def forward(self, x: Tensor) -> Tensor:
        return self.product(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, small-M kernel"


def use_small_m_kernel(model: nn.Module, *, interpret_on_cpu: bool = False) -> int:
    """Route ``model``'s decoder-layer projections through the small-M kernel, in place
    (see the module doc); returns how many products now run through it (a merged group
    counts once; 0 for a model without projections). Idempotent. InputError for
    ``interpret_on_cpu=True`` without the Triton interpreter, before anything changes."""
    if interpret_on_cpu and _triton_backend() != "interpreter":
        raise InputError(expected("interpret_on_cpu", "False unless TRITON_INTERPRET=1 was set before the kernel "
                                  "module was imported", True))
    from .fused import MergedLinear

    product, merged, count = SmallMProduct(interpret_on_cpu), set(), 0
    for module in list(model.modules()):
        for name in PROJECTIONS:
            child = getattr(module, name, None)
            if type(child) is nn.Linear:
                setattr(module, name, SmallMLinear(child, product))
                count += 1
            elif isinstance(child, SmallMLinear):
                child.product = product
                count += 1
            elif isinstance(child, MergedLinear) and id(child.merged) not in merged:
                merged.add(id(child.merged))
                child.merged.product = product
                count += 1
    return count


__all__ = ["OP", "PROJECTIONS", "SmallMLinear", "SmallMProduct", "use_small_m_kernel"]
