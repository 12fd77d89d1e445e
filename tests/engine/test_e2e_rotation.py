"""KVQ_ROTATE through the real SGLang engine on CPU with the tiny random Llama (float32):

- where nothing is quantized (a residual window longer than every context: each token is read from the fp32 frames)
  the rotation is exact, so kivi2 at its default (the values rotated, here on a head_dim of 24: block-diagonal
  Hadamard blocks of 8) decodes the unrotated engine's greedy tokens: V is rotated in the spawned scheduler (the pool
  reports it) and the output rotated back;
- on 2-bit pages, kvq_triton (the values rotation in its decode kernels) and kvq_torch (at the backends' entry, the C
  kernel by default) decode the same tokens, over two turns where the second reads the first's packed pages from the
  radix tree (tests/unit/test_attention_rotation.py has the unit tests of both modes on every path)."""

from __future__ import annotations

import random

import pytest

from bench.models import tiny_llama
from slices import matrix_only
from engine_runs import engine_in_env, pool_stats

pytestmark = [pytest.mark.slow, pytest.mark.engine]

SAMPLING = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
NONE = {"KVQ_ROTATE": "none"}


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


@pytest.fixture(scope="module")
def tiny_hd24():
    """The tiny Llama with head_dim 24 (not a power of two)."""
    return tiny_llama(head_dim=24)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(30)
    words = "def class return import from self lambda yield while for if else try except with as".split()
    return [" ".join(rng.choice(words) for _ in range(n)) for n in (150, 100, 70)]


def serve_turns(model, prompts, env, turns=1, **kw):
    """Greedy outputs of `turns` turns (turn t+1 = turn t's text + its output + two words), the pool's stats."""
    with engine_in_env(model, "kivi2", env, **kw) as llm:
        outs, texts = [], list(prompts)
        for _ in range(turns):
            got = llm.generate(texts, SAMPLING)
            outs.append(got)
            texts = [t + o["text"] + " return self" for t, o in zip(texts, got)]
        return outs, pool_stats(llm)


def ids(turn) -> list[list[int]]:
    return [o["output_ids"] for o in turn]


@matrix_only("kivi2 rotates its values by default, so its greedy record through both backends "
             "(tests/engine/test_e2e_greedy_tokens.py) serves the rotation end to end; the block Hadamard of head_dim "
             "24 is tests/unit/test_attention_rotation.py's (72 s)")
def test_rotation_changes_no_token_where_nothing_is_quantized(tiny_hd24, prompts):
    # R = 512: the longest request (~200 tokens with its output) never leaves the fp32 frames; value groups of 8
    window = {"KVQ_RESIDUAL": "512", "KVQ_VALUE_GROUP": "8"}
    plain, stats = serve_turns(tiny_hd24, prompts, {**window, **NONE}, max_total_tokens=65536)
    assert stats["config"]["rotate"] == "none", stats
    rotated, stats = serve_turns(tiny_hd24, prompts, window, max_total_tokens=65536)
    assert stats["config"]["rotate"] == "values", stats  # kivi2's default
    assert ids(rotated[0]) == ids(plain[0])


@matrix_only("the rotated basis is checked on every read path over 2-bit pages by "
             "tests/unit/test_attention_rotation.py "
             "(kvq_triton's fused decode against kvq_torch's entry too) and end to end by the exact test above")
@pytest.mark.parametrize("rotate", ["values", "hadamard"])
def test_rotated_kivi2_gives_the_same_tokens_on_both_backends_across_a_radix_hit(tiny, prompts, rotate):
    # R = 0: only each request's open page is fp16, so the second turn reads its whole cached prefix from 2-bit pages
    env = {"KVQ_ROTATE": rotate, "KVQ_RESIDUAL": "0"}
    triton, _ = serve_turns(tiny, prompts, {**env, "TRITON_INTERPRET": "1"}, turns=2, max_total_tokens=16384,
                            attention_backend="kvq_triton")
    torch_, stats = serve_turns(tiny, prompts, env, turns=2, max_total_tokens=16384, attention_backend="kvq_torch")
    assert stats["config"]["rotate"] == rotate and stats["pages_quantized"] > 0, stats
    assert all(o["meta_info"]["cached_tokens"] >= 64 for o in torch_[1][:2])  # the first turn's complete pages
    assert [ids(t) for t in triton] == [ids(t) for t in torch_]
