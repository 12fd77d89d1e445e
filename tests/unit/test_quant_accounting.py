"""Byte accounting across every format: only compact dtypes are stored, and the count is of those tensors."""

from __future__ import annotations

import pytest
import torch

from bench.quant.accounting import bits_per_element, breakdown, kivi_page_bits
from sgl_kvq.quant.compressed import CompressedKV
from bench.quant.gear import gear, gear_l
from bench.quant.kivi import fp16_baseline, kivi
from bench.quant.logquant import logquant
from bench.quant.per_token import per_token
from bench.quant.zipcache import zipcache

T, H, D = 150, 2, 16
_g = torch.Generator().manual_seed(0)
K, V, Q = torch.randn(T, H, D, generator=_g), torch.randn(T, H, D, generator=_g), torch.randn(T, 4, D, generator=_g)
KW = dict(group_size=32, value_group=16)
FORMATS = {
    "fp16": lambda: fp16_baseline(K, V),
    "kivi2": lambda: kivi(K, V, bits=2, residual=32, **KW),
    "kivi1": lambda: kivi(K, V, bits=1, residual=32, **KW),
    "kivi3": lambda: kivi(K, V, bits=3, residual=32, **KW),
    "per_token4": lambda: per_token(K, V, bits=4, residual=32, **KW),
    "gear": lambda: gear(K, V, residual=32, outlier_ratio=0.05, **KW),
    "gear_l": lambda: gear_l(K, V, residual=32, **KW),
    "zipcache": lambda: zipcache(K, V, Q, residual=32, **KW),
    "logquant": lambda: logquant(K, V, window=8, **KW),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_stored_tensor_is_compact_and_counted(name):
    c = FORMATS[name]()
    assert c.k_hat.shape == c.v_hat.shape == (T, H, D) and c.kept.shape == (T, H)
    for key, t in c.stored.items():
        assert key.startswith(("k.", "v.")), key
        assert t.dtype in (torch.uint8, torch.float16, torch.int32), (key, t.dtype)  # no fp32 sneaks in
    b = bits_per_element(c)
    total = sum(breakdown(c).values())
    assert b.total == pytest.approx(8 * total / (2 * T * H * D))
    assert 1 < b.total <= 16.5


def test_unnamed_stored_tensors_are_refused():
    c = fp16_baseline(K, V)
    bad = CompressedKV(c.k_hat, c.v_hat, {**c.stored, "scale": torch.zeros(3, dtype=torch.float16)}, c.kept)
    with pytest.raises(ValueError, match="k.\\* or v.\\*"):
        bits_per_element(bad)


def test_pool_page_formula():
    assert kivi_page_bits(2, 32, 64) == (3.0, 2.5)
    assert kivi_page_bits(4, 64, 128) == (4.5, 4.25)
