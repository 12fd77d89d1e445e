"""`sgl-kvq bench serving` without servers: the scheduler-log parsing, the workload token bounds, the regime budgets
(predicted with the servers' own sizing rule) and the SpeCache counter differences."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.commands import serving_stats as stats
from bench.commands import serving_workloads as wl

LOG = """\
[2026-11-23 17:00:01] Prefill batch, #new-seq: 2, #new-token: 640, #cached-token: 0, token usage: 0.10, #running-req: 0, #queue-req: 3, #pending-token: 0, 
[2026-11-23 17:00:02] Decode batch, #running-req: 2, #token: 700, token usage: 0.11, cpu graph: False, gen throughput (token/s): 9.50, #queue-req: 3, 
[2026-11-23 17:00:03] Prefill batch, #new-seq: 3, #new-token: 192, #cached-token: 768, token usage: 0.60, #running-req: 2, #queue-req: 0, #pending-token: 0, 
[2026-11-23 17:00:04] Decode batch, #running-req: 5, #token: 1900, token usage: 0.97, cpu graph: False, gen throughput (token/s): 20.00, #queue-req: 0, 
[2026-11-23 17:00:05 TP0] KV cache pool is full. Retract requests. #retracted_reqs: 2, #new_tokens_gained: 600, #new_token_ratio: 0.7000 -> 1.0000
[2026-11-23 17:00:06] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 300, #new_token_ratio: 0.5000 -> 1.0000
[2026-11-23 17:00:07] Decode batch, #running-req: 2, #token: 900, token usage: 0.45, cpu graph: False, gen throughput (token/s): 8.00, #queue-req: 3, 
"""

SMOLLM2 = wl.ModelShape(layers=30, kv_heads=3, head_dim=64, dtype="bfloat16")


def test_scheduler_log_stats_reads_peaks_retractions_and_cached_share():
    s = stats.scheduler_log_stats(LOG)
    assert s["peak_running_requests"] == 5 and s["peak_queued_requests"] == 3
    assert s["peak_token_usage"] == pytest.approx(0.97)
    assert s["retraction_events"] == 2 and s["retracted_requests"] == 3
    assert (s["prefill_new_tokens"], s["prefill_cached_tokens"]) == (832, 768)
    assert s["cached_token_share"] == pytest.approx(768 / 1600)


def test_scheduler_log_stats_of_an_idle_slice_is_all_zero():
    s = stats.scheduler_log_stats("[2026-11-23 17:00:00] INFO: 127.0.0.1 GET /health 200\n")
    assert s["peak_running_requests"] == 0 and s["retracted_requests"] == 0 and s["cached_token_share"] == 0.0


def test_shared_prefix_workload_counts_the_group_prefix_once_when_shared():
    w = wl.shared_prefix_workload(groups=4, prompts_per_group=4, turns=2, system_len=256, question_len=64,
                                  output_len=32)
    assert "--gsp-num-turns" in w.loadgen_args and "sglang-oai-chat" in w.loadgen_args
    per = w.tokens_per_conversation
    assert per >= 256 + 2 * (64 + 32)
    assert w.peak_tokens(16) == 16 * per
    assert w.peak_tokens(16, shared=True) == 4 * 256 + 16 * (per - 256)
    assert w.peak_tokens(64) == w.peak_tokens(16), "no more conversations run than the workload has"


def test_smollm2_bf16_is_23040_bytes_per_token():
    assert SMOLLM2.dense_bytes_per_token() == 23_040


def test_tight_regime_fits_kivi2_but_not_bf16_and_generous_fits_bf16():
    loads = [wl.shared_prefix_workload(4, 4, 2, 256, 64, 32), wl.sharegpt_workload(Path("x.json"), 16, 32, 512)]
    need = max(w.peak_tokens(16) for w in loads)
    tight = wl.bottleneck_budget(SMOLLM2, loads, 16)
    kivi2 = wl.predicted_pool(SMOLLM2, "kivi2", tight, 16)
    bf16 = wl.predicted_pool(SMOLLM2, "auto", tight, 16)
    assert kivi2["capacity_tokens"] >= need and kivi2["max_running_requests"] == 16
    # bf16 holds less than the top concurrency needs even with every group's prefix shared, yet a whole conversation
    assert loads[0].tokens_per_conversation <= bf16["capacity_tokens"] < loads[0].peak_tokens(16, shared=True)
    generous = wl.generous_budget(SMOLLM2, loads, 16)
    assert wl.predicted_pool(SMOLLM2, "auto", generous, 16)["capacity_tokens"] >= 1.9 * need
    assert wl.predicted_pool(SMOLLM2, "kivi2", generous, 16)["max_running_requests"] == 16


def test_a_budget_too_small_for_one_specache_request_is_predicted_refused():
    # 32 MiB of packed + 16-bit host rows hold ~1,260 tokens, fewer than one request's frames and the dummy frame
    pool = wl.predicted_pool(SMOLLM2, "specache2", 32 * 2**20, 16)
    assert "refused" in pool and "specache2" in pool["refused"]


def test_specache_delta_is_per_run():
    before = {"top_k": 64, "decode_steps": 10, "prefetched_bytes": 1000, "spec_token_guesses": 10,
              "spec_token_hit_rate": 0.5, "recall_wanted": 100, "recall": 0.5}
    after = {"top_k": 64, "decode_steps": 30, "prefetched_bytes": 5000, "spec_token_guesses": 30,
             "spec_token_hit_rate": 0.5 + 10 / 30 * 0.5, "recall_wanted": 300, "recall": 0.6}
    d = stats.specache_delta(before, after)
    assert d["decode_steps"] == 20 and d["prefetched_bytes_per_step"] == 200
    assert d["spec_token_hit_rate"] == pytest.approx((20 - 5) / 20)  # hits: 20 after, 5 before
    assert d["recall"] == pytest.approx((180 - 50) / 200)
    assert stats.specache_delta(None, after) is None
