"""Sequence-level KIVI, the per-token baseline, and the byte accounting of both."""

from __future__ import annotations

import pytest
import torch

from sgl_kvq.quant import kivi_page
from bench.quant.accounting import bits_per_element, kivi_expected_bits, kivi_page_bits, stored_bytes
from bench.quant.kivi import fp16_baseline, kivi, quantized_len
from bench.quant.per_token import per_token


def _kv(T, H=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)


@pytest.mark.parametrize("T,G,R,n_q", [(0, 16, 0, 0), (5, 16, 0, 0), (16, 16, 0, 16), (16, 16, 16, 0),
                                       (47, 16, 16, 16), (48, 16, 16, 32), (100, 32, 64, 32), (130, 32, 64, 64)])
def test_window_is_open_page_plus_r_over_g_pages(T, G, R, n_q):
    assert quantized_len(T, G, R) == n_q
    k, v = _kv(T)
    c = kivi(k, v, bits=2, group_size=G, value_group=8, residual=R)
    assert c.k_hat.shape == c.v_hat.shape == (T, 2, 16)
    assert c.kept.shape == (T, 2) and c.kept[:n_q].sum() == 0 and c.kept[n_q:].all()
    assert torch.equal(c.k_hat[n_q:], k[n_q:].half().float())
    assert c.stored["k.fp16"].shape[0] == T - n_q


def test_residual_must_be_whole_pages():
    with pytest.raises(ValueError, match="multiple of G"):
        kivi(*_kv(64), group_size=32, residual=48)


def test_stored_tensors_are_what_k_hat_is_rebuilt_from():
    k, v = _kv(100)
    c = kivi(k, v, bits=2, group_size=16, value_group=8, residual=32)
    s = c.stored
    k_pages = kivi_page.dequantize_keys(s["k.codes"], s["k.scale"], s["k.zero"], 2).reshape(-1, 2, 16)
    v_pages = kivi_page.dequantize_values(s["v.codes"], s["v.scale"], s["v.zero"], 2).reshape(-1, 2, 16)
    assert torch.equal(torch.cat([k_pages, s["k.fp16"].float()]), c.k_hat)
    assert torch.equal(torch.cat([v_pages, s["v.fp16"].float()]), c.v_hat)


def test_hand_computed_bytes_small_kivi():
    # T=128, H=2, D=16, G=32, VG=16, R=32, 2 bit: 96 quantized tokens (3 pages), 32 fp16 tokens
    c = kivi(*_kv(128), bits=2, group_size=32, value_group=16, residual=32)
    codes = 96 * 2 * 16 * 2 // 8  # 768
    k_scale_zero = 2 * (3 * 2 * 16) * 2  # per page, head, channel: fp16 scale + zero = 384
    v_scale_zero = 2 * (96 * 2 * 1) * 2  # per token, head, one group of 16 channels = 768
    fp16_tokens = 32 * 2 * 16 * 2  # 2048
    assert stored_bytes(c, "k.") == codes + k_scale_zero + fp16_tokens == 3200
    assert stored_bytes(c, "v.") == codes + v_scale_zero + fp16_tokens == 3584
    b = bits_per_element(c)
    assert b.keys == pytest.approx(3200 * 8 / (128 * 32)) and b.values == pytest.approx(3584 * 8 / (128 * 32))


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("T,G,VG,R", [(256, 64, 64, 0), (300, 32, 16, 64), (64, 64, 32, 64), (77, 16, 8, 32)])
def test_accounting_agrees_with_the_pool_formula(bits, T, G, VG, R):
    D = 64
    c = kivi(*_kv(T, D=D), bits=bits, group_size=G, value_group=VG, residual=R)
    assert bits_per_element(c) == pytest.approx(kivi_expected_bits(T, bits, G, VG, quantized_len(T, G, R)))
    if T % G == 0 and R == 0:  # nothing in fp16: exactly the page cost b + 32/G, b + 32/VG
        b = bits_per_element(c)
        assert (b.keys, b.values) == pytest.approx(kivi_page_bits(bits, G, VG))


def test_fp16_baseline_is_16_bits_and_rounds_only():
    k, v = _kv(33)
    c = fp16_baseline(k, v)
    assert bits_per_element(c).total == 16.0 and torch.equal(c.k_hat, k.half().float())


def test_per_token_matches_kivi_except_for_the_keys():
    k, v = _kv(200, D=32)
    a = per_token(k, v, bits=2, group_size=32, value_group=32, residual=32)
    b = kivi(k, v, bits=2, group_size=32, value_group=32, residual=32)
    assert torch.equal(a.v_hat, b.v_hat) and torch.equal(a.kept, b.kept)
    assert bits_per_element(a) == bits_per_element(b)  # same cost at G == VG
    assert not torch.equal(a.k_hat, b.k_hat)


def test_per_channel_keys_win_when_outliers_sit_in_fixed_channels():
    # KIVI's observation, planted: a few key channels carry a large offset on every token
    k, v = _kv(256, D=32, seed=1)
    k[..., :3] += 20
    err = {f.__name__: (f(k, v, bits=2, group_size=32, value_group=32, residual=0).k_hat - k).norm()
           for f in (kivi, per_token)}
    assert err["kivi"] < 0.5 * err["per_token"]
