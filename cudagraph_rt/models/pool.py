"""The paged KV pool every model steps on: cells in blocks, a host-side block allocator, a
per-sequence block table on the device, and the attention over a row's own cells.

Layout. ``k`` / ``v`` are ``[layers, (num_blocks + 1) * block_size, kv_heads, head_dim]``:
``num_blocks`` blocks for the sequences, then the scratch block (index ``num_blocks``),
whose first cell :attr:`KVPool.scratch_cell` padding rows write. The cell of position ``j``
of sequence ``s`` is ``block_table[s, j // block_size] * block_size + j % block_size``;
``block_table`` is int32 ``[max_seqs, cdiv(max_seq_len, block_size)]``, and an entry a
sequence does not use points at the scratch block (a stray read stays in bounds).

Allocation. :meth:`KVPool.cell_range` takes a block from a free list the first time one of
its positions is written (no reservation). :meth:`KVPool.fork` shares whole blocks by
refcount; a shared block is copied for the writer before a cell in it is handed out
(copy-on-write). The host writes a sequence's changed table entries as one small
stream-ordered copy from a fresh pinned tensor: no host sync, and a step queued before the
update reads the old entries (why this way: ARCHITECTURE.md, "The KV pool's block table").

Counters: on CUDA the pool owns ``counters``, the split counters of its attention launches
(:mod:`cudagraph_rt.kernels.attention`), and the bound attentions of piecewise replays
(:meth:`KVPool.bind_attend`) share one split scratch per dtype.

Lifetime: the pool lives as long as its model; ``k``, ``v``, ``block_table`` and
``counters`` never move (captured graphs read them at their addresses).
Failure modes: bad arguments raise :class:`~cudagraph_rt.errors.InputError`, a request for
more blocks than are free :class:`~cudagraph_rt.errors.CapacityError` (naming the sequence,
the blocks asked and free), a table update while the current stream captures a graph
:class:`~cudagraph_rt.errors.CaptureError`; each before anything is changed.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..checks import as_int, resolve_device
from ..errors import CapacityError, CaptureError, InputError, expected
from ..kernels.attention import (MAX_CELLS, cell_attention, cell_attention_reference, new_attention_counters,
                                 plan_cell_attention, plan_write_cells, write_cells, write_cells_reference)
from ..kernels.rotary_cells import rotary_write_cells, rotary_write_cells_reference

DEFAULT_BLOCK_SIZE = 16


def _count(name: str, v, lo: int = 1) -> int:
    """``v`` as an int >= ``lo`` (numpy integers taken; bools, floats and tensors refused),
    else InputError naming ``name``."""
    return as_int(name, v, lo)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_cells(max_seqs: int, max_len: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """A pool where every sequence can reach ``max_len`` at once: ``max_seqs * max_len``,
    each sequence's share rounded up to whole blocks."""
    return max_seqs * cdiv(max_len, block_size) * block_size


class KVPool:
    """A paged KV pool of at least ``cells`` cells for ``max_seqs`` sequences of up to
    ``max_seq_len`` positions each (see the module docstring for the layout, the allocator
    and how the block table is updated).

    Attributes: ``k``, ``v`` (the caches), ``block_table`` (device, int32), ``counters``
    (the attention's split counters on CUDA, None elsewhere), ``block_size``,
    ``num_blocks`` (blocks for sequences, the scratch block not counted), ``free_blocks``,
    ``scratch_block``, ``scratch_cell``, ``max_seqs``, ``max_seq_len``, ``max_blocks`` (the
    table's width). ``device``: one this machine has (None: CUDA when there is one, else
    the CPU; see :func:`cudagraph_rt.checks.resolve_device`); the sizes are ints (numpy
    integers taken as the plain int). The step functions read ``k``, ``v`` and ``block_table`` only through
    :meth:`attend` and :meth:`device_cells` (capturable); every other method is host-side
    and must run outside a graph capture.
    """

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device,
                 cells: int, max_seqs: int, max_seq_len: int, block_size: int = DEFAULT_BLOCK_SIZE):
        layers, kv_heads, head_dim, cells, max_seqs, max_seq_len, block_size = (
            _count(f"KVPool.{name}", v) for name, v in (
                ("layers", layers), ("kv_heads", kv_heads), ("head_dim", head_dim), ("cells", cells),
                ("max_seqs", max_seqs), ("max_seq_len", max_seq_len), ("block_size", block_size)))
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InputError(expected("KVPool.dtype", "a floating torch.dtype", repr(dtype)))
        if (cdiv(cells, block_size) + 1) * block_size > MAX_CELLS:  # checked before a byte is allocated
            raise InputError(expected("KVPool.cells", f"at most {MAX_CELLS} cells with the scratch block (the "
                                      "attention addresses a cache's cells as int32)", cells))
        self.device = resolve_device(device, "KVPool.device")
        self.block_size, self.max_seqs, self.max_seq_len = block_size, max_seqs, max_seq_len
        self.num_blocks = cdiv(cells, block_size)
        self.scratch_block = self.num_blocks
        self.scratch_cell = self.num_blocks * block_size
        self.max_blocks = cdiv(max_seq_len, block_size)
        shape = (layers, (self.num_blocks + 1) * block_size, kv_heads, head_dim)
        # Zeroed, never uninitialised: a reference attention multiplies masked cells by 0.
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.block_table = torch.full((max_seqs, self.max_blocks), self.scratch_block, dtype=torch.int32,
                                      device=self.device)
        self._pin = self.device.type == "cuda"
        self.counters = new_attention_counters(self.device) if self._pin else None
        self._scratch: dict[torch.dtype, tuple[Tensor, Tensor]] = {}  # bind_attend's split partials
        self._clear_host()

    def _clear_host(self) -> None:
        self._rows = [[self.scratch_block] * self.max_blocks for _ in range(self.max_seqs)]  # host mirror
        self._refs = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))  # a stack: block 0 is taken first

    # ------------------------------------------------------------------ host-side queries
    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes of ``k`` and ``v`` together."""
        return 2 * self.k.numel() * self.k.element_size()

    def blocks(self, seq: int) -> list[int]:
        """The blocks ``seq`` holds, by block index of its table (None where it has none)."""
        seq = self._seq(seq, "seq")
        return [None if b == self.scratch_block else b for b in self._rows[seq]]

    def refcount(self, block: int) -> int:
        """How many sequences' tables hold ``block`` (0: free)."""
        b = _count("block", block, 0)
        if b >= self.num_blocks:
            raise InputError(expected("block", f"in [0, {self.num_blocks})", b))
        return self._refs[b]

    def readers(self, cell: int) -> list[tuple[int, int]]:
        """``(seq, pos)`` of every sequence position whose table maps to ``cell``: a scan of
        the table, for messages about one cell (not for a step's hot path)."""
        blk, off = divmod(_count("cell", cell, 0), self.block_size)
        if blk >= self.num_blocks:
            return []
        return [(s, b * self.block_size + off) for s, row in enumerate(self._rows) for b, x in enumerate(row)
                if x == blk and b * self.block_size + off < self.max_seq_len]

    # ------------------------------------------------------------------ allocation
    def cell_for(self, seq: int, pos: int) -> int:
        """The cell a row of ``seq`` at ``pos`` WRITES (see :meth:`cell_range`)."""
        p = _count("pos", pos, 0)
        if p >= self.max_seq_len:
            raise InputError(expected("pos", f"in [0, {self.max_seq_len})", p))
        return self.cell_range(seq, p, 1)[0]

    def cell_range(self, seq: int, pos0: int, n: int) -> list[int]:
        """The cells rows of ``seq`` at positions ``pos0 .. pos0 + n - 1`` write, in order.

        Takes a block for every block index of the range the sequence does not hold yet,
        and copies (all layers) every block of the range it shares with another sequence,
        then writes the changed table entries (one copy). The
        cells stay valid until the sequence is freed, forked over, or reset. All or
        nothing: CapacityError when the free blocks do not cover the range's new blocks,
        InputError for a bad seq, pos0 or n; nothing changed by either."""
        seq = self._seq(seq, "seq")
        pos0, n = _count("pos0", pos0, 0), _count("n", n, 0)
        if pos0 + max(n, 1) > self.max_seq_len:
            raise InputError(expected("pos0 + n", f"positions within max_seq_len {self.max_seq_len}",
                                      f"positions {pos0}..{pos0 + max(n, 1) - 1}"))
        if n == 0:
            return []
        bs, row = self.block_size, self._rows[seq]
        b0, b1 = pos0 // bs, (pos0 + n - 1) // bs
        need = [b for b in range(b0, b1 + 1) if row[b] == self.scratch_block or self._refs[row[b]] > 1]
        if need:
            self._take(seq, need, f"positions {pos0}..{pos0 + n - 1}")
        cells: list[int] = []
        for b in range(b0, b1 + 1):
            shift = (row[b] - b) * bs
            cells.extend(range(shift + max(pos0, b * bs), shift + min(pos0 + n, (b + 1) * bs)))
        return cells

    def free(self, seq: int) -> None:
        """Give back every block ``seq`` holds (a shared block only once no other sequence
        holds it) and point its table row at the scratch block. A sequence without blocks
        costs nothing. The next sequence on this id starts empty."""
        seq = self._seq(seq, "seq")
        row = self._rows[seq]
        held = [b for b in row if b != self.scratch_block]
        if not held:
            return
        self._host_side()
        for b in reversed(held):  # pushed in reverse: the next takes pop them in table order
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
        row[:] = [self.scratch_block] * self.max_blocks
        self.block_table[seq].fill_(self.scratch_block)

    def fork(self, src: int, dst: int, upto: int) -> None:
        """``dst`` continues ``src``'s positions ``[0, upto)``: dst's own blocks are freed
        first, then it shares src's whole blocks below ``upto`` by reference (refcount + 1,
        nothing copied) and gets a copy of the last partial block (its cells, all layers).
        Later writes of either sequence into a shared block copy it first (copy-on-write),
        so neither disturbs the other. InputError when src lacks a block below ``upto`` or
        ``src == dst``; CapacityError when the partial block finds no free block (after
        dst's blocks would be freed); nothing changed by either."""
        src, dst = self._seq(src, "src"), self._seq(dst, "dst")
        upto = _count("upto", upto, 0)
        if src == dst:
            raise InputError(expected("dst", f"a sequence other than src {src}", dst))
        if upto > self.max_seq_len:
            raise InputError(expected("upto", f"<= max_seq_len {self.max_seq_len}", upto))
        full, partial = divmod(upto, self.block_size)
        srow, drow = self._rows[src], self._rows[dst]
        missing = [b for b in range(full + (partial > 0)) if srow[b] == self.scratch_block]
        if missing:
            raise InputError(expected("src", f"a sequence holding positions [0, {upto})",
                                      f"seq {src} without block(s) {missing}"))
        released = sum(1 for b in drow if b != self.scratch_block and self._refs[b] == 1)
        if partial and self.free_blocks + released < 1:
            raise CapacityError(f"fork of seq {src} into seq {dst} (upto {upto}): needs 1 block for the partial "
                                f"block, {self.free_blocks} free of {self.num_blocks}")
        self._host_side()
        self.free(dst)
        for b in range(full):
            drow[b] = srow[b]
            self._refs[srow[b]] += 1
        if partial:
            drow[full] = new = self._free.pop()
            self._refs[new] = 1
            self._copy_blocks([(srow[full], new)])
        if upto:
            self._write_row(dst, 0, full + (partial > 0))

    def reset(self) -> None:
        """Every block free, every table entry the scratch block, K/V zeroed."""
        self._host_side()
        self._clear_host()
        self.block_table.fill_(self.scratch_block)
        self.k.zero_()
        self.v.zero_()

    # ------------------------------------------------------------------ on the device (capturable)
    def device_cells(self, seq_ids: Tensor, positions: Tensor) -> Tensor:
        """[N] int64: the cell each row writes, read from the block table ON THE DEVICE (no
        host read: capturable, for decode loops that keep tokens on the device). Padding
        rows (seq id < 0) get :attr:`scratch_cell`. Allocates nothing: reserve the
        positions first (:meth:`cell_range`); a position the sequence holds no block for
        maps into the scratch block (never out of bounds, but not the sequence's)."""
        live = seq_ids >= 0
        seq, pos = seq_ids.clamp(min=0).long(), positions.long()
        blk = self.block_table[seq, pos // self.block_size].long()
        cells = blk * self.block_size + pos % self.block_size
        return torch.where(live, cells, torch.full_like(cells, self.scratch_cell))

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, seq_ids: Tensor, positions: Tensor,
               cells: Tensor, *, scale: float, window: int | None = None, slopes: Tensor | None = None,
               bias_shift: int = 0, out: Tensor | None = None,
               rotary: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Write the rows' ``k`` / ``v`` ``[N, kv_heads, head_dim]`` at ``cells`` of ``layer``,
        then return every row's attention over its own sequence's positions ``<=`` its own
        (through the block table), ``[N, heads, head_dim]`` in q's dtype: the Triton kernels
        on CUDA, their torch references elsewhere (contract in
        :mod:`cudagraph_rt.kernels.attention`). All rows write before any reads, so
        the rows of one step see each other. Capturable; no host read.

        ``rotary``: the rows' ``(cos, sin)`` ``[N, head_dim]`` when q and k come unrotated:
        the write rotates k into its cell and q into a fresh buffer the attention reads, in
        one launch (:mod:`cudagraph_rt.kernels.rotary_cells`, transformers' rotation)."""
        kc, vc = self.k[layer], self.v[layer]
        write, attention = ((write_cells, cell_attention) if q.is_cuda
                            else (write_cells_reference, cell_attention_reference))
        if rotary is None:
            write(k, v, kc, vc, cells)
        else:
            rotate = rotary_write_cells if q.is_cuda else rotary_write_cells_reference
            q = rotate(q, k, v, *rotary, kc, vc, cells, q.new_empty(q.shape))
        return attention(q, kc, vc, self.block_table, seq_ids, positions, block_size=self.block_size,
                         scale=scale, window=window, slopes=slopes, bias_shift=bias_shift, out=out,
                         counters=self.counters, dependent=True)  # right after its own write

    def bind_attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, seq_ids: Tensor, positions: Tensor,
                    cells: Tensor, *, scale: float, out: Tensor, window: int | None = None,
                    slopes: Tensor | None = None, bias_shift: int = 0):
        """:meth:`attend` on these very tensors as a zero-argument callable (returning
        ``out``): checked, planned and its scratch allocated once, here; each call then
        launches the two kernels and nothing else on the host (on CUDA; the references
        elsewhere, as :meth:`attend`). What a piecewise replay runs between two graphs for
        a call marked eager (:func:`cudagraph_rt.eager`'s ``bind``). Raises InputError
        here, before anything is written (``layer`` included: an int in ``[0, layers)``, where
        :meth:`attend` indexes the caches as given). Lifetime: as long as its tensors and
        this pool."""
        layer = self._layer(layer)
        kc, vc = self.k[layer], self.v[layer]
        if not q.is_cuda:  # the checks once, then attend itself: its references are plain calls
            plan_write_cells(k, v, kc, vc, cells)
            plan_cell_attention(q, kc, vc, self.block_table, seq_ids, positions, block_size=self.block_size,
                                scale=scale, out=out, window=window, slopes=slopes, bias_shift=bias_shift)
            return functools.partial(self.attend, layer, q, k, v, seq_ids, positions, cells, scale=scale,
                                     window=window, slopes=slopes, bias_shift=bias_shift, out=out)
        write = plan_write_cells(k, v, kc, vc, cells).run
        attention = plan_cell_attention(q, kc, vc, self.block_table, seq_ids, positions, block_size=self.block_size,
                                        scale=scale, out=out, window=window, slopes=slopes, bias_shift=bias_shift,
                                        counters=self.counters, scratch=self._bound_scratch, dependent=True).run

        def attend() -> Tensor:
            write()
            return attention()
        return attend

    # ------------------------------------------------------------------ internals
    def _bound_scratch(self, lse_elements: int, out_elements: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The split scratch every bound attention of this pool shares (they run one after
        the other, on the stream that steps the model, as its counters): grown when a bind
        needs more, the old buffers kept by the binds that hold them."""
        have = self._scratch.get(dtype)
        if have is None or have[0].numel() < lse_elements or have[1].numel() < out_elements:
            lse = max(lse_elements, have[0].numel() if have else 0)
            part = max(out_elements, have[1].numel() if have else 0)
            have = (torch.empty(lse, dtype=torch.float32, device=self.device),
                    torch.empty(part, dtype=dtype, device=self.device))
            self._scratch[dtype] = have
        return have

    def _layer(self, layer) -> int:
        """``layer`` as an index in ``[0, layers)``, else InputError (a negative one would
        silently pick a layer from the end)."""
        return as_int("layer", layer, 0, self.k.shape[0] - 1, f"an int in [0, {self.k.shape[0]})")

    def _seq(self, seq, name: str) -> int:
        """``seq`` as a sequence id in ``[0, max_seqs)``, else InputError naming ``name``."""
        return as_int(name, seq, 0, self.max_seqs - 1, f"a sequence id in [0, {self.max_seqs})")

    def _host_side(self) -> None:
        """CaptureError while the current stream captures: a table update in a graph would
        be replayed with stale host values."""
        if self._pin and torch.cuda.is_current_stream_capturing():
            raise CaptureError("KVPool: the block table is updated by the host, outside any graph capture "
                               "(reserve cells before the step; use device_cells inside it)")

    def _take(self, seq: int, need: list[int], what: str) -> None:
        """A fresh block for each block index in ``need`` (increasing) of ``seq``'s row:
        copied from the shared one it replaces, if any; then one table write."""
        if len(need) > len(self._free):
            raise CapacityError(f"seq {seq}: {what} need {len(need)} new block(s) of {self.block_size} cells, "
                                f"{len(self._free)} free of {self.num_blocks}")
        self._host_side()
        row, copies = self._rows[seq], []
        for b in need:
            new = self._free.pop()
            self._refs[new] = 1
            if row[b] != self.scratch_block:  # shared (refcount > 1): copy on write
                self._refs[row[b]] -= 1
                copies.append((row[b], new))
            row[b] = new
        self._copy_blocks(copies)
        self._write_row(seq, need[0], need[-1] + 1)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in pairs:
            for cache in (self.k, self.v):
                cache[:, dst * bs:(dst + 1) * bs].copy_(cache[:, src * bs:(src + 1) * bs])

    def _write_row(self, seq: int, lo: int, hi: int) -> None:
        """Device entries ``[lo, hi)`` of ``seq``'s row from the host mirror: one copy from a
        fresh pinned tensor on CUDA, a plain copy elsewhere."""
        vals = torch.tensor(self._rows[seq][lo:hi], dtype=torch.int32, pin_memory=self._pin)
        self.block_table[seq, lo:hi].copy_(vals, non_blocking=self._pin)


__all__ = ["DEFAULT_BLOCK_SIZE", "KVPool", "cdiv", "default_cells"]
