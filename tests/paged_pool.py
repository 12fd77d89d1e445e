"""A one-layer quantized pool with random contents and a PagedPlan over it: the input of the attention tests
(kernels and the batched torch decode against attention_ref)."""

from __future__ import annotations

import math

import torch

from sgl_kvq.plan import LayerKV, PagedPlan
from sgl_kvq.quant import gear_page, kivi_page, logquant_page, zipcache_page


def make_pool(G, H, D, VG, bits, reqs, dtype, seed, gear=None, salient=0, rows=None):
    """A layer whose pages hold quantized random K/V, and a PagedPlan giving each request shuffled pages/frames.
    gear=(rank, NK, NV): the pages are GEAR pages (sgl_kvq/quant/gear_page.py) carrying their correction.
    salient=NS > 0: zipcache2 pages (sgl_kvq/quant/zipcache_page.py) with NS random salient rows per page-head.
    rows=M: LogQuant pages (sgl_kvq/quant/logquant_page.py) with M row slots at random distinct offsets, about a
    quarter of them empty (255)."""
    gen = torch.Generator().manual_seed(seed)
    n_base = [math.ceil(b / G) for b, _ in reqs]
    n_ov = [math.ceil(o / G) for _, o in reqs]
    P, F = sum(n_base) + 2, sum(n_ov) + 2  # spare page 0 and a page/frame nobody references
    k_pages, v_pages = torch.randn(P, G, H, D, generator=gen) * 1.5, torch.randn(P, G, H, D, generator=gen)
    corr = sal = None
    if salient:
        v_pages[:, :, :, 1] *= 8  # an outlier value channel, for the channel scale c to matter
        idx = zipcache_page.select_salient(torch.rand(P, G, H, generator=gen), salient)
        pages, sal = zipcache_page.pack_zipcache_pages(k_pages, v_pages, idx, bits, VG)
    elif gear is None:
        pages = kivi_page.pack_pages(k_pages, v_pages, bits, VG)
    else:
        # a low-rank component and a few large entries, so the correction has something to correct
        k_pages += torch.randn(P, G, H, 1, generator=gen) * torch.randn(P, 1, H, D, generator=gen)
        k_pages[:, 3, :, 5] += 20
        pages, corr = gear_page.pack_gear_pages(k_pages, v_pages, bits, VG, *gear[:1], 2, *gear[1:])
        corr = corr._replace(v_out_val=corr.v_out_val.reshape(P * G, H, -1),
                             v_out_idx=corr.v_out_idx.reshape(P * G, H, -1))
    kv = LayerKV(
        k_codes=pages.k_codes.reshape(P * G, H, -1), k_scale=pages.k_scale, k_zero=pages.k_zero,
        v_codes=pages.v_codes.reshape(P * G, H, -1), v_scale=pages.v_scale.reshape(P * G, H, -1),
        v_zero=pages.v_zero.reshape(P * G, H, -1),
        ov_k=(torch.randn(F, G, H, D, generator=gen) * 1.5).to(dtype),
        ov_v=torch.randn(F, G, H, D, generator=gen).to(dtype),
        bits=bits, corr=corr, sal=sal,
    )
    if rows is not None:
        off = torch.stack([torch.randperm(G, generator=gen)[:rows] for _ in range(P)]).to(torch.uint8)
        off[torch.rand(P, rows, generator=gen) < 0.25] = logquant_page.EMPTY
        k_rows, v_rows = logquant_page.gather_rows(k_pages, v_pages, off)
        kv.rows = logquant_page.PageRows(k_rows + 0.5, v_rows - 0.5, off)  # differ from the codes' reading
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
            if corr is not None:
                corr.v_out_val[tail] = float("nan")
    return kv, PagedPlan(kvi, kvx, kvl, ovi, ovx, ovl)


def poison_unused(kv: LayerKV, plan: PagedPlan, G: int) -> None:
    """NaN into every page's key scale and zero and value scales, and every overlay frame, that no request of plan
    references: a path that reads beyond the batch's own pages then shows it in its output."""
    used_pages, used_frames = set(plan.kv_indices.tolist()), set(plan.ov_indices.tolist())
    for p in range(kv.k_scale.shape[0]):
        if p not in used_pages:
            kv.k_scale[p] = kv.k_zero[p] = float("nan")
            kv.v_scale[p * G:(p + 1) * G] = float("nan")
    for f in range(kv.ov_k.shape[0]):
        if f not in used_frames:
            kv.ov_k[f] = kv.ov_v[f] = float("nan")
