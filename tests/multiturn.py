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
