"""Settings that make the real SGLang engine run on a CPU-only machine (the README's "CPU development environment").

    os.environ.update(cpu_engine_env())          # before sglang is imported (children inherit it)
    engine = sglang.Engine(**engine_kwargs(sgl_kvq.models.smollm2(), kv_cache_dtype="kivi2"))

Without SGLANG_USE_CPU_ENGINE=1 the scheduler dies importing vllm (rotary fallback); HF_HUB_OFFLINE=1 keeps
transformers from reaching for a hub these machines cannot reach. The CPU venv's import shims (sgl_kvq/cpu_shims)
must be on the path too; scripts/setup_env.sh does that.
"""

from __future__ import annotations

import os

CPU_ENGINE_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}


def cpu_engine_env(apply: bool = True) -> dict[str, str]:
    """The environment variables the CPU engine needs; with apply=True they are also set in os.environ."""
    if apply:
        os.environ.update(CPU_ENGINE_ENV)
    return dict(CPU_ENGINE_ENV)


def engine_kwargs(model_path, **overrides) -> dict:
    """Keyword arguments for `sglang.Engine` on CPU; `overrides` win (e.g. kv_cache_dtype, page_size).

    max_total_tokens is capped so a test does not reserve ~15 GB of KV (mem_fraction_static applies on CPU);
    torch_native attention, because SGLang's Triton decode kernel returns garbage on bf16 under TRITON_INTERPRET."""
    kwargs = dict(
        model_path=str(model_path),
        device="cpu",
        attention_backend="torch_native",
        disable_cuda_graph=True,
        dtype="bfloat16",
        max_total_tokens=8192,
        log_level="warning",
    )
    kwargs.update(overrides)
    return kwargs
