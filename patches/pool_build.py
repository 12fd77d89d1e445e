"""Build the quantized pool where SGLang builds its MHA pool (KVCacheConfigurator._build_token_to_kv_pool)."""

from __future__ import annotations

from sgl_kvq.config import KVQConfigError, is_kvq_dtype
from sgl_kvq.patches.sizing import budget_split, kvq_pool_shape


def build_token_to_kv_pool(orig, self, *, sizes, is_dsa_model, is_dsv4_model, req_to_token_pool, **kwargs):
    if not is_kvq_dtype(self.kv_cache_dtype_str):
        return orig(self, sizes=sizes, is_dsa_model=is_dsa_model, is_dsv4_model=is_dsv4_model,
                    req_to_token_pool=req_to_token_pool, **kwargs)
    shape = kvq_pool_shape(self, num_pages=-(-sizes.max_total_num_tokens // self.pool_page_size))
    cfg = shape.cfg
    if self.pool_page_size != cfg.group_size:
        raise KVQConfigError(f"sgl_kvq: page size {self.pool_page_size} != {cfg.name}'s quantization group "
                             f"G={cfg.group_size}")
    if self.use_mla_backend or is_dsa_model or is_dsv4_model or self.is_hybrid_swa or self.mambaish_config:
        raise KVQConfigError(f"sgl_kvq: {cfg.name} supports plain multi-head / grouped-query attention models only")
    if self.is_draft_worker:
        raise KVQConfigError("sgl_kvq: speculative draft workers are not supported")
    mc = self.model_config
    if mc.v_head_dim != mc.head_dim:
        raise KVQConfigError(f"sgl_kvq: head_dim {mc.head_dim} != v_head_dim {mc.v_head_dim} is not supported")
    # Per-slot state (static frames, SpeCache's top-k rows): the budget split charged for request_slots of it.
    split = budget_split(self)
    slots = req_to_token_pool.req_to_token.shape[0]
    if split.per_request_bytes and slots > split.request_slots:
        raise RuntimeError(f"sgl_kvq: SGLang built {slots} request slots, the KV budget was split for "
                           f"{split.request_slots}")
    from sgl_kvq.patches.frames import register_slot_pool
    from sgl_kvq.pool import KVQTokenToKVPool

    pool = KVQTokenToKVPool(sizes.max_total_num_tokens, shape, device=self.device, model_dtype=self.model_dtype,
                            num_req_slots=slots, start_layer=self.layer_info.start_layer,
                            end_layer=self.layer_info.end_layer, frames_pooled=split.frames_pooled)
    if split.frames_pooled:
        register_slot_pool(req_to_token_pool, pool)
    return pool
