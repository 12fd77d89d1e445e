"""SpeCache's 16-bit cached prefix as frames (sgl_kvq/specache/prefix_frames.py): kvq_triton's fused extend over the
staged frames equals the torch reference reading the host tier's rows directly (ref_extend with contexts, what
kvq_torch runs), for prefixes of odd lengths, none, exactly a page, and with GQA."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton import (tests/conftest.py does the same)

import pytest  # noqa: E402

from sgl_kvq.attention_ref import ref_extend  # noqa: E402
from sgl_kvq.kernels.extend_attention import extend_attention  # noqa: E402
from sgl_kvq.specache import prefix_frames  # noqa: E402
from sgl_kvq.specache.host_tier import HostTier  # noqa: E402
from kernel_checks import DEVICE, DTYPES, assert_close_written, to_device  # noqa: E402
from paged_pool import make_pool  # noqa: E402

# (G, H, group, D, requests as (prefix tokens, new tokens))
CASES = {
    "G16-gqa3-odd": (16, 2, 3, 64, [(37, 5), (0, 9), (16, 1), (70, 20)]),
    "G32-mha": (32, 1, 1, 128, [(95, 3), (32, 32)]),
}


def test_build_lays_each_prefix_out_in_its_own_frames():
    slots = [torch.tensor([9, 4, 7]), torch.zeros(0, dtype=torch.int64), torch.arange(16) + 100, torch.arange(20)]
    pf = prefix_frames.build(slots, 16, torch.device("cpu"))
    assert pf.num_frames == 1 + 0 + 1 + 2
    assert pf.plan.ov_indptr.tolist() == [0, 1, 1, 2, 4] and pf.plan.ov_indices.tolist() == [0, 1, 2, 3]
    assert pf.plan.ov_last_page_len.tolist() == [3, 0, 16, 4]
    assert pf.plan.kv_indptr.tolist() == [0] * 5 and pf.plan.kv_indices.numel() == 0  # no base page is read
    assert pf.slots.tolist() == [9, 4, 7] + list(range(100, 116)) + list(range(20))
    assert pf.rows.tolist() == [0, 1, 2] + list(range(16, 32)) + list(range(32, 52))


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_extend_over_staged_frames_matches_the_host_rows(case, dtype):
    G, H, group, D, reqs = CASES[case]
    gen = torch.Generator().manual_seed(G + H)
    S = 4 * G * (len(reqs) + 2)
    host = HostTier(2, S, H, D, dtype, torch.device("cpu"))
    for layer in range(2):
        host.hk[layer] = (torch.randn(S, H, D, generator=gen) * 1.5).to(dtype)
        host.hv[layer] = torch.randn(S, H, D, generator=gen).to(dtype)
    perm = torch.randperm(S, generator=gen)
    slots, used = [], 0
    for n, _ in reqs:  # each request's prefix at scattered slots, no slot shared
        slots.append(perm[used:used + n])
        used += n
    pf = prefix_frames.build(slots, G, torch.device(DEVICE))
    kv, _ = make_pool(G, H, D, 64, 2, [(0, 1)], dtype, seed=1)  # a pool whose pages must not be read
    qo_indptr = torch.tensor([0] + [m for _, m in reqs]).cumsum(0).int()
    N = int(qo_indptr[-1])
    q = torch.randn(N, H * group, D, generator=gen).to(dtype)
    k_new, v_new = (torch.randn(N, H, D, generator=gen) * 1.5).to(dtype), torch.randn(N, H, D, generator=gen).to(dtype)
    sm_scale = D ** -0.5
    layer = 1
    contexts = [host.rows(layer, s) for s in slots]
    ref = ref_extend(q, k_new, v_new, qo_indptr, kv, pf.plan, sm_scale, contexts=contexts)
    ov_k, ov_v = prefix_frames.stage(pf, host, layer)
    dev = to_device(kv)
    dev.ov_k, dev.ov_v = ov_k.to(DEVICE), ov_v.to(DEVICE)
    out = torch.full_like(q, float("nan"), device=DEVICE)
    extend_attention(q.to(DEVICE), k_new.to(DEVICE), v_new.to(DEVICE), qo_indptr.to(DEVICE), dev, to_device(pf.plan),
                     sm_scale, out=out)
    assert_close_written(out, ref, dtype)
    # the other layer's rows give another answer: the frames hold this layer's prefix
    other_k, other_v = prefix_frames.stage(pf, host, 0)
    assert not torch.equal(other_k, ov_k) and torch.equal(ov_k.view(-1, H, D)[pf.rows], host.hk[layer][pf.slots])
