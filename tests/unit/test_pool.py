"""The quantized pool against SGLang's real paged allocator and radix tree (CPU, no engine).

Episodes of requests that share prefixes go through match_prefix -> alloc (chunked extends, then decodes) ->
begin_batch/write_layer -> insert/free -> evict, under a pool small enough that pages are evicted and reused.
Every position's K/V is a deterministic function of the token prefix, so the expected context of any request is
known without the pool: after every batch, each request's context gathered through the plan must equal the exact
fp16 values on its overlay pages and the reference quantization of the TRUE page contents on its base pages.
A stale scale, a stale frame or a page of another request would show up as a mismatch.
"""

from __future__ import annotations

import random
from array import array

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("sglang")

from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

from sgl_kvq.attention_ref import gather_context  # noqa: E402
from sgl_kvq.config import KVQConfig  # noqa: E402
from sgl_kvq.formats import logquant, zipcache  # noqa: E402
from sgl_kvq.formats.logquant import LogQuantParams  # noqa: E402
from sgl_kvq.formats.specache import SpeCacheParams  # noqa: E402
from sgl_kvq.formats.zipcache import ZipCacheParams  # noqa: E402
from sgl_kvq.metadata.host import begin_batch, plan_contexts  # noqa: E402
from sgl_kvq.pool import KVQTokenToKVPool  # noqa: E402
from sgl_kvq.pool_shape import PoolShape  # noqa: E402
from sgl_kvq.formats.gear import codec as gear_page  # noqa: E402
from sgl_kvq.formats.logquant import codec as logquant_page  # noqa: E402
from sgl_kvq.formats.zipcache import codec as zipcache_page  # noqa: E402
from sgl_kvq.quant import kivi_page  # noqa: E402
from bench.quant.zipcache import page_scores  # noqa: E402
from slices import full_matrix

H, D, L = 2, 16, 2
HQ, SM_SCALE = 2 * H, 0.25  # zipcache2's queries: GQA group 2


def true_kv(tokens: list[int], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H, D] K/V where position p depends on tokens[:p+1] only (like a causal model's KV)."""
    out_k, out_v, h = [], [], 17 + layer
    for t in tokens:
        h = (h * 1_000_003 + t) % (2**31 - 1)
        g = torch.Generator().manual_seed(h)
        out_k.append(torch.randn(H, D, generator=g) * 2 + torch.arange(D) * 0.1)  # per-channel offsets like real keys
        out_v.append(torch.randn(H, D, generator=g))
    return torch.stack(out_k), torch.stack(out_v)


def true_q(tokens: list[int], layer: int) -> torch.Tensor:
    """[T, HQ, D] queries, position p a function of tokens[:p+1] (zipcache2's saliency reads them)."""
    out, h = [], 91 + layer
    for t in tokens:
        h = (h * 1_000_003 + t) % (2**31 - 1)
        out.append(torch.randn(HQ, D, generator=torch.Generator().manual_seed(h)) * 2)
    return torch.stack(out)


def expected_context(tokens, n, layer, plan, b, cfg):
    """What request b must read: overlay pages exact, base pages = reference quantization of the true page."""
    G = cfg.group_size
    k, v = true_kv(tokens[:n], layer)
    n_base_pages = int(plan.kv_indptr[b + 1] - plan.kv_indptr[b])
    nb = min(n_base_pages * G, n)
    full = n_base_pages * G
    if n_base_pages:
        kp = k[:full].reshape(n_base_pages, G, H, D)
        vp = v[:full].reshape(n_base_pages, G, H, D)
        vg = min(cfg.value_group, D)
        if cfg.method == "zipcache":
            qp = true_q(tokens[:full], layer).reshape(n_base_pages, G, HQ, D)
            idx = zipcache_page.select_salient(page_scores(qp, kp, SM_SCALE), zipcache.codec.salient_per_page(cfg))
            kq, vq = zipcache_page.dequantize_zipcache_pages(*zipcache_page.pack_zipcache_pages(
                kp, vp, idx, cfg.bits, vg), cfg.bits)
        elif cfg.method in ("gear", "gearl"):
            kq, vq = gear_page.dequantize_gear_pages(*gear_page.pack_gear_pages(
                kp, vp, cfg.bits, vg, cfg.params.rank, cfg.params.iters, cfg.format.codec.outliers_per_row(cfg, G),
                cfg.format.codec.outliers_per_row(cfg, D)), cfg.bits)
        else:
            kq, vq = kivi_page.dequantize_pages(kivi_page.pack_pages(kp, vp, cfg.bits, vg), cfg.bits)
        # the rows LogQuant's rule keeps at each logical page's exit: a function of positions only
        if cfg.method == "logquant":
            off = logquant_page.offsets_table(cfg.params.window, G, cfg.ring_pages, n_base_pages,
                                               logquant.codec.rows_per_page(cfg))
            kq, vq = logquant_page.apply_rows(kq, vq, logquant_page.PageRows(*logquant_page.gather_rows(kp, vp, off),
                                                                             off))
        k = torch.cat([kq.reshape(-1, H, D)[:nb], k[nb:]])
        v = torch.cat([vq.reshape(-1, H, D)[:nb], v[nb:]])
    return k, v


class Episode:
    def __init__(self, cfg: KVQConfig, num_pages: int, rng: random.Random):
        G = cfg.group_size
        self.cfg, self.G, self.rng = cfg, G, rng
        self.pool = KVQTokenToKVPool(num_pages * G, PoolShape(L, H, D, num_pages, cfg), "cpu", torch.float32,
                                     num_req_slots=5)
        self.alloc = PagedTokenToKVPoolAllocator(size=num_pages * G, page_size=G, dtype=torch.uint8, device="cpu",
                                                 kvcache=self.pool, need_sort=False)
        self.r2t = ReqToTokenPool(size=4, max_context_len=4096, device="cpu", enable_memory_saver=False)
        self.tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=self.r2t,
                                               token_to_kv_pool_allocator=self.alloc, page_size=G))
        self.checked = 0
        self.prefix_hits = 0
        self.kernels = False  # write_layer's Triton path (interpreted on CPU)

    def check(self, r: int, tokens: list[int], n: int):
        store = self.pool.store
        G = self.G
        pages = self.r2t.req_to_token[r, : -(-n // G) * G: G].long() // G
        plan = plan_contexts(store, [pages], [r], [n])
        for layer in range(L):
            got_k, got_v = gather_context(store.layer_view(layer), plan, 0)
            want_k, want_v = expected_context(tokens, n, layer, plan, 0, self.cfg)
            torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got_v, want_v, atol=1e-5, rtol=1e-5)
        sc = self.pool.strategy_state
        if sc is not None:  # SpeCache's host tier: every context slot holds its token's exact K/V, never a stale row
            slots = self.r2t.req_to_token[r, :n].long()
            for layer in range(L):
                want_k, want_v = true_kv(tokens[:n], layer)
                host_k, host_v = sc.host.rows(layer, slots)
                assert torch.equal(host_k, want_k) and torch.equal(host_v, want_v)
        n_ov = int(plan.ov_indptr[1])
        assert n_ov <= self.cfg.ring_pages
        if n % G:
            assert n_ov >= 1, "the open page must come from the fp16 overlay"
        self.checked += 1

    def write(self, r: int, tokens: list[int], start: int, locs: torch.Tensor):
        end = start + locs.numel()
        store = self.pool.store
        bw = begin_batch(store, locs, torch.full((locs.numel(),), r), torch.arange(start, end),
                         torch.full((locs.numel(),), end))
        for layer in range(L):
            k, v = true_kv(tokens[:end], layer)
            q = true_q(tokens[:end], layer)[start:end] if self.cfg.format.codec.needs_queries else None
            store.write_layer(layer, bw, k[start:end], v[start:end], kernels=self.kernels, q=q, sm_scale=SM_SCALE)
            if self.pool.strategy_state is not None:
                self.pool.strategy_state.host.write(layer, locs, k[start:end], v[start:end])

    def alloc_or_evict(self, fn):
        out = fn()
        if out is None:
            self.tree.evict(EvictParams(num_tokens=self.alloc.size))
            out = fn()
        return out

    def take_slot(self, slot: int | None) -> int:
        if slot is None:
            return self.r2t.alloc_rows(1)[0]
        self.r2t.free_slots.remove(slot)
        return slot

    def run_request(self, tokens: list[int], decode_steps: int, chunk: int, slot: int | None = None) -> bool:
        G = self.G
        m = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        prefix = self.tree.path_device_indices(m.last_device_node)[: m.device_prefix_len].clone()
        node = m.last_device_node
        self.tree.inc_lock_ref(node)
        self.prefix_hits += int(prefix.numel() > 0)
        r = self.take_slot(slot)
        self.r2t.req_to_token[r, : prefix.numel()] = prefix.to(torch.int32)
        n = prefix.numel()
        if n:
            self.check(r, tokens, n)  # the shared prefix reads back right before this request writes anything
        total = len(tokens) + decode_steps
        seq = tokens + [self.rng.randrange(50) for _ in range(decode_steps)]
        ok = True
        while n < total:
            step = 1 if n >= len(tokens) else min(chunk, len(tokens) - n)
            last = self.r2t.req_to_token[r, n - 1].long().view(1) if n else torch.tensor([-1])
            if step == 1 and n >= len(tokens):
                locs = self.alloc_or_evict(lambda: self.alloc.alloc_decode(
                    torch.tensor([n + 1]), torch.tensor([n + 1]), last))
            else:
                locs = self.alloc_or_evict(lambda: self.alloc.alloc_extend(
                    torch.tensor([n]), torch.tensor([n]), torch.tensor([n + step]), torch.tensor([n + step]), last,
                    step))
            if locs is None:
                ok = False
                break
            self.r2t.req_to_token[r, n: n + step] = locs.to(torch.int32)
            self.write(r, seq, n, locs.long())
            n += step
            self.check(r, seq, n)
        kv = self.r2t.req_to_token[r, :n].long()
        aligned = n // G * G
        if ok and aligned:
            res = self.tree.insert(InsertParams(key=RadixKey(array("q", seq[:aligned])), value=kv[:aligned].clone()))
            # Pages another request inserted first are duplicates: SGLang frees this request's copies.
            if res.prefix_len > prefix.numel():
                self.alloc.free(kv[prefix.numel(): res.prefix_len])
            self.alloc.free(kv[aligned:n]) if n > aligned else None
        else:
            self.alloc.free(kv[prefix.numel():n])
        self.tree.dec_lock_ref(node)
        self.r2t.free_rows([r])
        return ok


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), bits=st.sampled_from([1, 2, 3, 4]), G=st.sampled_from([8, 16]),
       window_pages=st.sampled_from([0, 1, 2]))
def test_pool_through_radix_tree(seed, bits, G, window_pages):
    rng = random.Random(seed)
    cfg = KVQConfig(method="kivi", bits=bits, group_size=G, value_group=8, residual=window_pages * G)
    ep = Episode(cfg, num_pages=14, rng=rng)
    trunks = [[rng.randrange(100) for _ in range(rng.randrange(G, 5 * G))] for _ in range(3)]
    for _ in range(7):
        trunk = rng.choice(trunks)
        tokens = (trunk[: rng.randrange(1, len(trunk) + 1)]
                  + [rng.randrange(100) for _ in range(rng.randrange(0, 2 * G))])
        ep.run_request(tokens, decode_steps=rng.randrange(0, G + 3), chunk=rng.choice([3, G - 1, G, 2 * G + 5]),
                       slot=rng.randrange(1, 5))
        if rng.random() < 0.3:
            ep.tree.evict(EvictParams(num_tokens=rng.randrange(1, 6) * G))
    assert ep.checked > 0


def _shared_life(cfg: KVQConfig, rng: random.Random) -> None:
    """Six requests over three shared trunks (G = 8 pages), chunked extends, decodes and random evictions through
    a 14-page pool; every read is checked against the reference (Episode.check)."""
    ep = Episode(cfg, num_pages=14, rng=rng)
    trunks = [[rng.randrange(100) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    for _ in range(6):
        trunk = rng.choice(trunks)
        tokens = trunk[: rng.randrange(1, len(trunk) + 1)] + [rng.randrange(100) for _ in range(rng.randrange(0, 16))]
        ep.run_request(tokens, decode_steps=rng.randrange(0, 11), chunk=rng.choice([3, 7, 8, 21]),
                       slot=rng.randrange(1, 5))
        if rng.random() < 0.3:
            ep.tree.evict(EvictParams(num_tokens=rng.randrange(1, 6) * 8))
    assert ep.checked > 0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), method=st.sampled_from(["gear", "gearl"]), window_pages=st.sampled_from([0, 1]))
def test_gear_pool_through_radix_tree(seed, method, window_pages):
    """GEAR pages (codes + low-rank factors + outliers) shared, evicted and reused behind the radix tree read back
    as the reference compression of their true K/V."""
    rng = random.Random(seed)
    cfg = KVQConfig(method=method, bits=2, group_size=8, value_group=8, residual=window_pages * 8)
    _shared_life(cfg, rng)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), ratio=st.sampled_from([0.1, 0.4, 0.6]), window_pages=st.sampled_from([0, 1]))
def test_zipcache_pool_through_radix_tree(seed, ratio, window_pages):
    """zipcache2 pages (codes + salient plane, picked from saliency accumulated over chunked extends and decodes)
    shared, evicted and reused behind the radix tree read back as the reference compression of their true K/V
    and queries."""
    rng = random.Random(seed)
    cfg = KVQConfig(method="zipcache", bits=2, group_size=8, value_group=8, residual=window_pages * 8,
                    params=ZipCacheParams(salient=ratio))
    _shared_life(cfg, rng)


# 10 examples under KVQ_TEST_MATRIX=all, 3 in CI (12 s each under the interpreter)
@settings(max_examples=10 if full_matrix() else 3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), window=st.sampled_from([2, 3, 5]), window_pages=st.sampled_from([0, 1]),
       kernels=st.booleans())
def test_logquant_pool_through_radix_tree(seed, window, window_pages, kernels):
    """LogQuant pages (codes + the fp16 rows the rule keeps at the page's exit) shared, evicted and reused behind
    the radix tree read back exactly as the same context written without the cache: a prefix hit reads the rows of
    the same positions (expected_context knows no cache)."""
    rng = random.Random(seed)
    # G = 16: the Triton write path's smallest page; M = 4..11 rows per page without a window page, 1..2 with one
    cfg = KVQConfig(method="logquant", bits=2, group_size=16, value_group=16, residual=window_pages * 16,
                    params=LogQuantParams(window=window))
    ep = Episode(cfg, num_pages=14, rng=rng)
    ep.kernels = kernels
    trunks = [[rng.randrange(100) for _ in range(rng.randrange(16, 80))] for _ in range(3)]
    for _ in range(5):
        trunk = rng.choice(trunks)
        tokens = trunk[: rng.randrange(1, len(trunk) + 1)] + [rng.randrange(100) for _ in range(rng.randrange(0, 20))]
        ep.run_request(tokens, decode_steps=rng.randrange(0, 18), chunk=rng.choice([5, 16, 37]),
                       slot=rng.randrange(1, 5))
        if rng.random() < 0.3:
            ep.tree.evict(EvictParams(num_tokens=rng.randrange(1, 4) * 16))
    assert ep.checked > 0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), bits=st.sampled_from([1, 2]))
def test_specache_host_tier_through_radix_tree(seed, bits):
    """SpeCache's host copies live at the pool's token slots: shared prefix pages share them, and a freed, evicted
    and reused slot holds its new token's K/V (check() compares every context row with the exact K/V)."""
    rng = random.Random(seed)
    cfg = KVQConfig(method="specache", bits=bits, group_size=8, value_group=8, residual=8,
                    params=SpeCacheParams(top_k=4))
    ep = Episode(cfg, num_pages=10, rng=rng)
    trunks = [[rng.randrange(100) for _ in range(rng.randrange(8, 40))] for _ in range(3)]
    host_bytes = ep.pool.host_bytes()
    for _ in range(7):
        trunk = rng.choice(trunks)
        tokens = trunk[: rng.randrange(1, len(trunk) + 1)] + [rng.randrange(100) for _ in range(rng.randrange(0, 16))]
        ep.run_request(tokens, decode_steps=rng.randrange(0, 11), chunk=rng.choice([3, 8, 21]),
                       slot=rng.randrange(1, 5))
        if rng.random() < 0.4:
            ep.tree.evict(EvictParams(num_tokens=rng.randrange(1, 6) * 8))
    assert ep.checked > 0 and ep.pool.host_bytes() == host_bytes  # fixed at startup: nothing to free, no growth


def test_prefix_pages_are_shared_not_requantized():
    """A second request on the same prefix reads the first one's quantized pages: the tree hands out the same
    pool pages, and the pool's codes for them are not rewritten."""
    rng = random.Random(1)
    cfg = KVQConfig(method="kivi", bits=2, group_size=8, value_group=8, residual=0)
    ep = Episode(cfg, num_pages=32, rng=rng)
    tokens = [rng.randrange(100) for _ in range(40)]
    ep.run_request(tokens, decode_steps=0, chunk=40)
    codes_before = ep.pool.store.k_codes.clone()
    scales_before = ep.pool.store.k_scale.clone()
    ep.run_request(tokens[:32] + [7, 8, 9], decode_steps=2, chunk=3)
    assert ep.prefix_hits == 1
    m = ep.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    shared_pages = ep.tree.path_device_indices(m.last_device_node)[:32:8].long() // 8
    for p in shared_pages.tolist():
        assert torch.equal(ep.pool.store.k_codes[:, p * 8:(p + 1) * 8], codes_before[:, p * 8:(p + 1) * 8])
        assert torch.equal(ep.pool.store.k_scale[:, p], scales_before[:, p])


def test_frame_of_reused_page_is_not_read():
    """A page freed and reallocated to another request must not be read through a frame still tagged with it."""
    cfg = KVQConfig(method="kivi", bits=2, group_size=8, value_group=8, residual=8)
    ep = Episode(cfg, num_pages=3, rng=random.Random(2))  # so few pages that every request reuses them
    for i in range(8):
        # Alternate request slots: slot 1's frames still name pages that slot 2 then rewrites, and the next
        # request in slot 1 gets those pages back from the tree.
        tokens = [(i * 31 + j) % 97 for j in range(13)] if i % 3 else [5] * 8 + [i] * 5
        assert ep.run_request(tokens, decode_steps=3, chunk=5, slot=1 + i % 2)
        if i % 3 == 2:
            ep.tree.evict(EvictParams(num_tokens=64))
    assert ep.checked >= 8 * 4


@pytest.mark.parametrize("name", ["kivi2", "gear2", "zipcache2"])
def test_kv_size_bytes_names_every_device_tensor(name):
    """get_kv_size_bytes (SGLang's KV bytes, the live pool's kv_bytes) counts the whole base and the overlay's K/V
    state (zipcache2's salient plane and saliency accumulator included); only the frame tags are left out."""
    from sgl_kvq.config import parse_kv_cache_dtype

    cfg = parse_kv_cache_dtype(name)
    pool = KVQTokenToKVPool(4 * 64, PoolShape(L, H, D, 4, cfg), "cpu", torch.float32, num_req_slots=3)
    s = pool.store
    tags = sum(t.numel() * t.element_size() for t in (s.ov_tag, s.ov_gen))
    assert sum(pool.get_kv_size_bytes()) == s.base_bytes() + s.overlay_bytes() - tags
