"""Which models a quantized pool can serve, judged from the Hugging Face config alone (no weights loaded)."""

from __future__ import annotations

from sgl_kvq.config import KVQConfig, KVQConfigError
from sgl_kvq.recipe import config_sha256
from sgl_kvq.strategies import strategy_of

# Attention shapes the pool does not model: latent (MLA) KV, linear/state-space layers.
_MLA_KEYS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim")
_LAYER_KINDS = ("full_attention", "sliding_attention")  # what every layer keeps in the one pool, all its tokens


def _text(hf_config):
    return getattr(hf_config, "get_text_config", lambda: hf_config)()


def has_sliding_windows(hf_config) -> bool:
    """Whether some layer attends through a sliding window (Gemma 2/3, Mistral, gpt-oss ...)."""
    text = _text(hf_config)
    return bool(getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)) \
        or "sliding_attention" in (getattr(text, "layer_types", None) or ())


def check_hf_config(hf_config, cfg: KVQConfig, hybrid_swa: bool = False, model_path: str | None = None) -> None:
    """Raise KVQConfigError, before any weight loads, for a model `cfg` cannot serve; hybrid_swa: SGLang would give
    its sliding-window layers a pool of their own; model_path: its folder, whose config.json a recipe is bound to.
    Sliding windows are masked by both kvq backends' every path, SpeCache's lanes included (backends/base.py
    sliding_windows); a strategy may still refuse them (refusal)."""
    text = _text(hf_config)
    arch = ",".join(getattr(hf_config, "architectures", None) or []) or type(hf_config).__name__
    if any(getattr(text, k, None) for k in _MLA_KEYS):
        raise KVQConfigError(f"sgl_kvq: {arch} uses multi-head latent attention (MLA); {cfg.name} quantizes "
                             "per-head K/V pages and does not support MLA models")
    kinds = set(getattr(text, "layer_types", None) or ())
    if kinds - set(_LAYER_KINDS):
        raise KVQConfigError(f"sgl_kvq: {arch} mixes attention kinds {sorted(kinds)}; {cfg.name} supports models "
                             f"whose layers are {' or '.join(_LAYER_KINDS)}")
    if has_sliding_windows(hf_config):
        if hybrid_swa:
            raise KVQConfigError(f"sgl_kvq: SGLang would give {arch}'s sliding-window layers a KV pool of their own "
                                 f"(hybrid SWA memory), which {cfg.name} does not build; pass "
                                 "--disable-hybrid-swa-memory to keep every layer's tokens in one pool")
        refusal = strategy_of(cfg).refusal("sliding_window", cfg.name)
        if refusal:
            raise KVQConfigError(f"sgl_kvq: {arch} has sliding-window layers: {refusal}")
    heads = getattr(text, "num_attention_heads", None)
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else None)
    if head_dim is None:
        raise KVQConfigError(f"sgl_kvq: cannot tell the head_dim of {arch}")
    cfg.check_head_dim(head_dim)
    cfg.format.check_model(cfg, text.num_hidden_layers, getattr(text, "num_key_value_heads", None) or heads, head_dim,
                           config_sha256(model_path) if model_path else None, arch)
