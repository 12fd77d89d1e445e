"""A one-layer quantized pool with random contents and a PagedPlan over it: the input of the attention tests
(kernels and the batched torch decode against attention_ref)."""

from __future__ import annotations

import math
import random
import torch

from sgl_kvq.config import KVQConfig
from sgl_kvq.formats.page_codec import PageWrite
from sgl_kvq.layout import PageGeometry
from sgl_kvq.plan import LayerKV, PagedPlan


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


# Data that gives a format's correction something to correct (random pages have no structure to find):
# GEAR's low rank and large entries, ZipCache's outlier value channel for its channel scale c.
def _low_rank_and_outliers(gen, k, v):
    P, G, H, D = k.shape
    k += torch.randn(P, G, H, 1, generator=gen) * torch.randn(P, 1, H, D, generator=gen)
    k[:, 3 % G, :, 5 % D] += 20


def _outlier_value_channel(gen, k, v):
    v[:, :, :, 1] *= 8


SHAPING = {"gear": _low_rank_and_outliers, "gearl": _low_rank_and_outliers, "zipcache": _outlier_value_channel}


def make_pool(G, H, D, VG, bits, reqs, dtype, seed, fmt="kivi", params=None, frame_gap=0, v_bits=None,
              v_frame_gap=None):
    """A layer whose pages hold random K/V packed by format family `fmt` at width `bits` (values at `v_bits` where
    given, as a recipe's layer stores them; its codec, at `params`,
    the family's parameters dataclass, defaults where None), shaped as the format declares, and a PagedPlan giving
    each request shuffled pages/frames. Each page is written as the server writes it: with its logical index in
    its request (LogQuant's rows) and random attention received (ZipCache's saliency). frame_gap: the overlay
    frames lie that many elements apart (frames_apart), the value frames v_frame_gap apart where given (pooled frames
    over a recipe layer's key and value codes of different widths)."""
    gen = torch.Generator().manual_seed(seed)
    n_base = [math.ceil(b / G) for b, _ in reqs]
    n_ov = [math.ceil(o / G) for _, o in reqs]
    P, F = sum(n_base) + 2, sum(n_ov) + 2  # spare page 0 and a page/frame nobody references
    page_ids = (torch.randperm(P - 1, generator=gen) + 1)[: sum(n_base)]
    frame_ids = torch.randperm(F, generator=gen)[: sum(n_ov)]
    lpages = torch.zeros(P, dtype=torch.int64)  # each page's index in its request (0 where unused)
    lpages[page_ids] = torch.cat([torch.arange(n) for n in n_base]) if page_ids.numel() else page_ids

    # the default fp16 window R = 64 where G divides it (LogQuant's rows depend on it), else one page
    cfg = KVQConfig(method=fmt, bits=bits, group_size=G, value_group=VG, residual=G * max(1, 64 // G), params=params)
    form = cfg.format
    g = PageGeometry(P=P, G=G, H=H, D=D, NG=D // VG)
    k_pages, v_pages = torch.randn(P, G, H, D, generator=gen) * 1.5, torch.randn(P, G, H, D, generator=gen)
    SHAPING.get(fmt, lambda *_: None)(gen, k_pages, v_pages)
    v_bits = v_bits or bits
    w = PageWrite(torch.arange(P), lpages, received=torch.rand(P, G, H, generator=gen), bits=(bits, v_bits))
    base, extras = form.codec.pack(cfg, VG, k_pages, v_pages, w, form.codec.tables(cfg, g, torch.device("cpu")))
    declared = {**form.base_shapes(g, bits, v_bits), **form.page_shapes(g, **form.sizes(cfg, g))}

    def as_declared(name, t):  # a per-slot tensor comes from pack as [P, G, ...]
        return t.reshape(declared[name][0])

    named = dict(zip(base._fields, base))
    kv = LayerKV(
        **{n: None if named.get(n) is None else as_declared(n, named[n])
           for n in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero")},
        ov_k=frames_apart((torch.randn(F, G, H, D, generator=gen) * 1.5).to(dtype), frame_gap),
        ov_v=frames_apart(torch.randn(F, G, H, D, generator=gen).to(dtype),
                          frame_gap if v_frame_gap is None else v_frame_gap),
        k_bits=bits, v_bits=v_bits,
        extras=None if extras is None else extras._make(as_declared(n, t) for n, t in zip(extras._fields, extras)),
    )
    per_slot = [getattr(kv, n) if n in base._fields else getattr(kv.extras, n) for n, (dims, dtype_) in
                declared.items() if dims[0] == g.S and dtype_.is_floating_point]

    def lists(counts, lens, ids):
        indptr = torch.tensor([0] + counts).cumsum(0)
        last = [0 if c == 0 else n - (c - 1) * G for c, n in zip(counts, lens)]
        return indptr.int(), ids.int(), torch.tensor(last, dtype=torch.int32)

    kvi, kvx, kvl = lists(n_base, [b for b, _ in reqs], page_ids)
    ovi, ovx, ovl = lists(n_ov, [o for _, o in reqs], frame_ids)
    # Past each context's end, a pool holds whatever was there: NaN here (in the frame, or in the per-slot scales
    # of a partial last page), which kernels must never let through.
    for b in range(len(reqs)):
        if n_ov[b]:
            f = int(ovx[ovi[b + 1] - 1])
            kv.ov_k[f, int(ovl[b]):] = float("nan")
            kv.ov_v[f, int(ovl[b]):] = float("nan")
        elif n_base[b]:
            tail = slice(int(kvx[kvi[b + 1] - 1]) * G + int(kvl[b]), (int(kvx[kvi[b + 1] - 1]) + 1) * G)
            for t in per_slot:
                t[tail] = float("nan")
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
