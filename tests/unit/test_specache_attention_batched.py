"""SpeCache's batched lanes (sgl_kvq/specache/attention_batched.py, kvq_torch's specache decode) against the
per-request oracle (sgl_kvq/specache/attention.py) on random pools: batch sizes 1..6, GQA groups 1..4, 1 and 2 bits,
contexts shorter than a page, empty overlays, top-k larger than a base, prefetched positions -1 and past the base,
follow on and off, and the pre-decode. Outputs fp32 within 1e-5; top-k positions equal as sets per request and KV
head, or, where fp rounding breaks a near-tie differently, the differing positions' masses equal within 1e-6."""

from __future__ import annotations

import random

import pytest
import torch

from paged_pool import SHAPES, make_pool, random_requests
from sgl_kvq import padded
from sgl_kvq.attention_ref import attention_probs, gather_context
from sgl_kvq.specache import attention as oracle
from sgl_kvq.specache import attention_batched as lanes

TOL = dict(rtol=1e-5, atol=1e-5)


def topk_buffers(n_base, H, K, D, gen):
    """Prefetched rows topk_k/v [B, H, K, D] and positions [B, H, K], distinct per (request, head): about a fifth
    -1 (none), some past the request's base (ignored: the window is fp16 already), the rest inside it."""
    B = len(n_base)
    tk, tv = torch.randn(B, H, K, D, generator=gen) * 1.5, torch.randn(B, H, K, D, generator=gen)
    pos = torch.full((B, H, K), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            cand = torch.randperm(n_base[b] + 6, generator=gen)[:K]
            cand[torch.rand(cand.shape, generator=gen) < 0.2] = -1
            pos[b, h, :cand.numel()] = cand
    return tk, tv, pos


def case(B, group, bits, seed):
    """A random pool and batch: (kv, plan, G, H, D, n_base, q [2B, Hq, D], own k/v [B, H, D], top_k, topk)."""
    rng = random.Random(seed)
    G, H, D, VG = SHAPES[seed % len(SHAPES)]
    reqs = random_requests(rng, B, G)
    kv, plan = make_pool(G, H, D, VG, bits, reqs, torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2 * B, H * group, D, generator=gen)
    k_own, v_own = torch.randn(B, H, D, generator=gen) * 1.5, torch.randn(B, H, D, generator=gen)
    n_base = [plan.base_len(b, G) for b in range(B)]
    top_k = rng.choice([1, 5, 24, 4 * G + 7])  # the last more than any base
    return kv, plan, G, H, D, n_base, q, k_own, v_own, top_k, topk_buffers(n_base, H, top_k, D, gen)


def assert_same_top_k(got, want, q, k_own, contexts, n_base, H, sm_scale, follow_probs=None):
    """got, want [B, H, K]: the same number of positions per (request, head), each at most once, and the same set
    or, where they differ, equal oracle masses (a near-tie that fp rounding broke the other way)."""
    assert got.shape == want.shape
    assert torch.equal(got < 0, want < 0), "a different number of positions was selected"
    for b in range(len(contexts)):
        for h in range(H):
            g, w = got[b, h][got[b, h] >= 0], want[b, h][want[b, h] >= 0]
            assert g.unique().numel() == g.numel() and bool((g < n_base[b]).all())
            extra = sorted(set(g.tolist()) - set(w.tolist()))
            missing = sorted(set(w.tolist()) - set(g.tolist()))
            if extra:
                mass = oracle_mass(q[b], k_own[b], contexts[b][0], n_base[b], H, sm_scale,
                                   None if follow_probs is None else follow_probs[b])
                torch.testing.assert_close(mass[h, extra].sort().values, mass[h, missing].sort().values,
                                           rtol=0, atol=1e-6)


def oracle_mass(q, k_own, k, n_base, H, sm_scale, follow_probs=None):
    """The ranking the oracle's top_positions sorts: [H, n_base] (one request's q [Hq, D], own key [H, D])."""
    p = attention_probs(q[None], torch.cat([k, k_own[None]]), sm_scale)[:, 0]
    mass = p[:, :n_base].reshape(H, -1, n_base).sum(1)
    if follow_probs is not None and n_base > 1:
        mass[:, 1:] += follow_probs[:, :n_base - 1].reshape(H, -1, n_base - 1).sum(1)
    return mass


@pytest.mark.parametrize("B", range(1, 7))
@pytest.mark.parametrize("bits", [1, 2])
def test_lanes_match_the_oracle(B, bits):
    group = (B + bits) % 4 + 1  # every group 1..4 with each bit width
    kv, plan, G, H, D, n_base, q, k_own, v_own, top_k, (tk, tv, tpos) = case(B, group, bits, 100 * B + 10 * group
                                                                             + bits)
    sm_scale = D ** -0.5
    ctx = padded.prepare(plan, G, H)
    assert ctx.base_len.tolist() == n_base
    stored = [gather_context(kv, plan, b) for b in range(B)]

    # pre-decode: the real tokens as speculative rows over the context as stored, no follow
    out, pos = lanes.predecode(q[:B], k_own, v_own, kv, ctx, sm_scale, top_k)
    want_out, want_pos = oracle.speculative_rows(q[:B], k_own, v_own, stored, n_base, sm_scale, top_k)
    assert not out.isnan().any(), "a position past a context's end (NaN in the pool) reached the output"
    torch.testing.assert_close(out, want_out, **TOL)
    assert_same_top_k(pos, want_pos, q[:B], k_own, stored, n_base, H, sm_scale)

    # two lanes over the context with the prefetched rows, ranked with and without the real row's follow
    contexts = oracle.with_topk(stored, n_base, tk, tv, tpos)
    real, real_probs = oracle.output_rows(q[:B], contexts, sm_scale)
    for follow in (False, True):
        follow_probs = real_probs if follow else None
        spec, want_pos = oracle.speculative_rows(q[B:], k_own, v_own, contexts, n_base, sm_scale, top_k,
                                                 follow_probs)
        out, pos = lanes.two_lane(q, k_own, v_own, kv, ctx, sm_scale, top_k, tk, tv, tpos, follow,
                                  padded.Workspace())
        assert not out.isnan().any()
        torch.testing.assert_close(out, torch.cat([real, spec]), **TOL)
        assert_same_top_k(pos, want_pos, q[B:], k_own, contexts, n_base, H, sm_scale, follow_probs)


def test_model_dtypes():
    """The engine's dtypes: q, own K/V, prefetched rows and overlay in bf16; outputs in q's dtype."""
    kv, plan, G, H, D, n_base, q, k_own, v_own, top_k, (tk, tv, tpos) = case(5, 3, 2, 7)
    ctx = padded.prepare(plan, G, H)
    bf = [x.bfloat16() for x in (q, k_own, v_own, tk, tv)]
    out, _ = lanes.two_lane(*bf[:3], kv, ctx, D ** -0.5, top_k, *bf[3:], tpos, True)
    assert out.dtype == torch.bfloat16
    contexts = oracle.with_topk([gather_context(kv, plan, b) for b in range(5)], n_base, bf[3], bf[4], tpos)
    real, probs = oracle.output_rows(bf[0][:5], contexts, D ** -0.5)
    spec, _ = oracle.speculative_rows(bf[0][5:], bf[1], bf[2], contexts, n_base, D ** -0.5, top_k, probs)
    torch.testing.assert_close(out.float(), torch.cat([real, spec]).float(), rtol=1e-2, atol=1e-2)


def test_prefetched_rows_are_read_inside_the_base_only():
    """Changing a prefetched row inside a request's base changes its output rows; changing rows at -1 or at
    positions past the base changes nothing."""
    B = 4
    kv, plan, G, H, D, n_base, q, k_own, v_own, top_k, (tk, tv, tpos) = case(B, 2, 1, 3)
    ctx = padded.prepare(plan, G, H)
    run = lambda k, v: lanes.two_lane(q, k_own, v_own, kv, ctx, D ** -0.5, top_k, k, v, tpos, True)[0]  # noqa: E731
    base = run(tk, tv)
    inside = (tpos >= 0) & (tpos < torch.tensor(n_base)[:, None, None])
    assert inside.any() and (~inside).any()
    ignored = run(torch.where(inside[..., None], tk, tk + 3), torch.where(inside[..., None], tv, tv - 3))
    torch.testing.assert_close(ignored, base, rtol=0, atol=0)
    changed = run(torch.where(inside[..., None], tk + 3, tk), tv)
    for b in range(B):
        rows = [b, B + b]  # the real and the speculative row read the same keys
        assert (changed[rows] - base[rows]).abs().max() > 1e-3 if inside[b].any() else \
            torch.equal(changed[rows], base[rows])


def test_workspace_is_rebuilt_for_the_predecode():
    """The top-k rows are written into the workspace's padded copy: the next call on the same workspace (a
    pre-decode, or the next layer) rebuilds it and never sees them."""
    kv, plan, G, H, D, n_base, q, k_own, v_own, top_k, (tk, tv, tpos) = case(6, 3, 2, 5)
    ctx, ws = padded.prepare(plan, G, H), padded.Workspace()
    fresh = lanes.predecode(q[:6], k_own, v_own, kv, ctx, D ** -0.5, top_k)
    lanes.two_lane(q, k_own, v_own, kv, ctx, D ** -0.5, top_k, tk, tv, tpos, False, ws)
    again = lanes.predecode(q[:6], k_own, v_own, kv, ctx, D ** -0.5, top_k, ws)
    torch.testing.assert_close(again[0], fresh[0], rtol=0, atol=0)
    assert torch.equal(again[1], fresh[1])
