"""Decode / extend attention kernels and the split merge vs the torch references, on the SAME quantized pool.

Tolerances are the kernels' own arithmetic error only (quantization error is the reference's too):
fp32 ~1e-5, fp16 ~1e-3, bf16 (CUDA only: bf16 tl.dot is broken in the Triton interpreter) ~1e-2.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton import (tests/conftest.py does the same)

import pytest  # noqa: E402

from sgl_kvq.attention_ref import ref_decode, ref_extend  # noqa: E402
from sgl_kvq.kernels import decode_attention as dec  # noqa: E402
from sgl_kvq.kernels.extend_attention import extend_attention  # noqa: E402
from sgl_kvq.attention_rotation import basis  # noqa: E402
from sgl_kvq.kernels.merge_state import merge_state  # noqa: E402
from sgl_kvq.formats.gear import GearParams  # noqa: E402
from sgl_kvq.formats.logquant import LogQuantParams  # noqa: E402
from sgl_kvq.formats.zipcache import ZipCacheParams  # noqa: E402
from kernel_checks import DEVICE, DTYPES, assert_close_written, to_device  # noqa: E402
from paged_pool import make_pool  # noqa: E402
from slices import ci_slice, covering_pairs  # noqa: E402


# (G, H, group, D, VG, requests as (base tokens, overlay tokens)); base tokens are whole pages whenever the request
# has overlay frames (only a context's last page may be partial).
CASES = {
    "G16-mha-odd": (16, 2, 1, 64, 64, [(0, 5), (48, 13), (160, 16), (37, 0)]),
    "G32-gqa3-d128": (32, 1, 3, 128, 32, [(0, 40), (64, 1), (95, 0)]),
    "G64-gqa4-short": (64, 2, 4, 64, 16, [(128, 73), (0, 3), (61, 0)]),
    "G16-gqa4-d256": (16, 1, 4, 256, 64, [(32, 10), (17, 0)]),
}


@pytest.mark.parametrize("case,dtype", covering_pairs(list(CASES), DTYPES))
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_decode_matches_reference(case, bits, dtype):
    G, H, group, D, VG, reqs = CASES[case]
    kv, paged = make_pool(G, H, D, VG, bits, reqs, dtype, seed=bits)
    q = torch.randn(len(reqs), H * group, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    sm_scale = D ** -0.5
    ref = ref_decode(q, kv, paged, sm_scale)
    # min_pages_per_split=1 and 3 splits: requests get 1..3 splits, some with an empty last split
    p = dec.plan(to_device(paged), num_qo_heads=H * group, num_kv_heads=H, head_dim=D, page_size=G,
                 max_splits=3, min_pages_per_split=1)
    p.o_partial.fill_(float("nan"))
    p.lse_partial.fill_(float("nan"))
    out = torch.full_like(q, float("nan"), device=DEVICE)
    dec.decode_attention(q.to(DEVICE), to_device(kv), p, sm_scale, out=out)
    assert_close_written(out, ref, dtype)


def test_decode_one_split_equals_many():
    G, H, group, D, VG, reqs = CASES["G16-mha-odd"]
    kv, paged = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=5)
    kv, paged = to_device(kv), to_device(paged)
    q = torch.randn(len(reqs), H * group, D, device=DEVICE)
    outs = []
    for splits in (1, 4):
        p = dec.plan(paged, num_qo_heads=H, num_kv_heads=H, head_dim=D, page_size=G, max_splits=splits,
                     min_pages_per_split=1)
        assert int(p.num_splits.max()) == min(splits, 10)
        lse = torch.full((len(reqs), H), float("nan"), device=DEVICE)
        outs.append((dec.run(q, kv, p, 0.125, lse_out=lse), lse))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)


def test_decode_rejects_plan_for_other_pool():
    G, H, group, D, VG, reqs = CASES["G16-mha-odd"]
    kv, paged = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=5)
    p = dec.plan(to_device(paged), num_qo_heads=2 * H, num_kv_heads=H, head_dim=D, page_size=G)
    with pytest.raises(ValueError, match="q must be"):
        dec.run(torch.zeros(len(reqs), H, D, device=DEVICE), to_device(kv), p, 0.125)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_merge_state_matches_logsumexp(splits):
    gen = torch.Generator().manual_seed(splits)
    B, H, D = 3, 2, 64
    o = torch.randn(B, H, splits, D, generator=gen)
    lse = torch.randn(B, H, splits, generator=gen) * 3
    ns = torch.tensor([splits, max(1, splits - 1), 1], dtype=torch.int32)
    if splits > 1:
        lse[0, :, -1] = float("-inf")  # an empty split inside num_splits (what decode writes for one)
        o[0, :, -1] = 0.0
    want_o = torch.empty(B, H, D)
    want_lse = torch.empty(B, H)
    for b in range(B):
        s = int(ns[b])
        want_lse[b] = torch.logsumexp(lse[b, :, :s], dim=-1)
        w = torch.softmax(lse[b, :, :s], dim=-1)
        want_o[b] = (w[..., None] * o[b, :, :s]).sum(1)
        o[b, :, s:] = float("nan")  # splits past num_splits must never be read
        lse[b, :, s:] = float("nan")
    got_lse = torch.full((B, H), float("nan"), device=DEVICE)
    got = merge_state(o.to(DEVICE), lse.to(DEVICE), ns.to(DEVICE), lse_out=got_lse)
    torch.testing.assert_close(got.cpu(), want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse.cpu(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("D", [16, 64, 128])
def test_merge_state_writes_the_rotated_row(D):
    """out_rotation RT: the merged row o is written as o @ RT (KVQ_ROTATE=values undone by the merge), equal to the
    plain merge rotated in fp32, in the output's dtype."""
    gen = torch.Generator().manual_seed(D)
    B, H, S = 3, 4, 3
    o = torch.randn(B, H, S, D, generator=gen)
    lse = torch.randn(B, H, S, generator=gen)
    ns = torch.tensor([3, 2, 1], dtype=torch.int32)
    rt = basis("values", D).T.contiguous()
    plain = merge_state(o.to(DEVICE), lse.to(DEVICE), ns.to(DEVICE)).cpu()
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        out = torch.empty(B, H, D, dtype=dtype, device=DEVICE)
        got = merge_state(o.to(DEVICE), lse.to(DEVICE), ns.to(DEVICE), out=out, out_rotation=rt.to(DEVICE))
        torch.testing.assert_close(got.cpu().float(), plain @ rt, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="rotation must be"):
        merge_state(o.to(DEVICE), lse.to(DEVICE), ns.to(DEVICE), out_rotation=rt[:8].to(DEVICE))


# (G, H, group, D, VG, requests as (base tokens, overlay tokens, new tokens))
EXTEND_CASES = {
    "G16-mha": (16, 2, 1, 64, 64, [(48, 13, 7), (0, 0, 20), (64, 0, 1), (0, 5, 70)]),
    "G32-gqa3-d128": (32, 1, 3, 128, 32, [(32, 0, 9), (0, 33, 25)]),
    "G64-gqa4": (64, 2, 4, 64, 16, [(64, 70, 17), (0, 0, 3), (0, 0, 0), (45, 0, 18)]),
}


@pytest.mark.parametrize("case,dtype", covering_pairs(list(EXTEND_CASES), DTYPES))
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_extend_matches_reference(case, bits, dtype):
    G, H, group, D, VG, reqs = EXTEND_CASES[case]
    kv, paged = make_pool(G, H, D, VG, bits, [(b, o) for b, o, _ in reqs], dtype, seed=10 + bits)
    gen = torch.Generator().manual_seed(2)
    qo_indptr = torch.tensor([0] + [n for _, _, n in reqs]).cumsum(0).int()
    N = int(qo_indptr[-1])
    q = torch.randn(N, H * group, D, generator=gen).to(dtype)
    k_new = (torch.randn(N, H, D, generator=gen) * 1.5).to(dtype)
    v_new = torch.randn(N, H, D, generator=gen).to(dtype)
    sm_scale = D ** -0.5
    ref = ref_extend(q, k_new, v_new, qo_indptr, kv, paged, sm_scale)
    out = torch.full_like(q, float("nan"), device=DEVICE)
    extend_attention(q.to(DEVICE), k_new.to(DEVICE), v_new.to(DEVICE), qo_indptr.to(DEVICE), to_device(kv),
                     to_device(paged), sm_scale, out=out)
    assert_close_written(out, ref, dtype)


# A recipe's layers (kivimix): keys and values at their own widths, each read at its own.
MIXED_WIDTHS = [(4, 1), (1, 3), (3, 2)]


@pytest.mark.parametrize("k_bits,v_bits", MIXED_WIDTHS)
@pytest.mark.parametrize("case", ["G16-mha-odd", "G32-gqa3-d128"])
def test_decode_with_key_and_value_widths_matches_reference(case, k_bits, v_bits):
    G, H, group, D, VG, reqs = CASES[case]
    # the frames lie apart as pooled frames over a recipe layer's codes do
    q, paged, ref = _check_decode_format(case, torch.float32, seed=k_bits, bits=k_bits, v_bits=v_bits,
                                         frame_gap=16 * k_bits, v_frame_gap=16 * v_bits)
    same, _ = make_pool(G, H, D, VG, k_bits, reqs, torch.float32, seed=k_bits)  # values at the keys' width
    assert not torch.allclose(ref, ref_decode(q, same, paged, D ** -0.5))


@pytest.mark.parametrize("k_bits,v_bits", MIXED_WIDTHS)
def test_extend_with_key_and_value_widths_matches_reference(k_bits, v_bits):
    _check_extend_format("G64-gqa4", seed=k_bits, bits=k_bits, v_bits=v_bits)


# Sliding windows (a query at position i sees i - W .. i): W = 0, ending mid base page, on a page boundary, in the
# overlay, inside the new tokens, wider than every context; every case's geometry, 2-bit pages, fp32.
WINDOWS = [0, 5, 16, 40, 200]


@pytest.mark.parametrize("case", ["G16-mha-odd", "G32-gqa3-d128"])
def test_decode_under_sliding_windows_matches_reference(case):
    G, H, group, D, VG, reqs = CASES[case]
    kv, paged = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=7)
    q = torch.randn(len(reqs), H * group, D, generator=torch.Generator().manual_seed(3))
    p = dec.plan(to_device(paged), num_qo_heads=H * group, num_kv_heads=H, head_dim=D, page_size=G,
                 max_splits=3, min_pages_per_split=1)
    for window in WINDOWS:
        out = torch.full_like(q, float("nan"), device=DEVICE)
        dec.decode_attention(q.to(DEVICE), to_device(kv), p, D ** -0.5, out=out, window=window)
        assert_close_written(out, ref_decode(q, kv, paged, D ** -0.5, window=window), torch.float32)


@pytest.mark.parametrize("case", ["G16-mha", "G64-gqa4"])
def test_extend_under_sliding_windows_matches_reference(case):
    G, H, group, D, VG, reqs = EXTEND_CASES[case]
    kv, paged = make_pool(G, H, D, VG, 2, [(b, o) for b, o, _ in reqs], torch.float32, seed=8)
    gen = torch.Generator().manual_seed(4)
    qo_indptr = torch.tensor([0] + [n for _, _, n in reqs]).cumsum(0).int()
    N = int(qo_indptr[-1])
    q, k_new, v_new = (torch.randn(N, h, D, generator=gen) for h in (H * group, H, H))
    for window in WINDOWS:
        out = torch.full_like(q, float("nan"), device=DEVICE)
        extend_attention(q.to(DEVICE), k_new.to(DEVICE), v_new.to(DEVICE), qo_indptr.to(DEVICE), to_device(kv),
                         to_device(paged), D ** -0.5, out=out, window=window)
        assert_close_written(out, ref_extend(q, k_new, v_new, qo_indptr, kv, paged, D ** -0.5, window=window),
                             torch.float32)


def _check_decode_format(case, dtype, *, seed, bits=2, **pool):
    """Decode over `bits`-bit pages as make_pool builds them from `pool` (a format's extras: fmt, params; a recipe's
    layer: v_bits) vs ref_decode. -> (q, the plan, the reference's output)."""
    G, H, group, D, VG, reqs = CASES[case]
    kv, paged = make_pool(G, H, D, VG, bits, reqs, dtype, seed=seed, **pool)
    q = torch.randn(len(reqs), H * group, D, generator=torch.Generator().manual_seed(1)).to(dtype)
    ref = ref_decode(q, kv, paged, D ** -0.5)
    p = dec.plan(to_device(paged), num_qo_heads=H * group, num_kv_heads=H, head_dim=D, page_size=G,
                 max_splits=3, min_pages_per_split=1)
    out = torch.full_like(q, float("nan"), device=DEVICE)
    dec.decode_attention(q.to(DEVICE), to_device(kv), p, D ** -0.5, out=out)
    assert_close_written(out, ref, dtype)
    return q, paged, ref


def _check_extend_format(case, *, seed, bits=2, **pool):
    """Extend over `bits`-bit pages as make_pool builds them from `pool` vs ref_extend (fp32)."""
    G, H, group, D, VG, reqs = EXTEND_CASES[case]
    kv, paged = make_pool(G, H, D, VG, bits, [(b, o) for b, o, _ in reqs], torch.float32, seed=seed, **pool)
    gen = torch.Generator().manual_seed(2)
    qo_indptr = torch.tensor([0] + [n for _, _, n in reqs]).cumsum(0).int()
    N = int(qo_indptr[-1])
    q, k_new, v_new = (torch.randn(N, h, D, generator=gen) for h in (H * group, H, H))
    ref = ref_extend(q, k_new, v_new, qo_indptr, kv, paged, D ** -0.5)
    out = torch.full_like(q, float("nan"), device=DEVICE)
    extend_attention(q.to(DEVICE), k_new.to(DEVICE), v_new.to(DEVICE), qo_indptr.to(DEVICE), to_device(kv),
                     to_device(paged), D ** -0.5, out=out)
    assert_close_written(out, ref, torch.float32)


# GEAR pages (family, parameters: rank and the outliers' share, which sets NK per key channel and NV per value
# token): the correction in registers vs the codec's correct_keys / correct_values in the reference, over odd shapes
# (GQA 3 and 4, D 128 and 256, partial last pages, contexts shorter than a page).
GEAR = {"gear2": ("gear", GearParams()), "gearl2": ("gearl", GearParams()),
        "rank3-more-outliers": ("gear", GearParams(rank=3, outliers=0.1))}


@pytest.mark.parametrize("case,dtype", covering_pairs(list(CASES), DTYPES))
@pytest.mark.parametrize("gear", list(GEAR))
def test_decode_gear_matches_reference(case, gear, dtype):
    _check_decode_format(case, dtype, seed=3, fmt=GEAR[gear][0], params=GEAR[gear][1])


@pytest.mark.parametrize("case", list(EXTEND_CASES))
@pytest.mark.parametrize("gear", list(GEAR))
def test_extend_gear_matches_reference(case, gear):
    _check_extend_format(case, seed=4, fmt=GEAR[gear][0], params=GEAR[gear][1])


def test_gear_correction_layout_is_checked():
    G, H, group, D, VG, reqs = CASES["G16-mha-odd"]
    kv, paged = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=3, fmt="gear")
    kv.extras = kv.extras._replace(k_w=kv.extras.k_w[:, :, :1])
    p = dec.plan(to_device(paged), num_qo_heads=H, num_kv_heads=H, head_dim=D, page_size=G)
    with pytest.raises(ValueError, match="PageCorrection.k_w"):
        dec.run(torch.zeros(len(reqs), H, D, device=DEVICE), to_device(kv), p, 0.125)


# zipcache2 pages with a share of salient rows per page-head (NS = 1 and 7 at G = 16): the 4-bit rows replaced
# and V times c in registers vs the codec's apply_salient in the reference, over the same odd shapes.
SALIENT = [0.05, 0.45]


@pytest.mark.parametrize("case,dtype", covering_pairs(list(CASES), DTYPES))
@pytest.mark.parametrize("ns", SALIENT)
def test_decode_zipcache_matches_reference(case, ns, dtype):
    _check_decode_format(case, dtype, seed=5, fmt="zipcache", params=ZipCacheParams(ns))


@pytest.mark.parametrize("case", list(EXTEND_CASES))
@pytest.mark.parametrize("ns", SALIENT)
def test_extend_zipcache_matches_reference(case, ns):
    _check_extend_format(case, seed=6, fmt="zipcache", params=ZipCacheParams(ns))


def test_zipcache_salient_layout_is_checked():
    G, H, group, D, VG, reqs = CASES["G16-mha-odd"]
    kv, paged = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=3, fmt="zipcache")
    kv.extras = kv.extras._replace(s_v_scale=kv.extras.s_v_scale[:, :, :2])
    p = dec.plan(to_device(paged), num_qo_heads=H, num_kv_heads=H, head_dim=D, page_size=G)
    with pytest.raises(ValueError, match="SalientPlane.s_v_scale"):
        dec.run(torch.zeros(len(reqs), H, D, device=DEVICE), to_device(kv), p, 0.125)


# LogQuant pages at windows W whose rule keeps the sink alone (W10: M = 1, every other slot empty) up to M = 8
# rows at offsets across the page (W21; partial last pages have rows past their valid tokens): the rows replace the
# dequantized ones in registers vs the codec's apply_rows in the reference, over the same odd shapes.
ROWS = {"W3": 3, "W10": 10, "W21": 21}
# CI: the sink alone and the most rows; W3's rows (up to 7, near the page ends) in the matrix
ROWS_CI = ci_slice(list(ROWS), ["W10", "W21"])


@pytest.mark.parametrize("case,dtype", covering_pairs(list(CASES), DTYPES))
@pytest.mark.parametrize("rows", ROWS_CI)
def test_decode_logquant_rows_match_reference(case, rows, dtype):
    _check_decode_format(case, dtype, seed=5, fmt="logquant", params=LogQuantParams(ROWS[rows]))


@pytest.mark.parametrize("case", list(EXTEND_CASES))
@pytest.mark.parametrize("rows", ROWS_CI)
def test_extend_logquant_rows_match_reference(case, rows):
    _check_extend_format(case, seed=6, fmt="logquant", params=LogQuantParams(ROWS[rows]))


def test_logquant_rows_layout_is_checked():
    G, H, group, D, VG, reqs = CASES["G16-mha-odd"]
    kv, paged = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=3, fmt="logquant")
    kv.extras = kv.extras._replace(row_off=kv.extras.row_off.long())
    p = dec.plan(to_device(paged), num_qo_heads=H, num_kv_heads=H, head_dim=D, page_size=G)
    with pytest.raises(ValueError, match="PageRows.row_off"):
        dec.run(torch.zeros(len(reqs), H, D, device=DEVICE), to_device(kv), p, 0.125)
