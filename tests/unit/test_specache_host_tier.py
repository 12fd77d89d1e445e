"""SpeCache's host tier: the row-copy kernels against their torch references, the tier's write/read/prefetch, and
the startup budget check."""

from __future__ import annotations

import pytest
import torch

from sgl_kvq.config import KVQConfigError
from sgl_kvq.kernels.host_rows import gather_head_rows, scatter_rows
from sgl_kvq.specache.host_tier import (HostTier, check_host_budget, gather_head_rows_ref, host_bytes_per_token,
                                        scatter_rows_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def host_tensor(shape, dtype):
    t = torch.randn(shape).to(dtype)
    return t.pin_memory() if DEVICE == "cuda" else t


@pytest.mark.parametrize("H,D,dtype", [(3, 64, torch.float16), (1, 16, torch.float32), (8, 128, torch.bfloat16)])
def test_scatter_rows_matches_reference(H, D, dtype):
    S, T = 40, 7
    hk, hv = host_tensor((S, H, D), dtype), host_tensor((S, H, D), dtype)
    want_k, want_v = hk.clone(), hv.clone()
    k = torch.randn(T, H, D, device=DEVICE).to(dtype)  # rows arrive in the model dtype the tier stores
    v = torch.randn(T, H, D, device=DEVICE).to(dtype)
    slots = torch.tensor([5, 0, 39, 12, 13, 6, 21], device=DEVICE)
    scatter_rows(k, v, slots, hk, hv)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    scatter_rows_ref(k, v, slots, want_k, want_v)
    assert torch.equal(hk, want_k) and torch.equal(hv, want_v)


@pytest.mark.parametrize("H,D,dtype", [(3, 64, torch.float16), (2, 16, torch.float32)])
def test_gather_head_rows_matches_reference(H, D, dtype):
    S, M = 30, 12  # host slots, output rows (9 copies below)
    hk, hv = host_tensor((S, H, D), dtype), host_tensor((S, H, D), dtype)
    slots = torch.tensor([3, -1, 29, 0, 7, 7, -1, 15, 2], device=DEVICE)  # -1: nothing to fetch, a zero row
    heads = torch.tensor([0, 1, H - 1, 1 % H, 0, H - 1, 0, 1 % H, 0], device=DEVICE)
    rows = torch.tensor([11, 0, 3, 4, 5, 6, 7, 8, 1], device=DEVICE)
    out_k = torch.full((M, D), 7.0, dtype=dtype, device=DEVICE)
    out_v = out_k.clone()
    want_k, want_v = out_k.clone(), out_v.clone()
    gather_head_rows(hk, hv, slots, heads, out_k, out_v, rows)
    gather_head_rows_ref(hk, hv, slots, heads, want_k, want_v, rows)
    assert torch.equal(out_k, want_k) and torch.equal(out_v, want_v)
    assert (out_k[0] == 0).all() and (out_k[2] == 7).all()  # a -1 slot zeroes its row; untargeted rows stay


def test_host_tier_write_rows_prefetch():
    L, S, H, D = 2, 32, 2, 16
    tier = HostTier(L, S, H, D, torch.float32, torch.device(DEVICE))
    assert tier.nbytes() == S * host_bytes_per_token(L, H, D, torch.float32)
    k, v = torch.randn(5, H, D, device=DEVICE), torch.randn(5, H, D, device=DEVICE)
    slots = torch.tensor([3, 4, 5, 20, 31], device=DEVICE)
    tier.write(1, slots, k, v)
    rk, rv = tier.rows(1, slots[[4, 0]])
    assert torch.equal(rk.cpu(), k[[4, 0]].cpu()) and torch.equal(rv.cpu(), v[[4, 0]].cpu())
    assert not tier.hk[0].any()  # another layer untouched
    out_k = torch.zeros(4, D, device=DEVICE)
    out_v = torch.zeros(4, D, device=DEVICE)
    tier.prefetch(1, torch.tensor([20, -1, 3], device=DEVICE), torch.tensor([1, 0, 0], device=DEVICE), out_k, out_v,
                  torch.tensor([2, 0, 3], device=DEVICE))
    tier.wait(1)
    assert torch.equal(out_k[2].cpu(), k[3, 1].cpu()) and torch.equal(out_v[3].cpu(), v[0, 0].cpu())
    assert not out_k[0].any() and not out_k[1].any()


def test_budget_check_refuses_a_tier_larger_than_the_host_allows():
    check_host_budget("specache2", tokens=1000, bytes_per_token=1024, fraction=0.5, available=4 * 2**20)
    with pytest.raises(KVQConfigError, match=r"--max-total-tokens 2048\b"):
        check_host_budget("specache2", tokens=5000, bytes_per_token=1024, fraction=0.5, available=4 * 2**20)
