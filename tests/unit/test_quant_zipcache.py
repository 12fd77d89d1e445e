"""ZipCache pages (sgl_kvq/formats/zipcache/codec.py): the normalized saliency from a page's own queries, the page
format's round trip, channel-separable values, the store's saliency accumulator (token by token == all at once),
and the served pool reading exactly what the sequence-level reference (the eval's row) reconstructs."""

from __future__ import annotations

import pytest
import torch

from sgl_kvq.attention_ref import gather_context
from sgl_kvq.config import KVQConfig, KVQConfigError, parse_kv_cache_dtype
from sgl_kvq.formats.zipcache.codec import salient_per_page
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.metadata import host
from sgl_kvq.plan import PagedPlan
from sgl_kvq.pool_shape import PoolShape
from bench.quant.accounting import stored_bytes
from bench.quant.kivi import kivi
from bench.quant.zipcache import page_scores, zipcache
from sgl_kvq.formats.zipcache.codec import (apply_salient, normalize, pack_zipcache_pages, received_attention,
                                         salient_count, select_salient)
from sgl_kvq.quant import kivi_page
from sgl_kvq.formats.zipcache import ZipCacheParams


def _pages(N=3, G=16, H=2, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(N, G, H, D, generator=g) + 2 * torch.randn(1, 1, H, D, generator=g)
    v = torch.randn(N, G, H, D, generator=g)
    return k, v


def test_normalized_score_divides_by_the_queries_that_can_see_the_token():
    # q = 0: query o spreads its attention uniformly over tokens 0..o, 1 / (o + 1) each
    N, G, H, group, D = 1, 4, 1, 2, 8
    q = torch.zeros(N, G, H * group, D)
    recv = received_attention(q, torch.ones(N, G, dtype=torch.bool), torch.randn(N, G, H, D), 1.0)
    want_recv = torch.tensor([sum(1 / (o + 1) for o in range(t, G)) for t in range(G)]) * group
    assert torch.allclose(recv[0, :, 0], want_recv)
    score = normalize(recv, group)
    assert torch.allclose(score[0, :, 0], want_recv / ((G - torch.arange(G)) * group))
    # only some queries present: absent ones pay nothing
    present = torch.tensor([[False, True, False, True]])
    recv = received_attention(q, present, torch.randn(N, G, H, D), 1.0)
    assert torch.allclose(recv[0, :, 0], torch.tensor([1 / 2 + 1 / 4, 1 / 2 + 1 / 4, 1 / 4, 1 / 4]) * group)


def test_saliency_picks_planted_high_attention_tokens():
    g = torch.Generator().manual_seed(0)
    N, G, H, D = 2, 32, 2, 16
    q = torch.randn(N, G, 4, D, generator=g) * 0.1 + torch.ones(D)  # every query leans on the all-ones direction
    k = torch.randn(N, G, H, D, generator=g) * 0.1
    hot = torch.tensor([3, 11, 20, 29])
    k[:, hot] += 2 * torch.ones(D)
    idx = select_salient(page_scores(q, k, D ** -0.5), 4)
    assert idx.shape == (N, H, 4) and (idx == hot).all()


@pytest.mark.parametrize("ns", [1, 6, 15])
def test_page_round_trip_salient_rows_within_a_4_bit_step_others_within_2_bit(ns):
    k, v = _pages()
    N, G, H, D = k.shape
    idx = select_salient(torch.rand(N, G, H, generator=torch.Generator().manual_seed(ns)), ns)
    base, s = pack_zipcache_pages(k, v, idx, 2, 16)
    assert s.s_idx.dtype == torch.uint8 and s.s_k_codes.shape == (N, H, ns, D // 2)
    k_hat, v_hat = apply_salient(*kivi_page.dequantize_pages(base, 2), s)
    sal = torch.zeros(N, G, H, dtype=torch.bool).scatter_(1, idx.transpose(1, 2), True)
    # keys: salient rows within half a 4-bit step of their class range; the rest within half a 2-bit step of theirs
    for cls, levels in ((sal, 15), (~sal, 3)):
        x = torch.where(cls[..., None], k, float("nan"))
        step = (x.nan_to_num(-1e9).amax(1) - x.nan_to_num(1e9).amin(1)) / levels  # [N, H, D]
        # + fp16 rounding of the stored scale/zero (a one-row class stores its value as the fp16 zero)
        err = ((k_hat - k).abs() - step[:, None] / 2 * 1.01 - 1e-3 * (1 + k.abs())).masked_fill(~cls[..., None], -1)
        assert (err <= 0).all()
    # values: V / c per token, so the error bound is per row: half a step of that row's range, times c
    c = s.v_chan.float()[:, None]
    vn = v / c
    for cls, levels in ((sal, 15), (~sal, 3)):
        step = (vn.amax(-1) - vn.amin(-1)) / levels  # value group = 16 = D / 2: the whole row bounds both groups
        err = ((v_hat - v).abs() / c - step[..., None] / 2 * 1.01 - 1e-3 * (1 + vn.abs())).masked_fill(
            ~cls[..., None], -1)
        assert (err <= 0).all()
    # 4 bit really is finer: the salient rows' key error is far below what 2 bit gives them
    base2 = kivi_page.dequantize_pages(kivi_page.pack_pages(k, v, 2, 16), 2)[0]
    assert (k_hat - k)[sal].abs().mean() < 0.5 * (base2 - k)[sal].abs().mean()


def test_salient_rows_do_not_stretch_the_base_key_range():
    k, v = _pages(N=1, G=16, H=1, D=8)
    k[0, 5, 0, 3] = 100.0  # an extreme key in channel 3 at token 5
    idx = torch.tensor([[[5]]])
    base, _ = pack_zipcache_pages(k, v, idx, 2, 8)
    assert base.k_scale[0, 0, 3] < 10  # the 2-bit range of channel 3 spans only the other 15 tokens


def test_channel_separable_values_beat_plain_per_token_on_an_outlier_channel():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(4, 32, 1, 16, generator=g), torch.randn(4, 32, 1, 16, generator=g)
    v[..., 0] *= 30
    idx = torch.zeros(4, 1, 1, dtype=torch.long)
    _, v_hat = apply_salient(*kivi_page.dequantize_pages(pack_zipcache_pages(k, v, idx, 2, 16)[0], 2),
                             pack_zipcache_pages(k, v, idx, 2, 16)[1])
    plain = kivi_page.dequantize_pages(kivi_page.pack_pages(k, v, 2, 16), 2)[1]
    rows = torch.arange(32) != 0  # the salient row aside
    assert (v_hat - v)[:, rows, :, 1:].norm() < 0.7 * (plain - v)[:, rows, :, 1:].norm()


def test_salient_count_and_bad_knobs():
    assert salient_count(0.4, 64) == 26 and salient_count(0.01, 16) == 1
    assert salient_per_page(parse_kv_cache_dtype("zipcache2")) == 26
    for bad in (0.0, 1.0, 0.999):
        with pytest.raises(KVQConfigError, match="KVQ_ZIPCACHE_SALIENT"):
            KVQConfig(method="zipcache", bits=2, params=ZipCacheParams(salient=bad))
    with pytest.raises(KVQConfigError):
        KVQConfig(method="zipcache", bits=4)


def test_reference_keeps_ns_per_page_and_counts_every_byte():
    g = torch.Generator().manual_seed(0)
    T, H, D, G = 160, 2, 16, 32
    k, v, q = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g), torch.randn(T, 4, D, generator=g)
    c = zipcache(k, v, q, group_size=G, value_group=16, residual=32, salient_ratio=0.4)
    n_q, ns = 128, salient_count(0.4, G)  # 4 pages quantized (5 complete, 1 in the window)
    assert (c.kept[:n_q].view(4, G, H).sum(1) == ns).all() and c.kept[n_q:].all()
    pages = n_q // G
    keys = n_q * H * D * 2 // 8 + 2 * pages * H * D * 2 + pages * H * ns * (1 + D // 2) + 2 * pages * H * D * 2
    values = n_q * H * D * 2 // 8 + 2 * n_q * H * 2 + pages * H * D * 2 + pages * H * ns * (D // 2 + 2 * 2)
    fp16 = (T - n_q) * H * D * 2
    assert stored_bytes(c, "k.") == keys + fp16 and stored_bytes(c, "v.") == values + fp16


def test_salient_tokens_are_more_precise_and_the_whole_beats_kivi2():
    g = torch.Generator().manual_seed(0)
    T, H, D = 256, 2, 16
    k, v, q = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g), torch.randn(T, 4, D, generator=g)
    c = zipcache(k, v, q, group_size=32, value_group=16, residual=0)
    err = (c.k_hat - k).pow(2).sum(-1)
    assert err[c.kept].mean() < 0.2 * err[~c.kept].mean()
    assert (c.k_hat - k).norm() < (kivi(k, v, bits=2, group_size=32, value_group=16, residual=0).k_hat - k).norm()


def _store(G=16, H=2, D=32, pages=8, slots=3, Hq=4):
    cfg = KVQConfig(method="zipcache", bits=2, group_size=G, value_group=16, residual=G)
    return QuantizedKVStore(cfg, PoolShape(1, H, D, pages, cfg), slots, torch.float32, "cpu")


def _serve(store, chunks, k, v, q, sm_scale, req_slot=1, first_page=1):
    """Write one request's T tokens in the given chunk sizes (batch by batch) -> its pool pages."""
    G = store.G
    T = k.shape[0]
    slots = first_page * G + torch.arange(T)
    pos = 0
    for n in chunks:
        bw = host.begin_batch(store, slots[pos:pos + n], torch.full((n,), req_slot),
                              torch.arange(pos, pos + n), torch.tensor([pos + n]).repeat(n))
        store.write_layer(0, bw, k[pos:pos + n], v[pos:pos + n], q=q[pos:pos + n], sm_scale=sm_scale)
        pos += n
    return first_page + torch.arange(T // G)


@pytest.mark.parametrize("chunks", [[1] * 80, [5, 27, 1, 1, 30, 16], [40, 40]])
def test_token_by_token_equals_all_at_once_and_the_reference(chunks):
    """A page compresses the same however its tokens were batched (decode, chunked prefill, one prefill), and the
    pool reads what the sequence reference reconstructs."""
    G, H, D, Hq, T = 16, 2, 32, 4, 80
    g = torch.Generator().manual_seed(3)
    k, v, q = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g), torch.randn(T, Hq, D, generator=g)
    one = _store()
    pages = _serve(one, [T], k, v, q, 0.3)
    many = _store()
    assert torch.equal(_serve(many, chunks, k, v, q, 0.3), pages)
    assert torch.equal(many.s_idx[0, pages], one.s_idx[0, pages])
    for name in ("k_codes", "v_codes", "s_k_codes", "s_v_codes", "v_chan"):
        assert torch.equal(getattr(many, name)[0], getattr(one, name)[0]), name
    ref = zipcache(k, v, q, 0.3, group_size=G, value_group=16, residual=0)
    plan = PagedPlan(torch.tensor([0, pages.numel()], dtype=torch.int32), pages.int(),
                     torch.tensor([G], dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                     torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    kc, vc = gather_context(many.layer_view(0), plan, 0)
    assert torch.allclose(kc, ref.k_hat, atol=1e-6) and torch.allclose(vc, ref.v_hat, atol=1e-6)


def test_writes_refuse_a_missing_query():
    store = _store()
    bw = host.begin_batch(store, torch.arange(16, 20), torch.ones(4, dtype=torch.long), torch.arange(4),
                          torch.full((4,), 4))
    with pytest.raises(ValueError, match="queries"):
        store.write_layer(0, bw, torch.randn(4, 2, 32), torch.randn(4, 2, 32))
