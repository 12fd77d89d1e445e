"""Torch reference of SpeCache's two decode lanes over the quantized pool (the compute of kvq_torch for specache
dtypes, any device). Per request b, its context is the plan's base pages (dequantized) then its fp16 frames.

Both rows of a request read the same keys (the paper's Algorithm 3: K = [K' U K_{K_t}, K_t]): the context with
this step's prefetched top-k rows of each KV head replacing those positions' dequantized K/V (`with_topk`; the
rows come from the host tier in 16 bits; positions outside the packed base are ignored: the window is fp16
already). Attention is exact over the union because softmax attention does not care where a row came from
(LogQuant's permutation argument): a replaced position is simply a better copy.

Output row (the real token): attends to that context. Speculative row (the previous step's guess of the next
token, or the real token itself in the pre-decode step, which has no top-k yet): attends to it plus its own fresh
K/V, never written. Its attention over the packed base, summed over the query heads of each KV head, names the
top-k positions to prefetch; with the 16-bit rows of the positions that mattered one step ago in its keys, its
ranking and its next-token guess are computed from exact copies where they matter most. With specache_follow the
output row's mass one position earlier is added to the ranking: a copying head that read position p this step
reads p + 1 next (the paper ranks by the speculative row alone; config.py has the measurement).

Recall (a diagnostic): the output row's exact top-k, i.e. over the context's 16-bit rows from the host tier, and
the share of it the prefetched set covered.

Both lanes take each request's context as gathered once per layer (attention_ref.gather_context: K/V [T, H, D]
fp32, packed base dequantized, then the fp16 frames) with n_base = how many of its rows come from the base.
"""

from __future__ import annotations

import torch

from sgl_kvq.attention_ref import attention_probs, weighted_values

Context = tuple[torch.Tensor, torch.Tensor]


def top_positions(p: torch.Tensor, num_kv_heads: int, n_base: int, k: int,
                  follow: torch.Tensor | None = None) -> torch.Tensor:
    """p [Hq, T] (one query's attention_probs) -> top-k positions < n_base per KV head by attention mass summed over
    its query heads: [H, k], -1 padded. follow [Hq, T'] (the real row's attention_probs, T' >= n_base): its mass
    one position later is added, so the row after each position the real token read is a candidate too."""
    out = torch.full((num_kv_heads, k), -1, dtype=torch.int64, device=p.device)
    n = min(k, n_base)
    if n:
        mass = p[:, :n_base].reshape(num_kv_heads, -1, n_base).sum(1)
        if follow is not None and n_base > 1:
            mass[:, 1:] += follow[:, :n_base - 1].reshape(num_kv_heads, -1, n_base - 1).sum(1)
        out[:, :n] = mass.topk(n, dim=-1).indices
    return out


def _usable(pos: torch.Tensor, n_base: int) -> torch.Tensor:
    """pos [H, K] prefetched positions (-1: none) -> which of them replace a packed base row."""
    return (pos >= 0) & (pos < n_base)


def with_topk(contexts: list[Context], n_base: list[int], topk_k: torch.Tensor, topk_v: torch.Tensor,
              topk_pos: torch.Tensor) -> list[Context]:
    """Each request's context with its prefetched 16-bit rows in place of their dequantized base rows (copies;
    `contexts` is not modified). topk_k/v [B, H, K, D], topk_pos [B, H, K] (-1: none)."""
    out = []
    for b, (k, v) in enumerate(contexts):
        k, v = k.clone(), v.clone()
        pos = topk_pos[b]
        use = _usable(pos, n_base[b])
        heads = torch.arange(pos.shape[0], device=pos.device)[:, None].expand_as(pos)
        k[pos[use], heads[use]] = topk_k[b][use].float()
        v[pos[use], heads[use]] = topk_v[b][use].float()
        out.append((k, v))
    return out


def output_rows(q: torch.Tensor, contexts: list[Context], sm_scale: float
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """q [B, Hq, D] over each request's context (with_topk's) -> ([B, Hq, D] in q's dtype, each row's
    attention_probs [Hq, T])."""
    out = torch.empty_like(q)  # head_dim == v_head_dim (backends/base.py _check_layer)
    probs = []
    for b, (k, v) in enumerate(contexts):
        p = attention_probs(q[b:b + 1], k, sm_scale)
        out[b] = weighted_values(p, v)[0].to(q.dtype)
        probs.append(p[:, 0])
    return out, probs


def recall(q: torch.Tensor, exact: list[Context], n_base: list[int], topk_pos: torch.Tensor,
           sm_scale: float) -> list[tuple[int, int]]:
    """Per request (hits, wanted): how much of the output row's exact top-k (its attention over each request's
    16-bit context K/V `exact`) the prefetched positions topk_pos [B, H, K] covered."""
    H, K = topk_pos.shape[1], topk_pos.shape[2]
    out = []
    for b, (k, _) in enumerate(exact):
        pos = topk_pos[b]
        use = _usable(pos, n_base[b])
        want = top_positions(attention_probs(q[b:b + 1], k, sm_scale)[:, 0], H, n_base[b], K)
        hits = sum(len(set(w[w >= 0].tolist()) & set(g[u].tolist())) for w, g, u in zip(want, pos, use))
        out.append((hits, int((want >= 0).sum())))
    return out


def speculative_rows(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, contexts: list[Context],
                     n_base: list[int], sm_scale: float, top_k: int,
                     follow: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D], own k/v [B, H, D] (appended after each request's context, not stored; the contexts are
    with_topk's in a two-lane step, as stored in the pre-decode) -> (out [B, Hq, D], top-k positions
    [B, H, top_k] over the packed base, -1 padded). follow: the real rows' attention_probs (output_rows), whose
    mass one position later joins the ranking (top_positions)."""
    B, H = q.shape[0], k_own.shape[1]
    out = torch.empty_like(q)
    pos = torch.full((B, H, top_k), -1, dtype=torch.int64, device=q.device)
    for b in range(B):
        k = torch.cat([contexts[b][0], k_own[b:b + 1].float()])
        v = torch.cat([contexts[b][1], v_own[b:b + 1].float()])
        p = attention_probs(q[b:b + 1], k, sm_scale)
        out[b] = weighted_values(p, v)[0].to(q.dtype)
        pos[b] = top_positions(p[:, 0], H, n_base[b], top_k, None if follow is None else follow[b])
    return out, pos
