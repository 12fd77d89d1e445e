"""Which models a quantized pool can serve, judged from the Hugging Face config alone (no weights loaded)."""

from __future__ import annotations

from sgl_kvq.config import KVQConfig, KVQConfigError

# Attention shapes the pool does not model: latent (MLA) KV, sliding windows, linear/state-space layers.
_MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")


def check_hf_config(hf_config, cfg: KVQConfig) -> None:
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    arch = ",".join(getattr(hf_config, "architectures", None) or []) or type(hf_config).__name__
    if any(getattr(text, k, None) for k in _MLA_KEYS):
        raise KVQConfigError(f"sgl_kvq: {arch} uses multi-head latent attention (MLA); {cfg.name} quantizes "
                             "per-head K/V pages and does not support MLA models")
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        raise KVQConfigError(f"sgl_kvq: {arch} uses sliding-window attention, not supported by {cfg.name} yet")
    layer_types = getattr(text, "layer_types", None) or ()
    if any(t != "full_attention" for t in layer_types):
        raise KVQConfigError(f"sgl_kvq: {arch} mixes attention kinds {sorted(set(layer_types))}; {cfg.name} "
                             "supports models whose layers are all full attention")
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    if head_dim is None:
        raise KVQConfigError(f"sgl_kvq: cannot tell the head_dim of {arch}")
    cfg.check_head_dim(head_dim)
