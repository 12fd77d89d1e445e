"""Pool sizing: SGLang sizes the KV pool as budget / bytes-per-token. Without these hooks it would divide by bf16's
bytes and the compression would buy no capacity."""

from __future__ import annotations

import math

from sgl_kvq import env
from sgl_kvq.config import is_kvq_dtype, parse_kv_cache_dtype
from sgl_kvq.layout import PoolShape


def _shape(kvc, num_layers: int, cfg) -> PoolShape:
    from sglang.srt.runtime_context import get_parallel

    heads = kvc.model_config.get_num_kv_heads(get_parallel().attn_tp_size, get_parallel().attn_dcp_size)
    return PoolShape(layers=num_layers, heads=heads, head_dim=kvc.model_config.head_dim, num_pages=0, cfg=cfg)


def max_running_requests() -> int:
    from sglang.srt.runtime_context import get_schedule

    return get_schedule().max_running_requests


def pool_configurator_init(orig, self, kvc, *args, **kwargs):
    orig(self, kvc, *args, **kwargs)
    if not is_kvq_dtype(kvc.kv_cache_dtype_str):
        return
    cfg = parse_kv_cache_dtype(kvc.kv_cache_dtype_str)
    num_layers = kvc.layer_info.num_effective_layers
    shape = _shape(kvc, num_layers, cfg)
    self._cell_size = math.ceil(shape.base_bytes_per_token())
    # Overlay frames are a fixed cost per request slot (ReqToTokenPool has max_running_requests + 1 rows).
    slots = max_running_requests() + 1
    self._fixed_overhead_bytes += slots * cfg.ring_pages * shape.overlay_bytes_per_frame(kvc.model_dtype)
    if cfg.is_specache:
        from sgl_kvq.specache.host_tier import host_bytes_per_token
        from sgl_kvq.specache.state import topk_bytes_per_request

        self._fixed_overhead_bytes += slots * topk_bytes_per_request(cfg, shape, kvc.model_dtype)
        if str(kvc.device).startswith("cpu"):
            # The CPU engine's "device" is host RAM too: the host tier comes out of the same KV budget.
            self._cell_size += host_bytes_per_token(num_layers, shape.heads, shape.head_dim, kvc.model_dtype)


def profile_available_bytes(orig, self, *args, **kwargs):
    """KVQ_KV_CACHE_GB pins the KV budget (any dtype), so bf16 and kvq pools can be compared at equal memory."""
    budget = env.kv_cache_budget_bytes()
    return orig(self, *args, **kwargs) if budget is None else budget
