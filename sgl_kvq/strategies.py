"""The decode strategies by the name a format gives (Format.strategy): the object the sizing, the server-argument
resolution and the pool ask (sgl_kvq/decode_strategy.py's interface)."""

from __future__ import annotations

from sgl_kvq.decode_strategy import POOL_ONLY, DecodeStrategy
from sgl_kvq.specache.strategy import STRATEGY as SPECACHE

STRATEGIES: dict[str, DecodeStrategy] = {"pool": POOL_ONLY, "specache": SPECACHE}


def strategy_of(cfg) -> DecodeStrategy:
    """The strategy serving KVQConfig `cfg` (None: a dtype of SGLang's own, which reads the pool alone)."""
    return POOL_ONLY if cfg is None else STRATEGIES[cfg.format.strategy]
