"""Build the quantized pool where SGLang builds its MHA pool (KVCacheConfigurator._build_token_to_kv_pool)."""

from __future__ import annotations

import logging

from sgl_kvq.config import KVQConfigError, is_kvq_dtype, parse_kv_cache_dtype

logger = logging.getLogger("sgl_kvq")


def build_token_to_kv_pool(orig, self, *, sizes, is_dsa_model, is_dsv4_model, req_to_token_pool, **kwargs):
    if not is_kvq_dtype(self.kv_cache_dtype_str):
        return orig(self, sizes=sizes, is_dsa_model=is_dsa_model, is_dsv4_model=is_dsv4_model,
                    req_to_token_pool=req_to_token_pool, **kwargs)
    cfg = parse_kv_cache_dtype(self.kv_cache_dtype_str)
    if self.use_mla_backend or is_dsa_model or is_dsv4_model or self.is_hybrid_swa or self.mambaish_config:
        raise KVQConfigError(f"sgl_kvq: {cfg.name} supports plain multi-head / grouped-query attention models only")
    if self.is_draft_worker:
        raise KVQConfigError("sgl_kvq: speculative draft workers are not supported")
    from sglang.srt.runtime_context import get_parallel

    from sgl_kvq.pool import KVQTokenToKVPool

    mc = self.model_config
    if mc.v_head_dim != mc.head_dim:
        raise KVQConfigError(f"sgl_kvq: head_dim {mc.head_dim} != v_head_dim {mc.v_head_dim} is not supported")
    return KVQTokenToKVPool(
        sizes.max_total_num_tokens,
        page_size=self.pool_page_size,
        cfg=cfg,
        head_num=mc.get_num_kv_heads(get_parallel().attn_tp_size, get_parallel().attn_dcp_size),
        head_dim=mc.head_dim,
        layer_num=self.layer_info.num_effective_layers,
        device=self.device,
        model_dtype=self.model_dtype,
        num_req_slots=req_to_token_pool.req_to_token.shape[0],
        start_layer=self.layer_info.start_layer,
        end_layer=self.layer_info.end_layer,
    )
