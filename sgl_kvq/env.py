"""Every environment variable sgl_kvq reads, under one prefix.

| variable                 | KVQConfig field | default |
|--------------------------|-----------------|---------|
| SGL_KVQ_GROUP_SIZE       | group_size (G, = page size) | 64 |
| SGL_KVQ_VALUE_GROUP      | value_group     | 64 |
| SGL_KVQ_RESIDUAL         | residual (R)    | 64 |
| SGL_KVQ_TOPK             | topk            | 64 |
| SGL_KVQ_CACHE_DIR        | where embedded models are materialized | ~/.cache/sgl_kvq |
"""

from __future__ import annotations

import os
from pathlib import Path

_INT_KNOBS = {
    "SGL_KVQ_GROUP_SIZE": "group_size",
    "SGL_KVQ_VALUE_GROUP": "value_group",
    "SGL_KVQ_RESIDUAL": "residual",
    "SGL_KVQ_TOPK": "topk",
}


def knobs() -> dict:
    out = {}
    for var, field in _INT_KNOBS.items():
        raw = os.environ.get(var)
        if raw is None or raw == "":
            continue
        try:
            out[field] = int(raw)
        except ValueError:
            from sgl_kvq.config import KVQConfigError

            raise KVQConfigError(f"sgl_kvq: {var}={raw!r} is not an integer") from None
    return out


def cache_dir() -> Path:
    return Path(os.environ.get("SGL_KVQ_CACHE_DIR") or Path.home() / ".cache" / "sgl_kvq")
