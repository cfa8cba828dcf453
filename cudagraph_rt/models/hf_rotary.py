"""transformers attention modules whose rotary embedding runs in the pool's K/V write.

transformers' attention forward rotates q and k itself and hands the attention function
the rotated tensors; compiled, that is two small kernels a layer (q's rotation, k's) before
the pool's K/V write, each a launch and a round trip through memory for a few KB. In
:meth:`HFDecoder.step` with ``attention="cells"``, the modules this installs on instead
give the pool q, k and v as the projections leave them, with the rows' ``(cos, sin)``:
one kernel rotates q, rotates k into its cell and copies v into its cell
(:mod:`cudagraph_rt.kernels.rotary_cells`), and the attention reads the rotated q.

:func:`install` sets an instance ``forward`` on each attention module of a family whose
forward it knows (Llama, Mistral, Qwen2, Qwen3: :data:`FAMILIES`; their q/k norms and
windows included); the class and its forward are untouched. The installed forward does the
module's own projections and norms, then the pool's attention with the same scale and
window the module's forward would pass, then the output projection. Outside a step of the pool's attention (the model's ``reference()``,
``generate()``, ``attention="eager-piece"`` or ``"varlen"``, rotary tables narrower than the
head) it calls the class's forward unchanged. :func:`uninstall` removes it.

Numerics: the rotation is computed in fp32 and rounded once, as inductor computes
transformers' expression; eager bf16 rounds after each product (a last-bit difference).
"""
from __future__ import annotations

import functools

from torch import nn

from . import attention_op

# attention class name -> where its forward reads the sliding window from
FAMILIES = {"LlamaAttention": None, "MistralAttention": "config", "Qwen2Attention": "module",
            "Qwen3Attention": "module"}


def _window(module: nn.Module, source: str | None):
    if source == "module":
        return getattr(module, "sliding_window", None)
    if source == "config":
        return getattr(module.config, "sliding_window", None)
    return None


def _rotary_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
    """The module's forward with the rotation and K/V write in the pool's one kernel (see
    the module doc); the class's forward where the step does not attend through the pool."""
    st, d = kwargs.get("cgrt_cells"), self.head_dim
    if (st is None or not st.rotary or position_embeddings is None or hidden_states.shape[0] != 1
            or position_embeddings[0].shape[-1] != d):  # (a partial rotary embedding: the class's own)
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    n = hidden_states.shape[1]
    q = self.q_proj(hidden_states).view(n, -1, d)
    k = self.k_proj(hidden_states).view(n, -1, d)
    v = self.v_proj(hidden_states).view(n, -1, d)
    if self._cgrt_norms:
        q, k = self.q_norm(q), self.k_norm(k)
    cos, sin = position_embeddings
    out = attention_op.attend(st.pool_id, self.layer_idx, q, k, v, st.seq_ids, st.positions, st.cells,
                              scale=self.scaling, window=_window(self, self._cgrt_window), rotary=(cos[0], sin[0]))
    return self.o_proj(out.view(1, n, -1)), None


def installable(module: nn.Module) -> bool:
    """Whether :func:`install` takes ``module``: an attention module of one of
    :data:`FAMILIES` with the projections, head size, scale and config its forward uses.
    (A step whose rotary tables do not cover the whole head runs the class's forward.)"""
    return type(module).__name__ in FAMILIES and all(
        hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx",
                                     "config"))


def install(model: nn.Module) -> int:
    """Install the pool-rotary forward on every attention module of ``model`` that
    :func:`installable` takes; returns how many (0: the model keeps its forwards). Idempotent."""
    n = 0
    for module in model.modules():
        if installable(module):
            module._cgrt_window = FAMILIES[type(module).__name__]
            module._cgrt_norms = hasattr(module, "q_norm") and hasattr(module, "k_norm")
            # a partial, not a bound method: it pickles (torch.save of the model; a bound method
            # pickles as getattr(module, '_rotary_forward')) and deep-copies onto the copy
            module.forward = functools.partial(_rotary_forward, module)
            n += 1
    return n


def uninstall(model: nn.Module) -> int:
    """Remove what :func:`install` set; returns how many modules had it."""
    n = 0
    for module in model.modules():
        if getattr(module.__dict__.get("forward"), "func", None) is _rotary_forward:
            del module.forward, module._cgrt_window, module._cgrt_norms
            n += 1
    return n


__all__ = ["FAMILIES", "install", "installable", "uninstall"]
