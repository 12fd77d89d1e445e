"""Sliding-window layers through the engine and SGLang's HTTP server (SGLang's Gemma3ForCausalLM: a tiny random one
built here, float32, and in the matrix the embedded Gemma 3 270M): each sliding layer attends within its window on
every path, in SGLang's own semantics (a query at position i sees i - W .. i). The path-by-path checks against the
reference are tests/unit/test_attention_window.py and tests/kernels/test_kernels_attention.py."""

from __future__ import annotations

import random
import sys

import pytest

from engine_runs import engine_in_env, pool_stats
from slices import matrix_only
from bench.models import tiny_gemma3

pytestmark = [pytest.mark.slow, pytest.mark.engine]

GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


def generate(model, dtype, input_ids, env=None, **kw):
    """Greedy tokens and their logprobs of each prompt, one request at a time (no batch-dependent rounding)."""
    with engine_in_env(model, dtype, env, max_total_tokens=4096, max_running_requests=4, **kw) as llm:
        outs = [llm.generate(input_ids=ids, sampling_params=GREEDY, return_logprob=True) for ids in input_ids]
        stats = pool_stats(llm) if dtype != "auto" else None
    return [o["output_ids"] for o in outs], [[x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in outs], \
        stats


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 1000) for _ in range(n)]  # the tiny tokenizer's ids past its 4 special tokens


def test_inside_the_fp16_window_kivi2_gives_sglangs_own_sliding_window_tokens():
    """50-token prompts and 16 tokens each, window 24: every key a query sees is still fp16 (R = 64), so kivi2 must
    give the tokens and logprobs of SGLang's own pool and torch_native's own sliding-window mask, decode and prefill
    both cutting the context at the window."""
    model = tiny_gemma3(24)
    rng = random.Random(1)
    prompts = [random_ids(rng, 50) for _ in range(3)]
    auto_ids, auto_lp, _ = generate(model, "auto", prompts)
    kvq_ids, kvq_lp, stats = generate(model, "kivi2", prompts)
    assert stats["kv_cache_dtype"] == "kivi2"
    assert kvq_ids == auto_ids
    for a, b in zip(auto_lp, kvq_lp):
        assert a == pytest.approx(b, abs=1e-4)


@matrix_only("the test above serves the window against SGLang's own tokens; which pages each path reads under a "
             "window is tests/unit/test_attention_window.py's (39 s)")
def test_tokens_before_the_window_are_never_read_from_the_packed_pages():
    """Two sliding layers of window 100 with R = 0 (only the open page is fp16: the window reaches into packed
    pages). Two 400-token prompts that differ only in their first 100 tokens: a layer-2 key at position j depends on
    tokens j - 100 .. j, and the pages a query at 400 or later reads start at 400 - 100 - 64 or later, so nothing they
    hold depends on the differing tokens, and the outputs must be the same to the bit. (With the window ignored, or
    a window wider than the context, the two prompts' tokens differ from the first: tried.)"""
    rng = random.Random(2)
    tail = random_ids(rng, 300)
    prompts = [random_ids(rng, 100) + tail, random_ids(rng, 100) + tail]
    deterministic = {"KVQ_RESIDUAL": "0"}
    ids, lp, stats = generate(tiny_gemma3(100, ("sliding_attention",) * 2), "kivi2", prompts, deterministic)
    assert stats["pages_quantized"] >= 2 * 6  # both prompts' complete pages were packed, then read
    assert ids[0] == ids[1] and lp[0] == lp[1]


def window_prompts() -> list[list[int]]:
    """Two 400-token prompts that differ only in their first 100 tokens, and a third that shares the first one's
    first 300 (a radix hit) and differs in its last 100, inside every window."""
    rng = random.Random(2)
    tail = random_ids(rng, 300)
    prompts = [random_ids(rng, 100) + tail, random_ids(rng, 100) + tail]
    return prompts + [prompts[0][:300] + random_ids(rng, 100)]


@matrix_only("specache's windowed lanes equal the oracle in tests/unit/test_specache_window.py (47 s)")
def test_specache2_attends_and_prefetches_within_the_window():
    """specache2 on kvq_torch, two sliding layers of window 100, R = 0: its extend reads the 16-bit prefix (a radix
    hit for the third prompt) within the window, and its decode lanes attend within theirs, the top-k rows
    prefetched from the host tier chosen inside them (top-64 of 100 visible positions, so the choice matters). As for
    kivi2 above, nothing a query at 400 or later sees depends on the first 100 tokens, so the first two prompts give
    the same tokens and logprobs to the bit; the third does not. (With the lanes' window dropped, or the extend's,
    the first two differ: tried.)"""
    ids, lp, stats = generate(tiny_gemma3(100, ("sliding_attention",) * 2), "specache2", window_prompts(),
                              {"KVQ_RESIDUAL": "0"})
    sc = stats["specache"]
    assert stats["kv_cache_dtype"] == "specache2" and stats["config"]["residual"] == 0 and sc["top_k"] == 64
    assert sc["predecode_rows"] == 3 and sc["decode_steps"] >= 3 * 15 and sc["prefetched_rows"] > 0
    assert all(len(x) == GREEDY["max_new_tokens"] for x in ids)
    assert ids[0] == ids[1] and lp[0] == lp[1]
    assert lp[2] != lp[0]


# CI: one server start on the tiny model (about 50 s on a loaded 2-core machine)
@matrix_only("the Engine tests above slide the same window; launch_server and the frontend language are "
             "tests/engine/test_e2e_serving.py's (66 s)")
def test_launch_server_and_a_frontend_program_slide_the_window_on_kivi2(tmp_path, monkeypatch):
    """The window test above through SGLang's HTTP server, started as users start it (`python -m sglang.launch_server
    --kv-cache-dtype kivi2`, the plugin loading itself), and a two-turn frontend-language program against it: the
    server's pool is kivi2's at the packed layout's bytes per token; over /generate the two prompts that differ only
    before the window give the same tokens and logprobs to the bit, and a third that differs inside the window (its
    last 100 tokens; its first 256 a radix hit) does not (so the equality is no constant output); the program's
    turns exceed the window, and its second turn is served from the radix cache in whole pages. (With a window of
    1,000, wider than the context, the first two prompts' tokens differ from the first: tried.)"""
    import sglang as sgl

    from bench.launch import ServerProcess, server_argv

    class LaunchServer(ServerProcess):
        command = [sys.executable, "-m", "sglang.launch_server"]

    @sgl.function
    def two_turns(s, first, follow):
        s += first
        s += sgl.gen("a1", max_tokens=8, temperature=0, ignore_eos=True)
        s += follow
        s += sgl.gen("a2", max_tokens=8, temperature=0, ignore_eos=True)

    monkeypatch.setenv("KVQ_RESIDUAL", "0")  # inherited by the server: the windows reach into packed pages
    model = tiny_gemma3(100, ("sliding_attention",) * 2)
    rng = random.Random(2)
    tail = random_ids(rng, 300)
    prompts = [random_ids(rng, 100) + tail, random_ids(rng, 100) + tail]
    prompts.append(prompts[0][:300] + random_ids(rng, 100))
    words = "def class return import from self lambda yield while for if else try except with as print".split()
    first = " ".join(rng.choice(words) for _ in range(200))
    follow = "\n" + " ".join(rng.choice(words) for _ in range(60))
    args = server_argv(["--model-path", str(model), "--kv-cache-dtype", "kivi2", "--dtype", "float32",
                        "--max-total-tokens", "4096", "--mem-fraction-static", "0.3", "--max-running-requests", "4"])
    with LaunchServer(args, log_path=tmp_path / "server.log") as server:
        outs = [server.post("/generate", {"input_ids": ids, "sampling_params": GREEDY, "return_logprob": True})
                for ids in prompts]
        state = two_turns.run(first=first, follow=follow, backend=sgl.RuntimeEndpoint(server.base))
        state.sync()  # run() returns while the program's thread still sends its turns
        assert state.error() is None, state.error()
        stats = server.kv_pool_stats()
    ids = [o["output_ids"] for o in outs]
    lp = [[x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in outs]
    assert stats["pool_class"] == "KVQTokenToKVPool" and stats["kv_cache_dtype"] == "kivi2"
    assert stats["config"]["residual"] == 0
    # 2 layers x 2 KV heads x (K and V codes 2 x 16 ch x 2 bit = 8 B, the key scale and zero per page and channel
    # 2 x 16 x 2 B / 64 tokens = 1 B, the value scale and zero per token and group of 16 channels 2 x 2 B = 4 B)
    assert stats["base_bytes_per_token"] == 2 * 2 * (8 + 1 + 4), stats
    assert stats["pages_quantized"] >= 2 * 6  # the first two prompts' complete pages were packed, then read
    assert all(len(x) == GREEDY["max_new_tokens"] for x in ids)
    assert ids[0] == ids[1] and lp[0] == lp[1]
    assert ids[2] != ids[0]
    m1, m2 = state.get_meta_info("a1"), state.get_meta_info("a2")
    assert m1["prompt_tokens"] > 100 and m2["prompt_tokens"] > m1["prompt_tokens"] + 8, (m1, m2)
    assert m1["completion_tokens"] == m2["completion_tokens"] == 8
    assert m2["cached_tokens"] % 64 == 0 and m2["cached_tokens"] >= 64 * (m1["prompt_tokens"] // 64 - 1), (m1, m2)


@matrix_only("the Triton kernels' windows are compared with the reference in tests/kernels/test_kernels_attention.py")
def test_kvq_triton_gives_kvq_torchs_tokens_on_sliding_layers():
    """The window test above through kvq_triton (Triton's interpreter): the same tokens as kvq_torch's C kernel and
    extend, packed pages inside the window."""
    rng = random.Random(2)
    tail = random_ids(rng, 300)
    prompts = [random_ids(rng, 100) + tail, random_ids(rng, 100) + tail]
    model, env = tiny_gemma3(100, ("sliding_attention",) * 2), {"KVQ_RESIDUAL": "0"}
    torch_ids, _, _ = generate(model, "kivi2", prompts, env)
    triton_ids, _, stats = generate(model, "kivi2", prompts, {**env, "TRITON_INTERPRET": "1"},
                                    attention_backend="kvq_triton")
    assert triton_ids == torch_ids and triton_ids[0] == triton_ids[1]


@matrix_only("kernels/specache_decode.py's windows are compared with the torch lanes in "
             "tests/kernels/test_kernels_specache.py")
def test_specache2_on_kvq_triton_attends_within_the_window():
    """The specache2 window test above through kvq_triton (Triton's interpreter): its fused lanes, select_topk and
    extend over staged 16-bit prefix frames give kvq_torch's tokens, and the first two prompts the same tokens and
    logprobs to the bit."""
    model, env = tiny_gemma3(100, ("sliding_attention",) * 2), {"KVQ_RESIDUAL": "0"}
    torch_ids, _, _ = generate(model, "specache2", window_prompts(), env)
    ids, lp, stats = generate(model, "specache2", window_prompts(), {**env, "TRITON_INTERPRET": "1"},
                              attention_backend="kvq_triton")
    assert stats["kv_cache_dtype"] == "specache2" and stats["specache"]["prefetched_rows"] > 0
    assert ids == torch_ids and ids[0] == ids[1] and lp[0] == lp[1]


@matrix_only("the tiny Gemma 3 above serves the same architecture; building the real one takes about 70 s")
def test_gemma3_270m_serves_every_layer_from_packed_pages():
    """The embedded Gemma 3 270M (sgl-kvq model gemma3: 18 layers, 15 of them sliding-window of 512, one KV head of 256
    channels): kivi4 and kivi2 serve a 1.4k-token essay prompt and its follow-up turn from the radix cache, at the
    packed layout's bytes per token and head: K and V codes (kivi4 2 x 128, kivi2 2 x 64), the key scale and zero per
    page and channel (2 x 256 x 2 B / 64 tokens) and the value scale and zero per token and group of 64 channels
    (4 x 2 x 2 B)."""
    from bench.data import essay_text
    from bench.models import gemma3

    text = essay_text(min_chars=9000)[:6000]
    greedy = {"temperature": 0, "max_new_tokens": 8}
    for dtype, per_head in (("kivi4", 2 * 128 + 16 + 16), ("kivi2", 2 * 64 + 16 + 16)):
        with engine_in_env(gemma3(), dtype, dtype="bfloat16", max_total_tokens=16384, max_running_requests=4) as llm:
            first = llm.generate(text, greedy)
            second = llm.generate(text + first["text"] + " What else does the essay say?", greedy)
            stats = pool_stats(llm)
        assert first["meta_info"]["prompt_tokens"] > 1024 and second["meta_info"]["cached_tokens"] >= 1024
        assert stats["base_bytes_per_token"] == 18 * per_head, stats
