"""SpeCache end to end through the real SGLang engine on CPU (tiny random Llama, float32): specache1/specache2 serve
multi-turn conversations with radix hits, the scheduler exports the prefetch counters (the speculative lane's
recall of the output row's exact top-k among them), the host tier stays the size it was given over a long
contended run, and bad combinations are refused before the model loads."""

from __future__ import annotations

import os
import random
import re

import pytest
import torch

from slices import ci_slice, full_matrix, matrix_only
from engine_runs import pool_stats
from sgl_kvq.formats.specache import SPECACHE_TOP_K
from bench.launch import engine_kwargs
from bench.models import tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.engine]

WORDS = "def class return import from self lambda yield while for if else try except with as print".split()


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def engine(model, kv_cache_dtype, env=None, **kw):
    import sglang

    os.environ.update(env or {})
    return sglang.Engine(**engine_kwargs(model, kv_cache_dtype, **{"dtype": "float32", "mem_fraction_static": 0.3,
                                                                   "max_running_requests": 8, **kw}))


# CI: specache2 (specache1's lanes run in the batched retraction test below; its recall diagnostic in the
# kvq_triton-vs-kvq_torch test); the matrix adds specache1
@pytest.mark.parametrize("dtype", ci_slice(["specache1", "specache2"], ["specache2"]))
def test_multiturn_with_radix_hits_and_prefetch_counters(tiny, dtype, monkeypatch):
    # the recall diagnostic is off by default (no full-context host read per step); specache1 turns it on
    recall_on = dtype == "specache1"
    monkeypatch.setenv("KVQ_SPECACHE_RECALL", "1" if recall_on else "0")
    rng = random.Random(1)
    llm = engine(tiny, dtype, max_total_tokens=16384)
    try:
        histories = ["user: " + " ".join(rng.choice(WORDS) for _ in range(100)) for _ in range(3)]
        cached = []
        for turn in range(3):
            outs = llm.generate([h + "\nassistant:" for h in histories],
                                {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True})
            cached.append([o["meta_info"]["cached_tokens"] for o in outs])
            histories = [h + "\nassistant:" + o["text"] + "\nuser: " + " ".join(rng.choice(WORDS) for _ in range(30))
                         for h, o in zip(histories, outs)]
            assert all(len(o["output_ids"]) == 20 for o in outs)
        pool = pool_stats(llm)
    finally:
        llm.shutdown()
    assert all(c == 0 for c in cached[0]) and all(c >= 64 for c in cached[1] + cached[2]), cached
    sc = pool["specache"]
    assert pool["kv_cache_dtype"] == dtype and sc["top_k"] == SPECACHE_TOP_K[int(dtype[-1])]
    assert sc["predecode_rows"] == 9  # every request's first decode step, and only that one
    assert sc["decode_steps"] >= 3 * 19 and sc["prefetched_bytes"] > 0 and sc["prefetched_bytes_per_step"] > 0
    assert sc["spec_token_guesses"] > 0 and 0 <= sc["spec_token_hit_rate"] <= 1
    if recall_on:
        assert sc["recall_wanted"] > 0 and 0 < sc["recall"] <= 1
    else:
        assert sc["recall_wanted"] == 0 and sc["recall"] is None
    # 2 layers x (K, V) x 2 KV heads x D 16 x 4 B (fp32 model) for every pool slot, dummy page included
    assert pool["host_bytes"] == sc["host_bytes"] == (pool["capacity_tokens"] + 64) * 2 * 2 * 2 * 16 * 4
    print(dtype, "cached", cached, "specache", sc)


@matrix_only("kivi2's retraction pair in tests/engine/test_e2e_serving.py retracts through the same pool and tree; "
             "the host tier's writes and frees are tests/unit/test_specache_host_tier.py's (95 s)")
def test_long_contended_run_completes_and_the_host_tier_does_not_grow(tiny, capfd):
    """24 requests through a 128-page pool (about 2 requests' pooled frames, fp16 window and top-k rows, and their
    pages) with SGLang's
    retraction test mode: pages are evicted, freed and reused, requests retracted and resumed (each resume re-runs
    the pre-decode). Every request completes; the host tier is
    the same size before and after (its rows are the pool's slots: a freed page's copy is overwritten, never kept)."""
    rng = random.Random(2)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(60, 140))) for _ in range(24)]
    llm = engine(tiny, "specache2", env={"SGLANG_TEST_RETRACT": "1"}, max_total_tokens=8192)
    try:
        before = pool_stats(llm)["host_bytes"]
        outs = llm.generate(prompts, {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True})
        pool = pool_stats(llm)
    finally:
        llm.shutdown()
        os.environ.pop("SGLANG_TEST_RETRACT", None)
    assert re.search(r"#retracted_reqs: [1-9]", capfd.readouterr().err), "no request was retracted"
    assert all(len(o["output_ids"]) == 32 for o in outs)
    assert pool["host_bytes"] == before
    assert pool["specache"]["predecode_rows"] > 24  # resumed requests pre-decode again


@matrix_only("specache2's radix hits are the Engine test above's; the server and frontend language are "
             "tests/engine/test_e2e_serving.py's (69 s)")
def test_http_server_and_frontend_language_on_specache2(tiny, tmp_path, frontend_fork):
    """`sgl-kvq serve --kv-cache-dtype specache2` (SGLang's launch_server with the plugin): /generate with a shared
    prefix hits the radix cache, the frontend language forks on it, and the lanes ran in the server's scheduler."""
    from bench.launch import ServerProcess

    # 16,384 tokens: a running request's frames (ring and top-k rows) take 3,072 of the tiny model's pool tokens,
    # and the fork runs two branches beside the prefix's request
    args = ["--model-path", str(tiny), "--kv-cache-dtype", "specache2", "--dtype", "float32", "--max-total-tokens",
            "16384", "--mem-fraction-static", "0.3", "--max-running-requests", "8"]
    with ServerProcess(args, log_path=tmp_path / "server.log") as server:
        prefix = "shared prefix for both questions " * 30
        sampling = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
        server.post("/generate", {"text": prefix + "first", "sampling_params": sampling})
        second = server.post("/generate", {"text": prefix + "second", "sampling_params": sampling})

        branches = frontend_fork(server.base, prefix)
        pool = server.kv_pool_stats()
    assert second["meta_info"]["cached_tokens"] >= 128 and len(second["output_ids"]) == 12
    assert len(branches) == 2 and all(isinstance(a, str) for a, _ in branches)
    assert pool["kv_cache_dtype"] == "specache2" and pool["specache"]["decode_steps"] > 0
    assert pool["specache"]["predecode_rows"] >= 4
    assert pool["specache"]["recall_wanted"] == 0  # the diagnostic is off by default


def test_specache2_at_default_flags_runs_what_memory_holds_and_gives_every_frame_back(tiny, tmp_path, monkeypatch):
    """Default flags at a pinned budget: specache2's top-k rows are pool frames a running request takes with its
    fp16 window (nothing per request slot), so max_running_requests is SGLang's default, not the KVQ_OVERLAY_SHARE
    rule's; 10 requests sent at once all run at once, each gets the tokens it gets alone (top-64 covers every base
    position of these contexts, so no near-tie pick depends on the batch), and every frame comes back."""
    from bench.commands.serving_stats import scheduler_log_stats
    from sgl_kvq.config import parse_kv_cache_dtype
    from bench.launch import ServerProcess
    from sgl_kvq.pool_shape import PoolShape
    from sgl_kvq.specache.state import topk_bytes_per_request

    budget_gib = 0.025  # ~47k tokens: 10 requests' 3 frames of 1,024 tokens' pages and their own pages fit
    monkeypatch.setenv("KVQ_KV_CACHE_GB", str(budget_gib))
    rng = random.Random(6)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(40, 70))) for _ in range(10)]
    greedy = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    args = ["--model-path", str(tiny), "--kv-cache-dtype", "specache2", "--dtype", "float32", "--decode-log-interval",
            "1"]
    log = tmp_path / "server.log"
    with ServerProcess(args, log_path=log) as server:
        before = server.kv_pool_stats()
        alone = [server.post("/generate", {"text": p, "sampling_params": greedy})["output_ids"] for p in prompts]
        server.get("/flush_cache")
        # one batch request: all ten reach the scheduler together (ten client threads let one straggle in after
        # another had finished: a peak of 9 on a loaded machine)
        together = server.post("/generate", {"text": prompts, "sampling_params": greedy})
        after = server.kv_pool_stats()
    assert [o["output_ids"] for o in together] == alone
    assert scheduler_log_stats(log.read_text())["peak_running_requests"] == len(prompts)
    assert before["frames_pooled"] and before["specache"]["topk_pooled"] and before["max_running_requests"] >= 2048
    # the rule this replaces: top-k rows per request slot, KVQ_OVERLAY_SHARE (6%) of the budget for them
    cfg = parse_kv_cache_dtype("specache2")
    per_slot = topk_bytes_per_request(cfg, PoolShape(2, 2, 16, 0, cfg), torch.float32, pooled=False)
    assert int(cfg.overlay_share * budget_gib * 2**30) // per_slot - 1 < before["max_running_requests"]
    assert before["frame_tokens"] == 3 * 16 * 64  # 2 window frames and 1 of top-64 rows, 16 pages each
    assert after["frames_held"] == 0 and before["frames_held"] == 0


def _two_turns(model, dtype, backend, prompts):
    """Two greedy turns, the second extending each conversation (a radix hit, then a pre-decode) -> (token ids of
    both turns, the second turn's cached tokens, the pool's specache stats). One request at a time: batched, kvq_torch
    against itself diverged once (recall 0.569 vs 0.614), most likely because which requests share a batch depends
    on timing and a batch's numerics can flip a near-tie top-k pick, whose 16-bit rows then change the output;
    batched lanes are compared in tests/kernels/test_kernels_specache.py and
    tests/unit/test_specache_decode_metadata.py."""
    rng = random.Random(4)
    sampling = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    llm = engine(model, dtype, attention_backend=backend, max_total_tokens=16384)
    try:
        first = [llm.generate(p, sampling) for p in prompts]
        follow = [p + o["text"] + " " + " ".join(rng.choice(WORDS) for _ in range(20)) for p, o in zip(prompts, first)]
        second = [llm.generate(p, sampling) for p in follow]
        stats = pool_stats(llm)["specache"]
    finally:
        llm.shutdown()
    return ([o["output_ids"] for o in first + second], [o["meta_info"]["cached_tokens"] for o in second], stats)


# KVQ_TEST_MATRIX=all (150 s a case); in CI the fused lanes are compared with the torch lanes in
# tests/kernels/test_kernels_specache.py, and the torch lanes serve this module's other tests
@pytest.mark.parametrize("dtype,prefix", ci_slice(
    [("specache1", "host"), ("specache2", "host"), ("specache2", "device")], []))
def test_kvq_triton_gives_the_same_tokens_as_kvq_torch(tiny, dtype, prefix, monkeypatch):
    """The fused lanes (kernels/specache_decode.py) against the torch lanes through the engine, over two turns with
    radix hits: the same real tokens, the same speculative guesses (the guess hit count is row 1's argmax, step
    after step) and the same recall of the device-selected top-k sets (KVQ_SPECACHE_RECALL=1, so the torch
    diagnostic scores both backends' prefetches; a near-tie may pick another position on one head, so recall agrees
    to 0.01)."""
    monkeypatch.setenv("KVQ_SPECACHE_RECALL", "1")
    monkeypatch.setenv("KVQ_TOPK", "8")  # a top-k well below the base, so the sets matter
    monkeypatch.setenv("KVQ_SPECACHE_PREFIX", prefix)  # device: the second turn's extend is the fused kernel
    rng = random.Random(3)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in (150, 40, 90)]
    torch_out, torch_cached, a = _two_turns(tiny, dtype, "kvq_torch", prompts)
    triton_out, triton_cached, b = _two_turns(tiny, dtype, "kvq_triton", prompts)
    print(dtype, "cached", torch_cached, "torch", a, "triton", b)
    assert triton_out == torch_out
    assert triton_cached == torch_cached and all(c >= 64 for c in torch_cached), torch_cached
    for key in ("predecode_rows", "decode_steps", "prefetched_rows", "spec_token_guesses", "spec_token_hit_rate",
                "recall_wanted"):
        assert a[key] == b[key], key
    assert a["top_k"] == 8 and a["recall_wanted"] > 0 and b["recall"] == pytest.approx(a["recall"], abs=0.01)


@matrix_only("test_long_contended_run_completes_and_the_host_tier_does_not_grow retracts on kvq_torch's lanes, and "
             "the fused lanes equal the torch lanes in tests/kernels/test_kernels_specache.py (232 s)")
def test_kvq_triton_batched_lanes_with_retraction(tiny, capfd):
    """Batched two-lane steps on kvq_triton (2B rows, requests joining and leaving the batch) through a pool of 3
    requests' pooled frames (fp16 window and top-k rows) and their pages with SGLang's retraction test mode: every
    request completes, resumed requests pre-decode again, and the lanes' counters move. (Tokens are compared with
    kvq_torch one request at a time above: which requests share a batch depends on timing.)"""
    rng = random.Random(5)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randrange(60, 140))) for _ in range(6)]
    # specache1's request: 2 ring frames and 2 of top-128 rows, 32 pages each (fp32, 1 bit): 16 frames hold 3
    llm = engine(tiny, "specache1", env={"SGLANG_TEST_RETRACT": "1"}, attention_backend="kvq_triton",
                 max_total_tokens=32768)
    try:
        outs = llm.generate(prompts, {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
        sc = pool_stats(llm)["specache"]
    finally:
        llm.shutdown()
        os.environ.pop("SGLANG_TEST_RETRACT", None)
    assert re.search(r"#retracted_reqs: [1-9]", capfd.readouterr().err), "no request was retracted"
    assert all(len(o["output_ids"]) == 24 for o in outs)
    assert sc["predecode_rows"] > 6 and sc["decode_steps"] >= 23 and sc["prefetched_rows"] > 0
    assert sc["spec_token_guesses"] > 0
    print("kvq_triton batched specache1:", sc)


BAD = [
    ({"kv_cache_dtype": "specache4"}, {}, "unknown kv cache dtype 'specache4'"),
    ({"kv_cache_dtype": "specache1"}, {"KVQ_PREFILL": "paged"}, "applies to kivi only"),
    ({"kv_cache_dtype": "specache1"}, {"KVQ_TOPK": "0"}, "top-k 0 must be at least 1"),
    ({"kv_cache_dtype": "specache2"}, {"KVQ_SPECACHE_PREFIX": "disk"},
     "KVQ_SPECACHE_PREFIX='disk'; choose one of host"),
    ({"kv_cache_dtype": "specache2"}, {"KVQ_HOST_MEM_FRACTION": "1.5"},
     "KVQ_HOST_MEM_FRACTION=1.5 must be in \\(0, 1\\]"),
]


@pytest.mark.parametrize("kwargs,env,message", BAD)
def test_bad_specache_arguments_fail_before_the_model_loads(tiny, kwargs, env, message, monkeypatch):
    import sglang

    from sgl_kvq.config import KVQConfigError

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(KVQConfigError, match=message):
        sglang.Engine(model_path=str(tiny), device="cpu", log_level="error", **kwargs)


# SmolLM2 on specache2 runs in CI through the conformance servers (tests/engine/test_conformance_*.py); this 1-bit chat
# with the recall diagnostic (a full-context host read per step) repeats that start and prefill at 1 bit: the matrix
# runs it.
@pytest.mark.skipif(not full_matrix(), reason="KVQ_TEST_MATRIX=all: SmolLM2 on specache1 (CI serves specache2)")
def test_smollm2_two_turn_chat_on_specache1(monkeypatch):
    """The embedded real model on 1-bit SpeCache: a two-turn chat over an essay excerpt reads turn 1 from the radix
    cache, answers with text, and measures the speculative lane's recall on real attention."""
    from transformers import AutoTokenizer

    from bench import data
    from bench.models import smollm2

    monkeypatch.setenv("KVQ_SPECACHE_RECALL", "1")
    path = smollm2()
    tok = AutoTokenizer.from_pretrained(path)
    excerpt = data.essay_text(min_chars=2000)[:2000]
    chat = [{"role": "user", "content": excerpt + "\n\nWhat is this text about?"}]
    llm = engine(path, "specache1", dtype="bfloat16", max_total_tokens=8192)
    try:
        sampling = {"temperature": 0, "max_new_tokens": 24}
        first = llm.generate(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), sampling)
        chat += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "Say it shorter."}]
        second = llm.generate(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), sampling)
        pool = pool_stats(llm)
    finally:
        llm.shutdown()
    assert first["meta_info"]["completion_tokens"] > 0 and any(c.isalpha() for c in first["text"]), first["text"]
    assert second["meta_info"]["cached_tokens"] >= 384, second["meta_info"]
    sc = pool["specache"]
    assert sc["recall_wanted"] > 0 and sc["recall"] is not None and sc["predecode_rows"] == 2
    print("smollm2 specache1:", first["text"], "|", second["text"], "| recall", sc["recall"],
          "guess hits", sc["spec_token_hit_rate"])
