"""SpeCache (specache1, specache2): KIVI's low-bit base on the device plus every token's 16-bit K/V in host RAM,
and a speculative decode lane whose top-k picks the host rows each step reads in 16 bits (sgl_kvq/specache/). The
pages are KIVI's; what differs is the decode strategy (sgl_kvq/specache/strategy.py, by name) and its host tier."""

from __future__ import annotations

from sgl_kvq.errors import KVQConfigError
from sgl_kvq.formats.base import Format

# The default top-k per code width: the smallest k at which specache1 answers every needle bf16 answers on SmolLM2
# (3 KV heads of 64 channels: a 1-bit key ranks a position more noisily than at the paper's 8 x 128), with
# specache_follow on; KVQ_TOPK overrides it (docs/knobs.md, KVQ_TOPK).
SPECACHE_TOP_K = {1: 128, 2: 64}
PREFIX_SOURCES = ("host", "device")


class SpeCache(Format):
    family = "specache"
    bits = (1, 2)
    strategy = "specache"
    knobs = {"KVQ_TOPK": ("top_k", int), "KVQ_SPECACHE_FOLLOW": ("specache_follow", int),
             "KVQ_SPECACHE_PREFIX": ("specache_prefix", str), "KVQ_HOST_MEM_FRACTION": ("host_mem_fraction", float),
             "KVQ_SPECACHE_RECALL": ("specache_recall", int)}

    def default_knobs(self, bits: int) -> dict:
        return {**super().default_knobs(bits), "top_k": SPECACHE_TOP_K[bits]}

    def check_knobs(self, cfg) -> None:
        if cfg.specache_follow not in (0, 1):
            raise KVQConfigError(f"sgl_kvq: KVQ_SPECACHE_FOLLOW={cfg.specache_follow} must be 0 or 1")
        if cfg.top_k < 1:
            raise KVQConfigError(f"sgl_kvq: top-k {cfg.top_k} must be at least 1")
        if not 0 < cfg.host_mem_fraction <= 1:
            raise KVQConfigError(f"sgl_kvq: KVQ_HOST_MEM_FRACTION={cfg.host_mem_fraction} must be in (0, 1], e.g. 0.8")
        if cfg.specache_recall not in (0, 1):
            raise KVQConfigError(f"sgl_kvq: KVQ_SPECACHE_RECALL={cfg.specache_recall} must be 0 or 1")
        if cfg.specache_prefix not in PREFIX_SOURCES:
            raise KVQConfigError(f"sgl_kvq: KVQ_SPECACHE_PREFIX={cfg.specache_prefix!r}; choose one of "
                                 f"{', '.join(PREFIX_SOURCES)}")

    def check(self, cfg) -> None:
        if cfg.prefill != "full":
            raise KVQConfigError("sgl_kvq: specache extends read the cached prefix in 16 bits from the host tier; "
                                 f"KVQ_PREFILL={cfg.prefill} applies to kivi only")


FORMAT = SpeCache()
