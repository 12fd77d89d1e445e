"""End to end through the real SGLang engine and HTTP server on CPU, with the tiny random Llama (float32, so greedy
tokens are exact): the launch flag, radix hits across turns, the frontend language, kvq_triton == kvq_torch,
eviction + retraction under a pool too small for the workload, and bad input refused before the model loads."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import urllib.request

import pytest

from engine_runs import agreement, run_engine
from bench.launch import ServerProcess
from multiturn import multiturn_cached_tokens
from bench.models import tiny_llama
from slices import ci_slice, full_matrix, matrix_only

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    words = "def class return import from self lambda yield while for if else try except with as print".split()
    return [" ".join(rng.choice(words) for _ in range(120)) for _ in range(6)]


# KVQ_TEST_MATRIX=all (2-4 minutes of the Triton interpreter per case); in CI kivi2's tokens on both backends equal
# the committed record (test_e2e_greedy_tokens.py), and each torch path's reads equal the reference
# (tests/unit/test_attention_batched.py, test_attention_pages.py, tests/kernels/test_kernels_cpu_decode.py)
@pytest.mark.parametrize("prefill,contexts,torch_paths", ci_slice(
    [("full", "equal", ["padded", "cpu_kernel"]), ("paged", "ragged", ["pages"])], []))
def test_kvq_triton_gives_the_same_tokens_as_kvq_torch(tiny, prompts, prefill, contexts, torch_paths):
    """kvq_torch's decode paths give kvq_triton's tokens: with KVQ_CPU_KERNEL=0 equal contexts decode on the padded
    path, ragged ones (120, 40 and 6 words) page by page (sgl_kvq/attention_pages.py); by default on a CPU the C
    kernel (kernels/cpu_decode_attention.c) decodes them. The pool's decode_batches count which ran."""
    from sgl_kvq.kernels.cpu_decode_attention import compiler

    batch = prompts[:3] if contexts == "equal" else [" ".join(p.split()[:n]) for p, n in zip(prompts, (120, 40, 6))]
    triton_out, _ = run_engine(tiny, "kivi2", batch, attention_backend="kvq_triton", max_total_tokens=16384,
                               env={"KVQ_PREFILL": prefill, "TRITON_INTERPRET": "1"})
    for path in torch_paths:
        if path == "cpu_kernel" and compiler() is None:
            continue  # no C compiler: kvq_torch keeps its torch paths (tests/kernels/test_kernels_cpu_decode.py too)
        env = {"KVQ_PREFILL": prefill, "KVQ_CPU_KERNEL": "1" if path == "cpu_kernel" else "0"}
        torch_out, stats = run_engine(tiny, "kivi2", batch, attention_backend="kvq_torch", max_total_tokens=16384,
                                      env=env)
        assert stats["pool_class"] == "KVQTokenToKVPool" and stats["kv_cache_dtype"] == "kivi2"
        assert set(stats["decode_batches"]) == {path}, stats["decode_batches"]
        assert triton_out == torch_out, path


@matrix_only("kivi3's Triton kernels are compared with its reference in tests/kernels/ (114 s of a CI worker)")
def test_kivi3_gives_kvq_torchs_tokens_on_kvq_triton(tiny, prompts):
    """kivi3's two code planes per row and its pooled frames, k pages' codes apart (sgl_kvq/frames.py), read alike by
    the Triton kernels and kvq_torch's default decode (the C kernel where a compiler is found); one engine each,
    the default prefill (kivi2's case above covers the prefill modes and the torch paths)."""
    triton_out, _ = run_engine(tiny, "kivi3", prompts[:3], attention_backend="kvq_triton", max_total_tokens=16384,
                               env={"TRITON_INTERPRET": "1"})
    torch_out, stats = run_engine(tiny, "kivi3", prompts[:3], attention_backend="kvq_torch", max_total_tokens=16384)
    assert stats["kv_cache_dtype"] == "kivi3" and stats["frames_pooled"], stats
    assert triton_out == torch_out


def test_pool_too_small_completes_every_request_like_an_uncontended_run(capfd):
    """8 requests x 160 tokens against a pool that holds a few (tests/helpers/contended.py) with SGLang's retraction
    test mode on: requests are retracted (their complete pages checkpointed into the tree, patches/retraction.py), pages
    evicted and reused, requests resumed. Every request must complete; outputs are compared with an uncontended run
    of the same requests, and
    bf16's own contended/uncontended agreement is the baseline.

    kivi2 with KVQ_PREFILL=paged and KVQ_RESIDUAL=0 must agree exactly as well as bf16: every token's KV is then a
    function of the tokens alone, computed as decode computes it whatever the scheduling, so a stale or foreign page
    read would show at once. With the defaults (KIVI's full-precision prefill, R = 64) that cannot hold: a resumed or
    re-prefilled request recomputes its tokens without the fp16 window it decoded them with, and the window exists
    nowhere else (docs/status.md). There the contended run must stay closer to its uncontended run than
    quantization itself moves a run away from bf16 (the uncontended kvq run against the uncontended bf16 run,
    measured here): contention may perturb a kvq run at quantization-noise level, never more. A corrupted page read
    (another request's codes, a stale scale) derails a continuation far beyond that."""
    from contended import DETERMINISTIC, uncontended_and_contended

    # CI: bf16 and kivi2's deterministic mode (each run pair 2-5 minutes of CPU), where a stale or foreign page read
    # shows at once; KVQ_TEST_MATRIX=all adds kivi2 and kivi4 at their defaults (the quantization-noise bound)
    runs = {"auto": ("auto", {}), "kivi2-paged-r0": ("kivi2", DETERMINISTIC)}
    if full_matrix():
        runs.update({"kivi2": ("kivi2", {}), "kivi4": ("kivi4", {})})
    free, contended = {}, {}
    for name, (dtype, env) in runs.items():
        free[name], contended[name] = uncontended_and_contended(dtype, env, capfd)
    quantization = {name: agreement(free[name], free["auto"]) for name in runs if name in ("kivi4", "kivi2")}
    print("contended vs uncontended agreement:", contended, "uncontended kvq vs bf16:", quantization)
    assert contended["kivi2-paged-r0"] >= contended["auto"], contended
    for name, floor in quantization.items():
        assert contended[name] > floor, (name, contended, quantization)


def test_http_server_multiturn_radix_hits_abort_and_frontend_language(tiny, tmp_path, monkeypatch, frontend_fork):
    # R = 0: only each request's open page is fp16, so a cached page is always read from the packed base and the
    # abort check below does not depend on which request slot (and which overlay frames) a request lands on.
    monkeypatch.setenv("KVQ_RESIDUAL", "0")
    args = ["--model-path", str(tiny), "--kv-cache-dtype", "kivi2", "--dtype", "float32",
            "--max-total-tokens", "4096", "--mem-fraction-static", "0.3"]
    with ServerProcess(args, log_path=tmp_path / "server.log") as server:
        cached, history = multiturn_cached_tokens(server, turns=4)
        assert cached[0] == 0 and all(c >= 64 for c in cached[1:]), cached
        assert all(c % 64 == 0 for c in cached), "prefix hits come in whole quantized pages (G = 64)"

        # Abort: a streaming client hangs up after a few chunks; the server must free that request's pages and
        # slot cleanly, so the same prompt afterwards gives the same answer as before the abort.
        prompt = {"text": history, "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}}
        server.post("/generate", prompt)  # caches the prompt's pages: both reads below see the same cache
        before = server.post("/generate", prompt)["output_ids"]
        req = urllib.request.Request(server.base + "/generate", data=json.dumps({**prompt, "stream": True,
                                     "sampling_params": {**prompt["sampling_params"], "max_new_tokens": 400}}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as stream:
            for _ in range(3):
                assert stream.readline()
        after = server.post("/generate", prompt)["output_ids"]
        assert after == before

        branches = frontend_fork(server.base, "shared prefix for both branches " * 40)
        assert len(branches) == 2 and all(isinstance(a, str) for a, _ in branches)
        stats = server.kv_pool_stats()
        assert stats["kv_cache_dtype"] == "kivi2"
        # 2-bit codes plus fp16 scales/zeros: under a quarter of 16-bit KV (2 layers x 2 KV heads x D 16 x K,V x 2 B).
        assert stats["base_bytes_per_token"] < 2 * 2 * 16 * 2 * 2 / 4


BAD_ENGINE_ARGS = [
    ({"kv_cache_dtype": "kivi5"}, "unknown kv cache dtype 'kivi5'"),
    ({"kv_cache_dtype": "kivi2", "page_size": 16}, "conflicts with kivi2's quantization group G=64"),
    ({"kv_cache_dtype": "kivi2", "speculative_algorithm": "NGRAM"}, "speculative decoding is not supported"),
    ({"kv_cache_dtype": "kivi2", "attention_backend": "triton"}, "cannot read kivi2 KV"),
    ({"kv_cache_dtype": "specache2", "disaggregation_mode": "prefill"}, "disaggregation is not supported"),
    ({"kv_cache_dtype": "kivi2", "disaggregation_mode": "decode", "disaggregation_decode_retraction_backup":
      "cpu_tensor"}, "cannot hold kivi2 pages"),
    ({"kv_cache_dtype": "kivi2", "disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True},
     "decode-enable-radix-cache is not supported"),
    ({"kv_cache_dtype": "specache2", "enable_hierarchical_cache": True}, "keeps its own host tier"),
    ({"kv_cache_dtype": "kivi2", "enable_hierarchical_cache": True, "hicache_mem_layout": "page_head"},
     "page_head is not available"),
]


@pytest.mark.parametrize("kwargs,message", BAD_ENGINE_ARGS)
def test_bad_engine_arguments_fail_before_the_model_loads(tiny, kwargs, message):
    import sglang

    from sgl_kvq.config import KVQConfigError

    with pytest.raises(KVQConfigError, match=message):
        sglang.Engine(model_path=str(tiny), device="cpu", log_level="error", **kwargs)


def _config_only_model(tmp_path, name, config):
    folder = tmp_path / name
    config.save_pretrained(folder)
    return folder


def test_mla_and_unpackable_head_dim_are_refused(tiny, tmp_path):
    import sglang
    from transformers import DeepseekV2Config, LlamaConfig

    from sgl_kvq.config import KVQConfigError

    mla = _config_only_model(tmp_path, "mla", DeepseekV2Config(
        vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
        architectures=["DeepseekV2ForCausalLM"]))
    odd = LlamaConfig.from_pretrained(tiny)
    odd.head_dim, odd.hidden_size = 12, 48
    odd_dir = _config_only_model(tmp_path, "hd12", odd)
    for folder, message in ((mla, "multi-head latent attention"), (odd_dir, "head_dim=12 cannot be packed")):
        with pytest.raises(KVQConfigError, match=message):
            sglang.Engine(model_path=str(folder), tokenizer_path=str(tiny), device="cpu", log_level="error",
                          kv_cache_dtype="kivi2")


def test_launch_server_cli_refuses_unknown_dtype_and_lists_choices(tiny):
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "serve", "--model-path", str(tiny),
                           "--kv-cache-dtype", "kivi5"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "invalid choice: 'kivi5'" in proc.stderr and "kivi2" in proc.stderr and "specache2" in proc.stderr
    assert "Load weight" not in proc.stderr + proc.stdout


def test_kvq_triton_refuses_tiles_its_kernels_cannot_take(tiny, monkeypatch):
    import sglang

    from sgl_kvq.config import KVQConfigError

    monkeypatch.setenv("KVQ_GROUP_SIZE", "8")
    with pytest.raises(KVQConfigError, match="kvq_triton needs G"):
        sglang.Engine(model_path=str(tiny), device="cpu", log_level="error", kv_cache_dtype="kivi2",
                      attention_backend="kvq_triton")
