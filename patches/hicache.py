"""HiCache builds its host tier from the device pool (hybrid_pool_assembler.build_kv_host_pool): for the packed
pool that is KVQTokenToKVPoolHost, which keeps the same packed pages in host memory (sgl_kvq/host_pool.py)."""

from __future__ import annotations

import torch


def build_kv_host_pool(orig, *args, kv_pool=None, page_size=None, host_size=None, pool_label="kv", **kwargs):
    from sgl_kvq.pool import KVQTokenToKVPool

    if not isinstance(kv_pool, KVQTokenToKVPool):
        return orig(*args, kv_pool=kv_pool, page_size=page_size, host_size=host_size, pool_label=pool_label,
                    **kwargs)
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler

    from sgl_kvq.host_pool import KVQTokenToKVPoolHost

    memory = assembler.get_memory()
    host = KVQTokenToKVPoolHost(kv_pool, memory.hicache_ratio, memory.hicache_size if host_size is None else host_size,
                                page_size, memory.hicache_mem_layout, allocator_type=assembler._get_allocator_type(),
                                pool_label=pool_label, pin_memory=torch.cuda.is_available())
    kv_pool.hicache_host = host  # its sizes go into the pool's stats (/get_server_info)
    return host
