"""Attention with its K/V write as ONE opaque op for torch.compile, the pool kept out of the graph.

For any KV-pool-like object with ``attend(layer, q, k, v, seq_ids, positions, cells, *,
scale, window=None, slopes=None, bias_shift=0, out=None)`` (and ``rotary=`` for the calls
that pass one, :mod:`.hf_rotary`'s):

* :func:`pool_id` registers a pool in a weak registry (which never keeps it alive) and
  returns an int; :func:`attend` takes that int and the layer index, so a compiled graph
  holds two constants, never the pool's tensors;
* under torch.compile the call is ``torch.ops.cgrt.attend_cells``, a custom op that writes
  only ``out`` and whose body fetches the pool by id and calls ``pool.attend``; eager calls
  go straight to ``pool.attend``. Both run the same code and give the same result.

Why an opaque op, and not ``triton_op`` or the pool as a graph input: ARCHITECTURE.md,
"The attention as one opaque op".
"""

import itertools
import weakref
from typing import Optional

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import InputError, expected

OP = "cgrt::attend_cells"

_IDS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # pool -> id
_POOLS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> pool
_NEXT = itertools.count(1)


def pool_id(pool) -> int:
    """The registry id of ``pool`` (registered on first use; the same int for as long as
    the pool lives; ids are never reused). The registry holds the pool weakly. InputError
    for an object without a callable ``attend``. Call it outside compiled code (once, when
    the model is built) and pass the int into the step."""
    if not callable(getattr(pool, "attend", None)):
        raise InputError(expected("pool", "an object with attend(layer, q, k, v, ...)", type(pool).__name__))
    i = _IDS.get(pool)
    if i is None:
        i = _IDS[pool] = next(_NEXT)
        _POOLS[i] = pool
    return i


def pool_by_id(i: int):
    """The live pool registered as ``i``; InputError if none is (never registered, or
    garbage-collected: a compiled step that outlives its pool fails here, not in memory)."""
    pool = _POOLS.get(int(i))
    if pool is None:
        raise InputError(expected("pool id", "a live pool registered by pool_id()", i))
    return pool


@torch.library.custom_op(OP, mutates_args=("out",))
def _attend_cells(q: Tensor, k: Tensor, v: Tensor, seq_ids: Tensor, positions: Tensor, cells: Tensor,
                  out: Tensor, pool: int, layer: int, scale: float, window: Optional[int],
                  slopes: Optional[Tensor], bias_shift: int, cos: Optional[Tensor] = None,
                  sin: Optional[Tensor] = None) -> None:
    pool_by_id(pool).attend(layer, q, k, v, seq_ids, positions, cells, scale=scale, window=window,
                            slopes=slopes, bias_shift=bias_shift, out=out, **_rotary(cos, sin))


@_attend_cells.register_fake
def _attend_cells_fake(q, k, v, seq_ids, positions, cells, out, pool, layer, scale, window, slopes,
                       bias_shift, cos=None, sin=None) -> None:
    return None  # writes ``out`` in place; its shape is the caller's


def _rotary(cos: Optional[Tensor], sin: Optional[Tensor]) -> dict:
    """``attend``'s ``rotary`` keyword where there is one (a pool without rotation support
    serves every call without it)."""
    return {} if cos is None else {"rotary": (cos, sin)}


def attend(pool: int, layer: int, q: Tensor, k: Tensor, v: Tensor, seq_ids: Tensor, positions: Tensor,
           cells: Tensor, *, scale: float, window: int | None = None, slopes: Tensor | None = None,
           bias_shift: int = 0, out: Tensor | None = None, rotary: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """``pool_by_id(pool).attend(layer, q, k, v, ...)`` as one opaque op under torch.compile.

    ``pool`` is :func:`pool_id`'s int, ``layer``/``window``/``bias_shift`` Python ints and
    ``scale`` a float (constants of the compiled graph). ``q`` [N, Hq, D], ``k``/``v``
    [N, Hkv, D(v)] (views with any strides the pool accepts). Writes the rows' K/V into
    their ``cells`` of ``layer`` and returns the attention [N, Hq, Dv], in ``out`` if
    given (a fresh tensor otherwise). ``rotary``: ``(cos, sin)`` [N, D] for q and k given
    unrotated (the pool rotates them as it writes). The pool's own errors propagate;
    InputError if the pool is gone."""
    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    cos, sin = (None, None) if rotary is None else rotary
    if torch.compiler.is_compiling():
        torch.ops.cgrt.attend_cells(q, k, v, seq_ids, positions, cells, out, pool, layer, float(scale), window,
                                    slopes, bias_shift, cos, sin)
    else:
        pool_by_id(pool).attend(layer, q, k, v, seq_ids, positions, cells, scale=scale, window=window,
                                slopes=slopes, bias_shift=bias_shift, out=out, **_rotary(cos, sin))
    return out


__all__ = ["OP", "attend", "pool_by_id", "pool_id"]
