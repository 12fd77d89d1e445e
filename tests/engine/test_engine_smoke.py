"""The real sglang.Engine on CPU with SmolLM2 (bf16 KV cache, our plugin loaded): a sane answer and a radix-cache
hit."""

from __future__ import annotations

import os

import pytest

from bench import data
from sgl_kvq.cpu_engine import cpu_engine_env, engine_kwargs
from bench.models import smollm2
from slices import matrix_only

pytestmark = [pytest.mark.slow, pytest.mark.engine]

GREEDY = {"temperature": 0, "max_new_tokens": 16}


@pytest.fixture(scope="module")
def model_path():
    return smollm2()


@pytest.fixture(scope="module")
def engine(model_path):
    saved = dict(os.environ)
    cpu_engine_env()  # the engine's processes inherit it
    import sglang

    eng = sglang.Engine(**engine_kwargs(model_path, max_total_tokens=4096))
    yield eng
    eng.shutdown()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def test_capital_of_france(engine, tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    out = engine.generate(prompt, {"temperature": 0, "max_new_tokens": 24})
    assert "Paris" in out["text"], out["text"]
    assert out["meta_info"]["completion_tokens"] > 0


@matrix_only("bf16's radix cache is SGLang's own; kvq pages' radix hits are served end to end by "
             "tests/engine/test_e2e_serving.py and the greedy record's second turn (71 s of a CI worker)")
def test_shared_prefix_is_served_from_the_radix_cache(engine, tokenizer):
    prefix = data.essay_text(min_chars=3000)[:3000]  # ~600 tokens
    n_prefix = len(tokenizer(prefix).input_ids)
    first = engine.generate(prefix + "\n\nQ: What is this text about? A:", GREEDY)
    again = engine.generate(prefix + "\n\nQ: What is this text about? A:", GREEDY)
    other = engine.generate(prefix + "\n\nQ: Who wrote this? A:", GREEDY)
    assert first["meta_info"]["cached_tokens"] < 8, first["meta_info"]  # nothing shared with earlier prompts
    # an identical prompt: all but the last token come from the cache, and the answer is the same
    assert again["meta_info"]["cached_tokens"] >= again["meta_info"]["prompt_tokens"] - 1
    assert again["text"] == first["text"]
    # a shared prefix: the prefix comes from the cache (up to a token merged across the boundary), the rest does not
    assert n_prefix - 2 <= other["meta_info"]["cached_tokens"] < other["meta_info"]["prompt_tokens"]
