"""A constructor's refusal of a bad argument: an InputError, with the model's KV pool as it was."""
from __future__ import annotations

import pytest

from cudagraph_rt.errors import InputError


def refused_with_pool_untouched(model, pattern: str, build) -> None:
    """``build()`` raises an InputError matching ``pattern`` and ``model``'s pool keeps
    every free block it had (the cache reset first)."""
    model.reset_cache()
    free = model.pool.free_blocks
    with pytest.raises(InputError, match=pattern):
        build()
    assert model.pool.free_blocks == free
