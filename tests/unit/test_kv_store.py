"""sgl_kvq/kv_store.py: the store allocates what the format declares and counts it."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_kvq.config import DTYPE_NAMES, parse_kv_cache_dtype
from sgl_kvq.formats import registry
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.layout import PoolShape

L, H, D, PAGES = 2, 2, 32, 6


def shape_of(name: str) -> PoolShape:
    return PoolShape(L, H, D, PAGES, parse_kv_cache_dtype(name))


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_store_allocates_the_declaration_and_counts_it(name):
    shape = shape_of(name)
    store = QuantizedKVStore(shape.cfg, shape, 3, torch.float32, "cpu")
    for n, (dims, dtype) in shape.base_shapes().items():
        t = getattr(store, n)
        assert tuple(t.shape) == dims and t.dtype == dtype
    assert store.base_bytes() == sum(math.prod(d) * dt.itemsize for d, dt in shape.base_shapes().values())
    F = store.ov_k.shape[1]
    for n, (dims, dtype) in shape.frame_state_shapes().items():
        assert tuple(getattr(store, n).shape) == (L, F, *dims) and getattr(store, n).dtype == dtype
    assert store.frame_state == tuple(shape.frame_state_shapes())
    view = store.layer_view(0)
    fmt = shape.cfg.format
    assert (view.extras is None) == (fmt.extras is None)
    assert registry.of_extras(view.extras).extras is fmt.extras
