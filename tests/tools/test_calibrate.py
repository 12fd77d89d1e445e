"""`sgl-kvq calibrate` (bench/calibrate.py): the simulated decode read, the byte count, the allocation, the command."""

from __future__ import annotations

import json

import pytest
import torch

from bench import calibrate as cal
from sgl_kvq.config import KVQConfig
from sgl_kvq.pool_shape import PoolShape


def test_the_read_mask_is_kvqs_decode_read():
    """Query t reads key j packed exactly when j's page ends before t's open page and the R / G pages before it."""
    r = cal.Reader({}, group_size=4, residual=4)
    m = cal.read_mask(16, r, "cpu")
    for t in range(16):
        assert m[t].nonzero().flatten().tolist() == list(range(4 * max(0, t // 4 - 1)))
    assert cal.first_read_position(r) == 8 and m[8, 0] and not m[7].any()


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_bytes_per_token_are_the_pools(bits):
    """The allocation's bytes at one width everywhere equal the served kivi pool's (PoolShape's accounting)."""
    L, H, D = 30, 3, 64
    widths = {(layer, kind): bits for layer in range(L) for kind in cal.KINDS}
    shape = PoolShape(L, H, D, 8, KVQConfig(method="kivi", bits=bits))
    assert cal.bytes_per_token(widths, H, D, cal.Reader(widths)) == pytest.approx(shape.base_bytes_per_token())


def test_allocation_meets_the_mean_width_at_the_least_measured_loss():
    sens = {(0, "k"): {2: 5.0, 3: 1.0, 4: 0.0}, (0, "v"): {2: 0.2, 3: 0.1, 4: 0.0},
            (1, "k"): {2: 0.3, 3: 0.2, 4: 0.0}, (1, "v"): {2: 0.1, 3: 0.05, 4: 0.0}}
    w = cal.allocate(sens, 3.0)
    assert sum(w.values()) / len(w) <= 3.0
    assert w[(0, "k")] == 4 and w[(0, "v")] == 2 and w[(1, "v")] == 2  # the sensitive key keeps its width
    assert cal.allocate(sens, 4.0) == {key: 4 for key in sens}
    with pytest.raises(ValueError, match="no allocation"):
        cal.allocate(sens, 1.5)


def test_the_simulated_read_is_the_model_and_quantizing_moves_it(tmp_path):
    """Nothing quantized, the simulated read gives the model's own logits; a 1-bit value layer moves them (not a key
    layer: the random model's attention is near uniform, so 1-bit keys move its KL by ~3e-8, float noise that differs
    between CPUs); the command writes a recipe for every layer at the mean width asked for."""
    from bench.cli import main
    from bench.eval.attention import load_model

    model, tok, _ = load_model("tiny")
    ids = torch.randint(5, 500, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        native = model(input_ids=ids).logits
    r = cal.Reader({}, group_size=16, residual=16)
    cal.install(model, r)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, native, rtol=1e-4, atol=1e-4)
    one_bit = cal.Reader({(1, "v"): 1}, group_size=16, residual=16)
    keep = cal.scored_positions(one_bit, ids.shape[1])
    assert keep.tolist() == list(range(32, 96))
    kl = cal.model_kl(model, ids, one_bit, native[:, keep])
    assert kl > 0
    # skipping the layers before the quantized one computes the same
    assert cal.model_kl(model, ids, one_bit, native[:, keep], cal.LayerOutputs(model, ids, keep)) == \
        pytest.approx(kl, rel=1e-4)
    # every other scored position: half the softmaxes, about the same KL
    half = cal.Reader(one_bit.widths, group_size=16, residual=16, stride=2)
    assert cal.model_kl(model, ids, half, native[:, cal.scored_positions(half, 96)]) == pytest.approx(kl, rel=0.5)
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--model", "tiny", "--tokens", "128", "--group-size", "16", "--residual", "16",
                 "--widths", "2,4", "--bits", "3", "--stride", "2", "--splits", "K4V2", "--json", str(out),
                 "--recipe-dir", str(tmp_path / "recipes")]) == 0
    res = json.loads(out.read_text())
    recipe = res["recipes"]["3-w24"]  # named for the widths it drew from
    L = res["model"]["layers"]
    assert len(recipe["k_bits"]) == len(recipe["v_bits"]) == L
    assert sum(recipe["k_bits"] + recipe["v_bits"]) / (2 * L) <= 3
    assert res["calibration"]["read_check_max_abs_logit_diff"] < 1e-3
    assert set(res["uniform"]) == {"kivi2", "kivi4"}
    split = res["splits"]["K4V2"]  # every layer's keys at 4 bits, values at 2: measured, and between the uniforms
    assert split["mean_bits"] == 3 and split["kl"] > 0
    assert res["uniform"]["kivi2"]["bytes_per_token"] < split["bytes_per_token"] < \
        res["uniform"]["kivi4"]["bytes_per_token"]
    # the recipe kivimix serves, bound to the model it was made on
    from sgl_kvq.recipe import load_recipe

    served = load_recipe(str(tmp_path / "recipes" / "tiny-3.0-w24.json"))
    assert (list(served.key_bits), list(served.value_bits)) == (recipe["k_bits"], recipe["v_bits"])
    assert served.model.layers == L and served.model.config_sha256 == res["model"]["config_sha256"]
    # another target from the same measurements, without the model: its KL predicted, not measured
    assert main(["calibrate", "--from-json", str(out), "--bits", "2.5", "--recipe-dir", str(tmp_path / "recipes")]) == 0
    again = json.loads(out.read_text())["recipes"]["2.5-w24"]
    assert again["kl"] is None and again["mean_bits"] <= 2.5 and again["predicted_kl"] >= recipe["predicted_kl"]
    assert load_recipe(str(tmp_path / "recipes" / "tiny-2.5-w24.json")).mean_bits == again["mean_bits"]
    # --widths narrows the measured widths: 2 only is every tensor at 2 bits
    assert main(["calibrate", "--from-json", str(out), "--widths", "2", "--bits", "3"]) == 0
    floor = json.loads(out.read_text())["recipes"]["3-w2"]
    assert set(floor["k_bits"] + floor["v_bits"]) == {2}
    # a fixed split from the same file, predicted; alone it allocates nothing; a width the file lacks is refused
    before = json.loads(out.read_text())["recipes"]
    assert main(["calibrate", "--from-json", str(out), "--splits", "k2v4"]) == 0
    after = json.loads(out.read_text())
    assert after["recipes"] == before and after["splits"]["K2V4"]["kl"] is None
    assert after["splits"]["K2V4"]["predicted_kl"] == pytest.approx(
        sum(s["2"] for key, s in after["sensitivity_kl"].items() if key[0] == "k")
        + sum(s["4"] for key, s in after["sensitivity_kl"].items() if key[0] == "v"))
    with pytest.raises(SystemExit, match="K3V2.*3"):
        main(["calibrate", "--from-json", str(out), "--splits", "K3V2"])
    with pytest.raises(SystemExit, match="K5V2 is not"):
        main(["calibrate", "--from-json", str(out), "--splits", "K5V2"])
