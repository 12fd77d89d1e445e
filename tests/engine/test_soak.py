"""A short soak (bench/soak.py, `sgl-kvq bench soak` at full length): kivi2 on the tiny fp32 Llama (exact
tokens) in the deterministic mode, 4 concurrent multi-turn clients for 75 s on a 2,048-token budget (running
requests' fp16 frames come out of it: pooled frames) with SGLang's retraction test mode on, with mid-answer disconnects,
/abort_request and every malformed request mixed in. The server must answer each malformed request with a 4xx and log
no error, every replayed turn must repeat its tokens, the pool's live counts must return to their startup values
after /flush_cache, and its resident memory must stay within the bench's bound after warm-up."""

from __future__ import annotations

import pytest

from bench.commands.bench_soak import soak_one, verdict
from bench.models import tiny_llama
from bench.soak import malformed_requests
from slices import matrix_only

pytestmark = [pytest.mark.slow, pytest.mark.engine,
              matrix_only("a measurement-style run of `sgl-kvq bench soak` (183 s); its helpers are tests/tools/'s")]


def test_short_soak_kivi2_deterministic(tmp_path):
    row = soak_one(tiny_llama(), "kivi2", "deterministic", seconds=75, clients=4, max_total_tokens=2048,
                   log_path=tmp_path / "server.log", replay_max=10, test_retract=True)
    print({k: row[k] for k in ("counts", "evicted_tokens", "retracted_requests", "replay", "rss", "leaked")})
    assert verdict(row) == [], verdict(row)
    assert row["counts"]["malformed_4xx"] >= len(malformed_requests(4096)), row["counts"]
    assert row["counts"]["turns"] > 0 and row["replay"]["turns"] > 0, row["counts"]
    assert row["retracted_requests"] > 0 and row["evicted_tokens"] > 0, row
    # resident memory per process: the launcher (tokenizer manager), SGLang's scheduler and detokenizer
    roles = set(row["rss_by_process"])
    assert "tokenizer_manager" in roles and any(r.startswith("scheduler") for r in roles) and "detokenizer" in roles, \
        roles
