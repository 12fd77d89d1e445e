"""SpeCache's top-k rows in pool frames (sgl_kvq/specache/topk_rows.py): with pooled frames a running request's
prefetched 16-bit rows and their positions are pool pages it takes with its overlay frames when it gets a request
slot, and gives back when the slot is freed.

- Through SGLang's allocator hooks (patches/frames.py): a new request slot takes its ring and its top-k frames,
  admission charges them, the prefetch writes into those pages' bytes and no token page's, and freeing the slot
  returns every page; a slot without frames is never written through.
- The backends on a pooled pool serve exactly what they serve on a static one (rows per request slot, the layout
  before): the same extend, pre-decode and two-lane outputs and the same prefetched rows, step after step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sgl_kvq.config import KVQConfig  # noqa: E402
from sgl_kvq.patches import frames as frame_hooks  # noqa: E402
from sgl_kvq.pool import KVQTokenToKVPool  # noqa: E402
from sgl_kvq.pool_shape import PoolShape  # noqa: E402
from sgl_kvq.specache.state import Lanes  # noqa: E402
from sgl_kvq.formats.specache import SpeCacheParams

# fp32 model: a frame of k = 16 (2 bit) or 32 (1 bit) pages of G = 32 tokens, whose key scales hold the 32 rows'
# positions; top-40 rows span two frames, the second one partly
G, H, HQ, D, L, K = 32, 2, 4, 16, 2, 40
SLOTS, CTX = 4, 256
FRAMES = {1: [4, 5, 6, 7], 3: [8, 9, 10, 11]}  # slot -> its ring (2 frames), then its top-k frames (2)


def make_pool(bits: int, pooled: bool) -> KVQTokenToKVPool:
    cfg = KVQConfig("specache", bits, group_size=G, value_group=16, residual=G, params=SpeCacheParams(top_k=K))
    k = PoolShape(L, H, D, 0, cfg).pages_per_frame(torch.float32)
    pages = 12 * k - 1  # 12 frames, page 0 included
    return KVQTokenToKVPool(pages * G, PoolShape(L, H, D, pages, cfg), "cpu", torch.float32, num_req_slots=SLOTS,
                            frames_pooled=pooled)


def test_a_request_slot_takes_its_top_k_rows_from_the_pool_and_gives_them_back():
    pool = make_pool(2, pooled=True)
    store, sc = pool.store, pool.strategy_state
    assert store.frames.extra == 2 and store.frames.per_request == 4 and sc.topk.pooled
    assert sc.device_bytes() == SLOTS * (2 * 8 + 16)  # per slot: its table row, speculative token and guess
    r2t_pool = SimpleNamespace(req_to_token=torch.zeros(SLOTS, CTX, dtype=torch.int32))
    frame_hooks.register_slot_pool(r2t_pool, pool)
    alloc = frame_hooks.FramePageAllocator(store.shape.num_pages * G, G, torch.uint8, "cpu", pool, False)
    k = alloc.k
    assert alloc.request_slot_reserve(has_req_pool_slot=False) == 4 * k * G  # admission charges the top-k frames
    free_before = alloc.available_size()

    new_req = SimpleNamespace(rid="r", kv=SimpleNamespace(holds_kv=False))
    assert frame_hooks.alloc_req_slots(lambda *_: [2], r2t_pool, [new_req], None) == [2]
    owned = store.frames.owned[2]
    assert alloc.available_size() == free_before - 4 * k * G
    assert sc.topk.table[2].tolist() == owned[2:] and store.frames.slot_frames[2].tolist() == owned[:2]

    # a context of 150 tokens in pages the allocator hands out, its 16-bit rows in the host tier
    tokens = alloc.alloc(160)
    r2t_pool.req_to_token[2, :150] = tokens[:150].int()
    rows = {li: (torch.randn(150, H, D), torch.randn(150, H, D)) for li in range(L)}
    for li, (kk, vv) in rows.items():
        sc.host.write(li, tokens[:150], kk, vv)
    token_pages = (tokens // G).unique()
    codes_before = store.k_codes[:, :].clone().view(L, store.shape.P, -1)[:, token_pages]
    pos = torch.stack([torch.randperm(150)[:K] for _ in range(H)])[None]  # [1, H, K]
    pos[0, 1, -3:] = -1
    sc.reset_requests([2])
    for li in range(L):
        sc.prefetch(li, torch.tensor([2]), pos, r2t_pool.req_to_token)
    for li, (kk, vv) in rows.items():
        got_k, got_v, got_pos = (t[0] for t in sc.topk.rows(li, torch.tensor([2])))
        assert torch.equal(got_pos, pos[0])
        for h in range(H):
            p = pos[0, h][pos[0, h] >= 0]
            assert torch.equal(got_k[h, :len(p)], kk[p, h]) and torch.equal(got_v[h, :len(p)], vv[p, h])
            # the rows are the bytes of the request's top-k frames: row j of head h in frame table[j // G]
            for j in (0, G - 1, G, len(p) - 1):
                f = owned[2 + j // G]
                assert torch.equal(store.ov_k[li, f, j % G, h], kk[p[j], h])
    assert torch.equal(store.k_codes.view(L, store.shape.P, -1)[:, token_pages], codes_before)  # no token page

    alloc.free(tokens)
    frame_hooks.free_rows(lambda *_: None, r2t_pool, [2])
    assert alloc.available_size() == free_before and 2 not in store.frames.owned
    assert sc.topk.table[2].tolist() == [0, 0] and store.frames.frames_held() == 0
    # a slot without frames points at frame 0, whose pages 1.. serve tokens: its reset writes nothing
    scales = store.k_scale.view(torch.int16).clone()  # bits: a position read as fp16 may be a NaN
    sc.reset_requests([2, 3])
    assert torch.equal(store.k_scale.view(torch.int16), scales)


def make_backend(name: str, bits: int, pooled: bool):
    from sgl_kvq.backends.specache_backend import KVQSpeCacheBackend
    from sgl_kvq.backends.specache_triton_backend import KVQSpeCacheTritonBackend

    pool = make_pool(bits, pooled)
    if pooled:
        for slot, frames in FRAMES.items():
            pool.store.frames.assign(slot, frames, pool.store.ov_tag)
    r2t = torch.zeros(SLOTS, CTX, dtype=torch.int32)
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=r2t))
    cls = KVQSpeCacheBackend if name == "kvq_torch" else KVQSpeCacheTritonBackend
    return cls(runner), pool, r2t


def layer(li: int):
    return SimpleNamespace(layer_id=li, tp_q_head_num=HQ, tp_k_head_num=H, tp_v_head_num=H, qk_head_dim=D,
                           v_head_dim=D, scaling=D ** -0.5, is_cross_attention=False, sliding_window_size=None,
                           logit_cap=0)


class Run:
    """Requests in slots 1 and 3 whose tokens lie outside every frame the pooled pool hands them: slot 1's in frame
    0's pages 1.., slot 3's in frame 1's. The same random rows drive every backend and pool."""

    def __init__(self, name, bits, pooled, lens):
        self.backend, self.pool, self.r2t = make_backend(name, bits, pooled)
        k = self.pool.store.shape.pages_per_frame(torch.float32)
        self.slots, self.first = [1, 3], [G, k * G]
        for r, first in zip(self.slots, self.first):
            self.r2t[r] = torch.arange(CTX, dtype=torch.int32) + first
        self.lens = list(lens)

    def batch(self, mode):
        B = len(self.slots)
        if mode == "extend":
            loc = torch.cat([torch.arange(n) + f for n, f in zip(self.lens, self.first)])
            return SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.tensor(self.slots),
                                   seq_lens=torch.tensor(self.lens), out_cache_loc=loc,
                                   extend_prefix_lens_cpu=[0] * B, extend_seq_lens_cpu=list(self.lens))
        lens = torch.tensor([n + 1 for n in self.lens])
        loc = torch.tensor([f + n for n, f in zip(self.lens, self.first)])
        if mode == "two_lane":
            loc = torch.cat([loc, torch.zeros(B, dtype=torch.int64)])
        return SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor(self.slots),
                               seq_lens=lens, seq_lens_cpu=lens, out_cache_loc=loc)

    def step(self, mode, qkv, rows=None):
        sc, be = self.pool.strategy_state, self.backend
        sc.lanes = None if mode == "extend" else Lanes(mode, len(rows) if mode == "predecode" else 2, rows)
        fb = self.batch(mode)
        be.init_forward_metadata(fb)
        fwd = be.forward_extend if mode == "extend" else be.forward_decode
        outs = [fwd(q, k, v, layer(li), fb) for li, (q, k, v) in enumerate(qkv)]
        prefetched = [sc.topk.rows(li, torch.tensor(self.slots)) for li in range(L)]
        return outs, prefetched


def random_qkv(T: int, gen) -> list:
    return [(torch.randn(T, HQ * D, generator=gen), torch.randn(T, H * D, generator=gen),
             torch.randn(T, H * D, generator=gen)) for _ in range(L)]


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("backend", ["kvq_torch", "kvq_triton"])
def test_pooled_top_k_rows_serve_what_per_slot_rows_serve(backend, bits, triton_interpret, monkeypatch):
    # the query heads a rank serves, which the fused lanes' plan reads from SGLang's parallel state
    monkeypatch.setattr("sgl_kvq.backends.specache_triton_backend.query_heads_on_this_rank", lambda runner: HQ)
    lens = [150, 110]
    static, pooled = Run(backend, bits, False, lens), Run(backend, bits, True, lens)
    assert not static.pool.strategy_state.topk.pooled and pooled.pool.strategy_state.topk.pooled
    gen = torch.Generator().manual_seed(bits)
    plan = [("extend", sum(lens), None), ("predecode", 2, torch.tensor([0, 1]))]
    plan += [("two_lane", 4, None)] * (3 if triton_interpret else 6)
    for i, (mode, T, rows) in enumerate(plan):
        qkv = random_qkv(T, gen)
        want, want_rows = static.step(mode, qkv, rows)
        got, got_rows = pooled.step(mode, qkv, rows)
        for li in range(L):
            assert torch.equal(got[li], want[li]), (i, mode, li)
            assert all(torch.equal(a, b) for a, b in zip(got_rows[li], want_rows[li])), (i, mode, li)
        if mode == "two_lane":
            for run in (static, pooled):
                run.lens = [n + 1 for n in run.lens]
    # the rows moved: the last step prefetched positions inside the base for both requests
    assert all(((p >= 0).sum(-1) > 0).all() for _, _, p in got_rows)
