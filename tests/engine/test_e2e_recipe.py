"""kivimix through SGLang: a recipe's per-layer key and value widths served on the tiny fp32 Llama (2 layers), with
the greedy-token recorder of tests/engine/test_e2e_greedy_tokens.py (two turns, the second a radix hit whose
extend reads packed pages).

- A recipe with keys and values at different widths in each layer (4/1 and 1/3): kvq_torch (the C decode kernel and
  the torch extend) and kvq_triton (the Triton kernels, interpreted) give the same tokens: two implementations read
  every layer at its own widths alike.
- A recipe of 2 bits throughout gives kivi2's recorded tokens exactly (same pages, same rotation, same prefill;
  KVQ_TEST_MATRIX=all).
- A recipe that names its prefill is served with it (the scheduler's pool reports it) unless KVQ_PREFILL says
  otherwise.
- A recipe made for another model, or naming an unknown prefill, is refused before the model loads, naming what
  differs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from recipes import tiny_recipe
from slices import matrix_only
from test_e2e_greedy_tokens import RECORD, _recorder


@pytest.mark.slow
@pytest.mark.engine
def test_mixed_widths_read_alike_through_both_backends(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQ_RECIPE", tiny_recipe(tmp_path))
    got = _recorder().record(["kivimix"])["kivimix"]
    assert got["kvq_torch"] == got["kvq_triton"]
    assert len(got["kvq_torch"]) == 6 and all(len(t) == 16 for t in got["kvq_torch"])


@pytest.mark.slow
@pytest.mark.engine
@matrix_only("test_mixed_widths_read_alike_through_both_backends serves a recipe, and tests/unit/test_recipe.py "
             "holds a uniform recipe's pool to its kivi width's")
def test_a_recipe_of_two_bits_gives_kivi2s_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQ_RECIPE", tiny_recipe(tmp_path, (2, 2), (2, 2)))
    want = json.loads(RECORD.read_text())["tokens"]["kivi2"]["kvq_torch"]
    assert _recorder().record(["kivimix"], ("kvq_torch",))["kivimix"]["kvq_torch"] == want


@pytest.mark.engine
def test_the_server_prefills_as_the_recipe_says_unless_kvq_prefill_overrides(tmp_path):
    from bench.models import tiny_llama
    from engine_runs import run_engine

    recipe = tiny_recipe(tmp_path, prefill="paged")
    prompt = ["one two three four five " * 30]
    for env, want in (({}, "paged"), ({"KVQ_PREFILL": "full"}, "full")):
        _, stats = run_engine(tiny_llama(), "kivimix", prompt, {"temperature": 0, "max_new_tokens": 4},
                              env={"KVQ_RECIPE": recipe, **env}, attention_backend="kvq_torch", max_total_tokens=16384)
        assert stats["config"]["prefill"] == want and stats["pages_quantized"] > 0


REFUSED = {
    "another model": (dict(key_bits=[3] * 30, value_bits=[2] * 30, layers=30, kv_heads=3, head_dim=64,
                           config_sha256="6f1339384eecc10d"), {},
                      "calibrated on another model.*layers 2 \\(the recipe's 30\\), "
                      "kv_heads 2 \\(the recipe's 3\\)"),
    "another config": (dict(key_bits=[3, 3], value_bits=[2, 2], config_sha256="0000000000000000"), {},
                       "config_sha256 [0-9a-f]{16} \\(the recipe's 0000000000000000\\)"),
    "no recipe": (None, {}, "kivimix serves a recipe's per-layer widths: set KVQ_RECIPE"),
    "unknown prefill": (dict(key_bits=[3, 3], value_bits=[2, 2], prefill="chunked"), {},
                        "\"prefill\": 'chunked'; choose one of full, paged"),
}


@pytest.mark.engine
@pytest.mark.parametrize("case", list(REFUSED))
def test_a_recipe_the_server_cannot_serve_is_refused_before_loading(tmp_path, monkeypatch, case):
    import sglang

    from bench.launch import engine_kwargs
    from bench.models import tiny_llama
    from sgl_kvq.errors import KVQConfigError

    recipe, flags, message = REFUSED[case]
    if recipe is None:
        monkeypatch.delenv("KVQ_RECIPE", raising=False)
    else:
        recipe = dict(recipe)
        fields = {k: recipe.pop(k) for k in ("prefill",) if k in recipe}  # written as is: Recipe() refuses them
        path = tiny_recipe(tmp_path, recipe.pop("key_bits"), recipe.pop("value_bits"), **recipe)
        Path(path).write_text(json.dumps({**json.loads(Path(path).read_text()), **fields}))
        monkeypatch.setenv("KVQ_RECIPE", path)
    with pytest.raises(KVQConfigError, match=message):
        sglang.Engine(**engine_kwargs(tiny_llama(), "kivimix", dtype="float32", mem_fraction_static=0.3,
                                      max_total_tokens=16384, attention_backend="kvq_torch", **flags))
