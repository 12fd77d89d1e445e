"""Torch reference of SpeCache's two decode lanes over the quantized pool (the compute of kvq_torch for specache
dtypes, any device). Per request b, its context is the plan's base pages (dequantized) then its fp16 frames.

Output row (the real token): the context with the prefetched top-k rows of each KV head replacing those
positions' dequantized K/V (the rows come from the host tier in 16 bits; positions outside the packed base are
ignored: the window is fp16 already). Attention is exact over the union because softmax attention does not care
where a row came from (LogQuant's permutation argument): a replaced position is simply a better copy.

Speculative row (the previous step's guess of the next token, or the real token itself in the pre-decode step):
the context as stored (low-bit base + fp16 window, no top-k) plus its own fresh K/V, never written. Its attention
over the packed base, summed over the query heads of each KV head, names the top-k positions to prefetch.

Recall (a diagnostic): the output row's exact top-k, i.e. over the context's 16-bit rows from the host tier, and
the share of it the prefetched set covered.
"""

from __future__ import annotations

import torch

from sgl_kvq.attention_ref import LayerKV, PagedPlan, gather_context


def _probs(q: torch.Tensor, k: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [Hq, D], k [T, H, D] -> softmax probabilities [Hq, T] fp32 (GQA: query head i reads KV head i // group)."""
    group = q.shape[0] // k.shape[1]
    s = torch.einsum("hd,thd->ht", q.float(), k.float().repeat_interleave(group, dim=1)) * sm_scale
    return torch.softmax(s, dim=-1)


def _out(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = p.shape[0] // v.shape[1]
    return torch.einsum("ht,thd->hd", p, v.float().repeat_interleave(group, dim=1))


def top_positions(p: torch.Tensor, num_kv_heads: int, n_base: int, k: int) -> torch.Tensor:
    """Top-k positions < n_base per KV head by attention mass summed over its query heads: [H, k], -1 padded."""
    out = torch.full((num_kv_heads, k), -1, dtype=torch.int64, device=p.device)
    n = min(k, n_base)
    if n:
        mass = p[:, :n_base].reshape(num_kv_heads, -1, n_base).sum(1)
        out[:, :n] = mass.topk(n, dim=-1).indices
    return out


def output_rows(q: torch.Tensor, kv: LayerKV, plan: PagedPlan, topk_k: torch.Tensor, topk_v: torch.Tensor,
                topk_pos: torch.Tensor, sm_scale: float,
                exact: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> tuple[torch.Tensor, list]:
    """q [B, Hq, D]; topk_k/v [B, H, K, D], topk_pos [B, H, K] (-1: none) -> (out [B, Hq, D] in q's dtype,
    per request (hits, wanted) of the exact top-k when `exact` gives each request's 16-bit context K/V)."""
    B, Hq, D = q.shape
    H = topk_pos.shape[1]
    out = torch.empty(B, Hq, kv.ov_v.shape[-1], dtype=q.dtype, device=q.device)
    recall = []
    for b in range(B):
        k, v = gather_context(kv, plan, b)
        n_base = plan.base_len(b, kv.G)
        pos = topk_pos[b]
        use = (pos >= 0) & (pos < n_base)
        heads = torch.arange(H, device=q.device)[:, None].expand_as(pos)
        k[pos[use], heads[use]] = topk_k[b][use].float()
        v[pos[use], heads[use]] = topk_v[b][use].float()
        out[b] = _out(_probs(q[b], k, sm_scale), v).to(q.dtype)
        if exact is not None:
            want = top_positions(_probs(q[b], exact[b][0], sm_scale), H, n_base, topk_pos.shape[2])
            hits = sum(len(set(w[w >= 0].tolist()) & set(g[u].tolist())) for w, g, u in zip(want, pos, use))
            recall.append((hits, int((want >= 0).sum())))
    return out, recall


def speculative_rows(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, kv: LayerKV, plan: PagedPlan,
                     sm_scale: float, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D], own k/v [B, H, D] (appended after each request's context, not stored) -> (out [B, Hq, D],
    top-k positions [B, H, top_k] over the packed base, -1 padded)."""
    B, Hq, D = q.shape
    H = k_own.shape[1]
    out = torch.empty(B, Hq, kv.ov_v.shape[-1], dtype=q.dtype, device=q.device)
    pos = torch.full((B, H, top_k), -1, dtype=torch.int64, device=q.device)
    for b in range(B):
        k, v = gather_context(kv, plan, b)
        k = torch.cat([k, k_own[b:b + 1].float()])
        v = torch.cat([v, v_own[b:b + 1].float()])
        p = _probs(q[b], k, sm_scale)
        out[b] = _out(p, v).to(q.dtype)
        pos[b] = top_positions(p, H, plan.base_len(b, kv.G), top_k)
    return out, pos
