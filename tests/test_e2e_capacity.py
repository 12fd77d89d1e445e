"""Capacity read from live servers at SGLang's own sizing (a small --mem-fraction-static, no other flag): kvq pools
hold at least bf16's tokens and come close to the packed ratio; an explicit --max-running-requests the budget
cannot hold is refused with the largest value that fits (before the model loads when the budget is pinned)."""

from __future__ import annotations

import pytest

from sgl_kvq.launch import ServerProcess, baseline_page_size
from sgl_kvq.models import smollm2, tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.engine]

TARGET = {"kivi4": 3.2, "kivi2": 5.0}


def serve_stats(args: list[str], log_path) -> dict:
    with ServerProcess(args, log_path=log_path) as server:
        stats = server.kv_pool_stats()
        server.post("/generate", {"text": "capacity check", "sampling_params": {"max_new_tokens": 4}})
    return stats


def test_capacity_at_sglang_default_sizing(tmp_path, monkeypatch):
    monkeypatch.delenv("KVQ_KV_CACHE_GB", raising=False)
    base = ["--model-path", str(smollm2()), "--mem-fraction-static", "0.05"]
    bf16 = serve_stats(base + ["--page-size", str(baseline_page_size())], tmp_path / "bf16.log")
    for name, target in TARGET.items():
        s = serve_stats(base + ["--kv-cache-dtype", name], tmp_path / f"{name}.log")
        # Each budget is profiled from the RAM free after that server's weights load, so it moves with what other
        # processes hold at the time (up to 2x between two servers on a shared machine); tokens per byte of each
        # server's own budget compare the pools at equal memory, whatever the two budgets were.
        assert s["kv_budget_bytes"] > 2**27 and bf16["kv_budget_bytes"] > 2**27, (s, bf16)
        per_budget = (s["capacity_tokens"] / s["kv_budget_bytes"]) / (bf16["capacity_tokens"] / bf16["kv_budget_bytes"])
        assert per_budget >= target, (name, per_budget, s, bf16)
        assert s["max_running_requests"] >= 1
        assert s["request_state_bytes"] <= 0.06 * s["kv_budget_bytes"]


def test_explicit_max_running_requests_beyond_a_pinned_budget_fails_before_load(monkeypatch):
    import sglang

    from sgl_kvq.config import KVQConfigError

    monkeypatch.setenv("KVQ_KV_CACHE_GB", "0.05")
    with pytest.raises(KVQConfigError, match=r"use --max-running-requests \d+ or less"):
        sglang.Engine(model_path=str(smollm2()), device="cpu", log_level="error", kv_cache_dtype="kivi2",
                      max_running_requests=64)


def test_explicit_max_running_requests_beyond_a_profiled_budget_names_the_largest(tmp_path, monkeypatch):
    monkeypatch.delenv("KVQ_KV_CACHE_GB", raising=False)
    args = ["--model-path", str(tiny_llama()), "--kv-cache-dtype", "kivi2", "--mem-fraction-static", "0.02",
            "--max-running-requests", "1000000"]
    log = tmp_path / "server.log"
    with pytest.raises(RuntimeError, match="exited"):
        with ServerProcess(args, log_path=log):
            pass
    text = log.read_text()
    assert "--max-running-requests 1000000 does not fit" in text and "or less" in text
