"""Pooled overlay frames (sgl_kvq/frames.py, patches/frames.py): a running request's fp16 frames are pages of the
pool, handed out by SGLang's own paged allocator (FramePageAllocator) while the request holds a request slot.

The oracle is the static layout (every slot owns frames in a separate region, what the pool did before): a random
life of requests (prompts, decode steps, finished requests whose complete pages stay as a shared prefix, prefixes
dropped and their pages reused, slots reused) runs through a static store and a pooled one, and after every step
they must attend to the same result and hold the same base pages. The pooled store's frames come from the real
allocator, so the walk also checks what the allocator promises: a frame's pages are never a token's page, every
page comes back when its owner finishes, and tokens are handed out from partly used frames first."""

from __future__ import annotations

import random
import types

import pytest
import torch

from sgl_kvq import attention_ref
from sgl_kvq.config import KVQConfig
from sgl_kvq.frames import FrameTable, can_pool
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.metadata.device import DecodeBuffers, build_decode
from sgl_kvq.metadata.forward import build_forward_plan
from sgl_kvq.patches.frames import FramePageAllocator
from sgl_kvq.pool_shape import PoolShape
from slices import ci_slice

H, HQ, D, SCALE = 2, 4, 32, 0.2
SLOTS, MAX_CTX = 6, 192


def make_pair(G, bits, residual, method, num_pages):
    cfg = KVQConfig(method, bits, group_size=G, value_group=16, residual=residual)
    shape = PoolShape(1, H, D, num_pages, cfg)
    static = QuantizedKVStore(cfg, shape, SLOTS, torch.float16, "cpu")
    pooled = QuantizedKVStore(cfg, shape, SLOTS, torch.float16, "cpu", frames_pooled=True)
    device_built = QuantizedKVStore(cfg, shape, SLOTS, torch.float16, "cpu", frames_pooled=True)
    return static, pooled, device_built


def make_allocator(store, need_sort=False):
    kvcache = types.SimpleNamespace(store=store)
    return FramePageAllocator(store.shape.num_pages * store.G, store.G, torch.uint8, "cpu", kvcache, need_sort)


def test_frame_table_static_and_pooled():
    static = FrameTable(4, 2, 8, torch.device("cpu"), pooled=False)
    assert static.of(torch.tensor([3]), torch.tensor([5])).tolist() == [7] and static.holds(2)
    pooled = FrameTable(4, 2, 8, torch.device("cpu"), pooled=True)
    tags = torch.arange(8)
    assert not pooled.holds(2) and pooled.of_host(2, 0) == 0  # a slot without frames points at dummy frame 0
    pooled.assign(2, [5, 3], tags)
    assert pooled.holds(2) and [pooled.of_host(2, n) for n in range(4)] == [5, 3, 5, 3]
    assert tags[5] == -1 and tags[3] == -1 and tags[4] == 4  # a new owner never reads the last owner's rows
    with pytest.raises(AssertionError):
        pooled.assign(2, [6, 7], tags)  # one owner at a time
    with pytest.raises(AssertionError):
        pooled.assign(1, [0, 7], tags)  # the dummy frame is nobody's
    assert pooled.release(2) == [5, 3] and not pooled.holds(2) and pooled.of_host(2, 1) == 0
    assert pooled.frames_held() == 0


def test_frame_table_extra_frames_go_with_the_ring():
    """A strategy's extra frames (SpeCache's top-k rows) are owned, addressed and given back with the ring; the
    overlay reads never see them."""
    table = FrameTable(4, 2, 16, torch.device("cpu"), pooled=True, extra=2)
    assert table.per_request == 4 and table.extra_frames.tolist() == [[0, 0]] * 4
    tags = torch.arange(16)
    with pytest.raises(AssertionError):
        table.assign(1, [5, 3], tags)  # the ring alone is not a request's frames
    table.assign(1, [5, 3, 9, 12], tags)
    assert [table.of_host(1, n) for n in range(3)] == [5, 3, 5] and table.extra_frames[1].tolist() == [9, 12]
    assert table.frames_held() == 4 and (tags[[5, 3, 9, 12]] == -1).all()
    assert table.release(1) == [5, 3, 9, 12] and table.extra_frames[1].tolist() == [0, 0]
    with pytest.raises(AssertionError):
        FrameTable(4, 2, 16, torch.device("cpu"), pooled=False, extra=1)  # static frames carry no extra frames


def test_pooled_frames_are_the_code_bytes_of_their_pages():
    _, pooled, _ = make_pair(16, 2, 16, "kivi", 31)
    k = pooled.shape.pages_per_frame(torch.float16)
    assert k == 8 and pooled.ov_k.shape[1] == pooled.shape.P // k
    assert pooled.overlay_bytes() < pooled.ov_k.numel()  # the frames add no allocation, only their tags
    before_k, before_v = pooled.k_codes.clone(), pooled.v_codes.clone()
    pooled.ov_k[0, 2] = 1.5
    pooled.ov_v[0, 3] = -2.0
    changed_k = (pooled.k_codes != before_k).reshape(pooled.shape.P, -1).any(1).nonzero().squeeze(1).tolist()
    changed_v = (pooled.v_codes != before_v).reshape(pooled.shape.P, -1).any(1).nonzero().squeeze(1).tolist()
    assert changed_k == list(range(2 * k, 3 * k)) and changed_v == list(range(3 * k, 4 * k))


def test_pooling_needs_a_frame_no_wider_than_a_page_has_tokens():
    cfg = KVQConfig("kivi", 1, group_size=16, value_group=16, residual=16)
    assert not can_pool(PoolShape(1, H, D, 0, cfg), torch.float32)  # k = 32 pages over 16-token pages
    assert can_pool(PoolShape(1, H, D, 0, cfg), torch.float16)


def test_allocator_hands_out_whole_frames_and_keeps_them_whole():
    _, pooled, _ = make_pair(16, 2, 16, "kivi", 63)
    alloc = make_allocator(pooled)
    G, k = 16, alloc.k
    assert alloc.available_size() == 63 * G and alloc.request_slot_reserve(has_req_pool_slot=False) == 2 * k * G
    assert alloc.request_slot_reserve(has_req_pool_slot=True) == 0
    frames = alloc.take_frames(2)
    assert frames == [6, 7] and alloc.available_size() == (63 - 2 * k) * G  # the highest whole frames
    held = {p for f in frames for p in range(f * k, f * k + k)}
    tokens = alloc.alloc(5 * G)
    assert not held & set((tokens // G).tolist())
    alloc.free(tokens[G:3 * G])  # two pages of frame 0's group back: still a partly used frame
    assert alloc.take_frames(6) is None  # frames 1..5 only: frame 0 holds page 0, never free
    got = alloc.take_frames(4)
    assert got == [2, 3, 4, 5]
    # tokens now fill the partly used frame before anything else
    assert sorted((alloc.alloc(2 * G) // G).unique().tolist()) == [2, 3]
    alloc.give_back_frames(frames + got)
    assert alloc.free_frames().tolist() == [1, 2, 3, 4, 5, 6, 7]
    alloc.clear()
    assert alloc.available_size() == 63 * G and pooled.frames.frames_held() == 0
    # one request's room: the pool less its frames; a prompt that cannot fit beside them is refused, not queued
    cap = 63 * G
    assert alloc.max_new_tokens_for_memory(100, 10**6, token_capacity=cap, sliding_window_size=None,
                                           chunk_size=None) == cap - 2 * k * G - 7 * G - G - 1
    assert alloc.max_new_tokens_for_memory(cap - 2 * k * G, 8, token_capacity=cap, sliding_window_size=None,
                                           chunk_size=None) is None


def test_admission_counts_frames_eviction_can_make_whole_not_scattered_free_pages():
    """The soak's stop: free pages in every frame, none whole, the rest held by running requests. A frame whose other
    pages only the radix tree holds can be made whole (evicted); one a running request holds a page of cannot."""
    _, pooled, _ = make_pair(16, 2, 16, "kivi", 63)  # 8 frames of k = 8 pages; frame 0 holds page 0
    alloc = make_allocator(pooled)
    G, k = 16, alloc.k
    req_to_token = torch.zeros(SLOTS, MAX_CTX, dtype=torch.int32)
    alloc.req_to_token_pool = types.SimpleNamespace(req_to_token=req_to_token)
    running = alloc.take_frames(2)
    pooled.frames.assign(1, running, pooled.ov_tag)  # frames 6, 7: a running request's
    pages = (alloc.alloc(alloc.available_size()) // G).unique()
    assert alloc.available_size() == 0 and len(pages) == 6 * k - 1
    held = [f * k + 3 for f in (1, 2, 4, 5)]  # its tokens: one page in each of frames 1, 2, 4, 5
    req_to_token[1, :len(held) * G] = (torch.tensor(held)[:, None] * G + torch.arange(G)).reshape(-1)
    tree = [3 * k + 1, 3 * k + 6]  # frame 3: two pages only the radix tree holds (evictable)
    alloc.free(torch.tensor([p * G for p in pages.tolist() if p not in held and p not in tree]))
    assert alloc.free_frames().numel() == 0 and alloc.available_size() == (6 * k - 1 - 6) * G
    assert alloc.frames_obtainable(1) and not alloc.frames_obtainable(2)
    # the same tree pages as the matched prefix of a request being admitted: locked, so frame 3 is not obtainable
    assert not alloc.frames_obtainable(1, [torch.tensor([p * G + 5 for p in tree])])
    alloc.free(torch.tensor([p * G for p in tree]))  # what the hook's eviction does
    assert alloc.take_frames(1) == [3]
    req_to_token[1].zero_()
    pooled.frames.release(1)
    alloc.give_back_frames(running + [3])
    # nothing running: the pages it held are the tree's now, evictable; frame 0 is never handed out
    assert alloc.frames_obtainable(7) and not alloc.frames_obtainable(8)


def test_admission_reads_locked_prefixes_off_the_servers_rust_tree():
    """A server's radix tree is SGLang's UnifiedRadixCache on its Rust core, whose match nodes are ids: admission reads
    a matched prefix's pages through the tree's own API (walking Python nodes there found none, so a request's locked
    prefix pages counted as evictable and the soak stopped the scheduler with no whole frame free)."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from sgl_kvq.patches.frames import _locked_prefix_indices

    G = 16
    _, pooled, _ = make_pair(G, 2, 16, "kivi", 63)  # 8 frames of k = 8 pages
    alloc = make_allocator(pooled)
    r2t = ReqToTokenPool(size=SLOTS, max_context_len=MAX_CTX, device="cpu", enable_memory_saver=False)
    alloc.req_to_token_pool = r2t
    tree = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                                             page_size=G, tree_components=(ComponentType.FULL,)))
    # every page but one page in each frame is the tree's: one frame can be made whole only by evicting its pages
    pages = alloc.alloc(alloc.available_size()).reshape(-1, G)
    keep = torch.tensor([p for p in range(pages.shape[0]) if (int(pages[p, 0]) // G) % alloc.k != 5])
    alloc.free(pages[~torch.isin(torch.arange(pages.shape[0]), keep)].reshape(-1))
    values = pages[keep].reshape(-1)
    tree.insert(InsertParams(key=RadixKey(array("q", range(values.numel()))), value=values))
    assert alloc.free_frames().numel() == 0 and alloc.frames_obtainable(7)
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", range(values.numel())))))
    tree.inc_lock_ref(match.last_device_node)
    req = types.SimpleNamespace(last_node=match.last_device_node)
    prefixes = _locked_prefix_indices(tree, [req])
    assert torch.equal(torch.cat(prefixes).sort().values, values.sort().values)
    assert not alloc.frames_obtainable(1, prefixes)  # the locked prefix touches every frame


def test_admission_takes_the_frames_before_sglang_admits_and_the_slot_owns_them():
    """PrefillAdder.add_one_req's hook takes a request's frames before SGLang's own admission runs, so what that
    admission allocates (HiCache's load-back of the request's prefix) cannot split them, and charges it no
    request_slot_reserve for them; a request admission turns away gives them back; alloc_req_slots hands the taken
    frames to the request's slot. (With the frames taken at the slot instead, HiCache's load-back of the first
    prompt left no two whole frames: tests/engine/test_e2e_hicache.py.)"""
    import contextlib

    from sglang.srt.managers.schedule_policy import AddReqResult

    from sgl_kvq.patches import frames as hooks

    _, pooled, _ = make_pair(16, 2, 16, "kivi", 63)  # 8 frames of k = 8 pages; 2 frames a request
    alloc = make_allocator(pooled)
    G, k = 16, alloc.k
    alloc.req_to_token_pool = types.SimpleNamespace(req_to_token=torch.zeros(SLOTS, MAX_CTX, dtype=torch.int32))
    alloc.alloc(3 * G)  # a running request's pages: frame 0's pages 1..3, a partly used frame
    adder = types.SimpleNamespace(token_to_kv_pool_allocator=alloc, can_run_list=[], tree_cache=None,
                                  _lock_node=lambda node: contextlib.nullcontext())
    seen = {}

    def admit_with_load_back(adder, req):
        seen["reserve"] = alloc.request_slot_reserve(has_req_pool_slot=False)
        seen["loaded"] = alloc.alloc(6 * G)  # more pages than frame 0's holes: a whole frame breaks
        adder.can_run_list.append(req)
        return AddReqResult.CONTINUE

    def turn_away(adder, req):
        return AddReqResult.NO_TOKEN

    whole = alloc.free_frames().tolist()
    req = types.SimpleNamespace(rid="a", kv=types.SimpleNamespace(holds_kv=False), last_node=None)
    assert hooks.add_one_req(turn_away, adder, req) == AddReqResult.NO_TOKEN
    assert alloc.free_frames().tolist() == whole and not alloc.reserved
    assert hooks.add_one_req(admit_with_load_back, adder, req) == AddReqResult.CONTINUE
    taken = alloc.reserved["a"]
    assert taken == whole[-2:] and seen["reserve"] == 0
    assert not set((seen["loaded"] // G // k).tolist()) & set(taken)
    assert alloc.request_slot_reserve(has_req_pool_slot=False) == 2 * k * G  # outside the hook: charged again
    pool = types.SimpleNamespace(frame_allocator=alloc, store=pooled)
    r2t = types.SimpleNamespace(req_to_token=alloc.req_to_token_pool.req_to_token)
    hooks.register_slot_pool(r2t, pool)
    try:
        assert hooks.alloc_req_slots(lambda *_: [4], r2t, [req], None) == [4]
    finally:
        hooks._slot_pools.pop(id(r2t))
    assert pooled.frames.owned[4] == taken and not alloc.reserved
    held = alloc.held_pages()
    assert held[torch.tensor(taken)[:, None] * k + torch.arange(k)].all()


class Life:
    """Requests through SGLang's real paged allocator (FramePageAllocator): a request slot takes `ring` frames,
    pages are allocated one at a time as requests grow, finished requests leave their complete pages to a 'tree'
    that later requests share as a prefix until it is dropped."""

    def __init__(self, G, seed, alloc, ring):
        self.G, self.rng, self.alloc, self.ring = G, random.Random(seed), alloc, ring
        self.free_slots = list(range(1, SLOTS))
        self.req_to_token = torch.zeros(SLOTS, MAX_CTX, dtype=torch.int32)
        self.active: dict[int, tuple[list[int], int]] = {}
        self.frames: dict[int, list[int]] = {}
        self.tree: list[list[int]] = []
        self.shared = self.dropped = 0

    def page(self) -> int | None:
        got = self.alloc.alloc(self.G)
        return None if got is None else int(got[0]) // self.G

    def start(self, stores) -> int | None:
        frames = self.alloc.take_frames(self.ring)
        if frames is None:
            return None
        slot = self.free_slots.pop(self.rng.randrange(len(self.free_slots)))
        self.req_to_token[slot].zero_()  # as alloc_req_slots does: the row names only this request's pages
        self.frames[slot] = frames
        for s in stores:
            s.frames.assign(slot, frames, s.ov_tag)
        pages = []
        if self.tree and self.rng.random() < 0.7:
            prefix = self.rng.choice(self.tree)
            pages = prefix[:self.rng.randint(1, len(prefix))]
            self.shared += 1
        for n, p in enumerate(pages):
            self.req_to_token[slot, n * self.G:(n + 1) * self.G] = p * self.G + torch.arange(self.G)
        self.active[slot] = (list(pages), len(pages) * self.G)
        return slot

    def held_by_tree(self, p) -> bool:
        return any(p in t for t in self.tree)

    def finish(self, slot, stores):
        pages, n = self.active.pop(slot)
        complete = pages[:n // self.G]
        if complete and self.rng.random() < 0.7 and complete not in self.tree:
            self.tree.append(complete)
        mine = [p for p in pages if not self.held_by_tree(p) and not self.held_by_active(p)]
        self._free(mine)
        for s in stores:
            s.frames.release(slot)
        self.alloc.give_back_frames(self.frames.pop(slot))
        self.free_slots.append(slot)

    def held_by_active(self, p) -> bool:
        return any(p in pages for pages, _ in self.active.values())

    def _free(self, pages):
        if pages:
            self.alloc.free(torch.tensor([p * self.G for p in pages]))

    def drop_prefix(self):
        dropped = self.tree.pop(self.rng.randrange(len(self.tree)))
        self._free([p for p in dropped if not self.held_by_tree(p) and not self.held_by_active(p)])
        self.dropped += 1

    def grow(self, slot, n_new) -> tuple[list[int], int] | None:
        """Allocate pages for n_new more tokens of `slot`: the slots of its new tokens, or None (no page free)."""
        pages, n = self.active[slot]
        locs = []
        for pos in range(n, min(n + n_new, MAX_CTX)):
            if pos % self.G == 0:
                p = self.page()
                if p is None:
                    while p is None and self.tree:
                        self.drop_prefix()
                        p = self.page()
                    if p is None:
                        break
                pages.append(p)
                self.req_to_token[slot, pos:pos + self.G] = p * self.G + torch.arange(self.G)
            locs.append(pages[pos // self.G] * self.G + pos % self.G)
        self.active[slot] = (pages, n + len(locs))
        return locs, n

    def check_frames_own_their_pages(self):
        held = {p for f in self.frames.values() for fr in f for p in range(fr * self.alloc.k, (fr + 1) * self.alloc.k)}
        used = {p for pages, _ in self.active.values() for p in pages} | {p for t in self.tree for p in t}
        free = set(self.alloc.get_all_free_pages().tolist())
        assert not held & used and not held & free and not used & free
        # Admission's question: how many frames can be made whole, evicting tree pages no active request holds
        k = self.alloc.k
        busy = held | {p for pages, _ in self.active.values() for p in pages} | {0}
        can = sum(1 for f in range(self.alloc.num_frames) if not busy & set(range(f * k, (f + 1) * k)))
        for n in (1, self.ring, can, can + 1):
            assert self.alloc.frames_obtainable(n) == (can >= n), (n, can)


# CI: 2 bits (8 pages a frame), 3 (frames lie apart) and the formats with extras; 4 bits and R = 0 in the matrix
FRAME_CASES = [(16, 2, 16, "kivi"), (16, 4, 32, "kivi"), (16, 2, 0, "kivi"), (16, 3, 32, "kivi"),
               (16, 2, 16, "zipcache"), (16, 2, 16, "logquant")]


@pytest.mark.parametrize("G,bits,residual,method", ci_slice(FRAME_CASES, [FRAME_CASES[i] for i in (0, 3, 4, 5)]))
def test_pooled_frames_serve_what_static_frames_serve(G, bits, residual, method, triton_interpret):
    # whole frames, page 0 included: 8 pages a frame at 2 bits, 6 at 3 (5.33 used: frames lie apart), 4 at 4
    static, pooled, dev = make_pair(G, bits, residual, method, num_pages=131 if bits == 3 else 127)
    alloc = make_allocator(pooled)
    life = Life(G, seed=7 * G + bits + residual, alloc=alloc, ring=static.ring)
    alloc.req_to_token_pool = types.SimpleNamespace(req_to_token=life.req_to_token)
    bufs = DecodeBuffers(SLOTS, MAX_CTX // G, dev.ring, torch.device("cpu"))
    torch.manual_seed(bits + residual)
    steps = decodes = 0
    start_free = alloc.available_size()
    for _ in range(60 if triton_interpret else 200):
        life.check_frames_own_their_pages()
        if life.free_slots and (not life.active or life.rng.random() < 0.15):
            slot = life.start([pooled, dev])
            if slot is not None:
                locs, prefix = life.grow(slot, life.rng.randint(1, 3 * G))
                if not locs:
                    continue
                n = len(locs)
                t = torch.randn(n, H, D), torch.randn(n, H, D), torch.randn(n, HQ, D)
                args = dict(is_decode=False, extend_prefix_lens=[prefix], extend_seq_lens=[n])
                for store in (static, pooled, dev):  # the device path's extends run on the host, as kvq_triton's do
                    plan = build_forward_plan(store, life.req_to_token, torch.tensor([slot]),
                                              torch.tensor([prefix + n]), torch.tensor(locs), **args)
                    for step in plan.steps:
                        rows = step.rows if step.rows is not None else slice(None)
                        store.write_layer(0, step.write, t[0][rows], t[1][rows], q=t[2][rows], sm_scale=SCALE)
                steps += 1
            continue
        if life.active and life.rng.random() < 0.1:
            life.finish(life.rng.choice(list(life.active)), [pooled, dev])
            continue
        if not life.active:
            continue
        reqs, lens, locs = [], [], []
        for slot in [s for s in life.active if life.rng.random() < 0.8] or list(life.active)[:1]:
            got, n = life.grow(slot, 1)
            if got:
                reqs.append(slot), lens.append(n + 1), locs.append(got[0])
        if not reqs:
            continue
        req, seq, loc = torch.tensor(reqs), torch.tensor(lens), torch.tensor(locs)
        k, v, q = torch.randn(len(reqs), H, D), torch.randn(len(reqs), H, D), torch.randn(len(reqs), HQ, D)
        outs, plans = [], []
        for store in (static, pooled):
            step = build_forward_plan(store, life.req_to_token, req, seq, loc, is_decode=True).steps[0]
            store.write_layer(0, step.write, k, v, q=q, sm_scale=SCALE)
            outs.append(attention_ref.ref_decode(q, store.layer_view(0), step.plan, SCALE))
            plans.append(step.plan)
        write, plan = build_decode(dev, life.req_to_token, req, seq, loc, bufs)
        dev.write_decode_layer(0, write, k, v, q=q, sm_scale=SCALE)
        outs.append(attention_ref.ref_decode(q, dev.layer_view(0), plan, SCALE))
        for b in range(len(reqs)):
            for p in (plans[1], plan):  # same base pages, same number of frames, the pooled frames the slot's own
                assert p.kv_indices[p.kv_indptr[b]:p.kv_indptr[b + 1]].tolist() == \
                    plans[0].kv_indices[plans[0].kv_indptr[b]:plans[0].kv_indptr[b + 1]].tolist()
                ov = p.ov_indices[p.ov_indptr[b]:p.ov_indptr[b + 1]].tolist()
                assert len(ov) == int(plans[0].ov_indptr[b + 1] - plans[0].ov_indptr[b])
                assert set(ov) <= set(life.frames[reqs[b]])
        torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
        torch.testing.assert_close(outs[2], outs[0], atol=0, rtol=0)  # the Triton writes are bit-exact
        decodes += 1
    for slot in list(life.active):
        life.finish(slot, [pooled, dev])
    while life.tree:
        life.drop_prefix()
    life.check_frames_own_their_pages()
    assert alloc.available_size() == start_free and pooled.frames.frames_held() == 0  # every page came back
    assert decodes > 20 and steps > 5 and life.shared > 0 and int((pooled.page_gen[1:] > 1).sum()) > 0
