"""kvq's metrics on SGLang's Prometheus endpoint (sgl_kvq/metrics.py, patches/metrics.py): a live kivi2 server's
/metrics scraped and parsed with prometheus_client's parser against its /get_server_info kv_pool; the scheduler hook
on SpeCache and PD stats, on a bf16 pool and with metrics off, without an engine; every metric documented."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest  # noqa: E402
from fake_scheduler import fake_scheduler  # noqa: E402
from scrape import by_label, kvq_families, only, scrape_when, sglang_values  # noqa: E402

from sgl_kvq.config import KVQConfig  # noqa: E402
from sgl_kvq.metrics import METRICS  # noqa: E402
from sgl_kvq.patches import metrics as metrics_hook  # noqa: E402
from sgl_kvq.pool import KVQTokenToKVPool  # noqa: E402
from sgl_kvq.pool_shape import PoolShape  # noqa: E402
from sgl_kvq.formats.specache import SpeCacheParams

SGLANG_LABELS = {"model_name": "tiny", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0}


# ---- the scheduler hook, without an engine ----

def fake_reporter(pool, registry, capacity: int, enabled: bool = True):
    scheduler = fake_scheduler(pool, capacity, max_running_requests=3, free_slots=2)
    collector = SimpleNamespace(labels=dict(SGLANG_LABELS), _gauge_cls=functools.partial(Gauge, registry=registry),
                                _counter_cls=functools.partial(Counter, registry=registry))
    return SimpleNamespace(scheduler=scheduler, metrics_collector=collector if enabled else None)


def specache_pool(G=8):
    cfg = KVQConfig("specache", 2, group_size=G, value_group=8, residual=G, params=SpeCacheParams(top_k=5))
    return KVQTokenToKVPool(32 * G, PoolShape(2, 2, 16, 32, cfg), "cpu", torch.float32, num_req_slots=4)


def test_the_hook_turns_specache_and_pd_stats_into_counters_and_gauges(monkeypatch):
    from sgl_kvq.patches import pd
    from sgl_kvq.patches.observability import kv_pool_stats

    monkeypatch.setitem(pd.SENT, "kv_bytes", 9000)
    monkeypatch.setitem(pd.SENT, "aux_bytes", 600)
    monkeypatch.setitem(pd.SENT, "batches", 5)
    monkeypatch.setitem(pd.SENT, "requests", 3)
    pool, registry = specache_pool(), CollectorRegistry()
    sc = pool.strategy_state
    sc.spec_guesses += 4
    sc.spec_hits += 3
    sc.prefetched_rows += 10
    pool.store.pages_quantized += 6
    pool.decode_batches.update({"pages": 2, "padded": 1})
    reporter = fake_reporter(pool, registry, capacity=32 * 8)
    assert metrics_hook.publish_kvq_metrics("result", reporter) == "result"
    stats = kv_pool_stats(reporter.scheduler)
    got = kvq_families(generate_latest(registry).decode())

    for samples in got.values():
        for labels, _ in samples:
            assert {k: labels[k] for k in SGLANG_LABELS} == {k: str(v) for k, v in SGLANG_LABELS.items()}
            assert labels["kv_cache_dtype"] == "specache2"
    assert only(got["sglang:kvq_capacity_tokens"]) == stats["capacity_tokens"] == 256
    assert only(got["sglang:kvq_bytes_per_token"]) == pytest.approx(stats["kv_bytes_per_token"])
    assert only(got["sglang:kvq_packed_bytes_per_token"]) == pytest.approx(stats["base_bytes_per_token"])
    assert only(got["sglang:kvq_request_state_bytes"]) == stats["request_state_bytes"] > 0
    assert only(got["sglang:kvq_free_request_slots"]) == 2
    assert only(got["sglang:kvq_pages_quantized"]) == 6
    assert by_label(got["sglang:kvq_decode_batches"], "path") == {"pages": 2, "padded": 1}
    assert only(got["sglang:kvq_specache_prefetched_bytes"]) == stats["specache"]["prefetched_bytes"] > 0
    assert only(got["sglang:kvq_specache_guesses"]) == 4 and only(got["sglang:kvq_specache_guess_hits"]) == 3
    assert only(got["sglang:kvq_specache_guess_hit_ratio"]) == 0.75
    assert by_label(got["sglang:kvq_pd_sent_bytes"], "kind") == {"kv": 9000, "aux": 600}
    assert only(got["sglang:kvq_pd_sent_requests"]) == 3
    assert only(got["sglang:kvq_pd_sent_bytes_per_request"]) == 3200 == stats["pd_sent"]["bytes_per_request"]
    assert "sglang:kvq_frames_held" not in got  # static frames: none is held from the pool

    # The pool's totals grow; the counters follow them (incremented by the difference), the gauges are set
    pool.decode_batches["pages"] += 5
    monkeypatch.setitem(pd.SENT, "requests", 4)
    metrics_hook.publish_kvq_metrics(None, reporter)
    got = kvq_families(generate_latest(registry).decode())
    assert by_label(got["sglang:kvq_decode_batches"], "path") == {"pages": 7, "padded": 1}
    assert only(got["sglang:kvq_pd_sent_requests"]) == 4
    assert only(got["sglang:kvq_pd_sent_bytes_per_request"]) == 2400


def test_a_bf16_pool_and_a_scheduler_without_metrics_export_nothing():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    registry = CollectorRegistry()
    bf16 = MHATokenToKVPool(64, 1, torch.bfloat16, 2, 16, 2, "cpu", False)
    metrics_hook.publish_kvq_metrics(None, fake_reporter(bf16, registry, capacity=64))
    metrics_hook.publish_kvq_metrics(None, fake_reporter(specache_pool(), registry, capacity=256, enabled=False))
    assert kvq_families(generate_latest(registry).decode()) == {}


def test_every_metric_is_named_in_sglang_style_and_documented(repo_root: Path):
    doc = (repo_root / "docs" / "metrics.md").read_text()
    for metric in METRICS:
        assert metric.name.startswith("sglang:kvq_"), metric.name
        assert metric.name.endswith("_total") == (metric.kind == "counter"), metric.name
        assert f"`{metric.name}`" in doc, f"{metric.name} is not in docs/metrics.md"


# ---- a live server ----

@pytest.mark.slow
@pytest.mark.engine
def test_a_kivi2_server_exports_its_pool_stats_on_metrics(tmp_path):
    """One kivi2 server with --enable-metrics: two requests, then /metrics against /get_server_info's kv_pool.
    --decode-log-interval 1: SGLang publishes its scheduler metrics (and kvq's) after every decode batch."""
    from bench.launch import ServerProcess
    from bench.models import tiny_llama

    args = ["--model-path", str(tiny_llama()), "--kv-cache-dtype", "kivi2", "--dtype", "float32",
            "--max-total-tokens", "4096", "--mem-fraction-static", "0.3", "--enable-metrics",
            "--decode-log-interval", "1"]
    new_tokens = 8
    with ServerProcess(args, log_path=tmp_path / "server.log") as server:
        before = sum(server.kv_pool_stats().get("decode_batches", {}).values())
        for i in range(2):  # one after the other: each request decodes in batches of its own
            prompt = " ".join(f"word{i}{j}" for j in range(100))  # over one page (G = 64): the prefill quantizes one
            server.post("/generate", {"text": prompt, "sampling_params": {"temperature": 0, "ignore_eos": True,
                                                                          "max_new_tokens": new_tokens}})
        # the last publish follows the last decode batch (or the idle refresh once the requests are gone)
        stats, text = scrape_when(server, lambda got, stats: by_label(got.get("sglang:kvq_decode_batches", []),
                                                                      "path") == stats["decode_batches"])
        got = kvq_families(text)

    # pooled frames (the default): the frames running requests hold from the pool is a gauge too
    assert stats["frames_pooled"]
    assert set(got) == {"sglang:kvq_capacity_tokens", "sglang:kvq_bytes_per_token",
                        "sglang:kvq_packed_bytes_per_token", "sglang:kvq_request_state_bytes",
                        "sglang:kvq_overlay_frames_live", "sglang:kvq_frames_held", "sglang:kvq_free_request_slots",
                        "sglang:kvq_pages_quantized", "sglang:kvq_decode_batches"}, sorted(got)
    for samples in got.values():
        for labels, _ in samples:
            assert labels["kv_cache_dtype"] == "kivi2" and labels["tp_rank"] == "0", labels
            assert {"model_name", "engine_type", "pp_rank"} <= set(labels), labels
    assert only(got["sglang:kvq_capacity_tokens"]) == stats["capacity_tokens"]
    assert sglang_values(text, "sglang:max_total_num_tokens") == [stats["capacity_tokens"]]  # SGLang's own, beside
    assert only(got["sglang:kvq_bytes_per_token"]) == pytest.approx(stats["kv_bytes_per_token"])
    assert only(got["sglang:kvq_packed_bytes_per_token"]) == pytest.approx(stats["base_bytes_per_token"])
    # pooled frames set nothing aside per request slot but frame tags: the two differ by that alone
    assert only(got["sglang:kvq_bytes_per_token"]) >= only(got["sglang:kvq_packed_bytes_per_token"])
    assert only(got["sglang:kvq_frames_held"]) == stats["live"]["frames_held"]
    assert only(got["sglang:kvq_request_state_bytes"]) == stats["request_state_bytes"]
    assert only(got["sglang:kvq_overlay_frames_live"]) == stats["live"]["overlay_frames_live"]
    assert only(got["sglang:kvq_free_request_slots"]) == stats["live"]["free_req_slots"]
    assert only(got["sglang:kvq_pages_quantized"]) == stats["pages_quantized"] >= 2
    paths = by_label(got["sglang:kvq_decode_batches"], "path")
    assert paths == stats["decode_batches"]
    assert sum(paths.values()) - before >= 2 * (new_tokens - 1)  # each request: one prefill, then decode batches
