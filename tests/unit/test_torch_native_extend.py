"""patches/torch_native_extend.py gives what SGLang's own torch_native extend keeps (its new rows), for a batch of
requests with and without cached prefixes, causal and under a sliding window, with GQA, in one block of rows and
in several; encoder calls keep SGLang's path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_kvq.patches import torch_native_extend

SGLANG = pytest.importorskip("sglang.srt.layers.attention.torch_native_backend").TorchNativeAttnBackend
ORIG = SGLANG._run_sdpa_forward_extend
ORIG = getattr(ORIG, "__wrapped__", ORIG)  # SGLang's own, not a hook placed in this process


def batch(prefixes, news, heads=4, kv_heads=2, dim=16, dtype=torch.float32):
    torch.manual_seed(sum(prefixes) * 7 + sum(news))
    contexts = [p + n for p, n in zip(prefixes, news)]
    slots = sum(contexts) + 5
    k_cache, v_cache = (torch.randn(slots, kv_heads, dim, dtype=dtype) for _ in range(2))
    req_to_token = torch.zeros(len(news), max(contexts) + 3, dtype=torch.int64)
    perm = torch.randperm(slots)
    at = 0
    for r, c in enumerate(contexts):
        req_to_token[r, :c] = perm[at:at + c]
        at += c
    query = torch.randn(sum(news), heads, dim, dtype=dtype)
    return (query, k_cache, v_cache, req_to_token, torch.arange(len(news)), torch.tensor(contexts),
            torch.tensor(prefixes), torch.tensor(news))


@pytest.mark.parametrize("prefixes,news", [([0], [37]), ([50, 0, 9], [3, 20, 1]), ([130], [70])])
@pytest.mark.parametrize("window", [None, 8])
@pytest.mark.parametrize("rows", [2048, 16])
def test_new_rows_equal_sglangs(prefixes, news, window, rows, monkeypatch):
    monkeypatch.setattr(torch_native_extend, "ROWS", rows)
    query, k_cache, v_cache, req_to_token, pools, seq_lens, prefix_lens, new_lens = batch(prefixes, news)
    kwargs = dict(scaling=0.25, enable_gqa=True, causal=True, is_cross_attn=False, sliding_window_size=window)
    args = (k_cache, v_cache, req_to_token, pools, seq_lens, prefix_lens, new_lens, None)
    fake_self = SimpleNamespace(_make_sliding_window_mask=SGLANG._make_sliding_window_mask)
    want = ORIG(fake_self, query, torch.zeros_like(query), *args, **kwargs)
    got = torch_native_extend.sdpa_forward_extend(ORIG, fake_self, query, torch.zeros_like(query), *args, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_encoder_calls_keep_sglangs_path():
    calls = []
    torch_native_extend.sdpa_forward_extend(lambda *a, **k: calls.append(k), None, torch.zeros(1, 1, 1), None, None,
                                            None, None, None, None, None, None, torch.tensor([1]), causal=True)
    torch_native_extend.sdpa_forward_extend(lambda *a, **k: calls.append(k), None, torch.zeros(1, 1, 1), None, None,
                                            None, None, None, None, None, None, None, causal=False)
    assert len(calls) == 2
