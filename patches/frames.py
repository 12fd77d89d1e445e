"""Pooled overlay frames: a running request's fp16 frames are pages of the KV pool, handed out by SGLang's own page
allocator and charged where SGLang admits requests (the layout: sgl_kvq/layout.py; the table: sgl_kvq/frames.py).

- FramePageAllocator (SGLang's PagedTokenToKVPoolAllocator, built in its place for a pooled kvq pool) hands out a
  frame as k aligned free pages (frame f = pages f*k .. f*k+k-1) and takes it back as free pages. Its
  request_slot_reserve, which SGLang's PrefillAdder adds to every request that has no request slot yet, is one
  request's frames (per_request * k pages: its ring, and SpeCache's top-k rows), so admission sees them as it sees
  tokens; its available_size falls while a request holds them. Token pages are handed out from frames already in
  use by tokens first, whole free frames last, so the free pages stay in whole frames (tokens fill holes; frames
  come from the top).
- PrefillAdder.add_one_req (AROUND): a request without a request slot takes its frames when admission accepts it,
  before SGLang's own checks run (which then charge the request no request_slot_reserve: its frames are no longer
  free). Taken first, they are whole: HiCache's load-back, which places the request's prefix pages inside the
  admission, cannot split them. Free pages scattered over frames whose other pages requests hold add up in
  admission's count but form no frame, so a request whose frames cannot be made whole (by evicting radix-tree pages
  nothing locks) waits (NO_TOKEN) until running requests finish; with none running every non-free page is evictable,
  so it never waits forever. A request admission turns away gives its frames back.
- alloc_req_slots (AROUND): a request that gets a request slot owns the frames admission took for it
  (FrameTable.per_request); one that reaches a request slot without passing add_one_req takes them here,
  evicting radix-tree pages while no whole frame is free. Its req_to_token row is zeroed, so the pages
  the row names are its own (what admission counts as held).
- ReqToTokenPool.free_rows (AROUND): a freed request slot (finished, retracted, aborted) gives its frames back.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

# id(ReqToTokenPool) -> the pooled kvq pool whose frames its request slots own (patches/pool_build.py)
_slot_pools: dict[int, object] = {}


def register_slot_pool(req_to_token_pool, pool) -> None:
    _slot_pools[id(req_to_token_pool)] = pool
    pool.req_to_token_pool = req_to_token_pool  # read by its FramePageAllocator, built after the pool


class FramePageAllocator(PagedTokenToKVPoolAllocator):
    def __init__(self, size: int, page_size: int, dtype, device, kvcache, need_sort: bool):
        self.store = kvcache.store
        self.k = self.store.shape.pages_per_frame(self.store.model_dtype)
        self.num_frames = self.store.frames.num_frames
        self.frame_tokens = self.store.frames.per_request * self.k * page_size
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        kvcache.frame_allocator = self
        self.req_to_token_pool = getattr(kvcache, "req_to_token_pool", None)  # whose slots own the frames
        # rid -> the frames admission took for a request, until its request slot owns them (the same scheduler step)
        self.reserved: dict[str, list[int]] = {}
        self.admitting_reserved = False  # inside add_one_req for a request whose frames are taken

    def clear(self):
        super().clear()
        # Frame 0 holds page 0, which is never free: it is never handed out (the padded rows' dummy frame).
        self.store.frames.release_all()
        self.reserved = {}

    def request_slot_reserve(self, *, has_req_pool_slot: bool, prefill_tokens: int = 0) -> int:
        return 0 if has_req_pool_slot or self.admitting_reserved else self.frame_tokens

    def max_new_tokens_for_memory(self, input_tokens: int, max_new_tokens: int, *, token_capacity: int, **kwargs):
        """What an empty pool holds for one request besides its frames (admission charges them): a prompt that
        does not fit with its frames is refused (SGLang aborts it) instead of waiting for room that never comes."""
        capacity = token_capacity - self.frame_tokens
        if -(-input_tokens // self.page_size) * self.page_size + self.page_size >= capacity:
            return None
        return super().max_new_tokens_for_memory(input_tokens, max_new_tokens, token_capacity=capacity, **kwargs)

    def _release_page_ids(self, *page_ids: torch.Tensor):
        # Merged at once (not staged until an allocation runs short, as SGLang does): every allocation, HiCache's
        # load-back included, takes pages in token order.
        self.staged_pages.extend(page_ids)
        self.num_staged_pages += sum(ids.numel() for ids in page_ids)
        self.merge_and_sort_free()

    def merge_and_sort_free(self):
        if not self.staged_pages:
            return
        pages = self.get_all_free_pages()
        whole = self._free_counts(pages)[pages // self.k] == self.k
        # pages of partly used frames first, whole free frames last, lowest first: tokens fill holes before they
        # break a frame, frames are taken from the top
        self.free_pages = pages[torch.argsort(whole.long() * (self.num_frames * self.k) + pages)]
        self.staged_pages = []
        self.num_staged_pages = 0

    def _free_counts(self, pages: torch.Tensor) -> torch.Tensor:
        return torch.bincount(pages // self.k, minlength=self.num_frames)

    def free_frames(self) -> torch.Tensor:
        """Ids of frames all of whose pages are free, ascending."""
        self.merge_and_sort_free()
        return (self._free_counts(self.free_pages) == self.k).nonzero().squeeze(1)

    def take_frames(self, n: int) -> list[int] | None:
        """n whole free frames (the highest), their pages no longer free; None when fewer are free."""
        whole = self.free_frames()
        if whole.numel() < n:
            return None
        chosen = whole[whole.numel() - n:]
        self.free_pages = self.free_pages[~torch.isin(self.free_pages // self.k, chosen)]
        return chosen.tolist()

    def _pages_of(self, frames: list[int]) -> torch.Tensor:
        ids = torch.tensor(frames, dtype=torch.int64, device=self.device)
        return (ids[:, None] * self.k + torch.arange(self.k, device=self.device)).reshape(-1)

    def held_pages(self, prefixes: list[torch.Tensor] = ()) -> torch.Tensor:
        """Per page, whether a request holds it: a page a slot's req_to_token row names (its radix prefix, locked
        while it runs, and its own tokens; the row is zeroed when the slot gets frames, so nothing stale), a page of a
        frame it owns or admission took for it, page 0, or a token index in `prefixes` (the radix prefixes admission
        locked for requests that have no slot yet). A page neither free nor held is a radix-tree page nothing locks:
        evictable."""
        held = torch.zeros(self.num_frames * self.k, dtype=torch.bool, device=self.device)
        held[0] = True
        for tokens in prefixes:
            held[tokens.to(self.device).long() // self.page_size] = True
        owned = self.store.frames.owned
        if owned:
            rows = self.req_to_token_pool.req_to_token[torch.tensor(list(owned), device=self.device)]
            held[rows.reshape(-1).long() // self.page_size] = True
        taken = [f for fs in [*owned.values(), *self.reserved.values()] for f in fs]
        if taken:
            held[self._pages_of(taken)] = True
        return held

    def frames_obtainable(self, n: int, prefixes: list[torch.Tensor] = ()) -> bool:
        """Whether n whole frames are free, or can be made free by evicting radix-tree pages no request holds."""
        if self.free_frames().numel() >= n:
            return True
        unheld = (~self.held_pages(prefixes)).reshape(self.num_frames, self.k).all(dim=1)
        return int(unheld.sum()) >= n

    def give_back_frames(self, frames: list[int]) -> None:
        if frames:
            self._release_page_ids(self._pages_of(frames))


def build_allocator(orig, self, *, token_to_kv_pool, **kwargs):
    """KVCacheConfigurator._build_token_to_kv_pool_allocator: a pooled kvq pool gets the frame-aware allocator."""
    allocator = orig(self, token_to_kv_pool=token_to_kv_pool, **kwargs)
    store = getattr(token_to_kv_pool, "store", None)
    if store is None or not getattr(store, "frames_pooled", False):
        return allocator
    if type(allocator) is not PagedTokenToKVPoolAllocator:
        raise RuntimeError(f"sgl_kvq: pooled frames need SGLang's PagedTokenToKVPoolAllocator, this server built "
                           f"{type(allocator).__name__}")
    return FramePageAllocator(allocator.size, allocator.page_size, allocator.dtype, allocator.device,
                              token_to_kv_pool, allocator.need_sort)


def _make_whole_frames(allocator: FramePageAllocator, tree_cache, needed: int) -> None:
    """Evict unlocked radix-tree pages until `needed` frames are wholly free or nothing more can be evicted."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    while (short := needed - allocator.free_frames().numel()) > 0:
        if tree_cache is None or not tree_cache.supports_prefix_sharing():
            return
        result = tree_cache.evict(EvictParams(num_tokens=short * allocator.k * allocator.page_size))
        if not result.num_tokens_evicted:
            return


def _locked_prefix_indices(tree_cache, reqs) -> list[torch.Tensor]:
    """The token indices of the radix paths admission locked for `reqs` (their matched prefixes), read through
    SGLang's own path_device_indices: the server's tree is the Rust-core UnifiedRadixCache, whose nodes are ids, not
    Python nodes with values (walking node.parent there saw no prefix at all: the soak's stop)."""
    if tree_cache is None or not tree_cache.supports_prefix_sharing():
        return []
    return [tree_cache.path_device_indices(r.last_node) for r in reqs if r.last_node is not None]


def add_one_req(orig, self, req, *args, **kwargs):
    """PrefillAdder.add_one_req: a request that would need a new request slot takes its frames first, or waits (see
    the module docstring)."""
    allocator = self.token_to_kv_pool_allocator
    if not isinstance(allocator, FramePageAllocator) or req.kv.holds_kv:
        return orig(self, req, *args, **kwargs)
    from sglang.srt.managers.schedule_policy import AddReqResult

    if not self.can_run_list:
        _drop_stale_reservations(allocator)
    frames = _take_frames_for(self, allocator, req)
    if frames is None:
        return AddReqResult.NO_TOKEN
    allocator.reserved[req.rid] = frames
    allocator.admitting_reserved = True
    try:
        return orig(self, req, *args, **kwargs)
    finally:
        allocator.admitting_reserved = False
        if not (self.can_run_list and self.can_run_list[-1] is req):  # SGLang's own test of admission
            allocator.give_back_frames(allocator.reserved.pop(req.rid))


def _take_frames_for(adder, allocator: FramePageAllocator, req) -> list[int] | None:
    """The whole frames `req` runs with, evicting unlocked radix-tree pages to make them, or None while they cannot be
    made: its own matched prefix, and those of the requests admitted before it in this step (locked, in no request
    slot's row yet), count as held."""
    n = allocator.store.frames.per_request
    new = [r for r in adder.can_run_list if not r.kv.holds_kv] + [req]
    if not allocator.frames_obtainable(n, _locked_prefix_indices(adder.tree_cache, new)):
        return None
    with adder._lock_node(req.last_node):  # eviction must not take the prefix it matched
        _make_whole_frames(allocator, adder.tree_cache, n)
    return allocator.take_frames(n)


def _drop_stale_reservations(allocator: FramePageAllocator) -> None:
    """Frames taken for a request whose scheduler step built no batch: a new step's first admission gives them back
    (a step's admitted requests get their request slots in the same step)."""
    import logging

    for rid in list(allocator.reserved):
        logging.getLogger(__name__).warning("sgl_kvq: request %s was admitted but got no request slot; its frames go "
                                            "back to the pool", rid)
        allocator.give_back_frames(allocator.reserved.pop(rid))


def alloc_req_slots(orig, req_to_token_pool, reqs, tree_cache):
    pool = _slot_pools.get(id(req_to_token_pool))
    if pool is None:
        return orig(req_to_token_pool, reqs, tree_cache)
    allocator, frames = pool.frame_allocator, pool.store.frames
    taken = [None if r.kv.holds_kv else allocator.reserved.pop(r.rid, None) for r in reqs]
    unreserved = sum(1 for r, t in zip(reqs, taken) if not r.kv.holds_kv and t is None)
    _make_whole_frames(allocator, tree_cache, unreserved * frames.per_request)
    indices = orig(req_to_token_pool, reqs, tree_cache)
    for slot, got in zip(indices, taken):
        if frames.holds(slot):
            continue
        got = got or allocator.take_frames(frames.per_request)
        if got is None:
            raise RuntimeError(
                f"sgl_kvq: no {frames.per_request} whole free frames of {allocator.k} pages for request slot {slot} "
                f"({allocator.available_size()} tokens free): admission charged them, eviction could not free them. "
                f"Who holds each frame's pages: {frame_census(allocator, req_to_token_pool, tree_cache)}")
        frames.assign(slot, got, pool.store.ov_tag)
        req_to_token_pool.req_to_token[slot].zero_()
    return indices


def frame_census(allocator: FramePageAllocator, req_to_token_pool, tree_cache) -> list[str]:
    """Per frame, who holds each page: free (.), page 0 (0), a frame owned by slot s (Fs), the req_to_token row of
    slot s (Rs; rs for a slot without frames, whose row is stale), the radix tree (T), or nothing known (?)."""
    n = allocator.num_frames * allocator.k
    who = ["?"] * n
    who[0] = "0"
    ps = allocator.page_size
    if tree_cache is not None and tree_cache.supports_prefix_sharing():
        for page in (tree_cache.all_values_flatten().long() // ps).unique().tolist():
            who[page] = "T"
    rows, owned = req_to_token_pool.req_to_token, allocator.store.frames.owned
    for slot in range(rows.shape[0]):
        for page in (rows[slot].long() // ps).unique().tolist():
            if page and who[page] == "?":
                who[page] = f"R{slot}" if slot in owned else f"r{slot}"
    for slot, fs in owned.items():
        for f in fs:
            for page in range(f * allocator.k, (f + 1) * allocator.k):
                who[page] = f"F{slot}"
    allocator.merge_and_sort_free()
    for page in allocator.free_pages.tolist():
        who[page] = "."
    return [" ".join(who[f * allocator.k:(f + 1) * allocator.k]) for f in range(allocator.num_frames)]


def free_rows(orig, self, indices):
    result = orig(self, indices)
    pool = _slot_pools.get(id(self))
    if pool is not None:
        for slot in indices:
            pool.frame_allocator.give_back_frames(pool.store.frames.release(int(slot)))
    return result
