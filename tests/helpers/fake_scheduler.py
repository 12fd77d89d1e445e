"""A stand-in for SGLang's Scheduler with what the kv_pool stats read (patches/observability.py): a pool behind its
allocator, fixed live counts (capacity - 3 free tokens, 2 evictable and 1 locked in the tree, one running request,
none waiting) and `free_slots` free request slots."""

from __future__ import annotations

from types import SimpleNamespace


def fake_scheduler(pool, capacity: int, max_running_requests: int, free_slots: int) -> SimpleNamespace:
    allocator = SimpleNamespace(get_kvcache=lambda: pool, available_size=lambda: capacity - 3)
    return SimpleNamespace(token_to_kv_pool_allocator=allocator, max_total_num_tokens=capacity,
                           max_running_requests=max_running_requests,
                           tree_cache=SimpleNamespace(evictable_size=lambda: 2, protected_size=lambda: 1),
                           req_to_token_pool=SimpleNamespace(available_size=lambda: free_slots),
                           running_batch=SimpleNamespace(reqs=[None]), waiting_queue=[])
