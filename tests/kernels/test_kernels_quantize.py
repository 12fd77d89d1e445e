"""Quantize-and-pack and overlay-write kernels vs the torch reference: bit-exact codes and fp16 scales."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton import (tests/conftest.py does the same)

import pytest  # noqa: E402

from sgl_kvq.kernels.quantize_pages import quantize_pages  # noqa: E402
from sgl_kvq.attention_rotation import HeadRotation, basis  # noqa: E402
from sgl_kvq.kernels.store_overlay import store_overlay  # noqa: E402
from sgl_kvq.plan import LayerKV  # noqa: E402
from sgl_kvq.quant import kivi_page  # noqa: E402
from sgl_kvq.quant.pack import packed_dim  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
CODE_POISON = 0xA5  # a packed byte the test pages never hold in full rows: checked below via exact equality


def empty_layer(num_pages, G, H, D, bits, VG, frames=4, dtype=torch.float16, v_bits=None) -> LayerKV:
    v_bits = v_bits or bits
    P, S = num_pages + 1, (num_pages + 1) * G
    nan16 = dict(dtype=torch.float16, device=DEVICE)
    return LayerKV(
        k_codes=torch.full((S, H, packed_dim(D, bits)), CODE_POISON, dtype=torch.uint8, device=DEVICE),
        k_scale=torch.full((P, H, D), float("nan"), **nan16), k_zero=torch.full((P, H, D), float("nan"), **nan16),
        v_codes=torch.full((S, H, packed_dim(D, v_bits)), CODE_POISON, dtype=torch.uint8, device=DEVICE),
        v_scale=torch.full((S, H, D // VG), float("nan"), **nan16),
        v_zero=torch.full((S, H, D // VG), float("nan"), **nan16),
        ov_k=torch.full((frames, G, H, D), float("nan"), dtype=dtype, device=DEVICE),
        ov_v=torch.full((frames, G, H, D), float("nan"), dtype=dtype, device=DEVICE),
        k_bits=bits, v_bits=v_bits,
    )


def assert_pages_equal(kv: LayerKV, dst: list[int], ref: kivi_page.PackedPages, G: int) -> None:
    for n, page in enumerate(dst):
        slots = slice(page * G, (page + 1) * G)
        assert torch.equal(kv.k_codes[slots].cpu(), ref.k_codes[n].cpu()), f"k_codes page {page}"
        assert torch.equal(kv.v_codes[slots].cpu(), ref.v_codes[n].cpu()), f"v_codes page {page}"
        assert torch.equal(kv.k_scale[page].cpu(), ref.k_scale[n].cpu()), f"k_scale page {page}"
        assert torch.equal(kv.k_zero[page].cpu(), ref.k_zero[n].cpu()), f"k_zero page {page}"
        assert torch.equal(kv.v_scale[slots].cpu(), ref.v_scale[n].cpu()), f"v_scale page {page}"
        assert torch.equal(kv.v_zero[slots].cpu(), ref.v_zero[n].cpu()), f"v_zero page {page}"


def assert_untouched(kv: LayerKV, dst: list[int], G: int) -> None:
    keep = torch.ones(kv.k_scale.shape[0], dtype=torch.bool)
    keep[dst] = False
    slots = keep.repeat_interleave(G)
    assert (kv.k_codes.cpu()[slots] == CODE_POISON).all() and (kv.v_codes.cpu()[slots] == CODE_POISON).all()
    assert kv.k_scale.cpu()[keep].isnan().all() and kv.v_scale.cpu()[slots].isnan().all()


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("G,H,D,VG", [(16, 2, 64, 64), (32, 1, 128, 32), (64, 2, 64, 16)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_pages_bit_exact(bits, G, H, D, VG, dtype):
    gen = torch.Generator().manual_seed(bits * 1000 + G + D)
    N = 3
    k = (torch.randn(N, G, H, D, generator=gen) * 2).to(dtype)
    v = torch.randn(N, G, H, D, generator=gen).to(dtype)
    k[0, :, 0, 0] = 0.75  # a constant key channel: scale falls back to the tiny floor
    v[1, 2, 0, :VG] = -1.25  # a constant value group
    dst = [5, 1, 3]
    kv = empty_layer(6, G, H, D, bits, VG)
    quantize_pages(k.to(DEVICE), v.to(DEVICE), torch.tensor(dst, dtype=torch.int32, device=DEVICE), kv)
    assert_pages_equal(kv, dst, kivi_page.pack_pages(k, v, bits, VG), G)
    assert_untouched(kv, dst, G)


@pytest.mark.parametrize("k_bits,v_bits", [(4, 1), (3, 2), (1, 3)])
def test_quantize_pages_key_and_value_widths_differ(k_bits, v_bits):
    # A recipe's layer (kivimix): keys and values packed at their own widths, each into its own code rows.
    G, H, D, VG = 16, 2, 64, 32
    gen = torch.Generator().manual_seed(k_bits * 10 + v_bits)
    k, v = torch.randn(2, G, H, D, generator=gen) * 2, torch.randn(2, G, H, D, generator=gen)
    kv = empty_layer(4, G, H, D, k_bits, VG, v_bits=v_bits)
    quantize_pages(k.to(DEVICE), v.to(DEVICE), torch.tensor([3, 1], dtype=torch.int32, device=DEVICE), kv)
    assert_pages_equal(kv, [3, 1], kivi_page.pack_pages(k, v, k_bits, VG, v_bits=v_bits), G)
    assert_untouched(kv, [3, 1], G)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_quantize_rounds_half_to_even(bits):
    # Channel values 0..L and the halves between them: with scale 1 and zero 0 every half is an exact tie, where
    # torch.round (half to even) and floor(x + 0.5) disagree.
    G, H, D = 16, 1, 64
    L = (1 << bits) - 1
    col = torch.tensor([0.0, float(L)] + [i + 0.5 for i in range(L)] * 8)[:G]
    k = col[None, :, None, None].expand(1, G, H, D).contiguous()
    v = torch.arange(D, dtype=torch.float32).remainder(L + 1).add(0.5).clamp(max=L)
    v[0], v[1] = 0.0, float(L)
    v = v.expand(1, G, H, D).contiguous()
    kv = empty_layer(2, G, H, D, bits, VG=D, dtype=torch.float32)
    quantize_pages(k.to(DEVICE), v.to(DEVICE), torch.tensor([2], dtype=torch.int32, device=DEVICE), kv)
    ref = kivi_page.pack_pages(k, v, bits, D)
    assert_pages_equal(kv, [2], ref, G)


def fill_frames(kv: LayerKV, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    kv.ov_k.copy_(torch.randn(kv.ov_k.shape, generator=gen).to(kv.ov_k.dtype))
    kv.ov_v.copy_(torch.randn(kv.ov_v.shape, generator=gen).to(kv.ov_v.dtype))


@pytest.mark.parametrize("bits", [2, 3])
def test_quantize_pages_from_overlay_frames(bits):
    G, H, D, VG = 32, 2, 64, 32
    kv = empty_layer(4, G, H, D, bits, VG, frames=5)
    fill_frames(kv, seed=7)
    frames, dst = [4, 0], [2, 4]
    quantize_pages(kv.ov_k, kv.ov_v, torch.tensor(dst, device=DEVICE), kv,
                   src_ids=torch.tensor(frames, device=DEVICE))
    ref = kivi_page.pack_pages(kv.ov_k[frames].cpu(), kv.ov_v[frames].cpu(), bits, VG)
    assert_pages_equal(kv, dst, ref, G)
    assert_untouched(kv, dst, G)


def test_destination_page_zero_is_skipped():
    """A decode batch passes page 0 (SGLang's dummy page) for rows that complete no page: nothing is written."""
    G, H, D, VG, bits = 16, 2, 64, 64, 2
    kv = empty_layer(3, G, H, D, bits, VG, frames=3)
    fill_frames(kv, seed=5)
    quantize_pages(kv.ov_k, kv.ov_v, torch.tensor([0, 2, 0], device=DEVICE), kv,
                   src_ids=torch.tensor([0, 1, 2], device=DEVICE))
    assert_pages_equal(kv, [2], kivi_page.pack_pages(kv.ov_k[[1]].cpu(), kv.ov_v[[1]].cpu(), bits, VG), G)
    assert_untouched(kv, [2], G)  # page 0 included


def test_quantize_pages_rejects_wrong_layout():
    kv = empty_layer(2, 16, 1, 64, 2, 64)
    k = torch.zeros(1, 16, 1, 32, device=DEVICE)  # wrong head_dim
    with pytest.raises(ValueError, match="must be"):
        quantize_pages(k, k, torch.tensor([1], device=DEVICE), kv)


@pytest.mark.parametrize("src_dtype,ov_dtype", [(torch.float32, torch.float16), (torch.float16, torch.float16)])
def test_store_overlay_scatter(src_dtype, ov_dtype):
    G, H, D = 16, 3, 64
    kv = empty_layer(1, G, H, D, 4, 64, frames=3, dtype=ov_dtype)
    gen = torch.Generator().manual_seed(3)
    T = 5
    k = torch.randn(T, H, D, generator=gen).to(src_dtype)
    v = torch.randn(T, H, D, generator=gen).to(src_dtype)
    frames = torch.tensor([2, 0, 2, 1, 0])
    offsets = torch.tensor([0, 15, 7, 3, 0])
    store_overlay(k.to(DEVICE), v.to(DEVICE), frames.to(DEVICE), offsets.to(DEVICE), kv)
    want_k = torch.full(kv.ov_k.shape, float("nan"), dtype=ov_dtype)
    want_v = want_k.clone()
    want_k[frames, offsets] = k.to(ov_dtype)
    want_v[frames, offsets] = v.to(ov_dtype)
    torch.testing.assert_close(kv.ov_k.cpu(), want_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(kv.ov_v.cpu(), want_v, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("H,D", [(3, 64), (1, 16), (8, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])  # bf16 rows meet the dot in fp32
def test_store_overlay_stores_rotated_values(H, D, dtype):
    """v_rotation R: each value row is stored as v @ R (KVQ_ROTATE=values fused into the decode write), equal to the
    boundary rotation (attention_rotation.HeadRotation: fp32 product, rounded once); keys are stored as given."""
    G = 16
    kv = empty_layer(1, G, H, D, 4, min(D, 64), frames=3, dtype=dtype)
    gen = torch.Generator().manual_seed(H * D)
    T = 4
    k = torch.randn(T, H, D, generator=gen).to(dtype)
    v = torch.randn(T, H, D, generator=gen).to(dtype)
    frames = torch.tensor([2, 0, 1, 0])
    offsets = torch.tensor([0, 15, 3, 1])
    r = basis("values", D)
    store_overlay(k.to(DEVICE), v.to(DEVICE), frames.to(DEVICE), offsets.to(DEVICE), kv, v_rotation=r.to(DEVICE))
    want_v = HeadRotation(r, keys=False).into(v)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]  # a rounding of one ulp
    torch.testing.assert_close(kv.ov_v.cpu()[frames, offsets].float(), want_v.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(kv.ov_k.cpu()[frames, offsets], k, rtol=0, atol=0)
