"""kvq_torch's page-by-page decode (sgl_kvq/attention_pages.py) against its oracle attention_ref.ref_decode and the
padded path (attention_batched) on random pools: batch sizes 1..9, contexts shorter than a page, partial last pages
and frames (NaN past each end), empty overlays or bases, GQA groups 1..4, 1/2/3/4 bits, 1..4 value groups per head,
fp32 within 1e-5."""

from __future__ import annotations

import random

import pytest
import torch

from paged_pool import (EDGE_BATCHES, EDGE_IDS, SHAPES, check_edge_batch, check_reads_only_the_batch_pages,
                        check_scales_are_read, make_pool, random_requests)
from sgl_kvq import attention_batched, attention_pages, padded
from sgl_kvq.attention_ref import ref_decode


def decode(q, kv, plan, G, H, ws=None):
    return attention_pages.decode(q, kv, attention_pages.index(plan, G, H), q.shape[-1] ** -0.5, ws)


@pytest.mark.parametrize("B", range(1, 10))
@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_page_decode_matches_reference(B, group, bits):
    rng = random.Random(B * 100 + group * 10 + bits + 1)
    G, H, D, VG = SHAPES[(B + group + bits) % len(SHAPES)]
    reqs = random_requests(rng, B, G)
    kv, plan = make_pool(G, H, D, VG, bits, reqs, torch.float32, seed=B + 7 * bits + 1)
    q = torch.randn(B, H * group, D, generator=torch.Generator().manual_seed(group))
    ref = ref_decode(q, kv, plan, D ** -0.5)
    out = decode(q, kv, plan, G, H)
    assert not out.isnan().any(), "a position past a context's end (NaN in the pool) reached the output"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    batched = attention_batched.decode(q, kv, padded.prepare(plan, G, H), D ** -0.5)
    torch.testing.assert_close(out, batched, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k_bits,v_bits", [(4, 1), (1, 3), (3, 2)])
def test_key_and_value_widths_differ(k_bits, v_bits):
    """A recipe's layer (kivimix): the page path and the padded path read keys and values at their own widths, the
    frames apart by different strides as pooled frames over such codes lie."""
    rng = random.Random(k_bits * 10 + v_bits)
    for group, (G, H, D, VG) in ((1, SHAPES[0]), (3, SHAPES[-1])):
        kv, plan = make_pool(G, H, D, VG, k_bits, random_requests(rng, 5, G), torch.float32, seed=k_bits,
                             v_bits=v_bits, frame_gap=16 * k_bits, v_frame_gap=16 * v_bits)
        q = torch.randn(5, H * group, D, generator=torch.Generator().manual_seed(group))
        ref = ref_decode(q, kv, plan, D ** -0.5)
        torch.testing.assert_close(decode(q, kv, plan, G, H), ref, rtol=1e-5, atol=1e-5)
        batched = attention_batched.decode(q, kv, padded.prepare(plan, G, H), D ** -0.5)
        torch.testing.assert_close(batched, ref, rtol=1e-5, atol=1e-5)


def test_frames_apart_as_pooled_kivi3():
    """Pooled kivi3 frames lie k pages' codes apart (sgl_kvq/frames.py frame_view): read in place, not reshaped."""
    G, H, D, VG = SHAPES[1]
    kv, plan = make_pool(G, H, D, VG, 3, random_requests(random.Random(4), 6, G), torch.bfloat16, seed=4,
                         frame_gap=3 * D)
    assert not kv.ov_k.is_contiguous()
    q = torch.randn(6, H * 2, D, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(decode(q, kv, plan, G, H), ref_decode(q, kv, plan, D ** -0.5), rtol=1e-5, atol=1e-5)


def decode_pages(q, kv, plan):
    G, H = kv.G, kv.ov_k.shape[2]
    return decode(q, kv, plan, G, H)


@pytest.mark.parametrize("reqs", EDGE_BATCHES, ids=EDGE_IDS)
def test_page_decode_edge_batches(reqs):
    check_edge_batch(decode_pages, reqs)


def test_reads_only_the_batch_pages():
    check_reads_only_the_batch_pages(decode_pages, *SHAPES[0])


def test_scales_are_read():
    check_scales_are_read(decode_pages, *SHAPES[1])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_page_decode_model_dtypes(dtype):
    """The engine's dtypes: overlay and q in 16 bits, output in q's dtype (reference within its rounding)."""
    G, H, D, VG = SHAPES[1]
    reqs = [(2 * G, G + 3), (G - 1, 0), (0, 40)]
    kv, plan = make_pool(G, H, D, VG, 4, reqs, dtype, seed=11)
    q = torch.randn(len(reqs), H * 3, D).to(dtype)
    out = decode(q, kv, plan, G, H)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref_decode(q, kv, plan, D ** -0.5).float(), rtol=1e-2, atol=1e-2)


def test_workspace_reuse_across_batches():
    """One Workspace (shared with the padded path, as in the backend) through batches that grow and shrink: every
    output equals the one computed with fresh buffers."""
    ws = padded.Workspace()
    rng = random.Random(12)
    for i, B in enumerate([3, 8, 1, 5, 8]):
        G, H, D, VG = SHAPES[i % len(SHAPES)]
        kv, plan = make_pool(G, H, D, VG, 2, random_requests(rng, B, G), torch.float32, seed=i)
        q = torch.randn(B, H * 2, D, generator=torch.Generator().manual_seed(i))
        fresh = decode(q, kv, plan, G, H)
        attention_batched.decode(q, kv, padded.prepare(plan, G, H), D ** -0.5, ws)
        torch.testing.assert_close(decode(q, kv, plan, G, H, ws), fresh, rtol=0, atol=0)


def test_supports_only_plain_pages():
    """GEAR corrections, LogQuant rows and ZipCache planes change dequantized K/V: those go the padded way."""
    G, H, D, VG = SHAPES[0]
    reqs = [(2 * G, 3)]
    assert attention_pages.supports(make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=1)[0])
    for extra in ({"fmt": "gear"}, {"fmt": "logquant"}, {"fmt": "zipcache"}):
        assert not attention_pages.supports(make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=1, **extra)[0])


def test_pays_off_on_ragged_or_long_batches():
    """The backend's choice (attention_pages.pays_off): the page path where the padded layout pads or the batch is
    long, the padded one on short batches of equal contexts (where the page path's extra small ops cost more)."""
    G, H, D, VG = 64, 1, 16, 16

    def plan(reqs):
        return make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=0)[1]

    assert not attention_pages.pays_off(plan([(512, 64)]), G)  # one request, 9 units
    assert not attention_pages.pays_off(plan([(512, 64)] * 4), G)  # equal contexts, 2,304 tokens
    assert attention_pages.pays_off(plan([(512, 64), (64, 10), (0, 30)]), G)  # 3 x 9 padded units for 12
    assert attention_pages.pays_off(plan([(4096, 64)]), G)  # 4,160 tokens
