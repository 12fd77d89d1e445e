"""sgl_kvq/kv_store.py: the store allocates what the format declares and counts it, quantizes a page into the base
in the batch that writes its last slot (the open page stays exact in its frame), and refuses a write that lacks what
the format's write needs."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_kvq.config import DTYPE_NAMES, KVQConfig, parse_kv_cache_dtype
from sgl_kvq.formats import registry
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.metadata.forward import build_forward_plan
from sgl_kvq.pool_shape import PoolShape
from sgl_kvq.quant import kivi_page

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


def _one_request_extend(cfg, T: int, first_page: int = 2, seed: int = 0):
    """A store of one layer (2 KV heads, D 16) and an extend of T fresh tokens of request slot 1, whose pages start at
    pool page `first_page`: (store, k, v, the extend's writes)."""
    G, heads, dim = cfg.group_size, 2, 16
    store = QuantizedKVStore(cfg, PoolShape(1, heads, dim, 8, cfg), 3, torch.float32, "cpu")
    req_to_token = torch.zeros(3, 8 * G, dtype=torch.int32)
    req_to_token[1] = torch.arange(8 * G, dtype=torch.int32) + first_page * G
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(T, heads, dim, generator=gen), torch.randn(T, heads, dim, generator=gen)
    fp = build_forward_plan(store, req_to_token, torch.tensor([1]), torch.tensor([T]), req_to_token[1, :T],
                            is_decode=False, extend_prefix_lens=[0], extend_seq_lens=[T])
    return store, k, v, fp.steps


def test_a_page_is_quantized_when_a_batch_writes_its_last_slot_and_the_open_page_stays_exact():
    cfg = KVQConfig("kivi", 2, group_size=16, value_group=16, residual=0)
    G = cfg.group_size
    store, k, v, steps = _one_request_extend(cfg, G + 5)
    for step in steps:
        rows = torch.arange(G + 5) if step.rows is None else step.rows
        store.write_layer(0, step.write, k[rows], v[rows])
    assert int(store.pages_quantized) == 1
    kv = store.layer_view(0)
    # the completed page, read as attention reads it
    k_base, v_base = cfg.format.codec.read_pages(kv, torch.tensor([2]))
    k_ref, v_ref = kivi_page.dequantize_pages(kivi_page.pack_pages(k[None, :G], v[None, :G], 2, 16), 2)
    assert torch.equal(k_base, k_ref) and torch.equal(v_base, v_ref)
    assert not torch.equal(k_base[0], k[:G])  # 2-bit codes: the page is quantized, not copied
    frame = int(store.frames.of(torch.tensor(1), torch.tensor(1)))  # the open page's frame holds its 5 tokens as is
    assert torch.equal(kv.ov_k[frame, :5], k[G:]) and torch.equal(kv.ov_v[frame, :5], v[G:])


def test_a_format_whose_write_needs_the_queries_refuses_a_write_without_them():
    cfg = parse_kv_cache_dtype("zipcache2")
    store, k, v, steps = _one_request_extend(cfg, cfg.group_size + 1)
    with pytest.raises(ValueError, match="need the batch's queries"):
        store.write_layer(0, steps[0].write, k, v)
