"""Resolve a kvq dtype name for SGLang's model runner: (name, placeholder storage dtype)."""

from __future__ import annotations

import torch

from sgl_kvq.config import is_kvq_dtype, parse_kv_cache_dtype


def configure_kv_cache_dtype(orig, *args, **kwargs):
    name = kwargs.get("server_args_kv_cache_dtype")
    if is_kvq_dtype(name):
        parse_kv_cache_dtype(name)  # validates the KVQ_* knobs in this process too
        # uint8: the packed code type. Never the model dtype: SGLang takes bf16 pools as fused-write targets.
        return name, torch.uint8
    return orig(*args, **kwargs)
