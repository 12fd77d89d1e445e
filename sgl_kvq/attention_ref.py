"""Torch reference of attention over the packed paged base plus the fp16 overlay frames.

This is the oracle of the Triton kernels and the compute of the `kvq_torch` backend. It dequantizes per request,
only the pages that request references: never the whole pool.

The plan and layer types are in sgl_kvq/plan.py.

A sliding-window layer (SGLang's `sliding_window_size` W, -1 for none) lets a query at context position i see the
keys at positions i - W .. i: W + 1 tokens, its own included (SGLang's torch_native and triton backends alike).
Every path takes that `window` and masks by it; dropping whole hidden pages is only a saving (`visible_from`).
"""

from __future__ import annotations

import torch

from sgl_kvq.formats.registry import of_extras
from sgl_kvq.plan import LayerKV, PagedPlan


def plan_pages(plan: PagedPlan, b: int) -> torch.Tensor:
    """Request b's base pages in the plan (pool page ids, int64)."""
    return plan.kv_indices[plan.kv_indptr[b]:plan.kv_indptr[b + 1]].long()


def read_base(kv: LayerKV, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pool pages `pages` [N] as their format reads them (PageCodec.read_pages) -> k, v [N * G, H, D] fp32."""
    H, D = kv.ov_k.shape[2], kv.ov_k.shape[3]
    k, v = of_extras(kv.extras).codec.read_pages(kv, pages)
    return k.reshape(-1, H, D), v.reshape(-1, H, D)


def frame_rows(kv: LayerKV, plan: PagedPlan, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's overlay frames in the plan, as stored: k, v [n_frames, G, H, D] (copies)."""
    frames = plan.ov_indices[plan.ov_indptr[b]:plan.ov_indptr[b + 1]].long()
    return kv.ov_k[frames], kv.ov_v[frames]


def gather_context(kv: LayerKV, plan: PagedPlan, b: int, base: tuple[torch.Tensor, torch.Tensor] | None = None,
                   frames: tuple[torch.Tensor, torch.Tensor] | None = None,
                   skip_pages: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's keys and values, [T, H, D] fp32, dequantized from its own pages only (as its format reads
    them: PageCodec.read_pages; its overlay tokens through PageCodec.read_overlay). `base`: its base pages already read
    (read_base of plan_pages(plan, b)); `frames`: its frames already read (frame_rows), e.g. before a write that
    reuses them. `skip_pages`: that many leading base pages are not read (a sliding window hides them; at most
    full_base_pages): the context starts at position skip_pages * G."""
    G = kv.G
    H, D = kv.ov_k.shape[2], kv.ov_k.shape[3]
    fmt = of_extras(kv.extras)
    assert 0 <= skip_pages <= full_base_pages(plan, b, G), (skip_pages, plan.base_len(b, G))
    if base is None:
        k_base, v_base = read_base(kv, plan_pages(plan, b)[skip_pages:])
    else:
        k_base, v_base = base[0][skip_pages * G:], base[1][skip_pages * G:]
    k_fr, v_fr = frames if frames is not None else frame_rows(kv, plan, b)
    k_ov, v_ov = fmt.codec.read_overlay(k_fr.reshape(-1, H, D), v_fr.reshape(-1, H, D))
    nb, no = plan.base_len(b, G) - skip_pages * G, plan.overlay_len(b, G)
    k = torch.cat([k_base[:nb], k_ov[:no]])
    v = torch.cat([v_base[:nb], v_ov[:no]])
    return k, v


def full_base_pages(plan: PagedPlan, b: int, G: int) -> int:
    """Request b's base pages that are full (every one but a partly filled last)."""
    return plan.base_len(b, G) // G


def hidden_pages(plan: PagedPlan, b: int, G: int, first: int) -> int:
    """Request b's leading base pages wholly before context position `first` (visible_from of its earliest query):
    what a sliding window lets a reader skip."""
    return min(first // G, full_base_pages(plan, b, G))


def visible_from(query_pos, window: int):
    """The first context position a query at `query_pos` (an int or a tensor of them) sees under `window`."""
    if window < 0:
        return query_pos * 0
    return (query_pos - window).clamp(min=0) if isinstance(query_pos, torch.Tensor) else max(query_pos - window, 0)


def window_mask(n: int, p: int, window: int, device: torch.device, first: int = 0) -> torch.Tensor:
    """[n, p + n - first] bool: new token i (at position p + i, after a prefix of p tokens) sees positions
    visible_from(p + i) .. p + i, of the columns for positions first .. p + n - 1."""
    t = torch.arange(first, p + n, device=device)[None, :]
    i = torch.arange(p, p + n, device=device)[:, None]
    return (t <= i) & (t >= visible_from(i, window))


def attention_probs(q: torch.Tensor, k: torch.Tensor, sm_scale: float, mask=None) -> torch.Tensor:
    """q [N, Hq, D], k [T, H, D] (GQA: query head i reads KV head i // (Hq / H)) -> softmax [Hq, N, T] fp32."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("nhd,thd->hnt", q.float(), k.float().repeat_interleave(group, dim=1)) * sm_scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1)


def weighted_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [Hq, N, T] from attention_probs, v [T, H, Dv] -> [N, Hq, Dv] fp32."""
    return torch.einsum("hnt,thd->nhd", p, v.float().repeat_interleave(p.shape[0] // v.shape[1], dim=1))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, mask=None) -> torch.Tensor:
    """q [N, Hq, D], k/v [T, H, D] (GQA: Hq a multiple of H) -> [N, Hq, Dv] fp32."""
    return weighted_values(attention_probs(q, k, sm_scale, mask), v)


def ref_decode(q: torch.Tensor, kv: LayerKV, plan: PagedPlan, sm_scale: float, window: int = -1) -> torch.Tensor:
    """q [B, Hq, D]: one query per request over its whole context (its last `window` + 1 tokens under a sliding
    window) -> [B, Hq, Dv] in q's dtype."""
    out = torch.empty(q.shape[0], q.shape[1], kv.ov_v.shape[-1], dtype=q.dtype, device=q.device)
    for b in range(plan.batch_size):
        k, v = gather_context(kv, plan, b)
        first = visible_from(k.shape[0] - 1, window)
        out[b] = _attend(q[b:b + 1], k[first:], v[first:], sm_scale)[0].to(q.dtype)
    return out


def ref_extend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, qo_indptr: torch.Tensor, kv: LayerKV,
               plan: PagedPlan, sm_scale: float,
               contexts: list[tuple[torch.Tensor, torch.Tensor]] | None = None, window: int = -1) -> torch.Tensor:
    """Extend: request b's new tokens q/k_new/v_new[qo_indptr[b]:qo_indptr[b+1]] attend to b's cached prefix (the
    plan's pages and frames; or contexts[b] = its K/V [T, H, D] from elsewhere, e.g. SpeCache's 16-bit host tier)
    and causally to the new tokens (fresh, never re-read from the pool), all of it within `window`."""
    out = torch.empty(q.shape[0], q.shape[1], v_new.shape[-1], dtype=q.dtype, device=q.device)
    for b in range(plan.batch_size):
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if hi == lo:
            continue
        kp, vp = gather_context(kv, plan, b) if contexts is None else (contexts[b][0].float(), contexts[b][1].float())
        k = torch.cat([kp, k_new[lo:hi].float()])
        v = torch.cat([vp, v_new[lo:hi].float()])
        mask = window_mask(hi - lo, kp.shape[0], window, q.device)
        out[lo:hi] = _attend(q[lo:hi], k, v, sm_scale, mask).to(q.dtype)
    return out
