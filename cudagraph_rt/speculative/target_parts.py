"""The two pieces of a target model a drafter borrows: its token embedding and its readout
(hidden row -> logits), for the toy and for the transformers models.

A draft head (``head.py``) reads the target's committed hidden rows and predicts the next
row; the target's own readout turns that into logits, and its embedding gives the head
the token after the row. A draft model (``draft_model.py``) reads its own step's hidden
rows through the same readout to sample. Both are views of the target's weights (never
copies, never trained).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ..errors import InputError, expected

__all__ = ["TargetParts", "target_parts"]


@dataclass(frozen=True)
class TargetParts:
    """``embed(tokens [N]) -> [N, embed_width]``; ``readout_weight`` ``[vocab, row_width]``
    such that ``logits = rows @ readout_weight.T`` for the model's hidden rows (the step's
    ``hidden`` output, ``row_width`` wide); ``vocab``. Both share the model's weights."""

    embed: Callable[[Tensor], Tensor]
    embed_width: int
    readout_weight: Tensor
    row_width: int
    vocab: int

    def logits(self, rows: Tensor) -> Tensor:
        return rows @ self.readout_weight.T


def target_parts(model) -> TargetParts:
    """The embedding and readout of ``model``: an HFDecoder (its input embeddings and LM
    head; rows are its normed last hidden state) or a ToyDecoder whose last tap is its last
    layer (rows are the taps side by side; the readout reads the last tap). InputError
    naming ``model`` for anything else (a toy without its last layer among the taps)."""
    from ..models.toy import ToyDecoder

    cfg = model.config
    if isinstance(model, ToyDecoder):
        if cfg.taps[-1] != cfg.layers - 1:
            raise InputError(expected("model", "a toy whose last tap is its last layer (the readout reads it)",
                                      f"taps {cfg.taps} of {cfg.layers} layers"))
        H, W = cfg.hidden, model.hidden_width
        # [vocab, W]: zeros over the earlier taps, wout^T over the last one
        weight = torch.zeros(cfg.vocab, W, dtype=model.wout.dtype, device=model.device)
        weight[:, W - H:] = model.wout.T
        return TargetParts(lambda t: model.emb.index_select(0, t), H, weight, W, cfg.vocab)
    head = getattr(model, "head", None)
    lm = getattr(model, "model", None)
    if head is None or lm is None or not hasattr(lm, "get_input_embeddings"):
        raise InputError(expected("model", "a ToyDecoder or an HFDecoder", type(model).__name__))
    emb = lm.get_input_embeddings()
    if getattr(head, "bias", None) is not None:
        raise InputError(expected("model", "an LM head without a bias", "a biased head"))
    return TargetParts(emb, emb.weight.shape[1], head.weight, model.hidden_width, cfg.vocab)
