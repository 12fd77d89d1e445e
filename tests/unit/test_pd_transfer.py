"""Prefill/decode disaggregation at the pool level: a request prefilled into one KVQTokenToKVPool (the real store
path, in chunks) is moved into a second pool of another size through exactly the buffers the pool describes
(get_contiguous_buf_infos: pages; get_request_state_buf_infos: the request's overlay frames), with the addressing of
SGLang's mooncake backend (its own run grouping; K/V half pairing for the pages, entry to entry for the request
state, which SGLang sends flat because the pool gives each entry a layer id; the byte copy is a memmove here, the
engine test tests/engine/test_e2e_pd.py sends through mooncake). The decode pool must then read every context exactly as
the prefill pool does, and keep doing so while both decode past the open page.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.disaggregation.common.conn import CommonKVManager  # noqa: E402
from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

from sgl_kvq.config import parse_kv_cache_dtype  # noqa: E402
from sgl_kvq.pd_transfer import adopt_frames, base_entries, mark_window, request_state_layer_ids  # noqa: E402
from sgl_kvq.pool import KVQTokenToKVPool  # noqa: E402
from sgl_kvq.pool_shape import PoolShape  # noqa: E402
from pool_writes import D, H, HQ, L, read, write  # noqa: E402

DTYPES = ["kivi2", "kivi4", "kivi1", "kivi3", "gear2", "gearl2", "logquant2", "zipcache2"]


def loopback_send(src: tuple, dst: tuple, src_idx: list[int], dst_idx: list[int], flat: bool = False) -> int:
    """What mooncake's send_kvcache does for a plain-MHA pool at equal TP, with memmove for the wire: runs of
    consecutive indices, entry i of each half to entry i of the same half (flat: entry i to entry i, as for entries
    with layer ids). -> bytes moved."""
    (sp, _, s_items), (dp, _, d_items) = src, dst
    assert s_items == d_items, "both sides must describe the same items"
    if flat:
        pairs = list(zip(sp, dp, s_items))
    else:
        sk, sv, dk, dv, n = CommonKVManager.get_mha_kv_ptrs_with_pp(
            SimpleNamespace(kv_args=SimpleNamespace(prefill_start_layer=0)), sp, dp)
        pairs = [(sk[i], dk[i], s_items[i]) for i in range(n)] + [(sv[i], dv[i], s_items[n + i]) for i in range(n)]
    runs = group_concurrent_contiguous(np.array(src_idx, dtype=np.int32), np.array(dst_idx, dtype=np.int32))
    moved = 0
    for s_ptr, d_ptr, item in pairs:
        for s_run, d_run in zip(*runs):
            ctypes.memmove(d_ptr + d_run[0] * item, s_ptr + s_run[0] * item, item * len(s_run))
            moved += item * len(s_run)
    return moved


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("prefix_hit", [False, True])
def test_request_moves_between_pools(name, prefix_hit):
    """prefix_hit: the request's fifth page (in its fp16 window) came from the radix tree, so its frame holds
    another request's page: both sides must read that page from the base."""
    cfg = parse_kv_cache_dtype(name)
    G = cfg.group_size
    n = 5 * G + 3  # 5 complete pages and an open one; with chunked prefill below
    src = KVQTokenToKVPool(12 * G, PoolShape(L, H, D, 12, cfg), "cpu", torch.float32, num_req_slots=3)
    dst = KVQTokenToKVPool(20 * G, PoolShape(L, H, D, 20, cfg), "cpu", torch.float32, num_req_slots=5)
    gen = torch.Generator().manual_seed(7)
    # the prefill side's pages partly consecutive (runs), the decode side's scattered elsewhere
    src_pages = torch.tensor([3, 4, 5, 9, 10, 2])
    dst_pages = (torch.randperm(19, generator=gen) + 1)[:6]
    r_src, r_dst = 2, 3
    write(src, r_src, src_pages, 0, 2 * G + 5, seed=1)
    write(src, r_src, src_pages, 2 * G + 5, n, seed=1)
    if prefix_hit:  # another request (slot 0) wrote the same page after it: the frame it shared is now slot 0's
        src.store.ov_tag[r_src * cfg.ring_pages + 4 % cfg.ring_pages] = -1
    # stale contents on the decode side: another request's pages and frames in the same slot
    write(dst, r_dst, dst_pages, 0, 2 * G + 1, seed=99)

    mark_window(src.store, r_src, src_pages, n)
    assert int(src.store.pd_window[r_src]) == (1 if prefix_hit else min(cfg.ring_pages, 6))
    moved = loopback_send(src.get_contiguous_buf_infos(), dst.get_contiguous_buf_infos(), src_pages.tolist(),
                          dst_pages.tolist())
    assert len(request_state_layer_ids(src.store)) == len(src.get_request_state_buf_infos()[0])
    moved += loopback_send(src.get_request_state_buf_infos(), dst.get_request_state_buf_infos(), [r_src], [r_dst],
                           flat=True)
    adopt_frames(dst.store, r_dst, dst_pages, n)
    assert moved > 0

    q = torch.randn(1, HQ, D, generator=gen)
    # decode steps past the open page on both sides, each into a seventh page of its own
    src_pages = torch.cat([src_pages, torch.tensor([11])])
    dst_pages = torch.cat([dst_pages, torch.tensor([min(set(range(1, 20)) - set(dst_pages.tolist()))])])
    for end in (n, n + 1, 6 * G, 6 * G + 2):
        if end > n:
            write(src, r_src, src_pages, end - 1, end, seed=1)
            write(dst, r_dst, dst_pages, end - 1, end, seed=1)
        used = -(-end // G)
        ctx_s, out_s, plan_s = read(src, r_src, src_pages[:used], end, q)
        ctx_d, out_d, plan_d = read(dst, r_dst, dst_pages[:used], end, q)
        assert int(plan_s.ov_indptr[1]) == int(plan_d.ov_indptr[1]) >= 1, "the fp16 window must arrive"
        for (ks, vs), (kd, vd) in zip(ctx_s, ctx_d):
            assert torch.equal(ks, kd) and torch.equal(vs, vd), f"{name}: context differs at length {end}"
        for a, b in zip(out_s, out_d):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name,min_ratio", [("kivi2", 5.0), ("kivi4", 3.0), ("kivi3", 3.5), ("gear2", 3.0),
                                            ("logquant2", 3.0), ("zipcache2", 3.0)])
def test_bytes_per_transferred_token_against_bf16(name, min_ratio):
    """Per token, summed item_lens / G of the packed pool against SGLang's bf16 pool at the same page size (both
    from get_contiguous_buf_infos); the base's own accounting must agree."""
    cfg = parse_kv_cache_dtype(name)
    G = cfg.group_size
    pool = KVQTokenToKVPool(8 * G, PoolShape(L, H, D, 8, cfg), "cpu", torch.float32, num_req_slots=2)
    bf16 = MHATokenToKVPool(8 * G, G, torch.bfloat16, H, D, L, "cpu", False)
    sent = sum(pool.get_contiguous_buf_infos()[2]) / G
    sent_bf16 = sum(bf16.get_contiguous_buf_infos()[2]) / G
    assert sent_bf16 == 2 * L * H * D * 2
    entries = base_entries(pool.store)
    repeated = entries[-1].nbytes if len(entries) > len(pool.shape.base_shapes()) * L else 0  # odd count
    assert abs(sent - repeated / pool.shape.P / G - pool.shape.base_bytes_per_token()) < 1e-6
    print(f"{name}: {sent / (L * H):.2f} B per token per layer-head sent, bf16 {sent_bf16 / (L * H):.0f}: "
          f"{sent_bf16 / sent:.2f}x fewer")
    assert sent_bf16 / sent >= min_ratio


def test_a_pd_pair_with_different_fingerprints_is_refused(monkeypatch):
    """Both sides publish their pool's fingerprint as SGLang's kv_layout (patches/pd.publish_layout); SGLang's own
    decode-side check (CommonKVManager.try_ensure_parallel_info, run here against a prefill server's answer) refuses
    the pair, in sgl_kvq's words, with both fingerprints and what differs; equal fingerprints pass."""
    from dataclasses import replace
    from types import SimpleNamespace

    from sglang.srt.disaggregation.common import conn

    from sgl_kvq.patches import pd

    cfg = parse_kv_cache_dtype("kivi2")
    decode_side, prefill_side = cfg.fingerprint, replace(cfg, rotate="none").fingerprint
    args = SimpleNamespace(kv_layout=None)
    pd.publish_layout(args, KVQTokenToKVPool(8 * 64, PoolShape(L, H, D, 8, cfg), "cpu", torch.float32,
                                             num_req_slots=2))
    assert args.kv_layout == pd.LAYOUT_PREFIX + decode_side

    def manager():
        return SimpleNamespace(prefill_info_table={}, kv_args=SimpleNamespace(page_size=64),
                               kv_cache_dtype_str="kivi2", kv_layout=args.kv_layout, attn_tp_size=1)

    def prefill_answers(layout):
        info = dict(attn_tp_size=1, attn_cp_size=1, dp_size=1, pp_size=1, page_size=64, kv_cache_dtype="kivi2",
                    follow_bootstrap_room=True, kv_layout=layout)
        monkeypatch.setattr(conn.requests, "get", lambda *a, **k: SimpleNamespace(status_code=200, json=lambda: info))

    prefill_answers(pd.LAYOUT_PREFIX + prefill_side)
    with pytest.raises(pd.KVQPDMismatch) as e:
        pd.ensure_parallel_info(conn.CommonKVManager.try_ensure_parallel_info, manager(), "127.0.0.1:1")
    assert prefill_side in str(e.value) and decode_side in str(e.value)
    assert "rotate-none vs rotate-values" in str(e.value)
    prefill_answers(pd.LAYOUT_PREFIX + decode_side)
    try:  # the same fingerprint passes the layout check (the fake manager lacks what SGLang reads after it)
        pd.ensure_parallel_info(conn.CommonKVManager.try_ensure_parallel_info, manager(), "127.0.0.1:1")
    except pd.KVQPDMismatch:
        pytest.fail("equal fingerprints were refused")
    except Exception as e:  # noqa: BLE001
        assert "layout mismatch" not in str(e), e


def test_a_recipes_request_moves_between_pools(tmp_path, monkeypatch):
    """kivimix: each layer's codes at its own widths are their own transfer entries, moved as any other."""
    from sgl_kvq.recipe import ModelBinding, Recipe

    widths = [(4, 1), (1, 3), (3, 2), (2, 4)][:L]
    recipe = Recipe(ModelBinding(L, H, D, "0" * 16), tuple(k for k, _ in widths), tuple(v for _, v in widths))
    (tmp_path / "r.json").write_text(recipe.to_json())
    monkeypatch.setenv("KVQ_RECIPE", str(tmp_path / "r.json"))
    pool = KVQTokenToKVPool(8 * 64, PoolShape(L, H, D, 8, parse_kv_cache_dtype("kivimix")), "cpu", torch.float32,
                            num_req_slots=2)
    items = dict(zip(["k_codes", "v_codes"], [pool.get_contiguous_buf_infos()[2][i * L:(i + 1) * L]
                                              for i in (0, 3)]))
    assert items == {"k_codes": [64 * H * D * k // 8 for k, _ in widths],
                     "v_codes": [64 * H * D * v // 8 for _, v in widths]}
    test_request_moves_between_pools("kivimix", True)
