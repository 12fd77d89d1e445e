"""zipcache2 through the real SGLang engine and HTTP server on CPU with the tiny random Llama (float32, so greedy
tokens are exact): kvq_triton == kvq_torch (the saliency accumulated from each batch's queries, the salient rows read
in the kernels), radix hits across turns and on a forked frontend-language program, eviction + retraction under a
pool too small for the workload, bad ZipCache knobs refused before the model loads, and the pool's bytes per token."""

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


# Matrix only (KVQ_TEST_MATRIX=all): the Triton interpreter takes 2-5 minutes of a CI worker for this engine pair;
# in CI zipcache's kernels are checked against the reference in tests/kernels/test_kernels_format_extras.py and
# tests/unit/test_decode_metadata.py, and its greedy tokens through both backends in the matrix's greedy record.
@pytest.mark.parametrize("prefill", ci_slice(["full", "paged"], []))
def test_kvq_triton_gives_the_same_tokens_as_kvq_torch(tiny, prefill):
    prompts = contended_prompts(3)
    env = {"KVQ_PREFILL": prefill}
    torch_out, stats = run_engine(tiny, "zipcache2", prompts, attention_backend="kvq_torch", max_total_tokens=16384,
                                  env=env)
    triton_out, _ = run_engine(tiny, "zipcache2", prompts, attention_backend="kvq_triton", max_total_tokens=16384,
                               env={**env, "TRITON_INTERPRET": "1"})
    assert stats["kv_cache_dtype"] == "zipcache2" and stats["config"]["salient_per_page"] == 26
    assert triton_out == torch_out


def test_http_server_multiturn_and_forked_program_hit_the_radix_cache(tiny, tmp_path, frontend_fork):
    stats = radix_hits_over_http(tiny, "zipcache2", tmp_path / "server.log", frontend_fork)
    # tiny: 2 layers x 2 KV heads x D 16, G 64, NS 26. Per token and head: KIVI's 2-bit page 8 + 1 + 4 (codes,
    # key scale+zero per page, value scale+zero per token); per page: c and the salient key scale+zero
    # 3 x 16 x 2 / 64, and per salient row its offset, 4-bit key and value codes and value scale+zero
    # 26 x (1 + 8 + 8 + 4) / 64.
    per_head = 13 + 1.5 + 26 * 21 / 64
    assert stats["base_bytes_per_token"] == pytest.approx(2 * 2 * per_head)


@matrix_only("kivi2's run in tests/engine/test_e2e_serving.py retracts through the same pool and tree (78 s)")
def test_pool_too_small_completes_every_request_and_is_exact_in_the_deterministic_mode(capfd):
    """8 requests x 160 tokens against a 16-page pool with retraction forced. With KVQ_PREFILL=paged and
    KVQ_RESIDUAL=0 a page's compression is a function of its tokens and their queries alone, so the contended run
    must agree with the uncontended one at least as well as bf16's does."""
    contended = contended_agreement_in_the_deterministic_mode("zipcache2", capfd)
    assert contended["zipcache2"] >= contended["auto"], contended


@pytest.mark.parametrize("env,message", [
    ({"KVQ_ZIPCACHE_SALIENT": "0"}, "KVQ_ZIPCACHE_SALIENT=0.0 must be in (0, 1)"),
    ({"KVQ_ZIPCACHE_SALIENT": "1.5"}, "KVQ_ZIPCACHE_SALIENT=1.5 must be in (0, 1)"),
    ({"KVQ_ZIPCACHE_SALIENT": "most"}, "KVQ_ZIPCACHE_SALIENT='most' is not a number"),
])
def test_bad_zipcache_knobs_fail_before_the_model_loads(tiny, env, message, monkeypatch):
    refused_before_load(tiny, "zipcache2", env, message, monkeypatch)
