"""Export the live pool's real byte accounting through SGLang's /get_server_info (internal_states[0]["kv_pool"]),
so benchmarks and evaluations report measured bytes per token and capacity, not numbers computed on paper.
A kvq pool reports KVQTokenToKVPool.stats, any other pool (bf16) the keys every SGLang pool has."""

from __future__ import annotations


def add_kv_pool_stats(result, self, state, *args, **kwargs):
    state["kv_pool"] = kv_pool_stats(self.scheduler)
    return result


def kv_pool_stats(scheduler) -> dict:
    """The scheduler's pool stats: what /get_server_info reports and kvq's Prometheus metrics read
    (patches/metrics.py)."""
    # imported here: load() imports this module in every SGLang process, only the scheduler's calls it
    from sgl_kvq.patches.sizing import profiled_budget_bytes
    from sgl_kvq.pool import KVQTokenToKVPool, kv_cache_stats

    pool, capacity = scheduler.token_to_kv_pool_allocator.get_kvcache(), scheduler.max_total_num_tokens
    stats = pool.stats(capacity) if isinstance(pool, KVQTokenToKVPool) else kv_cache_stats(pool, capacity)
    # What the pool was sized from and how many requests run at once: capacity comparisons need both.
    stats.update(kv_budget_bytes=profiled_budget_bytes(), max_running_requests=scheduler.max_running_requests)
    stats["live"] = live_counts(scheduler, pool)
    from sgl_kvq.patches.pd import sent_stats

    pd_sent = sent_stats()
    if pd_sent is not None:
        stats["pd_sent"] = pd_sent
    return stats


def _pd_queued(scheduler) -> int | None:
    """Requests in a PD server's bootstrap, inflight, prealloc (retracted included) and transfer queues; None on a
    server without disaggregation."""
    queues = [getattr(scheduler, "disagg_prefill_bootstrap_queue", None),
              getattr(scheduler, "disagg_decode_prealloc_queue", None),
              getattr(scheduler, "disagg_decode_transfer_queue", None)]
    inflight = getattr(scheduler, "disagg_prefill_inflight_queue", None)
    if inflight is None and all(q is None for q in queues):
        return None
    n = len(inflight or [])
    for q in queues:
        if q is not None:
            n += len(q.queue) + len(getattr(q, "retracted_queue", ()))
    return n


def live_counts(scheduler, pool) -> dict:
    """What requests hold right now: free KV tokens, the radix tree's evictable and locked tokens, free request
    slots and, for a kvq pool, overlay frames still tagged with an allocated page. With no request in flight and
    after /flush_cache, each returns to its value at startup (the soak's leak check: `sgl-kvq bench soak`)."""
    import torch

    from sgl_kvq.pool import KVQTokenToKVPool

    tree = scheduler.tree_cache
    out = {"free_tokens": int(scheduler.token_to_kv_pool_allocator.available_size()),
           "evictable_tokens": int(tree.evictable_size()), "protected_tokens": int(tree.protected_size()),
           "free_req_slots": int(scheduler.req_to_token_pool.available_size()),
           "running_requests": len(scheduler.running_batch.reqs),
           "waiting_requests": len(scheduler.waiting_queue)}
    # prefill/decode disaggregation parks requests in queues of its own, holding pages and request slots (a decode
    # server keeps a failed transfer's 2,048 tokens until SGLang's bootstrap timeout: test_e2e_killed_servers.py)
    pd = _pd_queued(scheduler)
    if pd is not None:
        out["pd_queued_requests"] = pd
    if isinstance(pool, KVQTokenToKVPool):
        store = pool.store
        tagged = store.ov_tag >= 0
        pages = store.ov_tag.clamp(min=0)
        current = tagged & (store.ov_gen == store.page_gen[pages])
        allocator = scheduler.token_to_kv_pool_allocator
        free = allocator.get_all_free_pages() if hasattr(allocator, "get_all_free_pages") else None
        if free is not None:
            # page 0 is reserved (padded rows' dummy page), never handed out, never a live request's page
            current &= ~torch.isin(pages, free.to(pages.device)) & (pages != 0)
        out["overlay_frames_live"] = int(current.sum())
        out["frames_held"] = store.frames.frames_held()  # pooled frames of running requests (0 when idle)
    return out
