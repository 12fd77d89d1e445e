"""SpeCache (specache1, specache2): KIVI's low-bit base on the device plus every token's 16-bit K/V in host RAM,
and a speculative decode lane whose top-k picks the host rows each step reads in 16 bits (sgl_kvq/specache/). The
pages are KIVI's; what differs is the decode strategy (sgl_kvq/specache/strategy.py, by name) and its host tier."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from sgl_kvq.errors import KVQConfigError
from sgl_kvq.formats.base import Format

# The default top-k per code width: the smallest k at which specache1 answers every needle bf16 answers on SmolLM2
# (3 KV heads of 64 channels: a 1-bit key ranks a position more noisily than at the paper's 8 x 128), with
# specache_follow on; KVQ_TOPK overrides it (docs/knobs.md, KVQ_TOPK).
SPECACHE_TOP_K = {1: 128, 2: 64}
PREFIX_SOURCES = ("host", "device")


@dataclass(frozen=True)
class SpeCacheParams:
    # None of these changes a stored page (KIVI's) or a frame: they are not in the fingerprint (KVQConfig.fingerprint).
    STORED: ClassVar[tuple[str, ...]] = ()
    # Host rows each decode step reads in 16 bits per (request, layer, KV head), picked by the speculative lane's
    # attention (the paper's top-64; each width's default is SPECACHE_TOP_K's).
    top_k: int = 64
    # 1 = rank each base position by the speculative row's attention mass plus the real row's mass one position
    # before it: the row after each position the real token read, which is what a copying (induction) head reads
    # next. 0 = the paper's ranking. On because specache1 then answers more needles at the same top-k
    # (docs/knobs.md, KVQ_SPECACHE_FOLLOW; bench/results/quality/niah-specache-follow-smollm2.json).
    follow: int = 1
    # Where an extend reads its cached prefix: "host", the 16-bit rows from the host tier (the paper's
    # full-precision prefill, host-to-device traffic proportional to the prefix on every turn); "device", the
    # low-bit pool as kivi reads it. Host because it keeps SpeCache's perplexity bf16's (docs/knobs.md,
    # KVQ_SPECACHE_PREFIX).
    prefix: str = "host"
    # The share of the host's available RAM the 16-bit host tier may take (sizing caps the pool's tokens at what it
    # holds; a pinned --max-total-tokens that needs more fails at startup with the count that fits).
    host_mem_fraction: float = 0.8
    # 1 measures each decode step how much of the real row's exact 16-bit top-k the speculative lane prefetched,
    # reading every context row from the host tier: a diagnostic, off so that a default server does no extra read.
    recall: int = 0


class SpeCache(Format):
    family = "specache"
    bits = (1, 2)
    strategy = "specache"
    params = SpeCacheParams
    knobs = {"KVQ_TOPK": ("top_k", int), "KVQ_SPECACHE_FOLLOW": ("follow", int),
             "KVQ_SPECACHE_PREFIX": ("prefix", str), "KVQ_HOST_MEM_FRACTION": ("host_mem_fraction", float),
             "KVQ_SPECACHE_RECALL": ("recall", int)}

    def default_params(self, bits: int) -> SpeCacheParams:
        return SpeCacheParams(top_k=SPECACHE_TOP_K[bits])

    def check_params(self, params: SpeCacheParams, group_size: int) -> None:
        if params.follow not in (0, 1):
            raise KVQConfigError(f"sgl_kvq: KVQ_SPECACHE_FOLLOW={params.follow} must be 0 or 1")
        if params.top_k < 1:
            raise KVQConfigError(f"sgl_kvq: top-k {params.top_k} must be at least 1")
        if not 0 < params.host_mem_fraction <= 1:
            raise KVQConfigError(f"sgl_kvq: KVQ_HOST_MEM_FRACTION={params.host_mem_fraction} must be in (0, 1], "
                                 "e.g. 0.8")
        if params.recall not in (0, 1):
            raise KVQConfigError(f"sgl_kvq: KVQ_SPECACHE_RECALL={params.recall} must be 0 or 1")
        if params.prefix not in PREFIX_SOURCES:
            raise KVQConfigError(f"sgl_kvq: KVQ_SPECACHE_PREFIX={params.prefix!r}; choose one of "
                                 f"{', '.join(PREFIX_SOURCES)}")

    def check(self, cfg) -> None:
        if cfg.prefill != "full":
            raise KVQConfigError("sgl_kvq: specache extends read the cached prefix in 16 bits from the host tier; "
                                 f"KVQ_PREFILL={cfg.prefill} applies to kivi only")


FORMAT = SpeCache()
