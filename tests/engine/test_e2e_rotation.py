"""KVQ_ROTATE=hadamard through the real SGLang engine on CPU with the tiny random Llama (float32, head_dim 16):

- where nothing is quantized (a residual window longer than every context: each token is read from the fp32 frames)
  the rotation is exact, so the rotated engine decodes the unrotated engine's greedy tokens: q, k and v are rotated
  alike in the spawned scheduler (the pool reports it) and the output rotated back;
- on 2-bit pages, kvq_triton (its write and read kernels) and kvq_torch (the C kernel by default) decode the same
  tokens, over two turns where the second reads the first's packed pages from the radix tree;
- a head_dim that is not a power of two is refused before the model loads (tests/unit/test_attention_rotation.py has
  the unit tests)."""

from __future__ import annotations

import random

import pytest

from sgl_kvq.tools.models import tiny_llama
from slices import matrix_only
from engine_runs import engine_in_env, pool_stats

pytestmark = [pytest.mark.slow, pytest.mark.engine]

SAMPLING = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
ROTATE = {"KVQ_ROTATE": "hadamard"}


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


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


def test_rotation_changes_no_token_where_nothing_is_quantized(tiny, prompts):
    # R = 512: the longest request (~200 tokens with its output) never leaves the fp32 frames
    window = {"KVQ_RESIDUAL": "512"}
    plain, _ = serve_turns(tiny, prompts, window, max_total_tokens=65536)
    rotated, stats = serve_turns(tiny, prompts, {**window, **ROTATE}, max_total_tokens=65536)
    assert stats["config"]["rotate"] == "hadamard", stats
    assert ids(rotated[0]) == ids(plain[0])


@matrix_only("the rotated basis is checked on every read path over 2-bit pages by tests/unit/test_attention_rotation.py "
             "and end to end by the exact test above (124 s of a CI worker)")
def test_rotated_kivi2_gives_the_same_tokens_on_both_backends_across_a_radix_hit(tiny, prompts):
    # R = 0: only each request's open page is fp16, so the second turn reads its whole cached prefix from 2-bit pages
    env = {**ROTATE, "KVQ_RESIDUAL": "0"}
    triton, _ = serve_turns(tiny, prompts, {**env, "TRITON_INTERPRET": "1"}, turns=2, max_total_tokens=16384,
                            attention_backend="kvq_triton")
    torch_, stats = serve_turns(tiny, prompts, env, turns=2, max_total_tokens=16384, attention_backend="kvq_torch")
    assert stats["config"]["rotate"] == "hadamard" and stats["pages_quantized"] > 0, stats
    assert all(o["meta_info"]["cached_tokens"] >= 64 for o in torch_[1][:2])  # the first turn's complete pages
    assert [ids(t) for t in triton] == [ids(t) for t in torch_]


def test_rotation_refuses_a_head_dim_that_is_not_a_power_of_two(tiny, tmp_path, monkeypatch):
    import sglang
    from transformers import LlamaConfig

    from sgl_kvq.config import KVQConfigError

    odd = LlamaConfig.from_pretrained(tiny)
    odd.head_dim, odd.hidden_size = 24, 24 * odd.num_attention_heads
    odd.save_pretrained(tmp_path / "hd24")
    monkeypatch.setenv("KVQ_ROTATE", "hadamard")
    monkeypatch.setenv("KVQ_VALUE_GROUP", "8")
    with pytest.raises(KVQConfigError, match="power-of-two head_dim.*head_dim is 24"):
        sglang.Engine(model_path=str(tmp_path / "hd24"), tokenizer_path=str(tiny), device="cpu", log_level="error",
                      kv_cache_dtype="kivi2")
