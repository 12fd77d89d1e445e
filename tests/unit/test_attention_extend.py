"""kvq_torch's extend (sgl_kvq/attention_extend.py) against its oracle attention_ref.ref_extend on random pools:
batch sizes 1..6, requests with and without a cached prefix, prefixes shorter than a page or ending mid-page, empty
extends, GQA groups 1..4, 1/2/3/4 bits, contexts from elsewhere (SpeCache's host rows), fp32 within 1e-5."""

from __future__ import annotations

import random

import pytest
import torch

from paged_pool import SHAPES, make_pool, random_requests
from sgl_kvq import attention_extend
from sgl_kvq.attention_ref import ref_extend, window_mask


def new_tokens(rng: random.Random, B: int, G: int) -> torch.Tensor:
    """qo_indptr of B requests' extends: one or two pages' worth, a few tokens, or none at all."""
    lens = [rng.choice([0, 1, rng.randint(2, G), rng.randint(G, 2 * G + 5)]) for _ in range(B)]
    return torch.tensor([0, *lens]).cumsum(0)


def with_prefix_free(rng: random.Random, reqs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Some requests with no cached prefix at all (a new prompt: the fused causal path)."""
    return [(0, 0) if rng.random() < 0.3 else r for r in reqs]


def inputs(B: int, group: int, bits: int, dtype=torch.float32):
    rng = random.Random(B * 100 + group * 10 + bits)
    G, H, D, VG = SHAPES[(B + group + bits) % len(SHAPES)]
    kv, plan = make_pool(G, H, D, VG, bits, with_prefix_free(rng, random_requests(rng, B, G)), dtype,
                         seed=B + 7 * bits)
    qo = new_tokens(rng, B, G)
    gen = torch.Generator().manual_seed(group)
    N = int(qo[-1])
    q = torch.randn(N, H * group, D, generator=gen).to(dtype)
    k, v = torch.randn(N, H, D, generator=gen).to(dtype), torch.randn(N, H, D, generator=gen).to(dtype)
    return q, k, v, qo, kv, plan, D ** -0.5


@pytest.mark.parametrize("B", range(1, 7))
@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_extend_matches_reference(B, group, bits):
    q, k, v, qo, kv, plan, scale = inputs(B, group, bits)
    out = attention_extend.extend(q, k, v, qo, kv, plan, scale)
    torch.testing.assert_close(out, ref_extend(q, k, v, qo, kv, plan, scale), rtol=1e-5, atol=1e-5)


def test_cached_prefix_is_read():
    """A request whose prefix is cached must attend to it: dropping the plan's pages changes the output (the check
    above cannot pass by treating every request as prefix-free)."""
    G, H, D, VG = SHAPES[0]
    kv, plan = make_pool(G, H, D, VG, 2, [(2 * G, 5)], torch.float32, seed=1)
    q, k, v = torch.randn(4, H, D), torch.randn(4, H, D), torch.randn(4, H, D)
    qo = torch.tensor([0, 4])
    _, empty = make_pool(G, H, D, VG, 2, [(0, 0)], torch.float32, seed=1)
    with_prefix = attention_extend.extend(q, k, v, qo, kv, plan, D ** -0.5)
    without = attention_extend.extend(q, k, v, qo, kv, empty, D ** -0.5)
    assert (with_prefix - without).abs().max() > 1e-3
    torch.testing.assert_close(without, ref_extend(q, k, v, qo, kv, empty, D ** -0.5), rtol=1e-5, atol=1e-5)


def test_contexts_from_elsewhere():
    """SpeCache's host-tier prefixes: contexts[b] replaces the plan's pages, as in the reference."""
    q, k, v, qo, kv, plan, scale = inputs(4, 3, 2)
    H, D = k.shape[1], k.shape[2]
    gen = torch.Generator().manual_seed(5)
    contexts = [(torch.randn(t, H, D, generator=gen).half(), torch.randn(t, H, D, generator=gen).half())
                for t in (0, 1, 37, 130)]
    out = attention_extend.extend(q, k, v, qo, kv, plan, scale, contexts=contexts)
    torch.testing.assert_close(out, ref_extend(q, k, v, qo, kv, plan, scale, contexts=contexts),
                               rtol=1e-5, atol=1e-5)
    # under a window, a context may start where the window does: the rows before it are not needed
    for window in (0, 9, 40):
        want = ref_extend(q, k, v, qo, kv, plan, scale, contexts=contexts, window=window)
        at = [max(c[0].shape[0] - window, 0) for c in contexts]
        cut = [(ck[a:], cv[a:]) for (ck, cv), a in zip(contexts, at)]
        out = attention_extend.extend(q, k, v, qo, kv, plan, scale, contexts=cut, window=window, context_at=at)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extend_model_dtypes(dtype):
    """The engine's dtypes: q, new K/V and overlay in 16 bits, output in q's dtype (the reference within its
    rounding)."""
    q, k, v, qo, kv, plan, scale = inputs(5, 3, 2, dtype)
    out = attention_extend.extend(q, k, v, qo, kv, plan, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref_extend(q, k, v, qo, kv, plan, scale).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("n,p", [(1, 0), (5, 0), (3, 7), (4, 1)])
def test_window_mask_without_a_window_is_the_prefix_and_causal(n, p):
    m = window_mask(n, p, -1, torch.device("cpu"))
    expect = torch.ones(n, p + n, dtype=torch.bool)
    expect[:, p:] = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(m, expect)
