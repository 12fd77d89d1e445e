"""GEAR / GEAR-L: low-rank residual, sparse outliers, and their bytes."""

from __future__ import annotations

import pytest
import torch

from sgl_kvq.quant.accounting import bits_per_element, stored_bytes
from sgl_kvq.quant.gear import gear, gear_l, outlier_mask, power_iteration
from sgl_kvq.quant.kivi import kivi


def _kv(T=256, H=2, D=32, seed=0, low_rank=0.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, H, D, generator=g) + 3 * torch.randn(1, H, D, generator=g)
    v = torch.randn(T, H, D, generator=g)
    if low_rank:  # a rank-2 component per head: what GEAR-L's residual approximation is for
        for x in (k, v):
            x += low_rank * torch.einsum("thr,hrd->thd", torch.randn(T, H, 2, generator=g),
                                         torch.randn(H, 2, D, generator=g))
    return k, v


def test_power_iteration_recovers_an_exact_low_rank_matrix():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 100, 2, generator=g) @ torch.randn(3, 2, 24, generator=g)
    u, w = power_iteration(a, rank=2, iters=3, generator=g)
    assert u.shape == (3, 100, 2) and w.shape == (3, 24, 2)
    assert (u @ w.transpose(1, 2) - a).norm() < 1e-4 * a.norm()


@pytest.mark.parametrize("bits", [2, 4])
def test_low_rank_lowers_the_error_of_the_same_backbone(bits):
    k, v = _kv(low_rank=2.0)
    base = kivi(k, v, bits=bits, group_size=32, value_group=32, residual=32)
    lr = gear_l(k, v, bits=bits, group_size=32, value_group=32, residual=32, rank=4)
    assert (lr.k_hat - k).norm() < 0.9 * (base.k_hat - k).norm()
    assert (lr.v_hat - v).norm() < 0.9 * (base.v_hat - v).norm()
    assert torch.equal(lr.kept, base.kept) and torch.equal(lr.k_hat[-32:], base.k_hat[-32:])


def test_sparse_outliers_are_selected_and_restored_exactly():
    k, v = _kv(seed=1)
    k[17, 1, 5] = 500.0  # a key outlier in channel (1, 5)
    v[40, 0, 9] = -300.0  # a value outlier in token (40, 0)
    c = gear(k, v, bits=2, group_size=32, value_group=32, residual=32, outlier_ratio=0.02)
    for name, x, x_hat, pos in (("k", k, c.k_hat, (17, 1, 5)), ("v", v, c.v_hat, (40, 0, 9))):
        idx = c.stored[f"{name}.outlier_idx"].long()
        flat = torch.tensor(pos) @ torch.tensor([x.shape[1] * x.shape[2], x.shape[2], 1])
        assert flat in idx
        assert torch.equal(x_hat.reshape(-1)[idx], x.reshape(-1)[idx].half().float())
        assert x_hat[pos] == x[pos]
    # removing them before quantization keeps the rest of their group's range tight: the key page (tokens 0..31)
    # of channel (1, 5) and the value token (40, 0). Rank 0 on both sides: low rank would absorb a lone outlier's
    # damage too (it is a rank-1 residual), which is not what this test is about.
    kw = dict(bits=2, group_size=32, value_group=32, residual=32, rank=0)
    sparse, plain = gear(k, v, outlier_ratio=0.02, **kw), gear(k, v, outlier_ratio=0.0, **kw)
    assert (sparse.k_hat - k)[:32, 1, 5].norm() < 0.2 * (plain.k_hat - k)[:32, 1, 5].norm()
    assert (sparse.v_hat - v)[40, 0].norm() < 0.2 * (plain.v_hat - v)[40, 0].norm()


def test_outlier_selection_is_per_channel_for_keys_and_per_token_for_values():
    k, v = _kv(T=100)
    km = outlier_mask(k, 0.05, dim=0)
    vm = outlier_mask(v, 0.25, dim=-1)
    assert (km.sum(0) == 5).all()  # round(0.05 * 100) per (head, channel)
    assert (vm.sum(-1) == 8).all()  # round(0.25 * 32) per (token, head)


def test_hand_computed_bytes_small_gear():
    # T=128, H=2, D=16, G=32, VG=16, R=32, rank 2, 10% outliers: 96 quantized tokens
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(128, 2, 16, generator=g), torch.randn(128, 2, 16, generator=g)
    c = gear(k, v, bits=2, group_size=32, value_group=16, residual=32, rank=2, outlier_ratio=0.1)
    kivi_k, kivi_v = 768 + 384 + 2048, 768 + 768 + 2048  # tests/test_quant_kivi.py
    low_rank = 2 * 96 * 2 * 2 + 2 * 16 * 2 * 2  # fp16 u [H, n, r] + w [H, D, r] = 768 + 128
    k_outliers = round(0.1 * 96) * 2 * 16 * (2 + 4)  # 10 per (head, channel), fp16 value + int32 index = 1920
    v_outliers = round(0.1 * 16) * 96 * 2 * (2 + 4)  # 2 per (token, head) = 2304
    assert stored_bytes(c, "k.") == kivi_k + low_rank + k_outliers
    assert stored_bytes(c, "v.") == kivi_v + low_rank + v_outliers
    assert bits_per_element(c).total == pytest.approx(8 * stored_bytes(c) / (2 * 128 * 32))


def test_seeded_and_short_sequences():
    k, v = _kv(T=200)
    a, b = gear(k, v, seed=3, group_size=32, residual=32), gear(k, v, seed=3, group_size=32, residual=32)
    assert torch.equal(a.k_hat, b.k_hat)
    short = gear(k[:20], v[:20], group_size=32, residual=32)  # nothing quantized: all fp16, no factors
    assert torch.equal(short.k_hat, k[:20].half().float()) and bits_per_element(short).total == 16.0
