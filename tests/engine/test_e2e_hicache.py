"""HiCache on SGLang's CPU engine with a kvq dtype: the host tier is the packed host pool (patches/hicache.py,
sgl_kvq/host_pool.py). A prefix pushed out of a device pool too small to keep it comes back from the host, and the
request that reuses it decodes exactly the tokens it decodes when the prefix never left the device. CI runs kivi2;
KVQ_TEST_HICACHE_DTYPES=all adds the formats with extras (GEAR's correction, LogQuant's rows, ZipCache's salient
plane) and kivimix (a recipe whose layers differ in width: the host tier's per-layer buffers)."""

from __future__ import annotations

import os
import random

import pytest

from bench.launch import engine_kwargs
from bench.models import tiny_llama
from engine_runs import pool_stats

pytestmark = [pytest.mark.slow, pytest.mark.engine]

PROMPT, PAGES_KEPT = 448, 7  # tokens per prompt: 7 complete pages of G = 64
DTYPES = ["kivi2", "gear2", "gearl2", "logquant2", "zipcache2", "kivimix"] \
    if os.environ.get("KVQ_TEST_HICACHE_DTYPES") == "all" else ["kivi2"]


def run(dtype: str, **kw) -> tuple[list, dict]:
    """Five distinct prompts, then the first again with a suffix, one at a time (tiny fp32 Llama, greedy)."""
    import sglang

    rng = random.Random(0)
    prompts = [[rng.randrange(5, 900) for _ in range(PROMPT)] for _ in range(5)]
    llm = sglang.Engine(**engine_kwargs(tiny_llama(), dtype, dtype="float32", log_level="error", **kw))
    try:
        outs = [llm.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0},
                             return_logprob=True) for ids in prompts + [prompts[0] + [7, 8, 9]]]
        stats = pool_stats(llm)
    finally:
        llm.shutdown()
    # the logprobs too: a few greedy tokens of a tiny random model can survive a damaged prefix
    return [(o["meta_info"]["cached_tokens"], o["output_ids"], [t[0] for t in o["meta_info"]["output_token_logprobs"]])
            for o in outs], stats


@pytest.mark.parametrize("dtype", DTYPES)
def test_evicted_prefix_comes_back_from_the_host_tier(monkeypatch, tmp_path, dtype):
    monkeypatch.setenv("KVQ_KV_CACHE_GB", "0.25")  # a small budget; max_total_tokens sizes the device pool
    if dtype == "kivimix":
        from recipes import tiny_recipe

        # 2-bit codes at the narrowest, as kivi2's: a pooled frame spans as many pages, so the sizing below holds
        monkeypatch.setenv("KVQ_RECIPE", tiny_recipe(tmp_path, (4, 2), (2, 3)))
    ref, ref_stats = run(dtype, max_total_tokens=8192)  # the prefix never leaves the device
    assert ref[-1][0] == PAGES_KEPT * 64
    # Under HiCache too a running request's fp16 frames are pages of the pool, taken while it runs, and taken when
    # admission accepts it, so the load-back cannot split them. The pool: the frames, the padded rows' dummy frame
    # and tokens.
    frames = ref_stats["frame_tokens"]
    hi, stats = run(dtype, max_total_tokens=frames + 2048, enable_hierarchical_cache=True, hicache_ratio=4.0)
    assert stats["frames_pooled"] and stats["frame_tokens"] == frames > 0
    # beside one running request (its frames, its prompt's pages and a page of output) the device holds fewer tokens
    # than the four prompts sent after the first: the first one's pages had to leave the device
    assert stats["capacity_tokens"] - frames - (PROMPT + 64) < 4 * PROMPT
    assert stats["hicache_host_tokens"] >= 4 * stats["capacity_tokens"]
    assert stats["hicache_host_bytes"] == stats["hicache_host_tokens"] * stats["base_bytes_per_token"]
    assert hi[-1][0] == PAGES_KEPT * 64, "the first prompt's complete pages are a host hit"
    assert [o for _, o, _ in hi] == [o for _, o, _ in ref]
    assert [lp for _, _, lp in hi] == [lp for _, _, lp in ref]
