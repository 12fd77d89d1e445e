"""A peer format (sgl_kvq/formats/peers/) through the real SGLang engine on CPU with the tiny random Llama: one
engine serves peer_int4 through kvq_torch, a second turn hits the radix cache (its prefix read from the peer's
packed pages), and kvq_triton is refused before any model loads. The other peers' engine runs are in
tests/data/greedy_tokens.json (KVQ_TEST_MATRIX=all tests/engine/test_e2e_greedy_tokens.py)."""

from __future__ import annotations

import random

import pytest

from bench.models import tiny_llama
from engine_runs import pool_stats

pytestmark = [pytest.mark.slow, pytest.mark.engine]

SAMPLING = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


def test_peer_int4_serves_two_turns_with_a_radix_hit(tiny):
    import sglang

    from bench.launch import engine_kwargs

    rng = random.Random(30)
    words = "def class return import from self lambda yield while for if else try except".split()
    first = [" ".join(rng.choice(words) for _ in range(n)) for n in (150, 70)]  # past a 64-token page, and in one
    llm = sglang.Engine(**engine_kwargs(tiny, "peer_int4", dtype="float32", mem_fraction_static=0.3,
                                        max_total_tokens=16384, attention_backend="kvq_torch"))
    try:
        outs = llm.generate(first, SAMPLING)
        second = [p + o["text"] + " return self" for p, o in zip(first, outs)]
        outs2 = llm.generate(second, SAMPLING)
        stats = pool_stats(llm)
    finally:
        llm.shutdown()
    assert stats["kv_cache_dtype"] == "peer_int4" and stats["frames_pooled"]
    # tiny: 2 layers x 2 KV heads x D 16: per token, head and layer 8 code bytes + an fp32 scale, K and V
    assert stats["base_bytes_per_token"] == 2 * 2 * 2 * (8 + 4)
    assert all(len(o["output_ids"]) == SAMPLING["max_new_tokens"] for o in outs + outs2)
    # the first turn's complete pages are reused from the radix tree
    assert outs2[0]["meta_info"]["cached_tokens"] >= 128
    assert stats["pages_quantized"] > 0


def test_kvq_triton_refuses_a_peer_before_the_model_loads(tiny):
    import sglang

    from sgl_kvq.config import KVQConfigError

    with pytest.raises(KVQConfigError, match="peer_tq3 has no Triton kernel"):
        sglang.Engine(model_path=str(tiny), device="cpu", log_level="error", kv_cache_dtype="peer_tq3",
                      attention_backend="kvq_triton")
