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

A sliding-window layer (`window` W >= 0, attention_ref: a query at position i sees i - W .. i) hides what lies before
each row's window from its attention and from the top-k: the output row sits at the context's last position T - 1
and sees T - 1 - W .. T - 1, the speculative row (its own key one position later, at T) sees T - W .. T, and the
top-k is chosen among base positions >= T - W only, which is exactly the window of the next step's output row (the
row that reads it). The real row's follow mass at t - 1 >= T - 1 - W lands at t >= T - W, inside it too.
"""

from __future__ import annotations

import torch

from sgl_kvq.attention_ref import attention_probs, visible_from, weighted_values

Context = tuple[torch.Tensor, torch.Tensor]


def top_positions(p: torch.Tensor, num_kv_heads: int, n_base: int, k: int,
                  follow: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
    """p [Hq, T] (one query's attention_probs) -> top-k positions first <= t < n_base per KV head by attention mass
    summed over its query heads: [H, k], -1 padded. follow [Hq, T'] (the real row's attention_probs, T' >= n_base):
    its mass one position later is added, so the row after each position the real token read is a candidate too.
    first: the first position the ranking row sees (a sliding window; 0 for none): nothing before it is chosen."""
    out = torch.full((num_kv_heads, k), -1, dtype=torch.int64, device=p.device)
    n = min(k, max(n_base - first, 0))
    if n:
        mass = p[:, :n_base].reshape(num_kv_heads, -1, n_base).sum(1)
        if follow is not None and n_base > 1:
            mass[:, 1:] += follow[:, :n_base - 1].reshape(num_kv_heads, -1, n_base - 1).sum(1)
        out[:, :n] = mass[:, first:].topk(n, dim=-1).indices + first
    return out


def _seen_from(T: int, first: int, device) -> torch.Tensor | None:
    """The mask over T keys of a row whose window starts at `first` (None: it sees them all)."""
    return torch.arange(T, device=device) >= first if first > 0 else None


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


def output_rows(q: torch.Tensor, contexts: list[Context], sm_scale: float, window: int = -1
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """q [B, Hq, D] over each request's context (with_topk's; the row at its last position, within `window`) ->
    ([B, Hq, D] in q's dtype, each row's attention_probs [Hq, T], 0 before its window)."""
    out = torch.empty_like(q)  # head_dim == v_head_dim (backends/base.py _check_layer)
    probs = []
    for b, (k, v) in enumerate(contexts):
        T = k.shape[0]
        p = attention_probs(q[b:b + 1], k, sm_scale, _seen_from(T, visible_from(T - 1, window), k.device))
        out[b] = weighted_values(p, v)[0].to(q.dtype)
        probs.append(p[:, 0])
    return out, probs


def recall(q: torch.Tensor, exact: list[Context], n_base: list[int], topk_pos: torch.Tensor,
           sm_scale: float, window: int = -1) -> list[tuple[int, int]]:
    """Per request (hits, wanted): how much of the output row's exact top-k (its attention over each request's
    16-bit context K/V `exact`, within `window`) the prefetched positions topk_pos [B, H, K] covered."""
    H, K = topk_pos.shape[1], topk_pos.shape[2]
    out = []
    for b, (k, _) in enumerate(exact):
        pos = topk_pos[b]
        use = _usable(pos, n_base[b])
        T = k.shape[0]
        first = visible_from(T - 1, window)
        p = attention_probs(q[b:b + 1], k, sm_scale, _seen_from(T, first, k.device))[:, 0]
        want = top_positions(p, H, n_base[b], K, first=first)
        hits = sum(len(set(w[w >= 0].tolist()) & set(g[u].tolist())) for w, g, u in zip(want, pos, use))
        out.append((hits, int((want >= 0).sum())))
    return out


def speculative_rows(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, contexts: list[Context],
                     n_base: list[int], sm_scale: float, top_k: int,
                     follow: list[torch.Tensor] | None = None, window: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hq, D], own k/v [B, H, D] (appended after each request's context, not stored; the contexts are
    with_topk's in a two-lane step, as stored in the pre-decode) -> (out [B, Hq, D], top-k positions
    [B, H, top_k] over the packed base, -1 padded). follow: the real rows' attention_probs (output_rows), whose
    mass one position later joins the ranking (top_positions). window: each row (at position T, its own key's, after
    a context of T) sees T - window .. T, and its top-k is chosen there."""
    B, H = q.shape[0], k_own.shape[1]
    out = torch.empty_like(q)
    pos = torch.full((B, H, top_k), -1, dtype=torch.int64, device=q.device)
    for b in range(B):
        k = torch.cat([contexts[b][0], k_own[b:b + 1].float()])
        v = torch.cat([contexts[b][1], v_own[b:b + 1].float()])
        T = k.shape[0] - 1
        first = visible_from(T, window)
        p = attention_probs(q[b:b + 1], k, sm_scale, _seen_from(T + 1, first, k.device))
        out[b] = weighted_values(p, v)[0].to(q.dtype)
        pos[b] = top_positions(p[:, 0], H, n_base[b], top_k, None if follow is None else follow[b], first)
    return out, pos
