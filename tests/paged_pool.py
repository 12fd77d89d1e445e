"""A one-layer quantized pool with random contents and a PagedPlan over it: the input of the attention tests
(kernels and the batched torch decode against attention_ref)."""

from __future__ import annotations

import math

import torch

from sgl_kvq.plan import LayerKV, PagedPlan
from sgl_kvq.quant import kivi_page


def make_pool(G, H, D, VG, bits, reqs, dtype, seed):
    """A layer whose pages hold quantized random K/V, and a PagedPlan giving each request shuffled pages/frames."""
    gen = torch.Generator().manual_seed(seed)
    n_base = [math.ceil(b / G) for b, _ in reqs]
    n_ov = [math.ceil(o / G) for _, o in reqs]
    P, F = sum(n_base) + 2, sum(n_ov) + 2  # spare page 0 and a page/frame nobody references
    pages = kivi_page.pack_pages(torch.randn(P, G, H, D, generator=gen) * 1.5,
                                 torch.randn(P, G, H, D, generator=gen), bits, VG)
    kv = LayerKV(
        k_codes=pages.k_codes.reshape(P * G, H, -1), k_scale=pages.k_scale, k_zero=pages.k_zero,
        v_codes=pages.v_codes.reshape(P * G, H, -1), v_scale=pages.v_scale.reshape(P * G, H, -1),
        v_zero=pages.v_zero.reshape(P * G, H, -1),
        ov_k=(torch.randn(F, G, H, D, generator=gen) * 1.5).to(dtype),
        ov_v=torch.randn(F, G, H, D, generator=gen).to(dtype),
        bits=bits,
    )
    page_ids = (torch.randperm(P - 1, generator=gen) + 1)[: sum(n_base)]
    frame_ids = torch.randperm(F, generator=gen)[: sum(n_ov)]

    def lists(counts, lens, ids):
        indptr = torch.tensor([0] + counts).cumsum(0)
        last = [0 if c == 0 else n - (c - 1) * G for c, n in zip(counts, lens)]
        return indptr.int(), ids.int(), torch.tensor(last, dtype=torch.int32)

    kvi, kvx, kvl = lists(n_base, [b for b, _ in reqs], page_ids)
    ovi, ovx, ovl = lists(n_ov, [o for _, o in reqs], frame_ids)
    # Past each context's end, a pool holds whatever was there: NaN here, which kernels must never let through.
    for b in range(len(reqs)):
        if n_ov[b]:
            f = int(ovx[ovi[b + 1] - 1])
            kv.ov_k[f, int(ovl[b]):] = float("nan")
            kv.ov_v[f, int(ovl[b]):] = float("nan")
        elif n_base[b]:
            tail = slice(int(kvx[kvi[b + 1] - 1]) * G + int(kvl[b]), (int(kvx[kvi[b + 1] - 1]) + 1) * G)
            kv.v_scale[tail] = float("nan")
            kv.v_zero[tail] = float("nan")
    return kv, PagedPlan(kvi, kvx, kvl, ovi, ovx, ovl)
