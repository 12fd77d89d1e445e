"""A growing multi-turn chat against a running server: the radix-cache check the engine tests share."""

from __future__ import annotations


def multiturn_cached_tokens(server, turns: int, max_new_tokens: int = 16) -> tuple[list[int], str]:
    """A chat of `turns` growing turns through /generate, each sending the whole history: (cached tokens per turn,
    the final history)."""
    history = "system: you are terse\n"
    cached = []
    for turn in range(turns):
        history += f"user: question {turn} " + "about the code below " * 30 + "\nassistant:"
        out = server.post("/generate", {"text": history, "sampling_params": {"temperature": 0,
                                                                             "max_new_tokens": max_new_tokens}})
        cached.append(out["meta_info"]["cached_tokens"])
        history += out["text"] + "\n"
    return cached, history


def radix_hits_over_http(model, kv_cache_dtype: str, log_path, frontend_fork) -> dict:
    """An HTTP server for `kv_cache_dtype` on the float32 `model`: a 3-turn chat's later turns and a forked
    frontend-language program's shared prefix are served from the radix cache in whole 64-token pages -> the pool's
    stats from /get_server_info."""
    from bench.launch import ServerProcess

    args = ["--model-path", str(model), "--kv-cache-dtype", kv_cache_dtype, "--dtype", "float32",
            "--max-total-tokens", "4096", "--mem-fraction-static", "0.3"]
    with ServerProcess(args, log_path=log_path) as server:
        cached, _ = multiturn_cached_tokens(server, turns=3)
        assert cached[0] == 0 and all(c >= 64 and c % 64 == 0 for c in cached[1:]), cached
        # A forked frontend-language program: its shared prefix lands in the radix tree as quantized pages that a
        # later request matches whole. (Its two branches themselves report 0 cached tokens, on bf16 too: SGLang
        # 0.5.23's RuntimeEndpoint sends them before the prefix request has been inserted.)
        shared = "shared prefix for both branches " * 40
        branches = frontend_fork(server.base, shared)
        assert len(branches) == 2 and all(meta["completion_tokens"] == 8 for _, meta in branches), branches
        again = server.post("/generate", {"text": shared, "sampling_params": {"max_new_tokens": 1}})
        assert again["meta_info"]["cached_tokens"] == 64 * (again["meta_info"]["prompt_tokens"] // 64), again
        stats = server.kv_pool_stats()
    assert stats["kv_cache_dtype"] == kv_cache_dtype
    return stats
