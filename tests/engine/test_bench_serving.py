"""`sgl-kvq bench serving` end to end on the tiny model (float32): bf16 and kivi2 (with a knob of its own server:
KVQ_PREFILL=paged), one concurrency, both workloads, the tight regime; the JSON must hold the load generator's metrics
and the server's stats for each dtype, and the plots must be written."""

from __future__ import annotations

import json
import subprocess

import pytest
from slices import matrix_only

pytestmark = [pytest.mark.slow, pytest.mark.engine,
              matrix_only("a measurement-style run of `sgl-kvq bench serving` (189 s); its helpers are tests/tools/'s")]


def test_bench_serving_tiny_writes_loadgen_metrics_server_stats_and_plots(venv_bin, tmp_path):
    out = tmp_path / "serving-tiny.json"
    cmd = [str(venv_bin / "sgl-kvq"), "bench", "serving", "--model", "tiny",
           "--kv-cache-dtype", "auto,kivi2:KVQ_PREFILL=paged",
           "--concurrency", "2", "--waves", "1", "--regime", "tight", "--groups", "1", "--turns", "2",
           "--system-prompt-len", "64", "--question-len", "16", "--output-len", "4", "--sharegpt-context-len", "256",
           "--flags", "default", "--server-args", "--dtype float32", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["command"].startswith("sgl-kvq bench serving --model tiny")
    assert report["machine"]["cpus"] >= 1 and len(report["machine"]["load_average_before"]) == 3
    servers = {s["kv_cache_dtype"]: s for s in report["servers"]}
    kivi2 = "kivi2:KVQ_PREFILL=paged"
    assert set(servers) == {"auto", kivi2}
    assert servers[kivi2]["config"]["prefill"] == "paged"  # the knob reached its server (the default is full)
    for s in servers.values():
        assert s["capacity_tokens"] > 0 and s["max_running_requests"] >= 1 and s["kv_budget_bytes"] > 0
        assert s["flags"] == "default"  # no --max-running-requests: SGLang's default, kvq's pooled frames
    runs = report["runs"]
    assert {(r["kv_cache_dtype"], r["workload"]) for r in runs} == {
        (d, w) for d in ("auto", kivi2) for w in ("shared-prefix-multiturn", "sharegpt")}
    for r in runs:
        assert r["error"] is None, r
        m = r["loadgen"]
        assert m["completed"] > 0 and m["output_throughput"] > 0 and m["p99_ttft_ms"] > 0 and "p99_itl_ms" in m
        assert "cache_report" in m
        assert r["server"]["peak_running_requests"] >= 1
        assert r["loadgen_command"].startswith("python -m sglang.benchmark.serving ")
    multiturn = [r for r in runs if r["workload"] == "shared-prefix-multiturn"]
    assert all(r["server"]["prefill_cached_tokens"] > 0 for r in multiturn), "turn 2 must hit the radix cache"
    for workload in ("shared-prefix-multiturn", "sharegpt"):
        assert (tmp_path / f"serving-tiny-{workload}-tight.png").stat().st_size > 0
