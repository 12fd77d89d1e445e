"""GEAR / GEAR-L pages (sgl_kvq/formats/gear/codec.py): low-rank residual, sparse outliers, their bytes, and the
served pool reading exactly what the sequence-level reference (the eval's rows) reconstructs."""

from __future__ import annotations

import pytest
import torch

from sgl_kvq.attention_ref import gather_context
from sgl_kvq.config import parse_kv_cache_dtype
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.plan import PagedPlan
from sgl_kvq.pool_shape import PoolShape
from bench.quant.accounting import bits_per_element, stored_bytes
from bench.quant.gear import gear, gear_l
from sgl_kvq.formats.gear.codec import low_rank, outliers_per_row
from bench.quant.kivi import kivi


def _kv(T=256, H=2, D=32, seed=0, low_rank_scale=0.0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, H, D, generator=g) + 3 * torch.randn(1, H, D, generator=g)
    v = torch.randn(T, H, D, generator=g)
    if low_rank_scale:  # a rank-2 component per head: what GEAR-L's residual approximation is for
        for x in (k, v):
            x += low_rank_scale * torch.einsum("thr,hrd->thd", torch.randn(T, H, 2, generator=g),
                                               torch.randn(H, 2, D, generator=g))
    return k, v


def test_power_iteration_recovers_an_exact_low_rank_matrix():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 100, 2, generator=g) @ torch.randn(3, 2, 24, generator=g)
    u, w = low_rank(a, rank=2, iters=3)
    assert u.shape == (3, 2, 100) and w.shape == (3, 2, 24)
    assert (u.transpose(1, 2) @ w - a).norm() < 1e-4 * a.norm()
    assert torch.allclose(u @ u.transpose(1, 2), torch.eye(2, dtype=u.dtype).expand(3, 2, 2), atol=1e-5)  # orthonormal


def test_zero_residual_gives_zero_factors():
    u, w = low_rank(torch.zeros(2, 16, 8), rank=2, iters=3)
    assert torch.equal(u.transpose(1, 2) @ w, torch.zeros(2, 16, 8)) and not u.isnan().any()


@pytest.mark.parametrize("bits", [2, 4])
def test_low_rank_lowers_the_error_of_the_same_backbone(bits):
    k, v = _kv(low_rank_scale=2.0)
    base = kivi(k, v, bits=bits, group_size=32, value_group=32, residual=32)
    lr = gear_l(k, v, bits=bits, group_size=32, value_group=32, residual=32, rank=2)
    assert (lr.k_hat - k).norm() < 0.9 * (base.k_hat - k).norm()
    assert (lr.v_hat - v).norm() < 0.9 * (base.v_hat - v).norm()
    assert torch.equal(lr.kept, base.kept) and torch.equal(lr.k_hat[-32:], base.k_hat[-32:])


def test_sparse_outliers_are_selected_and_restored_exactly():
    k, v = _kv(seed=1)
    k[17, 1, 5] = 500.0  # a key outlier in channel (1, 5) of page 0 (tokens 0..31)
    v[40, 0, 9] = -300.0  # a value outlier in token (40, 0): page 1, offset 8
    c = gear(k, v, bits=2, group_size=32, value_group=32, residual=32, outlier_ratio=0.02)
    assert 17 in c.stored["k.outlier_idx"][0, 1, :, 5].tolist()
    assert 9 in c.stored["v.outlier_idx"][1, 8, 0].tolist()
    assert c.k_hat[17, 1, 5] == 500.0 and c.v_hat[40, 0, 9] == -300.0
    # removing them before quantization keeps the rest of their group's range tight. Rank 0 on both sides: low
    # rank would absorb a lone outlier's damage too (it is a rank-1 residual), which is not what this is about.
    kw = dict(bits=2, group_size=32, value_group=32, residual=32, rank=0)
    sparse, plain = gear(k, v, outlier_ratio=0.02, **kw), gear(k, v, outlier_ratio=0.0, **kw)
    assert (sparse.k_hat - k)[:32, 1, 5].norm() < 0.2 * (plain.k_hat - k)[:32, 1, 5].norm()
    assert (sparse.v_hat - v)[40, 0].norm() < 0.2 * (plain.v_hat - v)[40, 0].norm()


def test_outliers_are_per_key_channel_over_the_page_and_per_value_token():
    k, v = _kv(T=160)
    c = gear(k, v, group_size=32, value_group=32, residual=32, outlier_ratio=0.1)
    assert c.stored["k.outlier_idx"].shape == (4, 2, 3, 32)  # 4 pages, H, round(0.1 * 32) per channel, D
    assert c.stored["v.outlier_idx"].shape == (4, 32, 2, 3)  # pages, G, H, round(0.1 * 32) per token
    for idx, row_dim in ((c.stored["k.outlier_idx"], 2), (c.stored["v.outlier_idx"], 3)):
        assert int(idx.max()) < 32 and (idx.sort(dim=row_dim).values.diff(dim=row_dim) > 0).all()  # distinct
    assert outliers_per_row(0.02, 64) == 1 and outliers_per_row(0.001, 64) == 1 and outliers_per_row(0, 64) == 0


def test_hand_computed_bytes_small_gear():
    # T=128, H=2, D=16, G=32, VG=16, R=32, rank 2, 10% outliers: 96 quantized tokens = 3 pages
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(128, 2, 16, generator=g), torch.randn(128, 2, 16, generator=g)
    c = gear(k, v, bits=2, group_size=32, value_group=16, residual=32, rank=2, outlier_ratio=0.1)
    kivi_k, kivi_v = 768 + 384 + 2048, 768 + 768 + 2048  # tests/unit/test_quant_kivi.py
    low_rank_bytes = 3 * 2 * 2 * (32 + 16) * 2  # fp16 u [pages, H, r, G] + w [pages, H, r, D] = 1152
    k_outliers = 3 * 2 * 3 * 16 * (2 + 1)  # round(0.1 * 32) = 3 per (page, head, channel): fp16 + uint8 = 864
    v_outliers = 96 * 2 * 2 * (2 + 1)  # round(0.1 * 16) = 2 per (token, head) = 1152
    assert stored_bytes(c, "k.") == kivi_k + low_rank_bytes + k_outliers
    assert stored_bytes(c, "v.") == kivi_v + low_rank_bytes + v_outliers
    assert bits_per_element(c).total == pytest.approx(8 * stored_bytes(c) / (2 * 128 * 32))


def test_deterministic_and_short_sequences():
    k, v = _kv(T=200)
    a, b = gear(k, v, group_size=32, residual=32), gear(k, v, group_size=32, residual=32)
    assert torch.equal(a.k_hat, b.k_hat) and torch.equal(a.v_hat, b.v_hat)
    short = gear(k[:20], v[:20], group_size=32, residual=32)  # nothing quantized: all fp16, no factors
    assert torch.equal(short.k_hat, k[:20].half().float()) and bits_per_element(short).total == 16.0


def test_reference_defaults_are_the_served_dtype_defaults():
    import inspect

    cfg, params = parse_kv_cache_dtype("gear2"), inspect.signature(gear).parameters
    assert (params["rank"].default, params["iters"].default, params["outlier_ratio"].default) == (
        cfg.params.rank, cfg.params.iters, cfg.params.outliers)
    assert (params["group_size"].default, params["residual"].default) == (cfg.group_size, cfg.residual)


@pytest.mark.parametrize("dtype", ["gear2", "gearl2"])
def test_served_pool_reads_what_the_reference_reconstructs(dtype):
    """One implementation: pages written by the pool's store_pages read back (attention_ref.gather_context, the
    kernels' oracle) exactly as the eval's sequence-level gear()/gear_l() reconstructs them."""
    cfg = parse_kv_cache_dtype(dtype)
    G, H, D = cfg.group_size, 3, 64
    k, v = _kv(T=4 * G + cfg.residual, H=H, D=D, seed=5, low_rank_scale=1.0)
    ref = (gear if dtype == "gear2" else gear_l)(k, v)
    shape = PoolShape(layers=1, heads=H, head_dim=D, num_pages=6, cfg=cfg)
    store = QuantizedKVStore(cfg, shape, num_req_slots=2, model_dtype=torch.float32, device="cpu")
    pages = torch.tensor([5, 2, 6, 3])  # any pool pages, in position order
    store.store_pages(0, pages, k[:4 * G].reshape(4, G, H, D), v[:4 * G].reshape(4, G, H, D))
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    plan = PagedPlan(i32(0, 4), pages.int(), i32(G), i32(0, 0), i32(), i32(0))
    k_pool, v_pool = gather_context(store.layer_view(0), plan, 0)
    assert torch.equal(k_pool, ref.k_hat[:4 * G]) and torch.equal(v_pool, ref.v_hat[:4 * G])
    per_token = sum(t.numel() * t.element_size() for n, t in ref.stored.items() if not n.endswith("fp16")) / (4 * G)
    assert shape.base_bytes_per_token() == per_token  # the pool's bytes are the reference's stored tensors
