"""What the engine tests share: an Engine run that returns its greedy tokens and pool stats (the environment set
for the run alone), the agreement of two runs' tokens, and a dtype's bad knobs refused before any model loads."""

from __future__ import annotations

import os
import re
from contextlib import contextmanager

import pytest

from bench.launch import engine_kwargs
from bench.workload import common_prefix_share

GREEDY = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}


@contextmanager
def engine_in_env(model, kv_cache_dtype, env=None, **kw):
    """An in-process Engine (float32, 0.3 of memory unless kw says otherwise) started with `env` set, which is
    restored when the Engine shuts down."""
    import sglang

    saved = dict(os.environ)
    os.environ.update(env or {})
    kw = {"dtype": "float32", "mem_fraction_static": 0.3, **kw}
    try:
        llm = sglang.Engine(**engine_kwargs(model, kv_cache_dtype, **kw))
        try:
            yield llm
        finally:
            llm.shutdown()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def pool_stats(llm) -> dict:
    return llm.get_server_info()["internal_states"][0]["kv_pool"]


def run_engine(model, kv_cache_dtype, prompts, sampling=GREEDY, env=None, **kw):
    with engine_in_env(model, kv_cache_dtype, env, **kw) as llm:
        outs = llm.generate(prompts, sampling)
        stats = pool_stats(llm)
    return [o["output_ids"] for o in outs], stats


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean share of positions before the first differing token."""
    return sum(common_prefix_share(x, y) for x, y in zip(a, b)) / len(a)


def refused_before_load(model, kv_cache_dtype: str, env: dict, message: str, monkeypatch) -> None:
    """An Engine with `env` set raises KVQConfigError matching `message` before any model loads."""
    import sglang

    from sgl_kvq.config import KVQConfigError

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(KVQConfigError, match=re.escape(message)):
        sglang.Engine(model_path=str(model), device="cpu", log_level="error", kv_cache_dtype=kv_cache_dtype)
