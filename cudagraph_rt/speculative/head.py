"""An EAGLE-style draft head: the target's hidden row at position p and the embedding of
the token at p + 1 in, the predicted hidden row at p + 1 out; the target's own readout
(over the head's draft vocabulary) turns it into the token at p + 2. Drafting feeds the
head its own predicted rows (``head_drafter.py``); training is ``training.py``.

The file format (:func:`save_head` / :func:`load_head`): one ``torch.save`` of
``{"config": HeadConfig as a dict, "state": the module's state dict}`` (tensors on the
CPU), and the config beside it as JSON (``PATH.json``) for people and tools to read
without torch.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checks import as_int
from ..errors import InputError, expected

__all__ = ["DraftHead", "HeadConfig", "load_head", "save_head"]

FORMAT = "cgrt-draft-head/1"


@dataclass(frozen=True)
class HeadConfig:
    """A head's sizes: ``row_width`` (the target's hidden rows), ``embed_width`` (its token
    embedding), ``hidden`` (the head's own width), ``layers`` residual MLP blocks,
    ``vocab`` (the target's), ``draft_vocab`` (how many token ids the head proposes from:
    its ``draft_ids`` buffer; ``vocab`` = all), ``target`` (what it was trained on, for
    people: e.g. ``hf:llama 1b seed 0``). Immutable; InputError naming a bad field."""

    row_width: int
    embed_width: int
    hidden: int
    vocab: int
    layers: int = 1
    draft_vocab: int | None = None
    target: str = ""

    def __post_init__(self):
        for name in ("row_width", "embed_width", "hidden", "vocab"):
            object.__setattr__(self, name, as_int(f"HeadConfig.{name}", getattr(self, name), 1))
        object.__setattr__(self, "layers", as_int("HeadConfig.layers", self.layers, 0))
        dv = self.vocab if self.draft_vocab is None else as_int("HeadConfig.draft_vocab", self.draft_vocab, 1,
                                                                   self.vocab)
        object.__setattr__(self, "draft_vocab", dv)


class _Norm(nn.Module):
    """RMS norm with a learned gain (fp32 inside: the rows come in bf16)."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (y * self.gain.float()).to(x.dtype)


class DraftHead(nn.Module):
    """``forward(row [N, row_width], emb [N, embed_width]) -> row' [N, row_width]``:
    ``[norm(row); norm(emb)]`` -> ``hidden`` -> ``layers`` residual SiLU MLP blocks ->
    ``row_width``, plus ``row`` itself (the next row starts from this one). ``draft_ids``
    ``[draft_vocab]`` int64: the token ids the head drafts from, most frequent first in
    training (the readout is the target's weight restricted to them)."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        self.norm_row, self.norm_emb = _Norm(cfg.row_width), _Norm(cfg.embed_width)
        self.inp = nn.Linear(cfg.row_width + cfg.embed_width, cfg.hidden)
        self.norms = nn.ModuleList(_Norm(cfg.hidden) for _ in range(cfg.layers))
        self.up = nn.ModuleList(nn.Linear(cfg.hidden, 2 * cfg.hidden) for _ in range(cfg.layers))
        self.down = nn.ModuleList(nn.Linear(2 * cfg.hidden, cfg.hidden) for _ in range(cfg.layers))
        self.out_norm = _Norm(cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.row_width)
        nn.init.zeros_(self.out.weight)  # starts as "the next row is this row"
        nn.init.zeros_(self.out.bias)
        self.register_buffer("draft_ids", torch.arange(cfg.draft_vocab, dtype=torch.int64))

    def forward(self, row: Tensor, emb: Tensor) -> Tensor:
        x = self.inp(torch.cat([self.norm_row(row), self.norm_emb(emb)], -1))
        for norm, up, down in zip(self.norms, self.up, self.down):
            x = x + down(F.silu(up(norm(x))))
        return row + self.out(self.out_norm(x))


def _json_path(path: str) -> str:
    return path + ".json"


def save_head(head: DraftHead, path: str) -> str:
    """Write ``head`` to ``path`` (and its config to ``path.json``); returns ``path``."""
    state = {k: v.detach().cpu() for k, v in head.state_dict().items()}
    torch.save({"format": FORMAT, "config": asdict(head.cfg), "state": state}, path)
    with open(_json_path(path), "w") as f:
        json.dump({"format": FORMAT, **asdict(head.cfg)}, f, indent=1)
    return path


def load_head(path: str, *, name: str = "path") -> DraftHead:
    """A head saved by :func:`save_head` (on the CPU, float32). InputError naming ``name``
    for a path that is no file or not a head file."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        raise InputError(expected(name, "a draft head file (cgrt train-drafter --kind head --out PATH)", repr(path)))
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is the same bad argument
        raise InputError(expected(name, "a draft head file", f"{path!r} ({type(e).__name__})")) from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        raise InputError(expected(name, f"a {FORMAT} file", repr(path)))
    cfg = HeadConfig(**blob["config"])
    head = DraftHead(cfg)
    head.load_state_dict(blob["state"])
    return head.eval()
