"""Every environment variable sgl_kvq reads, under one prefix: KVQ_. (Not SGL_KVQ_: SGLang treats every SGL_*
variable as a deprecated spelling of SGLANG_* and warns about it in each of its processes.)

The knobs, their meaning and defaults are docs/knobs.md's table, the one table of them (tests/project/test_readme.py
holds its rows equal to the KVQ_ names sgl_kvq reads: add a row there with a knob here or in a format). CORE_KNOBS
below maps each knob every format's KVQConfig reads to its field; a format family's own knobs are declared by its
module (sgl_kvq/formats/, Format.knobs) and sgl_kvq.config reads both through knobs(table).

Set by sgl_kvq itself, not by users (sgl_kvq/cpu_engine.py: the CPU thread binding for more ranks than NUMA nodes):
KVQ_AUTO_THREADS_BIND (the SGLANG_CPU_OMP_THREADS_BIND value it chose) and KVQ_CPU_RANKS_PER_NODE (ranks sharing a
node's KV budget, read by patches/sizing.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from sgl_kvq.errors import KVQConfigError

# variable -> (KVQConfig field, parser), for the knobs every format shares (a family's own: Format.knobs)
CORE_KNOBS = {
    "KVQ_GROUP_SIZE": ("group_size", int),
    "KVQ_VALUE_GROUP": ("value_group", int),
    "KVQ_RESIDUAL": ("residual", int),
    "KVQ_OVERLAY_SHARE": ("overlay_share", float),
    "KVQ_PREFILL": ("prefill", str),
    "KVQ_ATTENTION_THREADS": ("attention_threads", int),
    "KVQ_CPU_KERNEL": ("cpu_kernel", int),
    "KVQ_FRAMES": ("frames", str),
    "KVQ_ROTATE": ("rotate", str),
}
# KVQ_PREFILL's values (KVQConfig.prefill says what each does)
PREFILL_MODES = ("full", "paged")


def run_record() -> dict:
    """What a result file records beside its numbers: when the run finished (UTC) and every KVQ_ variable it had set
    (`sgl-kvq bench decision` reads both: which file is newest, which knobs a run changed), and how the CPU engine
    ran its bf16 GEMMs."""
    from datetime import datetime, timezone

    return {"finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "kvq_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVQ_") and v},
            "cpu_gemm": cpu_gemm_mode()}


def knob_values(table: dict) -> tuple:
    """The raw values of `table`'s variables (variable -> (field, parser)): the key of the per-process config
    cache."""
    return tuple(os.environ.get(var) for var in table)


def knobs(table: dict) -> dict:
    """field -> parsed value of each of `table`'s variables that is set."""
    out = {}
    for var, (field, parse) in table.items():
        raw = os.environ.get(var)
        if raw is None or raw == "":
            continue
        try:
            out[field] = parse(raw)
        except KVQConfigError:  # a parser's own error (a recipe file's) names its cause
            raise
        except ValueError:
            raise KVQConfigError(f"sgl_kvq: {var}={raw!r} is not a {'number' if parse is float else 'integer'}") \
                from None
    return out


CPU_GEMM_MODES = ("fp32", "native")


def cpu_gemm_mode() -> str:
    """How the CPU engine runs bf16 GEMMs of two or more rows (patches/cpu_gemm.py): KVQ_CPU_GEMM if set, else
    "fp32" on a CPU without bf16 matrix instructions (no avx512_bf16, amx_bf16 in /proc/cpuinfo), where torch's bf16
    GEMM runs ~100x slower than its fp32 one (docs/development.md, CPU development environment), else "native"."""
    raw = os.environ.get("KVQ_CPU_GEMM", "")
    if raw:
        if raw not in CPU_GEMM_MODES:
            raise KVQConfigError(f"sgl_kvq: KVQ_CPU_GEMM={raw!r}: use one of {', '.join(CPU_GEMM_MODES)}")
        return raw
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "native"
    return "native" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "fp32"


def kv_cache_budget_bytes() -> int | None:
    raw = os.environ.get("KVQ_KV_CACHE_GB")
    if not raw:
        return None
    try:
        gb = float(raw)
    except ValueError:
        gb = -1.0
    if gb <= 0:
        raise KVQConfigError(f"sgl_kvq: KVQ_KV_CACHE_GB={raw!r} must be a positive number of GiB")
    return int(gb * 2**30)


def cache_dir() -> Path:
    return Path(os.environ.get("KVQ_CACHE_DIR") or Path.home() / ".cache" / "sgl_kvq")
