"""Export the live pool's real byte accounting through SGLang's /get_server_info (internal_states[0]["kv_pool"]),
so benchmarks and evaluations report measured bytes per token and capacity, not numbers computed on paper.
A kvq pool reports KVQTokenToKVPool.stats, any other pool (bf16) the keys every SGLang pool has."""

from __future__ import annotations


def add_kv_pool_stats(result, self, state, *args, **kwargs):
    # imported here: load() imports this module in every SGLang process, only the scheduler's calls it
    from sgl_kvq.patches.sizing import profiled_budget_bytes
    from sgl_kvq.pool import KVQTokenToKVPool, kv_cache_stats

    scheduler = self.scheduler
    pool, capacity = scheduler.token_to_kv_pool_allocator.get_kvcache(), scheduler.max_total_num_tokens
    stats = pool.stats(capacity) if isinstance(pool, KVQTokenToKVPool) else kv_cache_stats(pool, capacity)
    # What the pool was sized from and how many requests run at once: capacity comparisons need both.
    stats.update(kv_budget_bytes=profiled_budget_bytes(), max_running_requests=scheduler.max_running_requests)
    state["kv_pool"] = stats
    return result
