"""Recipes (sgl_kvq/recipe.py) and the kivimix dtype that serves them: loading and refusing files, the model binding,
the fingerprint, the per-layer pool (bytes per token, per-layer code tensors, pooled frames) and its writes."""

from __future__ import annotations

import json
import types

import pytest
import torch

from sgl_kvq.config import KVQConfigError, parse_kv_cache_dtype
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.layer_tensors import LayerTensors
from sgl_kvq.metadata.host import begin_batch
from sgl_kvq.model_check import check_hf_config
from sgl_kvq.pool_shape import PoolShape
from sgl_kvq.quant import kivi_page
from sgl_kvq.recipe import ModelBinding, Recipe, load_recipe, shipped

SMOLLM2 = types.SimpleNamespace(architectures=["LlamaForCausalLM"], num_hidden_layers=30, num_attention_heads=9,
                                num_key_value_heads=3, hidden_size=576, head_dim=64)


def _write(tmp_path, key_bits, value_bits, layers=None, name="r.json", prefill=None):
    layers = layers or len(key_bits)
    path = tmp_path / name
    path.write_text(Recipe(ModelBinding(layers, 2, 64, "0123456789abcdef"), tuple(key_bits),
                           tuple(value_bits), prefill=prefill).to_json())
    return str(path)


def test_shipped_recipes_load_by_name_and_report_their_mean_width():
    assert {"smollm2-2.5", "smollm2-3.0", "smollm2-3.25"} <= set(shipped())
    assert [load_recipe(f"smollm2-{t}").mean_bits for t in ("2.5", "3.0", "3.25")] == [2.5, 3.0, 3.25]


def test_kivimix_needs_a_recipe(monkeypatch):
    monkeypatch.delenv("KVQ_RECIPE", raising=False)
    with pytest.raises(KVQConfigError, match="kivimix serves a recipe.*KVQ_RECIPE.*smollm2-3.0"):
        parse_kv_cache_dtype("kivimix")


@pytest.mark.parametrize("text,match", [
    ("not json", "cannot be read"),
    (json.dumps({"format": "x"}), "is not a recipe"),
    (json.dumps({"format": "sgl_kvq recipe 1", "model": {"layers": 2}}), "cannot be read"),
])
def test_a_bad_recipe_file_is_refused_with_its_cause(tmp_path, monkeypatch, text, match):
    (tmp_path / "bad.json").write_text(text)
    monkeypatch.setenv("KVQ_RECIPE", str(tmp_path / "bad.json"))
    with pytest.raises(KVQConfigError, match=match):
        parse_kv_cache_dtype("kivimix")


def test_widths_and_layer_counts_are_checked(tmp_path, monkeypatch):
    with pytest.raises(KVQConfigError, match=r"widths \[5\]"):
        Recipe(ModelBinding(1, 2, 64, ""), (5,), (2,))
    with pytest.raises(KVQConfigError, match="1 key and 2 value widths for a model of 2 layers"):
        Recipe(ModelBinding(2, 2, 64, ""), (2,), (2, 2))
    monkeypatch.setenv("KVQ_RECIPE", str(tmp_path / "missing.json"))
    with pytest.raises(KVQConfigError, match="neither a file nor a shipped recipe; shipped: .*smollm2-2.5"):
        parse_kv_cache_dtype("kivimix")


def test_the_fingerprint_names_the_recipe(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQ_RECIPE", _write(tmp_path, (4, 1), (1, 3)))
    a = parse_kv_cache_dtype("kivimix")
    assert a.fingerprint.startswith("kivimix_G64_VG64_R64_rotate-values_zero-specache_recipe-")
    assert a.layer_bits(0) == (4, 1) and a.layer_bits(1) == (1, 3)
    monkeypatch.setenv("KVQ_RECIPE", _write(tmp_path, (4, 2), (1, 3), name="other.json"))
    assert parse_kv_cache_dtype("kivimix").fingerprint != a.fingerprint


def test_a_recipe_names_its_prefill_and_kvq_prefill_overrides_it(tmp_path, monkeypatch):
    monkeypatch.delenv("KVQ_PREFILL", raising=False)
    monkeypatch.setenv("KVQ_RECIPE", _write(tmp_path, (4, 1), (1, 3)))
    unnamed = parse_kv_cache_dtype("kivimix")
    assert unnamed.prefill == "full"
    monkeypatch.setenv("KVQ_RECIPE", _write(tmp_path, (4, 1), (1, 3), name="paged.json", prefill="paged"))
    paged = parse_kv_cache_dtype("kivimix")
    assert paged.prefill == "paged" and paged.params.recipe.prefill == "paged"
    assert paged.fingerprint == unnamed.fingerprint  # the prefill does not change the stored pages
    assert json.loads(open(paged.params.recipe.source).read())["prefill"] == "paged"
    monkeypatch.setenv("KVQ_PREFILL", "full")
    assert parse_kv_cache_dtype("kivimix").prefill == "full"
    assert [load_recipe(n).prefill for n in ("gemma3-2.6-w234", "smollm2-2.875-w234", "smollm2-2.5")] == \
        ["paged", "paged", None]  # docs/recipes.md, "Which prefill a recipe takes"


def test_a_recipe_naming_an_unknown_prefill_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    raw = json.loads(Recipe(ModelBinding(1, 2, 64, ""), (2,), (2,)).to_json())
    path.write_text(json.dumps({**raw, "prefill": "chunked"}))
    monkeypatch.setenv("KVQ_RECIPE", str(path))
    with pytest.raises(KVQConfigError, match="\"prefill\": 'chunked'; choose one of full, paged or leave it out"):
        parse_kv_cache_dtype("kivimix")


def test_a_recipe_for_another_model_is_refused(monkeypatch):
    monkeypatch.setenv("KVQ_RECIPE", "smollm2-3.0")
    cfg = parse_kv_cache_dtype("kivimix")
    check_hf_config(SMOLLM2, cfg)  # geometry alone: no local config.json to hash
    other = types.SimpleNamespace(**{**SMOLLM2.__dict__, "num_hidden_layers": 18, "num_key_value_heads": 1})
    with pytest.raises(KVQConfigError, match=r"another model.*layers 18 \(the recipe's 30\), kv_heads 1"):
        check_hf_config(other, cfg)


def test_a_recipe_for_the_same_geometry_but_another_config_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQ_RECIPE", "smollm2-3.0")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(KVQConfigError, match="config_sha256 .* \\(the recipe's 6f1339384eecc10d\\)"):
        check_hf_config(SMOLLM2, parse_kv_cache_dtype("kivimix"), model_path=str(tmp_path))


def test_bytes_per_token_follow_the_recipe(monkeypatch):
    """The pool's bytes per token are the calibration's for each shipped SmolLM2 recipe, and a recipe of one width
    throughout stores what that kivi width stores."""
    for target in ("2.5", "3.0", "3.25"):
        monkeypatch.setenv("KVQ_RECIPE", f"smollm2-{target}")
        recipe = load_recipe(f"smollm2-{target}")
        made = json.loads(open(recipe.source).read())["calibration"]["bytes_per_token"]
        assert PoolShape(30, 3, 64, 8, parse_kv_cache_dtype("kivimix")).base_bytes_per_token() == made


def test_each_layers_bytes_follow_its_widths(tmp_path, monkeypatch):
    """layer_base_bytes_per_token (the decode benchmark's bytes per layer): a wider layer stores more, the layers sum
    to the pool's bytes per token, and layers of one width store alike."""
    monkeypatch.setenv("KVQ_RECIPE", _write(tmp_path, (4, 1, 4), (2, 1, 2)))
    shape = PoolShape(3, 2, 64, 8, parse_kv_cache_dtype("kivimix"))
    per_layer = shape.layer_base_bytes_per_token()
    assert per_layer[0] == per_layer[2] > per_layer[1] and sum(per_layer) == shape.base_bytes_per_token()


def test_a_uniform_recipe_stores_what_its_kivi_width_stores(tmp_path, monkeypatch):
    monkeypatch.setenv("KVQ_RECIPE", _write(tmp_path, (3, 3), (3, 3)))
    mix, kivi3 = (PoolShape(2, 2, 64, 8, parse_kv_cache_dtype(n)) for n in ("kivimix", "kivi3"))
    assert mix.uniform and mix.base_shapes() == kivi3.base_shapes()


@pytest.mark.parametrize("pooled", [False, True])
def test_each_layer_is_stored_and_read_at_its_widths(tmp_path, monkeypatch, pooled):
    monkeypatch.setenv("KVQ_RECIPE", _write(tmp_path, (4, 1, 3), (1, 3, 2)))
    cfg = parse_kv_cache_dtype("kivimix")
    G, H, D = cfg.group_size, 2, 64
    shape = PoolShape(3, H, D, 47, cfg)  # 48 pages: 3 frames of 16 (the narrowest layer's 1-bit rows decide)
    assert not shape.uniform and shape.Dp == D // 8 and shape.pages_per_frame(torch.bfloat16) == 16
    store = QuantizedKVStore(cfg, shape, 2, torch.bfloat16, "cpu", frames_pooled=pooled)
    if pooled:
        store.frames.assign(1, [1, 2], store.ov_tag)
    assert isinstance(store.k_codes, LayerTensors)
    assert [tuple(store.k_codes[layer].shape) for layer in range(3)] == [(48 * G, H, 32), (48 * G, H, 8),
                                                                          (48 * G, H, 24)]
    assert store.base_bytes() == sum(t.numel() * t.element_size() for name in shape.base_names()
                                     for t in (getattr(store, name)[layer] for layer in range(3)))
    # one request writes two complete pages and a partial one; each layer packs them at its widths
    gen = torch.Generator().manual_seed(0)
    T = 2 * G + 5
    pages = torch.tensor([3, 5, 7])
    slots = (pages[:, None] * G + torch.arange(G)).reshape(-1)[:T]
    bw = begin_batch(store, slots, torch.ones(T, dtype=torch.int64), torch.arange(T), torch.tensor([T]))
    for layer in range(3):
        k, v = torch.randn(T, H, D, generator=gen), torch.randn(T, H, D, generator=gen)
        store.write_layer(layer, bw, k, v)
        kb, vb = cfg.layer_bits(layer)
        want = kivi_page.pack_pages(k[:2 * G].view(2, G, H, D).bfloat16().float(),
                                    v[:2 * G].view(2, G, H, D).bfloat16().float(), kb, shape.VG, v_bits=vb)
        view = store.layer_view(layer)
        assert (view.k_bits, view.v_bits) == (kb, vb)
        for n, page in enumerate(pages[:2].tolist()):
            rows = slice(page * G, (page + 1) * G)
            assert torch.equal(view.k_codes[rows], want.k_codes[n]) and torch.equal(view.v_codes[rows],
                                                                                     want.v_codes[n])
