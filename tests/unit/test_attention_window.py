"""Sliding-window layers (SGLang's `sliding_window_size` W: a query at position i sees positions i - W .. i) on every
kvq_torch path (the C decode kernel included, where a compiler is found), against the oracle attention_ref: windows
that end inside a base page, inside an overlay frame, on a page boundary, W = 0 (the query's own token only) and
windows wider than the context; every format's pages."""

from __future__ import annotations

import random

import pytest
import torch

from paged_pool import SHAPES, make_pool, random_requests
from sgl_kvq import attention_batched, attention_extend, attention_pages, attention_ref, padded
from sgl_kvq.attention_ref import gather_context, ref_decode, ref_extend, window_mask
from sgl_kvq.kernels import cpu_decode_attention


def windows_for(reqs: list[tuple[int, int]], G: int) -> list[int]:
    """Windows that cut each request's context at every kind of place: mid base page, on a page boundary, mid
    overlay frame, its own token only, all of it."""
    longest = max(b + o for b, o in reqs)
    return sorted({0, 1, G - 1, G, G + 3, 2 * G + 5, longest // 2, longest + 7})


@pytest.mark.parametrize("n,p,window", [(1, 0, 0), (6, 0, 2), (4, 9, 3), (3, 2, 10), (5, 20, 0), (7, 3, -1)])
def test_window_mask_is_the_definition(n, p, window):
    m = window_mask(n, p, window, torch.device("cpu"))
    for i in range(n):
        for t in range(p + n):
            assert bool(m[i, t]) == (t <= p + i and (window < 0 or t >= p + i - window)), (i, t)


def test_window_zero_reads_only_the_querys_own_token():
    """W = 0: the softmax has one term, so the output is the last token's value (dequantized as gathered)."""
    G, H, D, VG = SHAPES[0]
    reqs = [(2 * G, 5), (3 * G + 1, 0), (0, 7)]
    kv, plan = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=2)
    q = torch.randn(len(reqs), H * 2, D)
    out = ref_decode(q, kv, plan, D ** -0.5, window=0)
    for b in range(len(reqs)):
        _, v = gather_context(kv, plan, b)
        torch.testing.assert_close(out[b], v[-1].repeat_interleave(2, dim=0), rtol=1e-6, atol=1e-6)


def test_a_window_wider_than_the_context_changes_nothing_and_a_narrow_one_does():
    G, H, D, VG = SHAPES[1]
    reqs = [(2 * G, G + 3), (G - 1, 0)]
    kv, plan = make_pool(G, H, D, VG, 4, reqs, torch.float32, seed=4)
    q = torch.randn(len(reqs), H * 3, D)
    full = ref_decode(q, kv, plan, D ** -0.5)
    torch.testing.assert_close(ref_decode(q, kv, plan, D ** -0.5, window=3 * G + 3), full, rtol=0, atol=0)
    assert (ref_decode(q, kv, plan, D ** -0.5, window=G) - full).abs().max() > 1e-3


# make_pool's arguments for each kind of page: the window is masked alike at every width (kivi1 and kivi4 read as
# kivi2 does; kivi3 has two code planes), per-page extras and a peer's own base go through the padded path
FORMATS = {
    "kivi2": dict(bits=2), "kivi3": dict(bits=3), "gear2": dict(bits=2, fmt="gear"),
    "zipcache2": dict(bits=2, fmt="zipcache"), "logquant2": dict(bits=2, fmt="logquant"),
    "peer_int4": dict(bits=4, fmt="peer_int4"),
}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("B", [1, 3])
def test_decode_paths_match_the_reference_under_windows(fmt, B):
    """attention_batched (every format), attention_pages and the C kernel (KIVI's plain pages) against ref_decode,
    for every window of windows_for; NaN past each context's end must not reach the output."""
    rng = random.Random(B * 31 + len(fmt))
    for shape_i, (G, H, D, VG) in enumerate(SHAPES):
        reqs = random_requests(rng, B, G)
        kv, plan = make_pool(G, H, D, VG, reqs=reqs, dtype=torch.float32, seed=B + shape_i, **FORMATS[fmt])
        q = torch.randn(B, H * 2, D, generator=torch.Generator().manual_seed(B))
        ctx = padded.prepare(plan, G, H)
        idx = attention_pages.index(plan, G, H) if attention_pages.supports(kv) else None
        for window in windows_for(reqs, G):
            ref = ref_decode(q, kv, plan, D ** -0.5, window=window)
            out = attention_batched.decode(q, kv, ctx, D ** -0.5, window=window)
            assert not out.isnan().any(), (fmt, window)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{fmt} W={window}: {m}")
            if idx is None:
                continue
            out = attention_pages.decode(q, kv, idx, D ** -0.5, window=window)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{fmt} W={window}: {m}")
            if cpu_decode_attention.available():
                out = cpu_decode_attention.decode_attention(q, kv, plan, D ** -0.5, window=window)
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"C {fmt} W={window}: {m}")


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("B", [1, 5])
def test_extend_matches_the_reference_under_windows(bits, B):
    """New tokens after a cached prefix (or none), windows shorter than the new tokens themselves included."""
    rng = random.Random(B * 7 + bits)
    for shape_i, (G, H, D, VG) in enumerate(SHAPES):
        reqs = [(0, 0) if rng.random() < 0.3 else r for r in random_requests(rng, B, G)]
        kv, plan = make_pool(G, H, D, VG, bits, reqs, torch.float32, seed=B + shape_i)
        lens = [rng.choice([0, 1, rng.randint(2, G), rng.randint(G, 2 * G + 5)]) for _ in range(B)]
        qo = torch.tensor([0, *lens]).cumsum(0)
        gen = torch.Generator().manual_seed(B)
        N = int(qo[-1])
        q, k, v = (torch.randn(N, h, D, generator=gen) for h in (H * 2, H, H))
        for window in windows_for([(b, o + n) for (b, o), n in zip(reqs, lens)], G):
            ref = ref_extend(q, k, v, qo, kv, plan, D ** -0.5, window=window)
            out = attention_extend.extend(q, k, v, qo, kv, plan, D ** -0.5, window=window)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"W={window}: {m}")


@pytest.mark.parametrize("n,p,window,first", [(4, 9, 3, 6), (1, 40, 0, 40), (5, 20, -1, 0), (3, 70, 16, 32)])
def test_window_mask_from_a_column_is_the_whole_mask_cut_there(n, p, window, first):
    cpu = torch.device("cpu")
    assert torch.equal(window_mask(n, p, window, cpu, first), window_mask(n, p, window, cpu)[:, first:])


@pytest.mark.parametrize("fmt", ["kivi", "gear"])
@pytest.mark.parametrize("window", [0, 5, 16, 40])
def test_extend_under_a_window_does_not_dequantize_the_pages_it_hides(monkeypatch, fmt, window):
    """A short extend after a long prefix (a question after a long document) reads only the base pages its window
    reaches, and still equals the reference, which reads every page."""
    G, H, D = 16, 2, 64
    reqs = [(10 * G, 7)]  # ten base pages, then an overlay frame
    kv, plan = make_pool(G, H, D, D, 2, reqs, torch.float32, seed=window, fmt=fmt)
    gen = torch.Generator().manual_seed(window)
    n = 3
    q, k, v = (torch.randn(n, h, D, generator=gen) for h in (2 * H, H, H))
    qo = torch.tensor([0, n])
    read = []
    real_read_base = attention_ref.read_base
    monkeypatch.setattr(attention_ref, "read_base", lambda kv_, pages: read.append(pages.numel()) or
                        real_read_base(kv_, pages))
    out = attention_extend.extend(q, k, v, qo, kv, plan, D ** -0.5, window=window)
    first = 10 * G + 7 - window  # the first position the first new token sees
    assert read == [10 - first // G], read  # the page holding `first` and every base page after it
    monkeypatch.setattr(attention_ref, "read_base", real_read_base)
    torch.testing.assert_close(out, ref_extend(q, k, v, qo, kv, plan, D ** -0.5, window=window), rtol=1e-5,
                               atol=1e-5)
