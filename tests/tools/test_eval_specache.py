"""SpeCache's read as `sgl-kvq eval attention` models it (bench/eval/specache.py): its ranking is the served
decode's (specache/attention.py top_positions), and its two limits are the low-bit copy and the 16-bit cache."""

from __future__ import annotations

import pytest
import torch

from sgl_kvq.attention_ref import attention_probs
from sgl_kvq.quant.compressed import fp16
from sgl_kvq.specache.attention import top_positions
from bench.eval.attention import causal_attention
from bench.eval.specache import specache

T, HQ, H, D, R = 200, 6, 2, 16, 32  # a window of 32 after 5 pages of 32 (and a partial one)
KIVI = dict(group_size=32, value_group=16, residual=R)


def _qkv(seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, H, D, generator=g) * 2 + torch.randn(1, H, D, generator=g)
    return torch.randn(T, HQ, D, generator=g), k, torch.randn(T, H, D, generator=g)


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("follow", [True, False])
def test_each_querys_16_bit_rows_are_the_served_rankings_top_k(bits, follow):
    q, k, v = _qkv(bits)
    read = specache(k, v, bits=bits, top_k=7, follow=follow, **KIVI)
    picks = read.picks(q, D ** -0.5)
    for i in (1, 3, 40, read.base - 1, read.base, T - 1):
        p = attention_probs(q[i:i + 1], read.k_hat[:i + 1], D ** -0.5)[:, 0]  # the speculative row (guess right)
        prev = attention_probs(q[i - 1:i], read.k_hat[:i], D ** -0.5)[:, 0] if follow else None
        want = top_positions(p, H, min(read.base, i + 1), 7, follow=prev)
        for h in range(H):
            got = picks[i, h].nonzero().flatten().tolist()
            assert got == sorted(t for t in want[h].tolist() if t >= 0), (i, h)


def test_every_base_row_in_16_bits_is_the_16_bit_cache_and_none_is_the_low_bit_copy():
    q, k, v = _qkv(5)
    s = D ** -0.5
    every = specache(k, v, bits=2, top_k=T, **KIVI)
    torch.testing.assert_close(every.attend(q, s, chunk=64), causal_attention(q, fp16(k), fp16(v), s),
                               rtol=1e-5, atol=1e-5)
    none = specache(k, v, bits=2, top_k=0, **KIVI)
    torch.testing.assert_close(none.attend(q, s, chunk=64), causal_attention(q, none.k_hat, none.v_hat, s),
                               rtol=1e-5, atol=1e-5)


def test_the_top_k_rows_bring_the_read_closer_to_fp16_than_the_low_bit_copy():
    q, k, v = _qkv(9)
    s = D ** -0.5
    ref = causal_attention(q, fp16(k), fp16(v), s)
    errs = [float((specache(k, v, bits=1, top_k=n, **KIVI).attend(q, s) - ref).norm() / ref.norm())
            for n in (0, 8, 32, 128)]
    assert errs == sorted(errs, reverse=True) and errs[-1] < 0.5 * errs[0], errs


@pytest.mark.parametrize("window", [20, 64, 101])
def test_a_sliding_layers_read_stays_in_its_window(window):
    # every row read in 16 bits inside the window is the windowed fp16 attention; the picks are all inside it
    q, k, v = _qkv(11)
    s = D ** -0.5
    every = specache(k, v, bits=2, top_k=T, **KIVI)
    torch.testing.assert_close(every.attend(q, s, chunk=64, window=window),
                               causal_attention(q, fp16(k), fp16(v), s, window=window), rtol=1e-5, atol=1e-5)
    picks = specache(k, v, bits=1, top_k=7, **KIVI).picks(q, s, window=window)
    for i in (5, window - 1, window, 150, T - 1):
        for h in range(H):
            got = picks[i, h].nonzero().flatten()
            assert got.numel() == min(7, max(0, min(i, read_base(k) - 1) - max(0, i - window + 1) + 1))
            assert bool(((got > i - window) & (got <= i)).all()), (i, h, got)


def read_base(k):
    return specache(k, k, bits=1, top_k=1, **KIVI).base


def test_values_in_the_hadamard_basis_change_only_what_the_low_bit_copy_reads():
    """values_basis R (KVQ_ROTATE=values): read wholly in 16 bits it is still the 16-bit cache (the rotated rows'
    rounding aside); its rankings are the unrotated read's (the keys are not rotated); its low-bit read is KIVI's over
    the rotated values, rotated back."""
    from bench.quant.kivi import kivi
    from sgl_kvq.quant.rotation import block_hadamard

    q, k, v = _qkv(6)
    s, r = D ** -0.5, block_hadamard(D)
    every = specache(k, v, bits=2, top_k=T, values_basis=r, **KIVI)
    torch.testing.assert_close(every.attend(q, s, chunk=64), causal_attention(q, fp16(k), fp16(v), s),
                               rtol=2e-3, atol=2e-3)
    plain, rotated = specache(k, v, bits=2, top_k=7, **KIVI), specache(k, v, bits=2, top_k=7, values_basis=r, **KIVI)
    assert torch.equal(plain.picks(q, s), rotated.picks(q, s))
    low = kivi(k, v @ r, bits=2, **KIVI).v_hat @ r.T
    torch.testing.assert_close(rotated.v_hat, low)
    assert not torch.allclose(rotated.v_hat, plain.v_hat, atol=1e-2)
