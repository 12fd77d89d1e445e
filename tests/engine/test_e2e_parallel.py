"""Past one rank on SGLang's CPU engine: tensor parallel (`--tp-size 2`: each rank holds half the KV heads, packed)
and data parallel (`--dp-size 2`: two replicas, each with its own pool and radix tree), started the way a user
starts them, `sgl-kvq serve ... --tp-size 2` with no SGLANG_CPU_OMP_THREADS_BIND (sgl_kvq chooses the binding).

The tiny fp32 Llama (2 KV heads, so tp 2 gives one head per rank) makes greedy tokens exact: tp 2 must give the tokens
tp 1 gives with the same dtype (SGLang all-reduces the row-parallel outputs over gloo on CPU). The tp-1 tokens come
from a `--dp-size 2` server, whose replicas are tp 1: one DP server and one TP server per dtype serve both tests.
CI covers kivi2 (the KIVI pool; specache2, its host tier and two lanes split by rank, took 236 s of a CI worker and
runs in the matrix); KVQ_TEST_PARALLEL_DTYPES=all runs every name in sgl_kvq.config.ALL_DTYPE_NAMES (kivimix with a
recipe whose layers differ in width), so a dtype added there is covered, and a comma list runs those
(docs/deployment.md, "Tensor and data parallel")."""

from __future__ import annotations

import os
import random

import pytest

from sgl_kvq.config import ALL_DTYPE_NAMES
from bench.launch import ServerProcess
from bench.models import tiny_llama
from recipes import serve_recipe_if_asked

pytestmark = [pytest.mark.slow, pytest.mark.engine]

CI_DTYPES = ["kivi2"]
_CHOSEN = os.environ.get("KVQ_TEST_PARALLEL_DTYPES", "")
TP_DTYPES = list(ALL_DTYPE_NAMES) if _CHOSEN == "all" else [d for d in _CHOSEN.split(",") if d] or CI_DTYPES
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
BUDGET_GB = "0.01"  # pinned per rank: capacity is then a known function of the per-rank shape


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    words = "def class return import from self lambda yield while for if else try except with as print".split()
    return [" ".join(rng.choice(words) for _ in range(100)) for _ in range(3)]


def rank_shape(model, dtype, kv_heads):
    """The pool shape of a rank holding `kv_heads` KV heads (sgl_kvq/layout.py)."""
    from transformers import AutoConfig

    from sgl_kvq.config import parse_kv_cache_dtype
    from sgl_kvq.pool_shape import PoolShape

    hf = AutoConfig.from_pretrained(model)
    return PoolShape(layers=hf.num_hidden_layers, heads=kv_heads, head_dim=hf.head_dim, num_pages=0,
                     cfg=parse_kv_cache_dtype(dtype)), hf.max_position_embeddings


def expected_split(model, dtype, kv_heads):
    """How a rank's pool splits the pinned per-rank budget with `kv_heads` KV heads (sgl_kvq/capacity.py)."""
    import torch

    from sgl_kvq.capacity import split_budget

    shape, context_len = rank_shape(model, dtype, kv_heads)
    return split_budget(int(float(BUDGET_GB) * 2**30), shape, torch.float32, host_is_device=True,
                        context_len=context_len)


def check_capacity(stats, model, dtype, kv_heads):
    split = expected_split(model, dtype, kv_heads)
    assert stats["kv_cache_dtype"] == dtype and stats["pool_class"] == "KVQTokenToKVPool", stats
    # The bytes a token costs on this rank are the per-rank shape's: its KV heads' codes, scales and extras, plus
    # what a format keeps per page for all heads (LogQuant's row count), which no rank can shard.
    assert stats["base_bytes_per_token"] == rank_shape(model, dtype, kv_heads)[0].base_bytes_per_token(), stats
    assert stats["kv_budget_bytes"] == split.budget_bytes, "each rank holds the whole pinned KV budget"
    running = split.max_running_requests
    if running is None:  # pooled frames: SGLang's own default (kv_cache_configurator.resolve_max_num_reqs)
        context_len = rank_shape(model, dtype, kv_heads)[1]
        running = min(max(min(int(split.tokens / context_len * 512), 4096), 2048), split.tokens // 2)
    assert (stats["capacity_tokens"], stats["max_running_requests"]) == (split.tokens, running), (stats, split)


@pytest.fixture(scope="module", params=TP_DTYPES)
def dp2(request, tiny, prompts, tmp_path_factory):
    """One `--dp-size 2` server per dtype (two tp-1 replicas): the tp-1 tokens the tp-2 test compares with, and
    what the DP test checks. Replica 1 also holds a conversation of its own, absent from replica 0."""
    dtype = request.param
    with pytest.MonkeyPatch.context() as mp:
        new_user_env(mp)
        serve_recipe_if_asked(mp, dtype, tmp_path_factory.mktemp("recipe"))
        args = ["--model-path", str(tiny), "--kv-cache-dtype", dtype, "--dtype", "float32", "--dp-size", "2"]
        with ServerProcess(args, log_path=tmp_path_factory.mktemp("dp2") / "server.log") as server:
            def gen(text, rank, n=GREEDY["max_new_tokens"]):
                return server.post("/generate", {"text": text, "routed_dp_rank": rank,
                                                 "sampling_params": {**GREEDY, "max_new_tokens": n}})

            run = {"dtype": dtype, "replica_outputs": [gen(prompts, r) for r in (0, 1)]}
            own = prompts[0][::-1]  # a conversation only replica 1 sees
            first = gen(own, 1, 8)
            turn2 = own + first["text"] + " try except"
            run["turn2_cached"] = [gen(prompts[0] + run["replica_outputs"][0][0]["text"] + " try except", 0, 4),
                                   gen(turn2, 1, 4)]
            run["turn2_cached"] = [o["meta_info"]["cached_tokens"] for o in run["turn2_cached"]]
            run["first_cached"] = first["meta_info"]["cached_tokens"]
            run["crossed_cached"] = gen(turn2, 0, 4)["meta_info"]["cached_tokens"]
            run["states"] = server.get("/get_server_info")["internal_states"]
    return run


def new_user_env(mp):
    """A new user's environment: no thread binding set; the KV budget pinned small (per rank)."""
    for var in ("SGLANG_CPU_OMP_THREADS_BIND", "KVQ_AUTO_THREADS_BIND", "KVQ_CPU_RANKS_PER_NODE"):
        mp.delenv(var, raising=False)
    mp.setenv("KVQ_KV_CACHE_GB", BUDGET_GB)


def test_dp2_replicas_each_serve_from_their_own_pool_and_radix_tree(dp2, tiny, monkeypatch, tmp_path):
    serve_recipe_if_asked(monkeypatch, dp2["dtype"], tmp_path)  # check_capacity parses the dtype
    tokens = [[o["output_ids"] for o in outs] for outs in dp2["replica_outputs"]]
    assert tokens[0] == tokens[1], "two replicas of the same model gave different greedy tokens"
    assert dp2["first_cached"] == 0
    for cached in dp2["turn2_cached"]:  # turn 2 on the replica that served turn 1 reads its pages back
        assert cached >= 64 and cached % 64 == 0, dp2["turn2_cached"]
    assert dp2["crossed_cached"] == 0, "replica 0 found pages only replica 1 cached: the trees are not separate"
    assert len(dp2["states"]) == 2
    for state in dp2["states"]:  # each replica: both KV heads, the whole pinned budget
        check_capacity(state["kv_pool"], tiny, dp2["dtype"], kv_heads=2)
    print(dp2["dtype"], "dp2: B/token per replica", dp2["states"][0]["kv_pool"]["base_bytes_per_token"],
          "tokens per replica", dp2["states"][0]["kv_pool"]["capacity_tokens"], "turn 2 cached", dp2["turn2_cached"])


def test_tp2_gives_tp1_tokens_with_half_the_kv_per_rank(dp2, tiny, prompts, monkeypatch, tmp_path):
    new_user_env(monkeypatch)
    dtype = dp2["dtype"]
    serve_recipe_if_asked(monkeypatch, dtype, tmp_path)
    args = ["--model-path", str(tiny), "--kv-cache-dtype", dtype, "--dtype", "float32", "--tp-size", "2"]
    with ServerProcess(args, log_path=tmp_path / "server.log") as server:
        outs = server.post("/generate", {"text": prompts, "sampling_params": GREEDY})
        # Turn 2 of the first conversation: its prompt and answer come back from the radix tree in whole pages.
        turn2 = server.post("/generate", {"text": prompts[0] + outs[0]["text"] + " while for if else",
                                          "sampling_params": {**GREEDY, "max_new_tokens": 4}})
        stats = server.kv_pool_stats()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in dp2["replica_outputs"][0]]
    cached = turn2["meta_info"]["cached_tokens"]
    assert cached >= 64 and cached % 64 == 0, cached
    # Rank 0's pool (SGLang syncs the token count across the TP group): one of the two KV heads, about half the
    # bytes per token of a tp-1 replica (check_capacity: exactly the per-rank shape's), so the same per-rank budget
    # holds about twice the tokens.
    tp1 = dp2["states"][0]["kv_pool"]
    assert stats["base_bytes_per_token"] <= 0.51 * tp1["base_bytes_per_token"], (stats, tp1)
    check_capacity(stats, tiny, dtype, kv_heads=1)
    print(dtype, "tp2: B/token per rank", stats["base_bytes_per_token"], "(tp1", tp1["base_bytes_per_token"],
          ") tokens per rank", stats["capacity_tokens"], "(tp1", tp1["capacity_tokens"], ") turn 2 cached", cached)
