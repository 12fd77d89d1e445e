"""A one-layer quantized pool with random contents and a PagedPlan over it: the input of the attention tests
(kernels and the batched torch decode against attention_ref)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import torch

from sgl_kvq.config import parse_kv_cache_dtype
from sgl_kvq.plan import LayerKV, PagedPlan
from sgl_kvq.formats.gear import codec as gear_page
from sgl_kvq.formats.logquant import codec as logquant_page
from sgl_kvq.formats.zipcache import codec as zipcache_page
from sgl_kvq.quant import kivi_page


def random_requests(rng: random.Random, B: int, G: int) -> list[tuple[int, int]]:
    """(base tokens, overlay tokens) per request; the base is whole pages whenever an overlay follows it."""
    reqs = []
    for _ in range(B):
        kind = rng.choice(["short", "base_only", "overlay_only", "both"])
        if kind == "short":  # less than a page, in the open page's frame
            reqs.append((0, rng.randint(1, G - 1)))
        elif kind == "base_only":  # no overlay: the last base page may be partial
            reqs.append((rng.randint(1, 4 * G), 0))
        elif kind == "overlay_only":
            reqs.append((0, rng.randint(1, 2 * G)))
        else:
            reqs.append((rng.randint(1, 4) * G, rng.randint(1, 2 * G)))
    return reqs


SHAPES = [  # (G, H, D, VG)
    (16, 2, 64, 64),
    (64, 3, 64, 64),  # SmolLM2's KV geometry
    (32, 1, 128, 32),
]


def frames_apart(x: torch.Tensor, gap: int) -> torch.Tensor:
    """Frames x [F, G, H, D] laid `gap` elements apart with NaN between them, as pooled kivi3 frames lie k pages'
    codes apart (sgl_kvq/frames.py frame_view); gap 0: x itself."""
    if not gap:
        return x
    buf = torch.full((x.shape[0], x[0].numel() + gap), float("nan"), dtype=x.dtype)
    out = buf[:, :x[0].numel()].view(x.shape)
    out.copy_(x)
    return out


def make_pool(G, H, D, VG, bits, reqs, dtype, seed, gear=None, salient=0, rows=None, frame_gap=0, peer=None):
    """A layer whose pages hold quantized random K/V, and a PagedPlan giving each request shuffled pages/frames.
    gear=(rank, NK, NV): the pages are GEAR pages (sgl_kvq/formats/gear/codec.py) carrying their correction.
    salient=NS > 0: zipcache2 pages (sgl_kvq/formats/zipcache/codec.py) with NS random salient rows per page-head.
    rows=M: LogQuant pages (sgl_kvq/formats/logquant/codec.py) with M row slots at random distinct offsets, about a
    quarter of them empty (255). frame_gap: the overlay frames lie that many elements apart (frames_apart).
    peer=a dtype name of sgl_kvq/formats/peers/: its own base and per-slot extras (no KIVI scales)."""
    gen = torch.Generator().manual_seed(seed)
    n_base = [math.ceil(b / G) for b, _ in reqs]
    n_ov = [math.ceil(o / G) for _, o in reqs]
    P, F = sum(n_base) + 2, sum(n_ov) + 2  # spare page 0 and a page/frame nobody references
    k_pages, v_pages = torch.randn(P, G, H, D, generator=gen) * 1.5, torch.randn(P, G, H, D, generator=gen)
    corr = sal = None
    if peer is not None:
        fmt = parse_kv_cache_dtype(peer).format
        base, ex = fmt.pack(None, VG, k_pages, v_pages, None, {})
        pages = SimpleNamespace(k_codes=base.k_codes, v_codes=base.v_codes, k_scale=None, k_zero=None,
                                v_scale=None, v_zero=None)
        sal = ex._make(t.reshape(P * G, *t.shape[2:]) for t in ex)  # per token slot
    elif salient:
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
        v_codes=pages.v_codes.reshape(P * G, H, -1),
        v_scale=None if pages.v_scale is None else pages.v_scale.reshape(P * G, H, -1),
        v_zero=None if pages.v_zero is None else pages.v_zero.reshape(P * G, H, -1),
        ov_k=frames_apart((torch.randn(F, G, H, D, generator=gen) * 1.5).to(dtype), frame_gap),
        ov_v=frames_apart(torch.randn(F, G, H, D, generator=gen).to(dtype), frame_gap),
        bits=bits, extras=corr if corr is not None else sal,
    )
    if rows is not None:
        off = torch.stack([torch.randperm(G, generator=gen)[:rows] for _ in range(P)]).to(torch.uint8)
        off[torch.rand(P, rows, generator=gen) < 0.25] = logquant_page.EMPTY
        k_rows, v_rows = logquant_page.gather_rows(k_pages, v_pages, off)
        kv.extras = logquant_page.PageRows(k_rows + 0.5, v_rows - 0.5, off)  # differ from the codes' reading
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
            if peer is not None:  # its float per-slot scales or norms
                for t in kv.extras:
                    if t.is_floating_point():
                        t[tail] = float("nan")
                continue
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


# Decode checks every decode path runs (attention_pages, the C kernel): decode(q, kv, plan) -> [B, Hq, D], compared
# with attention_ref.ref_decode in fp32 within 1e-5.
EDGE_BATCHES = [[(0, 5)], [(0, 5), (0, 64)], [(3, 0)], [(130, 0), (2, 0)], [(64, 1), (0, 1)]]
EDGE_IDS = ["overlay-only", "overlays-only", "one-partial-page", "partial-pages", "one-token-frames"]


def _close_to_reference(out, q, kv, plan) -> None:
    from sgl_kvq.attention_ref import ref_decode

    torch.testing.assert_close(out, ref_decode(q, kv, plan, q.shape[-1] ** -0.5), rtol=1e-5, atol=1e-5)


def check_edge_batch(decode, reqs) -> None:
    """Batches with no base page at all, no overlay frame at all, and single-token units (EDGE_BATCHES)."""
    G, H, D, VG = 64, 3, 64, 64
    kv, plan = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=5)
    q = torch.randn(len(reqs), H * 3, D, generator=torch.Generator().manual_seed(5))
    out = decode(q, kv, plan)
    assert not out.isnan().any()
    _close_to_reference(out, q, kv, plan)


def check_reads_only_the_batch_pages(decode, G, H, D, VG) -> None:
    """Pages and frames no request references (poisoned with NaN) never reach the output."""
    reqs = [(3 * G, 5), (7, 0), (0, 20)]
    kv, plan = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=3)
    poison_unused(kv, plan, G)
    q = torch.randn(len(reqs), H * 2, D)
    _close_to_reference(decode(q, kv, plan), q, kv, plan)


def check_scales_are_read(decode, G, H, D, VG) -> None:
    """Folding the scales into the query and weights still reads them: doubling a used page's key scale or a used
    token's value scale moves the output exactly as it moves the reference's."""
    kv, plan = make_pool(G, H, D, VG, 2, [(2 * G, 10), (G, 3)], torch.float32, seed=8)
    q = torch.randn(2, H * 3, D, generator=torch.Generator().manual_seed(8))
    before = decode(q, kv, plan)
    page = int(plan.kv_indices[0])
    kv.k_scale[page] *= 2
    kv.v_scale[page * G:(page + 1) * G] *= 2
    after = decode(q, kv, plan)
    assert (after - before).abs().max() > 1e-3
    _close_to_reference(after, q, kv, plan)
