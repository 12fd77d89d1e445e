"""kvq_torch's batched decode (sgl_kvq/attention_batched.py) against its oracle attention_ref.ref_decode on random
pools: batch sizes 1..9, contexts shorter than a page, partial last pages, empty overlays, GQA groups 1..4,
1/2/3/4 bits, fp32 within 1e-5."""

from __future__ import annotations

import random

import pytest
import torch

from paged_pool import SHAPES, make_pool, poison_unused, random_requests
from slices import ci_slice
from sgl_kvq import attention_batched, padded
from sgl_kvq.attention_ref import ref_decode
from sgl_kvq.formats.gear import GearParams
from sgl_kvq.formats.logquant import LogQuantParams
from sgl_kvq.formats.zipcache import ZipCacheParams


@pytest.mark.parametrize("B", range(1, 10))
@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_batched_decode_matches_reference(B, group, bits):
    rng = random.Random(B * 100 + group * 10 + bits)
    G, H, D, VG = SHAPES[(B + group + bits) % len(SHAPES)]
    reqs = random_requests(rng, B, G)
    kv, plan = make_pool(G, H, D, VG, bits, reqs, torch.float32, seed=B + 7 * bits)
    q = torch.randn(B, H * group, D, generator=torch.Generator().manual_seed(group))
    ref = ref_decode(q, kv, plan, D ** -0.5)
    out = attention_batched.decode(q, kv, padded.prepare(plan, G, H), D ** -0.5)
    assert not out.isnan().any(), "a position past a context's end (NaN in the pool) reached the output"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B", [1, 5])
def test_frames_apart_as_pooled_kivi3(B):
    """Pooled kivi3 frames lie k pages' codes apart (sgl_kvq/frames.py frame_view): read in place, not reshaped."""
    G, H, D, VG = SHAPES[1]
    reqs = random_requests(random.Random(B), B, G)
    kv, plan = make_pool(G, H, D, VG, 3, reqs, torch.bfloat16, seed=B, frame_gap=3 * D)
    assert not kv.ov_k.is_contiguous()
    q = torch.randn(B, H * 3, D, generator=torch.Generator().manual_seed(B))
    out = attention_batched.decode(q, kv, padded.prepare(plan, G, H), D ** -0.5)
    torch.testing.assert_close(out, ref_decode(q, kv, plan, D ** -0.5), rtol=1e-5, atol=1e-5)


def test_reads_only_the_batch_pages():
    """Pages and frames no request references (poisoned with NaN) never reach the output: nothing beyond the
    batch's own pages is dequantized, including the padding positions."""
    G, H, D, VG = SHAPES[0]
    reqs = [(3 * G, 5), (7, 0), (0, 20)]
    kv, plan = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=3)
    poison_unused(kv, plan, G)
    q = torch.randn(len(reqs), H * 2, D)
    out = attention_batched.decode(q, kv, padded.prepare(plan, G, H), D ** -0.5)
    torch.testing.assert_close(out, ref_decode(q, kv, plan, D ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_batched_decode_model_dtypes(dtype):
    """The engine's dtypes: overlay and q in 16 bits, output in q's dtype (reference within its rounding)."""
    G, H, D, VG = SHAPES[1]
    reqs = [(2 * G, G + 3), (G - 1, 0), (0, 40)]
    kv, plan = make_pool(G, H, D, VG, 4, reqs, dtype, seed=11)
    q = torch.randn(len(reqs), H * 3, D).to(dtype)
    out = attention_batched.decode(q, kv, padded.prepare(plan, G, H), D ** -0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref_decode(q, kv, plan, D ** -0.5).float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("fmt,params", [("gear", GearParams()), ("gearl", GearParams()),
                                        ("gear", GearParams(rank=3, outliers=0.1))],
                         ids=["gear2", "gearl2", "rank3-more-outliers"])
def test_batched_decode_with_gear_correction_matches_reference(B, fmt, params):
    rng = random.Random(B + 31 * params.rank + len(fmt))
    for G, H, D, VG in SHAPES:
        reqs = random_requests(rng, B, G)
        kv, plan = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=B, fmt=fmt, params=params)
        q = torch.randn(B, H * 2, D, generator=torch.Generator().manual_seed(B))
        ref = ref_decode(q, kv, plan, D ** -0.5)
        out = attention_batched.decode(q, kv, padded.prepare(plan, G, H), D ** -0.5)
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("share", [0.05, 0.4])
def test_batched_decode_with_zipcache_salient_rows_matches_reference(B, group, share):
    rng = random.Random(B + 31 * group + int(100 * share))
    for G, H, D, VG in SHAPES:
        reqs = random_requests(rng, B, G)
        kv, plan = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=B, fmt="zipcache",
                             params=ZipCacheParams(share))
        kv.extras.v_chan[0] = float("nan")  # dummy page 0 (padding reads it) may hold anything
        q = torch.randn(B, H * group, D, generator=torch.Generator().manual_seed(B))
        ref = ref_decode(q, kv, plan, D ** -0.5)
        out = attention_batched.decode(q, kv, padded.prepare(plan, G, H), D ** -0.5)
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B", [1, 4, 9])
@pytest.mark.parametrize("W", ci_slice([3, 10, 21], [10, 21]))  # W = 3 in the matrix (W = 21 keeps more rows)
def test_batched_decode_with_logquant_rows_matches_reference(B, W):
    rng = random.Random(B * 13 + W)
    for G, H, D, VG in SHAPES:
        reqs = random_requests(rng, B, G)
        kv, plan = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=B + W, fmt="logquant",
                             params=LogQuantParams(W))
        q = torch.randn(B, H * 2, D, generator=torch.Generator().manual_seed(B))
        ref = ref_decode(q, kv, plan, D ** -0.5)
        out = attention_batched.decode(q, kv, padded.prepare(plan, G, H), D ** -0.5)
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        kv.extras = None  # the rows change what is read
        assert not torch.allclose(ref_decode(q, kv, plan, D ** -0.5), ref, atol=1e-4) or not plan.kv_indices.numel()


PEER_BITS = {"peer_fp8_e4m3": 8, "peer_fp4_mx_block16": 4, "peer_nvfp4": 4, "peer_int4": 4, "peer_tq3": 3,
             "peer_tq4": 4}
PEERS = list(PEER_BITS)


@pytest.mark.parametrize("B", [1, 4, 9])
@pytest.mark.parametrize("peer", PEERS)
def test_batched_decode_of_peer_formats_matches_reference(B, peer):
    """A base that is not KIVI's (sgl_kvq/formats/peers/), and overlay tokens read through the format's quantizer."""
    rng = random.Random(B * 17 + len(peer))
    for G, H, D, VG in SHAPES:
        reqs = random_requests(rng, B, G)
        kv, plan = make_pool(G, H, D, VG, PEER_BITS[peer], reqs, torch.float32, seed=B, fmt=peer)
        q = torch.randn(B, H * 2, D, generator=torch.Generator().manual_seed(B))
        ref = ref_decode(q, kv, plan, D ** -0.5)
        out = attention_batched.decode(q, kv, padded.prepare(plan, G, H), D ** -0.5)
        assert not out.isnan().any()
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_workspace_reuse_across_batches():
    """One Workspace through batches that grow and shrink (the backend keeps one for its life): every output equals
    the one computed with fresh buffers, and a layer's K/V never leak into the next batch's padding."""
    ws = padded.Workspace()
    rng = random.Random(11)
    for i, B in enumerate([3, 8, 1, 5, 8]):
        G, H, D, VG = SHAPES[i % len(SHAPES)]
        kv, plan = make_pool(G, H, D, VG, 2, random_requests(rng, B, G), torch.float32, seed=i)
        q = torch.randn(B, H * 2, D, generator=torch.Generator().manual_seed(i))
        ctx = padded.prepare(plan, G, H)
        fresh = attention_batched.decode(q, kv, ctx, D ** -0.5)
        torch.testing.assert_close(attention_batched.decode(q, kv, ctx, D ** -0.5, ws), fresh, rtol=0, atol=0)
        torch.testing.assert_close(fresh, ref_decode(q, kv, plan, D ** -0.5), rtol=1e-5, atol=1e-5)
