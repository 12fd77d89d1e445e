"""logquant2 through the real SGLang engine and HTTP server on CPU with the tiny random Llama (float32, so greedy
tokens are exact): kvq_triton == kvq_torch at M = 1 (the default window: the sink only) and M = 8 rows per page
(W = 21), radix hits across turns and on a forked frontend-language program, eviction + retraction under a pool too
small for the workload, bad LogQuant knobs refused before the model loads, and the pool's bytes per token."""

from __future__ import annotations

import pytest

from bench.models import tiny_llama
from multiturn import radix_hits_over_http
from slices import ci_slice, matrix_only
from contended import contended_agreement_in_the_deterministic_mode, contended_prompts
from engine_runs import refused_before_load, run_engine

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


# Matrix only (KVQ_TEST_MATRIX=all), as zipcache2's pair (tests/engine/test_e2e_zipcache.py says why); 10: the default
# window.
@pytest.mark.parametrize("window,rows", ci_slice([("10", 1), ("21", 8)], []))
def test_kvq_triton_gives_the_same_tokens_as_kvq_torch(tiny, window, rows):
    # Longer than (1 + ring) pages: page 0 and its rows are read from the base.
    prompts = contended_prompts(3, words=200)
    env = {"KVQ_LOGQUANT_WINDOW": window}
    torch_out, stats = run_engine(tiny, "logquant2", prompts, attention_backend="kvq_torch", max_total_tokens=16384,
                                  env=env)
    triton_out, _ = run_engine(tiny, "logquant2", prompts, attention_backend="kvq_triton", max_total_tokens=16384,
                               env={**env, "TRITON_INTERPRET": "1"})
    assert stats["kv_cache_dtype"] == "logquant2" and stats["config"]["logquant_rows_per_page"] == rows
    assert triton_out == torch_out


def test_http_server_multiturn_and_forked_program_hit_the_radix_cache(tiny, tmp_path, frontend_fork):
    stats = radix_hits_over_http(tiny, "logquant2", tmp_path / "server.log", frontend_fork)
    # tiny: 2 layers x 2 KV heads x D 16, G 64. Per token and head: codes 2 x 4 B, key scale+zero 2 x 16 x 2 / 64,
    # value scale+zero 2 x 2, one fp16 K and V row slot per page 2 x 16 x 2 / 64; per layer one uint8 offset per
    # page.
    assert stats["base_bytes_per_token"] == pytest.approx(2 * 2 * (8 + 1 + 4 + 1) + 2 / 64)


@matrix_only("the same forced retraction runs on gear2 (test_e2e_gear.py) and kivi2 (test_e2e_serving.py); "
             "logquant2's page writes under it are its store's, unit-tested (161 s of a CI worker)")
def test_pool_too_small_completes_every_request_and_is_exact_in_the_deterministic_mode(capfd):
    """As tests/engine/test_e2e_gear.py's case, for logquant2: 8 requests x 160 tokens against a 16-page pool with
    retraction forced. With KVQ_PREFILL=paged and KVQ_RESIDUAL=0 a page's codes and rows are a function of its
    tokens and position alone, so the contended run must agree with the uncontended one at least as well as
    bf16's does."""
    contended = contended_agreement_in_the_deterministic_mode("logquant2", capfd)
    assert contended["logquant2"] >= contended["auto"], contended


@pytest.mark.parametrize("env,message", [
    ({"KVQ_LOGQUANT_WINDOW": "0"}, "KVQ_LOGQUANT_WINDOW=0 must be at least 1"),
    ({"KVQ_LOGQUANT_WINDOW": "ten"}, "KVQ_LOGQUANT_WINDOW='ten' is not a"),
    ({"KVQ_GROUP_SIZE": "256", "KVQ_RESIDUAL": "256"}, "G=256 must be at most 128"),
])
def test_bad_logquant_knobs_fail_before_the_model_loads(tiny, env, message, monkeypatch):
    refused_before_load(tiny, "logquant2", env, message, monkeypatch)
