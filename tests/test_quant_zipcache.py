"""ZipCache: probe saliency, mixed 4/2-bit planes, channel-separable values, bytes."""

from __future__ import annotations

import pytest
import torch

from sgl_kvq.quant.accounting import bits_per_element, stored_bytes
from sgl_kvq.quant.kivi import kivi
from sgl_kvq.quant.zipcache import normalized_attention, probe_positions, salient_mask, zipcache


def test_probes_are_the_recent_5_percent_plus_random_5_percent_and_seeded():
    p = probe_positions(200, seed=1)
    assert len(p) == 20 and p[-10:].tolist() == list(range(190, 200)) and (p[:10] < 190).all()
    assert torch.equal(p, probe_positions(200, seed=1)) and not torch.equal(p, probe_positions(200, seed=2))


def test_normalized_score_divides_by_the_queries_that_can_see_the_token():
    # q = 0: every probe spreads its attention uniformly over what it sees, 1 / (i + 1) per token
    T, probes = 6, torch.tensor([2, 5])
    score = normalized_attention(torch.zeros(T, 2, 4), torch.randn(T, 1, 4), probes, 1.0)  # 2 q heads, 1 KV head
    want = torch.tensor([(1 / 3 + 1 / 6) / 2] * 3 + [1 / 6] * 3)
    assert torch.allclose(score[:, 0], want)


def test_saliency_picks_planted_high_attention_tokens():
    g = torch.Generator().manual_seed(0)
    T, D = 256, 16
    q = torch.randn(T, 4, D, generator=g) * 0.1 + torch.ones(D)  # every query leans on the all-ones direction
    k = torch.randn(T, 2, D, generator=g) * 0.1
    hot = torch.tensor([3, 40, 77, 150])
    k[hot] += 2 * torch.ones(D)  # tokens every query attends to
    score = normalized_attention(q, k, probe_positions(T), D ** -0.5)
    top = score.topk(4, dim=0).indices
    for h in range(2):
        assert set(top[:, h].tolist()) == set(hot.tolist())
    c = zipcache(torch.cat([k, k]), torch.randn(2 * T, 2, D, generator=g), torch.cat([q, q]), group_size=32,
                 value_group=16, residual=32)
    assert c.kept[hot].all()


def test_mixed_precision_planes_and_bytes():
    g = torch.Generator().manual_seed(0)
    T, H, D, G = 160, 2, 16, 32
    k, v, q = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g), torch.randn(T, 4, D, generator=g)
    c = zipcache(k, v, q, group_size=G, value_group=16, residual=32, salient_ratio=0.4)
    n_q, n_sal = 128, round(0.4 * 128)  # 4 pages quantized (5 complete, 1 in the window), 51 salient per head
    assert (c.kept[:n_q].sum(0) == n_sal).all() and c.kept[n_q:].all()
    assert c.stored["k.codes_hi"].shape == (n_sal * H, D // 2) and c.stored["k.codes_lo"].shape == ((n_q - n_sal) * H, D // 4)
    keys = (n_sal * H * D * 4 + (n_q - n_sal) * H * D * 2) // 8 + 2 * (4 * 2 * H * D * 2) + (n_q * H + 7) // 8
    values = ((n_sal * H * D * 4 + (n_q - n_sal) * H * D * 2) // 8 + 4 * H * D * 2 + n_q * H * 2 * 2)
    fp16 = (T - n_q) * H * D * 2
    assert stored_bytes(c, "k.") == keys + fp16 and stored_bytes(c, "v.") == values + fp16
    assert bits_per_element(c).keys == pytest.approx(8 * (keys + fp16) / (T * H * D))


def test_salient_tokens_are_more_precise_than_the_rest():
    g = torch.Generator().manual_seed(0)
    T, H, D = 256, 2, 16
    k, v, q = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g), torch.randn(T, 4, D, generator=g)
    c = zipcache(k, v, q, group_size=32, value_group=16, residual=0)
    err = (c.k_hat - k).pow(2).sum(-1)
    assert err[c.kept].mean() < 0.2 * err[~c.kept].mean()
    assert (c.k_hat - k).norm() < (kivi(k, v, bits=2, group_size=32, value_group=16, residual=0).k_hat - k).norm()


def test_channel_separable_values_beat_plain_per_token_on_an_outlier_channel():
    g = torch.Generator().manual_seed(0)
    T, H, D = 128, 1, 16
    k, v, q = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g), torch.randn(T, 1, D, generator=g)
    v[..., 0] *= 30
    zc = zipcache(k, v, q, group_size=32, value_group=16, residual=0, salient_ratio=0.0)  # all 2-bit
    kv2 = kivi(k, v, bits=2, group_size=32, value_group=16, residual=0)
    assert (zc.v_hat - v)[..., 1:].norm() < 0.7 * (kv2.v_hat - v)[..., 1:].norm()


def test_salient_mask_counts():
    assert salient_mask(torch.rand(10, 3), 0.4).sum(0).tolist() == [4, 4, 4]
