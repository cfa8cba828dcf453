"""Merged q/k/v and gate/up projections, as serving engines load them, on the model's own weights.

:func:`fuse_projections` finds every module with ``q_proj``/``k_proj``/``v_proj`` (and
``gate_proj``/``up_proj``) linears of one input size, dtype and device, copies each
group's weights (and biases: Qwen2's q/k/v) into ONE merged tensor, one group at a time,
and replaces the linears by :class:`MergedLinear` modules whose ``weight``/``bias``
parameters are views of that tensor. Nothing of the model's source is patched, and:

* memory is not doubled: the old weights are freed group by group (peak: one group's
  weights twice), the parameters keep their names, shapes and bytes, so ``state_dict()``,
  ``load_state_dict()`` (it writes through the views), ``reference()`` and ``generate()``
  see the same storage; ``.to()``/``.half()``/``.cuda()`` move the merged tensor and re-view;
* the step runs one matmul per group: the first member called with an input computes the
  merged product and the others take their slice of it when called with the SAME tensor
  (in eager code an in-place change of that tensor in between is seen through its
  version and recomputed; inference tensors have no version: a step in inference mode
  must not change the input in place between the group's calls, which no transformers
  module does). torch.compile traces the same Python state (dynamo replays the
  bookkeeping; it ends empty, so no tensor outlives the call), so the compiled graph has
  one matmul per group too: inductor does not merge identical matmuls by itself.

After fusing, :func:`~.small_m.use_small_m_kernel` can route every merged product and
the layers' other projections (``o_proj``, ``down_proj``) through the small-M kernel at
decode widths (:func:`~.small_m.use_small_m_kernel`: M <= 16 rows on CUDA; F.linear
otherwise; the LM head stays on cuBLAS). Each group holds its product as a strategy
(:attr:`MergedWeights.product`: ``F.linear`` or a :class:`~.small_m.SmallMProduct`).

Works for Llama, Qwen2 (q/k/v biases), Qwen3 (q/k norms run on the q/k slices, as on the
separate outputs) and Mistral, and any model built with these names. Numerics: a merged
matmul may round differently from three (another kernel or split), within float tolerance.
``save_pretrained`` writes the parameters as separate tensors (transformers 5.24).
Inference only: gradients of the merged product reach the merged tensor, not the views.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class MergedWeights:
    """One group's merged ``weight`` [sum of outs, in] (and ``bias`` or None), how its
    product is computed (``product(x, weight, bias)``: ``F.linear`` unless
    :func:`~.small_m.use_small_m_kernel` set another) and the pending product of the
    current input (eager only). Owned by the group's :class:`MergedLinear` modules; not a
    module itself, so it adds no parameter."""

    def __init__(self, linears: list[nn.Linear]):
        self.sizes = tuple(m.out_features for m in linears)
        with torch.no_grad():
            self.weight = torch.cat([m.weight for m in linears])
            self.bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
        self.product = F.linear
        self._pending = None  # (input, its version, outputs, how many members may still take theirs)

    def rows(self, index: int) -> slice:
        start = sum(self.sizes[:index])
        return slice(start, start + self.sizes[index])

    def output(self, index: int, x: Tensor) -> Tensor:
        """Member ``index``'s ``F.linear`` of ``x``, from one merged product per input."""
        # Traced code has no in-place change in between; inference tensors (the runtime's
        # steps run in inference mode) keep no version counter.
        version = None if torch.compiler.is_compiling() or x.is_inference() else x._version
        p = self._pending
        if p is not None and p[0] is x and p[1] == version:
            self._pending = (x, version, p[2], p[3] - 1) if p[3] > 1 else None
            return p[2][index]
        outs = self.product(x, self.weight, self.bias).split(self.sizes, -1)
        self._pending = (x, version, outs, len(self.sizes) - 1)  # the others' turns still to come
        return outs[index]

    def convert(self, fn) -> None:
        """Apply a module conversion (``Module._apply``'s ``fn``) to the merged tensors."""
        self._pending = None
        self.weight = fn(self.weight)
        self.bias = None if self.bias is None else fn(self.bias)


class MergedLinear(nn.Linear):
    """An ``nn.Linear`` whose ``weight`` (and ``bias``) are rows of a :class:`MergedWeights`
    and whose forward takes its slice of the merged product. Same parameter names, shapes
    and values as the linear it replaces; lives as long as the model holds it."""

    def __init__(self, merged: MergedWeights, index: int, linear: nn.Linear):
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a weight
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.merged, self.index = merged, index
        self.weight = nn.Parameter(merged.weight[merged.rows(index)], requires_grad=linear.weight.requires_grad)
        if merged.bias is None:
            self.register_parameter("bias", None)
        else:
            self.bias = nn.Parameter(merged.bias[merged.rows(index)], requires_grad=linear.bias.requires_grad)

    def forward(self, x: Tensor) -> Tensor:
        return self.merged.output(self.index, x)

    def _apply(self, fn, recurse=True):
        # The first member of a group a conversion reaches still views the merged tensor:
        # it converts the merged tensor; every member then re-views it.
        m = self.merged
        if self.weight.untyped_storage().data_ptr() == m.weight.untyped_storage().data_ptr():
            m.convert(fn)
        self.weight.data = m.weight[m.rows(self.index)]
        if self.bias is not None:
            self.bias.data = m.bias[m.rows(self.index)]
        return self

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, merged rows {self.merged.rows(self.index)} of {sum(self.merged.sizes)}"


def _groups(model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """(module, member names) of every group of plain, compatible linears."""
    found = []
    for module in model.modules():
        for names in GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if all(type(m) is nn.Linear for m in linears) and _compatible(linears):
                found.append((module, names))
    return found


def _compatible(linears: list[nn.Linear]) -> bool:
    first = linears[0]
    return all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
               for m in linears)


def fuse_projections(model: nn.Module) -> int:
    """Merge every q/k/v and gate/up group of ``model`` in place (see the module doc);
    returns how many groups were merged (0 for a model without any, or already fused).
    Move the model to its device and dtype before or after: both work."""
    found = _groups(model)
    for module, names in found:  # no reference to a replaced linear survives its group
        merged = MergedWeights([getattr(module, n) for n in names])
        for i, name in enumerate(names):
            setattr(module, name, MergedLinear(merged, i, getattr(module, name)))
    return len(found)


__all__ = ["GROUPS", "MergedLinear", "MergedWeights", "fuse_projections"]
