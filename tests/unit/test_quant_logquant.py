"""LogQuant: the log-spaced fp16 selection and permutation invariance of attention."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.quant.accounting import stored_bytes
from bench.quant.logquant import log_positions, logquant
from sgl_kvq.formats.logquant.codec import max_rows, simulate_rows


@settings(max_examples=60, deadline=None)
@given(T=st.integers(0, 3000), W=st.integers(1, 64))
def test_selection_is_bounded_recent_and_log_spaced(T, W):
    p = log_positions(T, W)
    assert p == sorted(set(p)) and all(0 <= x < T for x in p)
    assert len(p) == T if T < 3 * W else 2 * W <= len(p) < 3 * W
    assert p[-W:] == list(range(max(0, T - W), T))  # the most recent W
    if T:
        assert p[0] == 0
    gaps = [b - a for a, b in zip(p[1:], p[2:])]
    assert all(a >= b for a, b in zip(gaps, gaps[1:]))  # density never decreases towards the present


def test_selection_example():
    assert log_positions(8, 2) == [0, 4, 6, 7] and log_positions(6, 2) == [0, 2, 4, 5]
    assert log_positions(5, 2) == [0, 1, 2, 3, 4]  # T < 3W: all kept


def test_fp16_positions_and_bytes():
    g = torch.Generator().manual_seed(0)
    T, H, D, G, R, W = 200, 2, 16, 32, 32, 10
    k, v = torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)
    c = logquant(k, v, window=W, group_size=G, value_group=16, residual=R)
    n_q = 160  # 6 complete pages, the last one in KIVI's window; the open page after
    rows = {n * G + t for n, r in enumerate(simulate_rows(W, G, 2, n_q // G)) for t in r}
    fp = sorted(rows | set(range(n_q, T)))
    assert c.kept[:, 0].nonzero().squeeze(1).tolist() == fp
    assert 0 in fp and set(log_positions(T, W)) <= set(fp)  # the sink and everything the rule keeps now
    assert torch.equal(c.k_hat[fp], k[fp].half().float()) and torch.equal(c.v_hat[fp], v[fp].half().float())
    M = max_rows(W, G, 2)
    codes, k_sz, v_sz = n_q * H * D * 2 // 8, 2 * (n_q // G) * H * D * 2, 2 * n_q * H * 2
    slots = (n_q // G) * M * H * D * 2  # every page's M row slots, used or not, as the pool stores them
    assert stored_bytes(c, "k.") == codes + k_sz + slots + (n_q // G) * M + (T - n_q) * H * D * 2
    assert stored_bytes(c, "v.") == codes + v_sz + slots + (T - n_q) * H * D * 2


def _attend(q, k, v):
    return torch.softmax(q @ k.T / k.shape[-1] ** 0.5, dim=-1) @ v


@pytest.mark.parametrize("seed", [0, 1])
def test_attention_is_permutation_invariant(seed):
    # LogQuant section 2.4: the fp16 tokens need not sit in position order next to the quantized ones
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(4, 16, generator=g), torch.randn(50, 16, generator=g), torch.randn(50, 16, generator=g)
    perm = torch.randperm(50, generator=g)
    assert torch.allclose(_attend(q, k[perm], v[perm]), _attend(q, k, v), atol=1e-6)
    assert not torch.allclose(_attend(q, k[perm], v), _attend(q, k, v), atol=1e-3)  # only jointly
