"""Property tests of the building blocks every format stands on: bit packing and the quantization error bounds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_kvq.quant import pack
from bench.quant.kivi import kivi, quantized_len

FAST = settings(max_examples=40, deadline=None)


@FAST
@given(bits=st.sampled_from([1, 2, 3, 4, 8]), lead=st.lists(st.integers(1, 5), min_size=0, max_size=3),
       chunks=st.integers(1, 9), seed=st.integers(0, 2**31 - 1))
def test_pack_round_trip_is_bit_exact(bits, lead, chunks, seed):
    n = chunks * (8 if bits == 3 else 8 // bits)  # a 3-bit row: its 1-bit plane is whole bytes
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (*lead, n), generator=g, dtype=torch.int32).to(torch.uint8)
    packed = pack.pack(codes, bits)
    assert packed.shape == (*lead, n * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(pack.unpack(packed, bits), codes)


def test_pack_layout_is_little_endian_in_the_byte():
    codes = torch.tensor([1, 0, 3, 2], dtype=torch.uint8)
    assert pack.pack(codes, 2).tolist() == [1 | 0 << 2 | 3 << 4 | 2 << 6]


def test_three_bit_rows_are_a_two_bit_plane_then_a_one_bit_plane():
    codes = torch.tensor([5, 0, 7, 2, 1, 6, 3, 4], dtype=torch.uint8)
    low, high = codes & 3, codes >> 2
    assert pack.pack(codes, 3).tolist() == pack.pack(low, 2).tolist() + pack.pack(high, 1).tolist()
    assert pack.packed_dim(64, 3) == 24 and pack.low_plane_bytes(64) == 16
    with pytest.raises(ValueError, match="multiple of 8"):
        pack.pack(torch.zeros(4, dtype=torch.uint8), 3)


def _slack(x: torch.Tensor) -> torch.Tensor:
    # scale and zero are fp16 (relative rounding 2**-11 each); codes are encoded against the fp16 values, so the
    # bound can only move by the rounding of the group's range ends
    return x.abs() * 2**-9 + 1e-5


def _bound(bits: int, lo: torch.Tensor, hi: torch.Tensor, specache: bool) -> torch.Tensor:
    if bits == 1:
        return (hi - lo) / (4 if specache else 2)
    return (hi - lo) / ((1 << bits) - 1) / 2  # scale / 2


@FAST
@given(bits=st.sampled_from([1, 2, 3, 4]), specache=st.booleans(), T=st.integers(1, 150),
       G=st.sampled_from([8, 16, 32]), windows=st.integers(0, 2), H=st.integers(1, 3),
       D=st.sampled_from([8, 16, 32]), magnitude=st.floats(1e-3, 1e3), seed=st.integers(0, 2**31 - 1))
def test_kivi_error_is_within_half_a_step(bits, specache, T, G, windows, H, D, magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, H, D, generator=g) * magnitude + torch.randn(1, H, D, generator=g) * magnitude
    v = torch.randn(T, H, D, generator=g) * magnitude
    vg = 8
    c = kivi(k, v, bits=bits, group_size=G, value_group=vg, residual=windows * G, specache_one_bit=specache)
    n = quantized_len(T, G, windows * G)
    # keys: per channel over each page of G tokens
    kp = k[:n].reshape(n // G, G, H, D)
    lo, hi = kp.amin(1, keepdim=True), kp.amax(1, keepdim=True)
    err = (c.k_hat[:n].reshape(kp.shape) - kp).abs()
    assert (err <= _bound(bits, lo, hi, specache) + _slack(kp.abs().amax(1, keepdim=True))).all()
    # values: per token over groups of VG channels
    vp = v[:n].reshape(n, H, D // vg, vg)
    lo, hi = vp.amin(-1, keepdim=True), vp.amax(-1, keepdim=True)
    err = (c.v_hat[:n].reshape(vp.shape) - vp).abs()
    assert (err <= _bound(bits, lo, hi, specache) + _slack(vp.abs().amax(-1, keepdim=True))).all()
    # the rest (window pages, open page, or all of a short sequence) is an exact fp16 copy
    assert torch.equal(c.k_hat[n:], k[n:].half().float()) and torch.equal(c.v_hat[n:], v[n:].half().float())


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("specache", [True, False])
def test_constant_groups_come_back_up_to_fp16_rounding(bits, specache):
    # keys constant along tokens (one value per channel) and values constant along channels
    k = torch.linspace(-3, 5, 32).reshape(1, 2, 16).expand(64, 2, 16).contiguous()
    v = torch.linspace(-2, 2, 128).reshape(64, 2, 1).expand(64, 2, 16).contiguous()
    c = kivi(k, v, bits=bits, group_size=32, value_group=16, residual=0, specache_one_bit=specache)
    # exact up to the fp16 rounding of the stored zero, plus at most `levels` steps of the 1e-6 floor scale that
    # uniform.py gives a constant group (the fp32 - fp16 difference can still round to a nonzero code)
    for x_hat, x in ((c.k_hat, k), (c.v_hat, v)):
        assert ((x_hat - x).abs() <= x.abs() * 2**-11 + 16e-6).all()


def test_specache_one_bit_beats_plain_min_max_on_gaussian_data():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(512, 2, 64, generator=g), torch.randn(512, 2, 64, generator=g)
    spec = kivi(k, v, bits=1, residual=0)
    plain = kivi(k, v, bits=1, residual=0, specache_one_bit=False)
    assert (spec.k_hat - k).norm() < 0.75 * (plain.k_hat - k).norm()
    assert (spec.v_hat - v).norm() < 0.75 * (plain.v_hat - v).norm()
