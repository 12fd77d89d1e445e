"""KVQ_PREFILL=paged: an extend computes exactly what decoding the same tokens one by one computes, however the
tokens are split into extends (so retraction, eviction, chunking and cache misses cannot change a token's KV).
"full" (KIVI's prefill, the default) does not have this property: the check below fails for it."""

from __future__ import annotations

import pytest
import torch

from sgl_kvq import attention_ref
from sgl_kvq.attention_extend_paged import extend_paged
from sgl_kvq.config import KVQConfig
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.layout import PoolShape
from sgl_kvq.metadata.forward import build_forward_plan

H, HQ, D = 2, 4, 16
SCALE = 0.25


def make(G, bits, residual, prefill):
    cfg = KVQConfig("kivi", bits, group_size=G, value_group=16, residual=residual, prefill=prefill)
    store = QuantizedKVStore(cfg, PoolShape(1, H, D, 64, cfg), 4, torch.float32, "cpu")
    req_to_token = torch.zeros(4, 1024, dtype=torch.int32)
    req_to_token[2] = torch.arange(1024, dtype=torch.int32) + 5 * G  # request slot 2, pages 5, 6, ...
    return store, req_to_token


def run_extend(store, r2t, q, k, v, start, end, slot=2, window=-1):
    fp = build_forward_plan(store, r2t, torch.tensor([slot]), torch.tensor([end]), r2t[slot, start:end], is_decode=False,
                            extend_prefix_lens=[start], extend_seq_lens=[end - start])
    out = torch.empty(end - start, HQ, D)
    for step in fp.steps:
        rows = torch.arange(end - start) if step.rows is None else step.rows
        out[rows] = attention_ref.ref_extend(q[start:end][rows], k[start:end][rows], v[start:end][rows],
                                             step.qo_indptr, store.layer_view(0), step.plan, SCALE, window=window)
        store.write_layer(0, step.write, k[start:end][rows], v[start:end][rows])
    return out


def run_extend_at_once(store, r2t, q, k, v, start, end, slot=2, window=-1):
    """The same extend as one attention (sgl_kvq/attention_extend_paged.py), then the steps' writes in order."""
    fp = build_forward_plan(store, r2t, torch.tensor([slot]), torch.tensor([end]), r2t[slot, start:end], is_decode=False,
                            extend_prefix_lens=[start], extend_seq_lens=[end - start])
    kv = store.layer_view(0)
    out = extend_paged(q[start:end], k[start:end], v[start:end], [0, end - start], kv, fp.steps[0].plan, SCALE,
                       store.ring, store.cfg, store.shape.VG, window=window)
    for step in fp.steps:
        rows = torch.arange(end - start) if step.rows is None else step.rows
        store.write_layer(0, step.write, k[start:end][rows], v[start:end][rows])
    return out


def run_decode(store, r2t, q, k, v, t):
    fp = build_forward_plan(store, r2t, torch.tensor([2]), torch.tensor([t + 1]), r2t[2, t:t + 1], is_decode=True)
    step = fp.steps[0]
    store.write_layer(0, step.write, k[t:t + 1], v[t:t + 1])
    return attention_ref.ref_decode(q[t:t + 1], store.layer_view(0), step.plan, SCALE)[0]


def one_by_one(G, bits, residual, prefill, q, k, v):
    store, r2t = make(G, bits, residual, prefill)
    out = [run_extend(store, r2t, q, k, v, 0, 1)[0]]
    out += [run_decode(store, r2t, q, k, v, t) for t in range(1, q.shape[0])]
    return torch.stack(out)


@pytest.mark.parametrize("at_once", [False, True], ids=["steps", "at-once"])
@pytest.mark.parametrize("G,bits,residual", [(16, 2, 16), (16, 1, 0), (32, 4, 64), (16, 2, 32), (16, 3, 16)])
@pytest.mark.parametrize("cuts", [(), (23,), (16, 48), (5, 37, 40)])
def test_paged_extends_equal_decoding_token_by_token(G, bits, residual, cuts, at_once):
    torch.manual_seed(G + bits + residual + sum(cuts))
    T = 83
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, H, D), torch.randn(T, H, D)
    want = one_by_one(G, bits, residual, "paged", q, k, v)
    store, r2t = make(G, bits, residual, "paged")
    bounds = [0, *cuts, T]
    extend = run_extend_at_once if at_once else run_extend
    got = torch.cat([extend(store, r2t, q, k, v, a, b) for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("G,bits,residual,prefix", [(16, 2, 16, 48), (16, 4, 32, 32), (32, 2, 64, 64)])
def test_at_once_equals_steps_after_a_prefix_another_request_wrote(G, bits, residual, prefix):
    """A radix hit: slot 2 continues from whole pages slot 1 wrote, which slot 2's frames do not hold, so even the
    pages of its fp16 window are read from the base until its own pages replace them."""
    torch.manual_seed(G + bits + prefix)
    T = 83
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, H, D), torch.randn(T, H, D)
    got = {}
    for extend in (run_extend, run_extend_at_once):
        store, r2t = make(G, bits, residual, "paged")
        r2t[1] = r2t[2]
        run_extend(store, r2t, q, k, v, 0, prefix, slot=1)
        got[extend] = extend(store, r2t, q, k, v, prefix, T, slot=2)
    torch.testing.assert_close(got[run_extend_at_once], got[run_extend], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 7, 20, 47, 200])
@pytest.mark.parametrize("cuts", [(), (37,)])
def test_at_once_equals_steps_in_a_sliding_window(window, cuts):
    """Sliding-window layers (Gemma 3's): windows inside a page, across the fp16 window, wider than the context."""
    torch.manual_seed(window + sum(cuts))
    T, G = 83, 16
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, H, D), torch.randn(T, H, D)
    got = {}
    for extend in (run_extend, run_extend_at_once):
        store, r2t = make(G, 2, 16, "paged")
        bounds = [0, *cuts, T]
        got[extend] = torch.cat([extend(store, r2t, q, k, v, a, b, window=window) for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(got[run_extend_at_once], got[run_extend], atol=1e-5, rtol=1e-5)


def test_full_prefill_does_not_have_the_property():
    torch.manual_seed(0)
    T, G = 83, 16
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, H, D), torch.randn(T, H, D)
    want = one_by_one(G, 2, 16, "full", q, k, v)
    store, r2t = make(G, 2, 16, "full")
    got = run_extend(store, r2t, q, k, v, 0, T)
    assert (got - want).abs().max() > 1e-2
