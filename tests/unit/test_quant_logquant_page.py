"""LogQuant's served page format (sgl_kvq/formats/logquant/codec.py): the incremental rule, M, the offsets table,
the page round trip, and one implementation with the eval's sequence-level logquant()."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sgl_kvq.attention_ref import gather_context
from sgl_kvq.config import KVQConfigError, parse_kv_cache_dtype
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.plan import PagedPlan
from sgl_kvq.pool_shape import PoolShape
from sgl_kvq.formats.logquant import codec as logquant_page
from sgl_kvq.quant import kivi_page
from bench.quant.logquant import log_positions, logquant
from sgl_kvq.formats.logquant.codec import EMPTY, RuleState, max_rows, offsets_table, simulate_rows
from sgl_kvq.formats.logquant import LogQuantParams
from slices import ci_slice


@pytest.mark.parametrize("W", ci_slice([1, 2, 5, 10, 21, 33], [1, 10, 21, 33]))
def test_incremental_rule_equals_from_scratch_rule_and_is_monotone(W):
    s, prev = RuleState(W), set()
    for T in range(1, 2500):
        s.append()
        assert s.kept == log_positions(T, W), T
        now = set(s.kept)
        assert now - prev <= {T - 1}, f"a position dropped before T={T} came back"  # monotone
        prev = now


@pytest.mark.parametrize(("W", "G", "R", "M"), [(21, 64, 64, 8), (10, 64, 64, 1), (12, 64, 64, 1), (13, 64, 64, 2),
                                                (21, 64, 128, 1), (21, 32, 64, 8)])
def test_rows_per_page(W, G, R, M):
    assert max_rows(W, G, 1 + R // G) == M


@pytest.mark.parametrize("W", [10, 21])
def test_a_longer_horizon_does_not_raise_M(W):
    assert max_rows(W, 64, 2, horizon=1 << 18) == max_rows(W, 64, 2)


def test_rows_are_what_the_rule_keeps_at_exit():
    W, G, ring = 21, 64, 2
    rows = simulate_rows(W, G, ring, 40)
    for n in range(40):
        T = (n + ring) * G + 1  # the first context length that reads page n from the base (plan_contexts)
        assert rows[n] == [p - n * G for p in log_positions(T, W) if n * G <= p < (n + 1) * G]
    assert rows[0][0] == 0  # the sink
    assert simulate_rows(10, 64, 2, 3) == [[0], [], []]  # the band fits the fp16 window: only the sink


@pytest.mark.parametrize(("W", "G", "ring"), [(21, 64, 2), (21, 16, 5), (10, 64, 2), (13, 32, 3), (42, 64, 2)])
def test_offsets_table_past_the_horizon_equals_the_simulation(W, G, ring):
    n = 3 * (logquant_page.HORIZON_TOKENS // G)
    M = max_rows(W, G, ring)
    table = offsets_table(W, G, ring, n, M)
    direct = simulate_rows(W, G, ring, n)
    assert table.dtype == torch.uint8 and table.shape == (n, M)
    assert [[x for x in r if x != EMPTY] for r in table.tolist()] == direct


def test_page_round_trip_rows_exact_others_kivi():
    g = torch.Generator().manual_seed(0)
    N, G, H, D = 5, 32, 2, 16
    k, v = torch.randn(N, G, H, D, generator=g), torch.randn(N, G, H, D, generator=g)
    off = offsets_table(21, G, 3, N, max_rows(21, G, 3))
    k_rows, v_rows = logquant_page.gather_rows(k, v, off)
    pages = kivi_page.pack_pages(k, v, 2, 16)
    k_hat, v_hat = logquant_page.apply_rows(*kivi_page.dequantize_pages(pages, 2),
                                            logquant_page.PageRows(k_rows, v_rows, off))
    kb, vb = kivi_page.dequantize_pages(pages, 2)
    is_row = torch.zeros(N, G, dtype=torch.bool)
    for n in range(N):
        for t in off[n].tolist():
            if t != EMPTY:
                is_row[n, t] = True
    assert is_row.sum() > N  # the test covers pages with several rows
    assert torch.equal(k_hat[is_row], k[is_row].half().float()) and torch.equal(v_hat[is_row], v[is_row].half().float())
    assert torch.equal(k_hat[~is_row], kb[~is_row]) and torch.equal(v_hat[~is_row], vb[~is_row])
    assert not (k_rows[off == EMPTY].any() or v_rows[off == EMPTY].any())  # empty slots hold zeros


@pytest.mark.parametrize("W", [10, 21])
def test_served_pool_reads_what_the_reference_reconstructs(W):
    """One implementation: pages written by the pool's store_pages read back (attention_ref.gather_context, the
    kernels' oracle) exactly as the eval's sequence-level logquant() reconstructs them, with the same bytes."""
    cfg = dataclasses.replace(parse_kv_cache_dtype("logquant2"), params=LogQuantParams(window=W))
    G, H, D, n = cfg.group_size, 3, 64, 6
    g = torch.Generator().manual_seed(W)
    k, v = torch.randn(n * G + cfg.residual + 5, H, D, generator=g), torch.randn(n * G + cfg.residual + 5, H, D,
                                                                               generator=g)
    ref = logquant(k, v, window=W)
    shape = PoolShape(layers=1, heads=H, head_dim=D, num_pages=8, cfg=cfg)
    store = QuantizedKVStore(cfg, shape, num_req_slots=2, model_dtype=torch.float32, device="cpu")
    pages = torch.tensor([5, 2, 6, 3, 8, 1])  # any pool pages, in position order
    store.store_pages(0, pages, k[:n * G].reshape(n, G, H, D), v[:n * G].reshape(n, G, H, D),
                      lpages=torch.arange(n))
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    plan = PagedPlan(i32(0, n), pages.int(), i32(G), i32(0, 0), i32(), i32(0))
    k_pool, v_pool = gather_context(store.layer_view(0), plan, 0)
    assert torch.equal(k_pool, ref.k_hat[:n * G]) and torch.equal(v_pool, ref.v_hat[:n * G])
    per_token = sum(t.numel() * t.element_size() for n_, t in ref.stored.items() if not n_.endswith("fp16")) / (n * G)
    assert shape.base_bytes_per_token() == per_token  # the pool's bytes are the reference's stored tensors
    # what the rule keeps outside the fp16 window at this length is fp16 in both
    T = k.shape[0]
    outside = [p for p in log_positions(T, W) if p < n * G]
    assert torch.equal(k_pool[outside], k[outside].half().float())


def test_reference_defaults_are_the_served_dtype_defaults():
    import inspect

    cfg, params = parse_kv_cache_dtype("logquant2"), inspect.signature(logquant).parameters
    assert (params["window"].default, params["group_size"].default, params["residual"].default) == (
        cfg.params.window, cfg.group_size, cfg.residual)


def test_bytes_per_token_at_the_defaults_and_at_w21():
    cfg = parse_kv_cache_dtype("logquant2")
    smol = dict(layers=30, heads=3, head_dim=64, num_pages=10)
    kivi2 = PoolShape(cfg=parse_kv_cache_dtype("kivi2"), **smol).base_bytes_per_token()
    assert kivi2 == 3600
    # M = 1 (the sink): k_rows + v_rows = 2 * 30 * 3 * 64 * 2 / 64 bytes per token, row_off 30 / 64
    assert PoolShape(cfg=cfg, **smol).base_bytes_per_token() == 3600 + 360 + 30 / 64
    w21 = dataclasses.replace(cfg, params=LogQuantParams(window=21))
    assert PoolShape(cfg=w21, **smol).base_bytes_per_token() == 3600 + 8 * 360 + 8 * 30 / 64


def test_bad_window_refused(monkeypatch):
    monkeypatch.setenv("KVQ_LOGQUANT_WINDOW", "0")
    with pytest.raises(KVQConfigError, match="KVQ_LOGQUANT_WINDOW=0 must be at least 1"):
        parse_kv_cache_dtype("logquant2")
    monkeypatch.setenv("KVQ_LOGQUANT_WINDOW", "ten")
    with pytest.raises(KVQConfigError, match="KVQ_LOGQUANT_WINDOW='ten' is not a"):
        parse_kv_cache_dtype("logquant2")
    monkeypatch.setenv("KVQ_LOGQUANT_WINDOW", "10")
    monkeypatch.setenv("KVQ_GROUP_SIZE", "256")
    monkeypatch.setenv("KVQ_RESIDUAL", "256")
    with pytest.raises(KVQConfigError, match="G=256 must be at most 128"):
        parse_kv_cache_dtype("logquant2")
