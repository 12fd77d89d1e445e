"""Export the live pool's real byte accounting through SGLang's /get_server_info (internal_states[0]["kv_pool"]),
so benchmarks and evaluations report measured bytes per token and capacity, not numbers computed on paper."""

from __future__ import annotations


def pool_stats(pool, capacity_tokens: int) -> dict:
    k, v = pool.get_kv_size_bytes() if hasattr(pool, "get_kv_size_bytes") else (0, 0)
    stats = {
        "pool_class": type(pool).__name__,
        "capacity_tokens": int(capacity_tokens),
        "kv_bytes": int(k + v),
        "kv_bytes_per_token": (k + v) / max(capacity_tokens, 1),
        "page_size": int(getattr(pool, "page_size", 1)),
    }
    store = getattr(pool, "store", None)
    if store is not None:
        stats.update(
            kv_cache_dtype=pool.cfg.name,
            base_bytes=store.base_bytes(),
            overlay_bytes=store.overlay_bytes(),
            base_bytes_per_token=pool.shape.base_bytes_per_token(),
            config={"group_size": pool.cfg.group_size, "value_group": pool.shape.VG, "residual": pool.cfg.residual,
                    "bits": pool.cfg.bits, "prefill": pool.cfg.prefill},
        )
    if getattr(pool, "specache", None) is not None:
        stats["specache"] = pool.specache.stats()
        stats["host_bytes"] = pool.host_bytes()
        stats["host_bytes_per_token"] = pool.host_bytes() / max(capacity_tokens, 1)
    return stats


def add_kv_pool_stats(result, self, state, *args, **kwargs):
    scheduler = self.scheduler
    state["kv_pool"] = pool_stats(scheduler.token_to_kv_pool_allocator.get_kvcache(), scheduler.max_total_num_tokens)
    return result
