"""KVQ_PREFILL=paged: an extend computes exactly what decoding the same tokens one by one computes, however the
tokens are split into extends (so retraction, eviction, chunking and cache misses cannot change a token's KV).
Both forms of a paged extend are checked: page steps (kvq_triton's) and one step attended after its write
(kvq_torch's, attention_extend.extend_paged). "full" (KIVI's prefill) does not have this property: the
check below fails for it."""

from __future__ import annotations

import pytest
import torch

from sgl_kvq import attention_extend, attention_ref
from sgl_kvq.config import KVQConfig
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.metadata.forward import build_forward_plan
from sgl_kvq.pool_shape import PoolShape

H, HQ, D = 2, 4, 16
SCALE = 0.25


def make(G, bits, residual, prefill):
    cfg = KVQConfig("kivi", bits, group_size=G, value_group=16, residual=residual, prefill=prefill)
    store = QuantizedKVStore(cfg, PoolShape(1, H, D, 64, cfg), 4, torch.float32, "cpu")
    req_to_token = torch.zeros(4, 1024, dtype=torch.int32)
    req_to_token[2] = torch.arange(1024, dtype=torch.int32) + 5 * G  # request slot 2, pages 5, 6, ...
    return store, req_to_token


def run_extend(store, r2t, q, k, v, start, end, page_steps=True, window=-1):
    fp = build_forward_plan(store, r2t, torch.tensor([2]), torch.tensor([end]), r2t[2, start:end], is_decode=False,
                            extend_prefix_lens=[start], extend_seq_lens=[end - start], page_steps=page_steps)
    out = torch.empty(end - start, HQ, D)
    if not page_steps and store.cfg.prefill == "paged":
        (step,) = fp.steps
        kv = store.layer_view(0)
        frames = [attention_ref.frame_rows(kv, step.plan, 0)]
        store.write_layer(0, step.write, k[start:end], v[start:end])
        return attention_extend.extend_paged(q[start:end], k[start:end], v[start:end], step.qo_indptr, kv,
                                             step.plan, step.reread, SCALE, frames, window=window)
    for step in fp.steps:
        rows = torch.arange(end - start) if step.rows is None else step.rows
        out[rows] = attention_ref.ref_extend(q[start:end][rows], k[start:end][rows], v[start:end][rows],
                                             step.qo_indptr, store.layer_view(0), step.plan, SCALE,
                                             window=window)
        store.write_layer(0, step.write, k[start:end][rows], v[start:end][rows])
    return out


def run_decode(store, r2t, q, k, v, t, window=-1):
    fp = build_forward_plan(store, r2t, torch.tensor([2]), torch.tensor([t + 1]), r2t[2, t:t + 1], is_decode=True)
    step = fp.steps[0]
    store.write_layer(0, step.write, k[t:t + 1], v[t:t + 1])
    return attention_ref.ref_decode(q[t:t + 1], store.layer_view(0), step.plan, SCALE, window=window)[0]


def one_by_one(G, bits, residual, prefill, q, k, v, window=-1):
    store, r2t = make(G, bits, residual, prefill)
    out = [run_extend(store, r2t, q, k, v, 0, 1, window=window)[0]]
    out += [run_decode(store, r2t, q, k, v, t, window) for t in range(1, q.shape[0])]
    return torch.stack(out)


@pytest.mark.parametrize("page_steps", [True, False], ids=["page-steps", "one-step"])
@pytest.mark.parametrize("G,bits,residual", [(16, 2, 16), (16, 1, 0), (32, 4, 64), (16, 2, 32)])
@pytest.mark.parametrize("cuts", [(), (23,), (16, 48), (5, 37, 40)])
def test_paged_extends_equal_decoding_token_by_token(G, bits, residual, cuts, page_steps):
    torch.manual_seed(G + bits + residual + sum(cuts))
    T = 83
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, H, D), torch.randn(T, H, D)
    want = one_by_one(G, bits, residual, "paged", q, k, v)
    store, r2t = make(G, bits, residual, "paged")
    bounds = [0, *cuts, T]
    got = torch.cat([run_extend(store, r2t, q, k, v, a, b, page_steps) for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 7, 16, 40])
@pytest.mark.parametrize("page_steps", [True, False], ids=["page-steps", "one-step"])
def test_paged_extends_equal_decoding_token_by_token_in_a_sliding_window(window, page_steps):
    torch.manual_seed(window)
    T, G = 83, 16
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, H, D), torch.randn(T, H, D)
    want = one_by_one(G, 2, 16, "paged", q, k, v, window)
    store, r2t = make(G, 2, 16, "paged")
    bounds = [0, 5, 37, T]
    got = torch.cat([run_extend(store, r2t, q, k, v, a, b, page_steps, window) for a, b in zip(bounds, bounds[1:])])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_full_prefill_does_not_have_the_property():
    torch.manual_seed(0)
    T, G = 83, 16
    q, k, v = torch.randn(T, HQ, D), torch.randn(T, H, D), torch.randn(T, H, D)
    want = one_by_one(G, 2, 16, "full", q, k, v)
    store, r2t = make(G, 2, 16, "full")
    got = run_extend(store, r2t, q, k, v, 0, T)
    assert (got - want).abs().max() > 1e-2
