"""SpeCache's two decode lanes over the padded batch layout of sgl_kvq/attention_batched.py: the compute of
kvq_torch for the specache dtypes.

Same semantics as sgl_kvq/specache/attention.py (its oracle; tests/unit/test_specache_attention_batched.py, fp32 within
1e-5, top-k positions equal up to near-ties) without a Python loop over requests: the batch's context is built once
per layer as padded K, V [H, B, T, D] (attention_batched.context), the prefetched 16-bit top-k rows are written over
their positions in that copy, and both lanes of a request attend in one masked matmul: its real row's and its
speculative row's query heads side by side, [H, B, 2g, D] (GQA: query head i reads KV head i // g). The speculative
row's own K/V is one extra score column and one extra value term, never written into the context; the real rows see
that column as -inf. The next top-k is one torch.topk over the [H, B, T] mass masked to each request's packed base.
Under a sliding window (`window` W >= 0) each row is also masked to its window (the real row at the context's last
position T - 1 sees T - 1 - W .. T - 1, the speculative row at T sees T - W .. T: specache/attention.py) and the
top-k to the speculative row's.

Why: one layer, SmolLM2's geometry (H=3, Hq=9, D=64, G=64), B=8 requests of 1,024 tokens (960 packed + 64 fp16),
2 bits, top-64 with follow, fp32, one torch thread (the 2-core machine was running another benchmark; at two threads
its load made every number noise), median of 20: the per-request lanes (gather_context per request, with_topk,
output_rows, speculative_rows) 12.6 ms, these 4.2 ms, kivi's batched decode of the B real rows alone 2.7 ms; the
pre-decode 8.5 vs 3.3 ms. prepare (once per step, not per layer) 0.14 ms.
"""

from __future__ import annotations

import torch

from sgl_kvq import attention_batched
from sgl_kvq.attention_ref import visible_from
from sgl_kvq.padded import BatchedContext, Workspace
from sgl_kvq.plan import LayerKV


def with_topk(k: torch.Tensor, v: torch.Tensor, n_base: torch.Tensor, topk_k: torch.Tensor, topk_v: torch.Tensor,
              topk_pos: torch.Tensor) -> None:
    """The prefetched 16-bit rows written in place over their positions of the padded k, v [H, B, T, D]: row
    topk_k/v[b, h, j] [B, H, K, D] replaces position topk_pos[b, h, j] [B, H, K] of request b, KV head h when
    0 <= pos < n_base[b] (BatchedContext.base_len); -1 and positions past the base (the fp16 window, already exact)
    are ignored."""
    use = (topk_pos >= 0) & (topk_pos < n_base[:, None, None])
    b, h, j = use.nonzero(as_tuple=True)
    t = topk_pos[b, h, j]
    k[h, b, t] = topk_k[b, h, j].float()
    v[h, b, t] = topk_v[b, h, j].float()


def _heads(x: torch.Tensor, H: int, lanes: int) -> torch.Tensor:
    """x [lanes * B, Hq, D] (lane-major rows) -> [H, B, lanes * g, D] fp32: request b's query heads of every lane
    side by side, lane l's head i at l * g + i % g of KV head i // g."""
    LB, Hq, D = x.shape
    B, g = LB // lanes, Hq // H
    return x.float().view(lanes, B, H, g, D).permute(2, 1, 0, 3, 4).reshape(H, B, lanes * g, D)


def _rows(o: torch.Tensor, lanes: int, dtype: torch.dtype) -> torch.Tensor:
    """_heads' inverse: o [H, B, lanes * g, D] -> [lanes * B, Hq, D] in dtype."""
    H, B, lg, D = o.shape
    g = lg // lanes
    return o.view(H, B, lanes, g, D).permute(2, 1, 0, 3, 4).reshape(lanes * B, H * g, D).to(dtype)


def top_positions(mass: torch.Tensor, n_base: torch.Tensor, top_k: int,
                  first: torch.Tensor | None = None) -> torch.Tensor:
    """mass [H, B, T] (the ranking of each request's positions, any value past its base) -> [B, H, top_k] int64:
    per request and KV head the top_k base positions t < n_base[b] by mass, descending, -1 padded where the base
    has fewer than top_k positions. first [B] (a sliding window): only positions t >= first[b] are candidates."""
    H, B, T = mass.shape
    out = torch.full((B, H, top_k), -1, dtype=torch.int64, device=mass.device)
    n = min(top_k, T)
    if n:
        t = torch.arange(T, device=mass.device)
        base = t < n_base[:, None]  # [B, T]
        count = n_base
        if first is not None:
            base &= t >= first[:, None]
            count = (n_base - first).clamp(min=0)
        idx = mass.masked_fill(~base, float("-inf")).topk(n, dim=-1).indices  # [H, B, n]
        rank = torch.arange(n, device=mass.device)
        out[:, :, :n] = idx.masked_fill_(rank >= count[:, None], -1).transpose(0, 1)
    return out


def _window_from(ctx: BatchedContext, query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[B, T] bool: the padded positions a row at query_pos [B] sees within `window` (>= 0)."""
    t = torch.arange(ctx.valid.shape[1], device=ctx.valid.device)
    return ctx.valid & (t >= visible_from(query_pos, window)[:, None])


def _attend(qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, sm_scale: float,
            own_k: torch.Tensor, own_v: torch.Tensor, spec: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """qg [H, B, r, D] over the padded k, v [H, B, T, D] (valid [B, T], or [B, r, T] per query row); the query rows
    `spec` of each request also see its own key own_k [H, B, D] (value own_v) after its context. -> (out
    [H, B, r, D] fp32, probabilities [H, B, r, T + 1], the last column the own key's)."""
    s = torch.matmul(qg, k.transpose(-1, -2)) * sm_scale  # [H, B, r, T]
    s.masked_fill_(~(valid[None, :, None, :] if valid.dim() == 2 else valid[None]), float("-inf"))
    own = torch.full(s.shape[:-1] + (1,), float("-inf"), device=s.device)
    own[:, :, spec, 0] = (qg[:, :, spec] * own_k[:, :, None, :]).sum(-1) * sm_scale
    p = torch.softmax(torch.cat([s, own], dim=-1), dim=-1)
    T = k.shape[2]
    out = torch.matmul(p[..., :T], v)
    out[:, :, spec] += p[:, :, spec, T:] * own_v[:, :, None, :]
    return out, p


def two_lane(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, kv: LayerKV, ctx: BatchedContext,
             sm_scale: float, top_k: int, topk_k: torch.Tensor, topk_v: torch.Tensor, topk_pos: torch.Tensor,
             follow: bool, ws: Workspace | None = None, window: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """A two-lane step: q [2B, Hq, D], rows [0, B) the real tokens (already in the pool), rows [B, 2B) their
    speculative tokens with own K/V k_own, v_own [B, H, D] (not stored). Both read the context with the prefetched
    rows topk_k/v [B, H, K, D] at topk_pos [B, H, K] (with_topk); -> (out [2B, Hq, D] in q's dtype, the next
    top-k positions [B, H, top_k]: the speculative rows' attention mass per KV head over the base, plus with
    follow the real rows' mass one position earlier). window: each row within its sliding window (module doc)."""
    H = kv.ov_k.shape[2]
    k, v = attention_batched.context(kv, ctx, ws)
    n_base = ctx.base_len
    with_topk(k, v, n_base, topk_k, topk_v, topk_pos)
    g = q.shape[1] // H
    valid, first = ctx.valid, None
    if window >= 0:  # the real rows at length - 1, the speculative rows one later
        first = visible_from(ctx.length, window)
        B, T = valid.shape
        valid = torch.cat([_window_from(ctx, ctx.length - 1, window)[:, None].expand(B, g, T),
                           _window_from(ctx, ctx.length, window)[:, None].expand(B, g, T)], dim=1)
    out, p = _attend(_heads(q, H, 2), k, v, valid, sm_scale, k_own.float().transpose(0, 1),
                     v_own.float().transpose(0, 1), slice(g, 2 * g))
    T = k.shape[2]
    mass = p[:, :, g:, :T].sum(2)  # [H, B, T]
    if follow:
        mass[:, :, 1:] += p[:, :, :g, :T - 1].sum(2)  # read at t - 1 by the real row: t is read next
    return _rows(out, 2, q.dtype), top_positions(mass, n_base, top_k, first)


def predecode(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, kv: LayerKV, ctx: BatchedContext,
              sm_scale: float, top_k: int, ws: Workspace | None = None,
              window: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-decode step: q [B, Hq, D] the real tokens as speculative rows (own K/V k_own, v_own [B, H, D], not
    stored; at position length, after the context as stored, nothing prefetched yet; within `window`) -> (out
    [B, Hq, D] in q's dtype, the first top-k positions [B, H, top_k] by their own attention mass alone)."""
    H = kv.ov_k.shape[2]
    k, v = attention_batched.context(kv, ctx, ws)
    g = q.shape[1] // H
    valid, first = ctx.valid, None
    if window >= 0:
        valid, first = _window_from(ctx, ctx.length, window), visible_from(ctx.length, window)
    out, p = _attend(_heads(q, H, 1), k, v, valid, sm_scale, k_own.float().transpose(0, 1),
                     v_own.float().transpose(0, 1), slice(0, g))
    return _rows(out, 1, q.dtype), top_positions(p[..., :k.shape[2]].sum(2), ctx.base_len, top_k, first)
