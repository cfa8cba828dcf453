"""Stand-ins the compile tests share until HFDecoder sits on the paged KVPool (issue 23):
a pool with KVPool's ``attend`` built on the cell-attention references, a small decoder in
plain torch, and a transformers model wired to the pool exactly as hf.py is to be (its
registered attention function calls :func:`cudagraph_rt.models.attention_op.attend`).

Each model has the surface the tests use of HFDecoder: ``step(inputs)`` -> ``tokens`` and
``hidden``, ``inputs()``, ``pool`` (``k``/``v`` [layers, cells, kv_heads, head_dim]),
``cell_for``, ``head``, ``clear_positions`` and ``compile_decoder(mode, **kwargs)``.
"""
from __future__ import annotations

import contextlib
import random

import torch
from torch import nn

from cudagraph_rt.kernels.attention import cell_attention_reference, write_cells_reference
from cudagraph_rt.models import attention_op
from cudagraph_rt.models.cells import ROW_INPUTS, take_rows
from cudagraph_rt.models.compiled import CompiledRows
from cudagraph_rt.inputs.spec import InputSpec


class StandInPool:
    """KVPool's attend over a fixed, shuffled block table: sequence s owns MB whole blocks
    (a random permutation of them, from ``seed``), the last block is the scratch block."""

    def __init__(self, *, layers, kv_heads, head_dim, max_seqs, max_seq_len, block_size=16, dtype=torch.float32,
                 device="cpu", seed=0):
        mb = -(-max_seq_len // block_size)
        blocks = max_seqs * mb
        order = list(range(blocks))
        random.Random(seed).shuffle(order)
        self.block_size, self.max_seqs, self.max_seq_len = block_size, max_seqs, max_seq_len
        self.k = torch.zeros(layers, (blocks + 1) * block_size, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.block_table = torch.tensor(order, dtype=torch.int32, device=device).view(max_seqs, mb)
        self.scratch_cell = blocks * block_size
        self._table = self.block_table.tolist()

    def cell_for(self, seq: int, pos: int) -> int:
        return self._table[seq][pos // self.block_size] * self.block_size + pos % self.block_size

    def attend(self, layer, q, k, v, seq_ids, positions, cells, *, scale, window=None, slopes=None, bias_shift=0,
               out=None):
        write_cells_reference(k, v, self.k[layer], self.v[layer], cells)
        return cell_attention_reference(q, self.k[layer], self.v[layer], self.block_table, seq_ids, positions,
                                        block_size=self.block_size, scale=scale, window=window, slopes=slopes,
                                        bias_shift=bias_shift, out=out)


class _Rows:
    """What the stand-ins share: the row inputs, the cell rule, the margin rule, compiling."""

    def inputs(self, verify: bool = False) -> dict[str, InputSpec]:
        return dict(tokens=InputSpec(pad=0), positions=InputSpec(pad=0), seq_ids=InputSpec(pad=-1),
                    cells=InputSpec(pad=self.pool.scratch_cell), want=InputSpec(pad=0))

    def cell_for(self, seq: int, pos: int) -> int:
        return self.pool.cell_for(seq, pos)

    def step(self, inputs):
        return self._rows(*take_rows(inputs, ROW_INPUTS, self.device))

    def compile_decoder(self, mode="default", **kwargs):
        """As HFDecoder's is to be: the step's rows through :class:`CompiledRows` (returned)."""
        self._rows = self._step_rows if mode is None else CompiledRows(self._step_rows, mode=mode, **kwargs)
        return None if mode is None else self._rows

    def clear_positions(self, logits, ulps=256.0):
        top2 = logits.float().topk(2, -1).values
        return (top2[:, 0] - top2[:, 1]) > ulps * torch.finfo(torch.float32).eps * logits.float().abs().amax(-1)


class PlainDecoder(_Rows, nn.Module):
    """Embedding, ``layers`` x (merged q/k/v, attention on the pool, o, residual), a head.
    ``in_graph=True`` calls ``pool.attend`` directly: under torch.compile the pool's
    ``index_copy_`` is then traced into the graph (the regression the op prevents)."""

    def __init__(self, *, in_graph=False, layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, vocab=512,
                 max_seqs=4, max_len=64, seed=0, device="cpu"):
        nn.Module.__init__(self)
        g = torch.Generator().manual_seed(seed)
        self.device, self.in_graph = torch.device(device), in_graph
        self.shape = (heads, kv_heads, head_dim)
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.ModuleList(nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(heads * head_dim, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        self.to(self.device)
        self.pool = StandInPool(layers=layers, kv_heads=kv_heads, head_dim=head_dim, max_seqs=max_seqs,
                                max_seq_len=max_len, seed=seed, device=self.device)
        self.pool_id = attention_op.pool_id(self.pool)
        self._rows = self._step_rows

    @torch.no_grad()
    def _step_rows(self, tokens, positions, seq_ids, cells, want):
        hq, hkv, d = self.shape
        h = self.embed(tokens)
        for layer, (qkv, o) in enumerate(zip(self.qkv, self.o)):
            q, k, v = qkv(h).split([hq * d, hkv * d, hkv * d], -1)
            q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
            if self.in_graph:
                a = self.pool.attend(layer, q, k, v, seq_ids, positions, cells, scale=d ** -0.5)
            else:
                a = attention_op.attend(self.pool_id, layer, q, k, v, seq_ids, positions, cells, scale=d ** -0.5)
            h = h + o(a.reshape(-1, hq * d))
        return {"tokens": self.head(h).argmax(-1).masked_fill(want != 1, -1), "hidden": h}


# ---------------------------------------------------------------------------- transformers
STAND_IN_ATTENTION = "cgrt_stand_in_pool"


class PoolRows:
    """The state one step hands every attention call through the model's kwargs."""

    def __init__(self, pool_id, seq_ids, positions, cells):
        self.pool_id, self.seq_ids, self.positions, self.cells = pool_id, seq_ids, positions, cells


def pool_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, cgrt_rows=None,
                   sliding_window=None, **kwargs):
    """The registered attention function as hf.py is to have it: q [1, Hq, N, D] ->
    [N, Hq, D] views, one op call, ``([1, N, Hq, D], None)``."""
    st = cgrt_rows
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    scale = module.head_dim ** -0.5 if scaling is None else scaling
    out = attention_op.attend(st.pool_id, module.layer_idx, q, k, v, st.seq_ids, st.positions, st.cells,
                              scale=scale, window=sliding_window)
    return out[None], None


class HFStandIn(_Rows):
    """A tiny transformers model of ``family`` (``hf_config(family, "tiny", **config)``)
    on a :class:`StandInPool` (random weights from ``seed``; fp32, CPU)."""

    def __init__(self, family="llama", *, max_seqs=4, max_len=64, seed=0, fuse=False, small_m=False, **config):
        import transformers

        from cudagraph_rt.models import hf

        transformers.AttentionInterface.register(STAND_IN_ATTENTION, pool_attention)
        torch.manual_seed(seed)
        self.model = transformers.AutoModelForCausalLM.from_config(hf.hf_config(family, "tiny", **config)).eval()
        if fuse:
            from cudagraph_rt.models.fused import fuse_projections
            fuse_projections(self.model)
        if small_m:  # the projections through the small-M kernel, interpreted on a CPU-only box
            from cudagraph_rt.kernels.common import triton_backend
            from cudagraph_rt.models.small_m import use_small_m_kernel
            use_small_m_kernel(self.model, interpret_on_cpu=triton_backend() == "interpreter")
        self.decoder, self.head = self.model.get_decoder(), self.model.get_output_embeddings()
        self.device = torch.device("cpu")
        cfg = self.model.config
        self.pool = StandInPool(layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                                head_dim=cfg.head_dim, max_seqs=max_seqs, max_seq_len=max_len, seed=seed)
        self.pool_id = attention_op.pool_id(self.pool)
        self._rows = self._step_rows

    def step(self, inputs):
        with self._attention():
            return super().step(inputs)

    @torch.no_grad()
    def _step_rows(self, tokens, positions, seq_ids, cells, want):
        out = self.decoder(input_ids=tokens[None], position_ids=positions[None], use_cache=False,
                           cgrt_rows=PoolRows(self.pool_id, seq_ids, positions, cells))
        h = out.last_hidden_state[0]
        return {"tokens": self.head(h).argmax(-1).masked_fill(want != 1, -1), "hidden": h}

    @contextlib.contextmanager
    def _attention(self):
        cfg = self.model.config
        before, cfg._attn_implementation = cfg._attn_implementation, STAND_IN_ATTENTION
        try:
            yield
        finally:
            cfg._attn_implementation = before
