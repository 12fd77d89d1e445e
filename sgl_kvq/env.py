"""Every environment variable sgl_kvq reads, under one prefix: KVQ_. (Not SGL_KVQ_: SGLang treats every SGL_*
variable as a deprecated spelling of SGLANG_* and warns about it in each of its processes.)

| variable                 | KVQConfig field | default |
|--------------------------|-----------------|---------|
| KVQ_GROUP_SIZE       | group_size (G, = page size) | 64 |
| KVQ_VALUE_GROUP      | value_group     | 64 |
| KVQ_RESIDUAL         | residual (R)    | 64 |
| KVQ_TOPK             | topk            | 64 |
| KVQ_CACHE_DIR        | where embedded models are materialized | ~/.cache/sgl_kvq |
"""

from __future__ import annotations

import os
from pathlib import Path

_INT_KNOBS = {
    "KVQ_GROUP_SIZE": "group_size",
    "KVQ_VALUE_GROUP": "value_group",
    "KVQ_RESIDUAL": "residual",
    "KVQ_TOPK": "topk",
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
    return Path(os.environ.get("KVQ_CACHE_DIR") or Path.home() / ".cache" / "sgl_kvq")
