"""gear2 / gearl2 through the real SGLang engine and HTTP server on CPU with the tiny random Llama (float32, so
greedy tokens are exact): kvq_triton == kvq_torch, radix hits across turns and on a forked frontend-language
program, eviction + retraction under a pool too small for the workload, bad GEAR knobs refused before the model
loads, and the pool's bytes per token."""

from __future__ import annotations


import pytest

from bench.models import tiny_llama
from multiturn import radix_hits_over_http
from slices import ci_slice, matrix_only
from contended import contended_agreement_in_the_deterministic_mode, contended_prompts
from engine_runs import refused_before_load, run_engine

pytestmark = [pytest.mark.slow, pytest.mark.engine]

GEAR_DTYPES = ["gear2", "gearl2"]


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


# KVQ_TEST_MATRIX=all (130 s a dtype); in CI GEAR's Triton correction equals its reference in
# tests/kernels/test_kernels_attention.py
@pytest.mark.parametrize("dtype", ci_slice(GEAR_DTYPES, []))
def test_kvq_triton_gives_the_same_tokens_as_kvq_torch(tiny, dtype):
    prompts = contended_prompts(3)
    torch_out, stats = run_engine(tiny, dtype, prompts, attention_backend="kvq_torch", max_total_tokens=16384)
    triton_out, _ = run_engine(tiny, dtype, prompts, attention_backend="kvq_triton", max_total_tokens=16384,
                               env={"TRITON_INTERPRET": "1"})
    assert stats["kv_cache_dtype"] == dtype and stats["config"]["gear_rank"] == 2
    assert triton_out == torch_out


@pytest.mark.parametrize("dtype", ci_slice(GEAR_DTYPES, ["gear2"]))
def test_http_server_multiturn_and_forked_program_hit_the_radix_cache(tiny, tmp_path, dtype, frontend_fork):
    stats = radix_hits_over_http(tiny, dtype, tmp_path / "server.log", frontend_fork)
    # tiny: 2 layers x 2 KV heads x D 16, G 64. Per token and head: codes 2 x 4 B, key scale+zero 2 x 16 x 2 / 64,
    # value scale+zero 2 x 2, rank-2 factors 2 x 2 x (64 + 16) x 2 / 64, gear2's outliers (fp16 + uint8 index;
    # one per key channel per page, one per value token) 16 x 3 / 64 + 3.
    per_head = 8 + 1 + 4 + 10 + (48 / 64 + 3 if dtype == "gear2" else 0)
    assert stats["base_bytes_per_token"] == pytest.approx(2 * 2 * per_head)


@matrix_only("kivi2's run in tests/engine/test_e2e_serving.py retracts through the same pool and tree (93 s)")
def test_pool_too_small_completes_every_request_and_is_exact_in_the_deterministic_mode(capfd):
    """As tests/engine/test_e2e_serving.py's kivi2 case, for gear2: 8 requests x 160 tokens against a 16-page pool with
    retraction forced. With KVQ_PREFILL=paged and KVQ_RESIDUAL=0 a page's compression is a function of its tokens
    alone (power iteration from a fixed start), so the contended run must agree with the uncontended one at least
    as well as bf16's does."""
    contended = contended_agreement_in_the_deterministic_mode("gear2", capfd)
    assert contended["gear2"] >= contended["auto"], contended


@pytest.mark.parametrize("env,message", [
    ({"KVQ_GEAR_RANK": "0"}, "KVQ_GEAR_RANK=0 must be in 1..G=64"),
    ({"KVQ_GEAR_OUTLIERS": "0.7"}, "KVQ_GEAR_OUTLIERS=0.7 must be in"),
    ({"KVQ_GEAR_ITERS": "two"}, "KVQ_GEAR_ITERS='two' is not a"),
])
def test_bad_gear_knobs_fail_before_the_model_loads(tiny, env, message, monkeypatch):
    refused_before_load(tiny, "gear2", env, message, monkeypatch)
