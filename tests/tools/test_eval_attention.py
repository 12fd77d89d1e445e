"""Attention-fidelity evaluation on the tiny random Llama (fast), and on SmolLM2 (slow)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from bench.commands import eval_attention
from bench.eval import attention
from slices import matrix_only

EXPECTED = {"fp16", "per-token-2", "kivi4", "kivi2", "kivi1", "kivi1-plain", "gear-l-2", "gear-2", "zipcache",
            "zipcache-0.6", "logquant-2", "logquant-2-w21",
            "kivi3", "kivi2-had", "kivi3-had", "kivi4-had",  # KIVI at 3 bits, KIVI in a Hadamard basis
            "fp8_e4m3", "fp4_mx_block16", "nvfp4", "nvfp4-gs1",  # SGLang's KV formats (sgl_kvq.formats.peers.reference)
            "int4-pth-asym", "int4-pth-sym", "tq3", "tq4", "tq-3bit-nc", "tq-4bit-nc", "tq-k8v4",  # vLLM's
            "specache1", "specache2"}  # SpeCache's read at its served top-k (tools/eval/specache.py)
# ... and each of ours (but the per-token baseline) with its values in the Hadamard basis (KVQ_ROTATE=values)
EXPECTED |= {f"{m}-hadv" for m in ("kivi4", "kivi2", "kivi1", "kivi1-plain", "gear-l-2", "gear-2", "zipcache",
                                   "zipcache-0.6", "logquant-2", "logquant-2-w21", "kivi3", "specache1", "specache2")}
# ... and each shipped recipe's per-layer widths (kivimix:KVQ_RECIPE=NAME), plain and values-rotated
EXPECTED |= {f"kivimix-{n}{r}" for n in ("smollm2-2.5", "smollm2-2.875", "smollm2-2.875-w234", "smollm2-3.0",
                                         "smollm2-3.25", "gemma3-2.4", "gemma3-2.6", "gemma3-2.6-w234", "gemma3-2.7",
                                         "gemma3-3.0")
             for r in ("", "-hadv")}
# ... and SpeCache's read over a device copy whose keys and values differ in width
EXPECTED |= {f"specache-{s}{r}" for s in ("K1V2", "K2V1") for r in ("", "-hadv")}


def _args(tmp_path, model, *extra):
    p = argparse.ArgumentParser()
    eval_attention.add_arguments(p)
    return p.parse_args(["--model", model, "--json", str(tmp_path / "out.json"),
                         "--markdown", str(tmp_path / "out.md"), *extra])


def test_causal_attention_matches_sdpa_with_gqa():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(40, 6, 8, generator=g), torch.randn(40, 2, 8, generator=g), torch.randn(40, 2, 8, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(3, 1).transpose(0, 1), v.repeat_interleave(3, 1).transpose(0, 1),
        is_causal=True).transpose(0, 1)
    out, mass = attention.causal_attention(q, k, v, 8 ** -0.5, kept=[torch.ones(40, 2, dtype=torch.bool),
                                                                     torch.zeros(40, 2, dtype=torch.bool)],
                                           tail=5, chunk=16)
    assert torch.allclose(out, want, atol=1e-5)
    assert mass.tolist() == pytest.approx([1.0, 0.0])


@pytest.mark.parametrize("window", [1, 7, 16, 39, 40, 100])
def test_sliding_window_attention_matches_sdpa_with_a_band_mask(window):
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(40, 4, 8, generator=g), torch.randn(40, 2, 8, generator=g), torch.randn(40, 2, 8, generator=g)
    i, j = torch.arange(40)[:, None], torch.arange(40)[None, :]
    band = (j <= i) & (j > i - window)  # HF's sliding_window: query i sees i - window + 1 .. i
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=band).transpose(0, 1)
    got = attention.causal_attention(q, k, v, 8 ** -0.5, chunk=16, window=window)
    assert torch.allclose(got, want, atol=1e-5)
    if window >= 40:  # a window as wide as the sequence is plain causal attention
        assert torch.allclose(got, attention.causal_attention(q, k, v, 8 ** -0.5), atol=1e-6)


def test_gemma3_capture_applies_the_head_norms_and_each_layers_window():
    # a tiny random Gemma 3: layer 0 slides over 24 tokens, layer 1 attends to all; q_norm/k_norm precede RoPE
    from bench.models import tiny_gemma3

    model, tok, _ = attention.load_model(str(tiny_gemma3(24, ("sliding_attention", "full_attention"))))
    ids = tok("the quick brown fox jumps over the lazy dog " * 8, return_tensors="pt").input_ids[:, :80]
    layers = attention.capture(model, ids, [0, 1])
    assert layers[0].window == 24 and layers[1].window is None
    for layer in layers.values():
        out = attention.causal_attention(layer.q, layer.k, layer.v, layer.sm_scale, window=layer.window)
        assert attention.rel_err(out, layer.out) < 1e-5
    sliding = layers[0]
    assert attention.rel_err(attention.causal_attention(sliding.q, sliding.k, sliding.v, sliding.sm_scale),
                             sliding.out) > 1e-3  # the window matters at 80 tokens
    res = attention.evaluate(layers, eval_attention.select_methods(attention.methods(16, 16, 16), "kivi2,specache2",
                                                                   attention.REFERENCE), tail=16)
    assert res["capture_check"]["max_rel_err"] < 1e-5
    assert 0 < res["methods"]["specache2"]["attn_err"] < res["methods"]["kivi2"]["attn_err"]


def test_tiny_llama_capture_reproduces_the_model_and_reports_every_method(tmp_path):
    args = _args(tmp_path, "tiny", "--tokens", "96", "--group-size", "16", "--residual", "16", "--tail", "16")
    assert eval_attention.run(args) == 0
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["capture_check"]["max_rel_err"] < 1e-5 and len(res["capture_check"]["per_layer"]) == 2
    assert set(res["methods"]) == EXPECTED and res["tokens"] == 96
    m = res["methods"]
    assert m["fp16"]["attn_err"] == 0.0 and m["fp16"]["bits"] == 16.0 and m["fp16"]["kept_mass"] == pytest.approx(1)
    assert m["kivi4"]["attn_err"] < m["kivi2"]["attn_err"] < m["kivi1-plain"]["attn_err"]
    assert m["kivi4"]["bits"] > m["kivi2"]["bits"] > m["kivi1"]["bits"]
    assert m["kivi2-hadv"]["bits"] == m["kivi2"]["bits"] and m["kivi2-hadv"]["k_err"] == m["kivi2"]["k_err"]
    # a split SpeCache copy stores its keys as the narrower dtype does and its values as the wider one
    split, one, two = m["specache-K1V2"], m["specache1"], m["specache2"]
    assert (split["bits_k"], split["k_err"]) == (one["bits_k"], one["k_err"])
    assert (split["bits_v"], split["v_err"]) == (two["bits_v"], two["v_err"])
    assert m["kivi2-hadv"]["v_err"] != m["kivi2"]["v_err"]  # the keys as they are, the values another basis's
    assert "| kivi2 |" in (tmp_path / "out.md").read_text()


def test_capture_is_the_tensors_the_model_attends_with():
    # perturb one captured key: causal attention no longer reproduces the model's own output
    model, tok, _ = attention.load_model("tiny")
    ids = tok("the quick brown fox jumps over the lazy dog " * 4, return_tensors="pt").input_ids[:, :40]
    layer = attention.capture(model, ids, [1])[1]
    ok = attention.causal_attention(layer.q, layer.k, layer.v, layer.sm_scale)
    assert attention.rel_err(ok, layer.out) < 1e-5
    k = layer.k.clone()
    k[3] += 1.0
    assert attention.rel_err(attention.causal_attention(layer.q, k, layer.v, layer.sm_scale), layer.out) > 1e-3


def test_method_subset_keeps_the_reference_and_table_order(tmp_path):
    table = attention.methods()
    assert list(eval_attention.select_methods(table, "tq3, kivi3", "fp16")) == ["fp16", "kivi3", "tq3"]
    assert eval_attention.select_methods(table, None, "fp16") is table
    with pytest.raises(SystemExit, match="unknown methods"):
        eval_attention.select_methods(table, "kivi5", "fp16")
    args = _args(tmp_path, "tiny", "--tokens", "64", "--group-size", "16", "--residual", "16", "--tail", "16",
                 "--methods", "kivi3,fp4_mx_block16")
    assert eval_attention.run(args) == 0
    res = json.loads((tmp_path / "out.json").read_text())
    assert list(res["methods"]) == ["fp16", "kivi3", "fp4_mx_block16"] and res["model_layers"] == 2
    assert "| bytes/token |" in (tmp_path / "out.md").read_text()


def test_a_recipe_quantizes_each_layer_at_its_own_key_and_value_widths():
    from bench.quant.kivi_bits import kivi_bits

    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(200, 3, 64, generator=g), torch.randn(200, 3, 64, generator=g)
    method = attention.recipe_method("smollm2-2.5")  # layer 0: K1 V1, layer 1: K3 V2
    for layer, (kb, vb) in ((0, (1, 1)), (1, (3, 2))):
        got = method.at(layer)(k, v, None, 1.0)
        assert torch.equal(got.k_hat, kivi_bits(k, v, bits=kb).k_hat)
        assert torch.equal(got.v_hat, kivi_bits(k, v, bits=vb).v_hat)
    assert attention.DTYPE_METHODS["kivimix:KVQ_RECIPE=smollm2-2.5"] == "kivimix-smollm2-2.5-hadv"


def test_a_per_layer_method_is_evaluated_at_each_layers_index():
    from bench.quant.kivi import kivi

    model, tok, _ = attention.load_model("tiny")
    ids = tok("the quick brown fox jumps over the lazy dog " * 8, return_tensors="pt").input_ids[:, :96]
    captured = attention.capture(model, ids, [0, 1])
    kv = dict(group_size=16, value_group=16, residual=16)
    table = {"fp16": attention.methods()["fp16"],
             "k4": lambda k, v, q, s: kivi(k, v, bits=4, **kv), "k1": lambda k, v, q, s: kivi(k, v, bits=1, **kv),
             "mix": attention.ByLayer(lambda i: (lambda k, v, q, s: kivi(k, v, bits=4 if i == 0 else 1, **kv)))}
    res = attention.evaluate(captured, table, tail=16)["methods"]
    err = {n: res[n]["per_layer"]["attn_err"] for n in ("k4", "k1", "mix")}
    assert err["mix"] == [err["k4"][0], err["k1"][1]] and err["k4"][0] < err["k1"][0]


def test_layer_spec():
    assert eval_attention.parse_layers("0,3-5", 30) == [0, 3, 4, 5]
    assert eval_attention.parse_layers(None, 3) == [0, 1, 2]
    with pytest.raises(SystemExit):
        eval_attention.parse_layers("31", 30)


@pytest.mark.slow
@matrix_only("a measurement (`sgl-kvq eval attention`, 58 s); the tests above check its parts offline")
def test_smollm2_two_layers(tmp_path):
    args = _args(tmp_path, "smollm2", "--tokens", "512", "--layers", "0,29")
    assert eval_attention.run(args) == 0
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["shape"] == {"q_heads": 9, "kv_heads": 3, "head_dim": 64}
    assert res["capture_check"]["max_rel_err"] < 1e-4 and set(res["methods"]) == EXPECTED
