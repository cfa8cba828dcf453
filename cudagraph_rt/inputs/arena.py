"""Where every input's rows and every control block sit in one byte buffer (`ArenaLayout`),
and the views carved from a buffer with that layout. The device arena, the pinned staging
arenas and the feed all share one layout, so one copy moves all of them at once."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from .casting import NUMPY_DTYPES
from .spec import InputSpec, itemsize

ALIGN = 256  # bytes: keeps every view aligned for vectorised loads (and no word in two blocks)
ONE_COPY_BYTES = 64 * 1024  # below this a host-to-device copy costs its latency, not its size
SRC = "__src__"  # fed graphs' control block: per input, whether the feed holds its rows
ROWS_T = "__t__"  # fed graphs' control block: the step's real rows (rows from T on are padding)


class ArenaLayout:
    """``rows`` rows of every input, each a contiguous block, then the fixed-size control
    blocks (``control``: name -> (words, dtype)), every block ``ALIGN``-aligned."""

    def __init__(self, specs: Mapping[str, InputSpec], rows: int, control: Mapping[str, tuple[int, torch.dtype]]):
        self.specs, self.rows, self.control = dict(specs), rows, dict(control)
        self.row_bytes = {n: s.row_bytes for n, s in self.specs.items()}
        self.offsets, off = {}, 0
        blocks = [(n, b * rows) for n, b in self.row_bytes.items()]
        blocks += [(n, numel * itemsize(dt)) for n, (numel, dt) in self.control.items()]
        for name, nbytes in blocks:
            self.offsets[name] = off
            off += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = max(off, ALIGN)

    def carve(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``buf`` (a uint8 buffer of ``nbytes``): ``[rows, *shape]`` per input,
        a flat block per control name."""
        out = {}
        for name, spec in self.specs.items():
            o = self.offsets[name]
            out[name] = buf[o:o + spec.row_bytes * self.rows].view(spec.dtype).view(self.rows, *spec.shape)
        for name, (numel, dt) in self.control.items():
            o = self.offsets[name]
            out[name] = buf[o:o + numel * itemsize(dt)].view(dt)
        return out

    @torch.no_grad()
    def fill_pads(self, views: Mapping[str, torch.Tensor], control: Mapping[str, Any] | None = None) -> None:
        """Pad values into every input row, zeros (or ``control``'s values) into the blocks."""
        for name, spec in self.specs.items():
            views[name].fill_(spec.pad)
        for name in self.control:
            views[name].zero_()
        for name, v in (control or {}).items():
            views[name][:len(v)].copy_(torch.as_tensor(v, dtype=views[name].dtype))

    def row_of_byte(self) -> torch.Tensor:
        """For each byte: the row of the input block that holds it, or -1 (control blocks
        and gaps). Bytes, not words: a word of a narrow dtype holds several rows."""
        rows = torch.full((self.nbytes,), -1, dtype=torch.int32)
        for name, nb in self.row_bytes.items():
            o = self.offsets[name]
            rows[o:o + nb * self.rows] = torch.arange(self.rows, dtype=torch.int32).repeat_interleave(nb)
        return rows

    def pad_bytes(self) -> torch.Tensor:
        """A buffer of this layout holding every input's pad value in every row."""
        buf = torch.zeros(self.nbytes, dtype=torch.uint8)
        self.fill_pads(self.carve(buf))
        return buf

    def input_of_word(self) -> torch.Tensor:
        """For each 4-byte word: the index of the input whose block holds it, or
        ``len(specs)`` for control blocks and gaps (ALIGN keeps words whole)."""
        words = torch.full((self.nbytes // 4,), len(self.specs), dtype=torch.int64)
        for i, (name, nb) in enumerate(self.row_bytes.items()):
            o = self.offsets[name]
            words[o // 4:-(-(o + nb * self.rows) // 4)] = i
        return words


def numpy_views(views: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """numpy views of host tensors (None for dtypes numpy lacks, and for device memory)."""
    return {n: (v.numpy() if v.device.type == "cpu" and v.dtype in NUMPY_DTYPES else None) for n, v in views.items()}
