"""Every environment variable sgl_kvq reads, under one prefix: KVQ_. (Not SGL_KVQ_: SGLang treats every SGL_*
variable as a deprecated spelling of SGLANG_* and warns about it in each of its processes.)

| variable                 | KVQConfig field | default |
|--------------------------|-----------------|---------|
| KVQ_GROUP_SIZE       | group_size (G, = page size) | 64 |
| KVQ_VALUE_GROUP      | value_group     | 64 |
| KVQ_RESIDUAL         | residual (R)    | 64 |
| KVQ_PREFILL              | prefill: "full" (KIVI) or "paged" (decode-consistent) | full |
| KVQ_TOPK             | top_k: SpeCache's host rows per request, layer and KV head read in 16 bits each step | 128 (specache1), 64 (specache2) |
| KVQ_SPECACHE_FOLLOW      | specache_follow: 1 ranks the next top-k by the speculative row's attention plus the real row's one position earlier; 0 by the speculative row's alone (the paper's) | 1 |
| KVQ_SPECACHE_PREFIX      | specache_prefix: where a SpeCache extend reads its cached prefix, "host" (16-bit) or "device" (low-bit) | host |
| KVQ_GEAR_RANK            | gear_rank: rank of each page's residual approximation (gear2, gearl2) | 2 |
| KVQ_GEAR_ITERS           | gear_iters: power-iteration steps | 3 |
| KVQ_GEAR_OUTLIERS        | gear_outliers: share of each row kept as fp16 outliers (gear2) | 0.02 |
| KVQ_LOGQUANT_WINDOW      | logquant_window: LogQuant's window W (logquant2) | 10 |
| KVQ_ZIPCACHE_SALIENT     | zipcache_salient: share of each page's tokens (per KV head) kept at 4 bit (zipcache2) | 0.4 |
| KVQ_OVERLAY_SHARE        | overlay_share: the KV budget's share for per-slot state (SpeCache's top-k rows; fp16 frames under PD) when --max-running-requests is not given | 0.06 |
| KVQ_SPECACHE_RECALL      | 1: measure each step how much of the output row's exact 16-bit top-k the speculative lane prefetched (reads every context row from the host tier: a diagnostic, off by default so a server does no extra full-context read) | 0 |
| KVQ_ATTENTION_THREADS    | attention_threads: intra-op threads of kvq_torch's batched decode attention on CPU (0: torch's own; 1 on a machine other processes load) | 0 |
| KVQ_CPU_KERNEL           | cpu_kernel: 1 decodes kivi formats on a CPU with the compiled C kernel (kernels/cpu_decode_attention.c) when a C compiler is found; 0 keeps kvq_torch's torch paths | 1 |
| KVQ_FRAMES               | frames: "pooled" (running requests' fp16 frames are pool pages, sgl_kvq/frames.py) or "static" (per request slot, outside the pool; what PD and HiCache use) | static |
| KVQ_HOST_MEM_FRACTION    | share of the host's available RAM SpeCache's host tier may take | 0.8 |
| KVQ_CACHE_DIR            | where embedded models are materialized | ~/.cache/sgl_kvq |
| KVQ_KV_CACHE_GB          | fixes SGLang's KV budget to this many GiB for ANY kv dtype (bf16 too), instead of profiling free memory: capacity comparisons at the same KV memory (per rank) | unset |

Set by sgl_kvq itself, not by users (sgl_kvq/cpu_engine.py: the CPU thread binding for more ranks than NUMA nodes):
KVQ_AUTO_THREADS_BIND (the SGLANG_CPU_OMP_THREADS_BIND value it chose) and KVQ_CPU_RANKS_PER_NODE (ranks sharing a
node's KV budget, read by patches/sizing.py).
"""

from __future__ import annotations

import os
from pathlib import Path

# variable -> (KVQConfig field, parser)
_CONFIG_KNOBS = {
    "KVQ_GROUP_SIZE": ("group_size", int),
    "KVQ_VALUE_GROUP": ("value_group", int),
    "KVQ_RESIDUAL": ("residual", int),
    "KVQ_TOPK": ("top_k", int),
    "KVQ_SPECACHE_FOLLOW": ("specache_follow", int),
    "KVQ_SPECACHE_PREFIX": ("specache_prefix", str),
    "KVQ_OVERLAY_SHARE": ("overlay_share", float),
    "KVQ_PREFILL": ("prefill", str),
    "KVQ_GEAR_RANK": ("gear_rank", int),
    "KVQ_GEAR_ITERS": ("gear_iters", int),
    "KVQ_GEAR_OUTLIERS": ("gear_outliers", float),
    "KVQ_LOGQUANT_WINDOW": ("logquant_window", int),
    "KVQ_ZIPCACHE_SALIENT": ("zipcache_salient", float),
    "KVQ_ATTENTION_THREADS": ("attention_threads", int),
    "KVQ_CPU_KERNEL": ("cpu_kernel", int),
    "KVQ_FRAMES": ("frames", str),
}


def knob_values() -> tuple:
    """The raw values of every knob KVQConfig reads: the key of the per-process config cache."""
    return tuple(os.environ.get(var) for var in _CONFIG_KNOBS)


def knobs() -> dict:
    out = {}
    for var, (field, parse) in _CONFIG_KNOBS.items():
        raw = os.environ.get(var)
        if raw is None or raw == "":
            continue
        try:
            out[field] = parse(raw)
        except ValueError:
            from sgl_kvq.config import KVQConfigError

            raise KVQConfigError(f"sgl_kvq: {var}={raw!r} is not a {'number' if parse is float else 'integer'}") \
                from None
    return out


def kv_cache_budget_bytes() -> int | None:
    raw = os.environ.get("KVQ_KV_CACHE_GB")
    if not raw:
        return None
    try:
        gb = float(raw)
    except ValueError:
        gb = -1.0
    if gb <= 0:
        from sgl_kvq.config import KVQConfigError

        raise KVQConfigError(f"sgl_kvq: KVQ_KV_CACHE_GB={raw!r} must be a positive number of GiB")
    return int(gb * 2**30)


def specache_recall() -> bool:
    return os.environ.get("KVQ_SPECACHE_RECALL", "0") not in ("0", "", "false")


def host_mem_fraction() -> float:
    raw = os.environ.get("KVQ_HOST_MEM_FRACTION", "0.8")
    try:
        frac = float(raw)
    except ValueError:
        frac = -1.0
    if not 0 < frac <= 1:
        from sgl_kvq.config import KVQConfigError

        raise KVQConfigError(f"sgl_kvq: KVQ_HOST_MEM_FRACTION={raw!r} must be in (0, 1]")
    return frac


def cache_dir() -> Path:
    return Path(os.environ.get("KVQ_CACHE_DIR") or Path.home() / ".cache" / "sgl_kvq")
