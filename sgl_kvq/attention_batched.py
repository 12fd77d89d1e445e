"""Batched decode attention over the packed paged base plus the fp16 overlay: the compute of `kvq_torch` decode.

Same result as attention_ref.ref_decode (its oracle; tests/unit/test_attention_batched.py, fp32 within 1e-5) without a
Python loop over requests. A per-batch index (`BatchedContext`, built once, reused by every layer) places each
request's context in a padded, head-major layout [H, B, T, D] (T: the longest context in whole pages); per layer
the batch's base pages are unpacked straight into that layout by one table lookup (only the pages the batch
references, never the pool), dequantized in place, the overlay tokens copied over their positions, and one masked
attention runs over the batch, GQA by reshaping the query heads (no repeat_interleave).

Why this shape (SmolLM2 geometry, B=8, 1k-token contexts, one CPU thread): the per-request reference spends most of
its time in small-op overhead and repeat_interleave; gathering rows into a token-major table and padding it after
doubled the bytes moved (einsum copied the padded [B, T, H, D] into bmm's layout), so the lookup writes the final
layout directly and the matmuls read it as is.
"""

from __future__ import annotations

import torch

from sgl_kvq.attention_ref import visible_from
from sgl_kvq.formats.registry import of_extras
from sgl_kvq.padded import BatchedContext, Workspace, frame_rows
from sgl_kvq.plan import LayerKV


def context(kv: LayerKV, ctx: BatchedContext, ws: Workspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's keys and values in the padded layout, k, v [H, B, T, D] fp32: base tokens read as the format
    reads them (PageCodec.read_padded), overlay tokens as it reads those (PageCodec.read_overlay), zeros at padding; in
    ws's buffers when given (valid until the next call)."""
    G, H, D = kv.G, kv.ov_k.shape[2], kv.ov_k.shape[3]
    B, units = ctx.pages.shape
    codec = of_extras(kv.extras).codec
    k, v = codec.read_padded(kv, ctx, ws)
    if ctx.ov_dst.numel():
        k_ov, v_ov = codec.read_overlay(frame_rows(kv.ov_k, ctx.ov_head_rows), frame_rows(kv.ov_v, ctx.ov_head_rows))
        k.index_copy_(1, ctx.ov_dst, k_ov)
        v.index_copy_(1, ctx.ov_dst, v_ov)
    return k.view(H, B, units * G, D), v.view(H, B, units * G, D)


def visible(ctx: BatchedContext, window: int) -> torch.Tensor:
    """[B, T] bool: the padded positions each request's query sees (its context; the last window + 1 tokens of it
    under a sliding window, attention_ref)."""
    if window < 0:
        return ctx.valid
    t = torch.arange(ctx.valid.shape[1], device=ctx.valid.device)[None, :]
    return ctx.valid & (t >= visible_from(ctx.length - 1, window)[:, None])


def decode(q: torch.Tensor, kv: LayerKV, ctx: BatchedContext, sm_scale: float,
           ws: Workspace | None = None, window: int = -1) -> torch.Tensor:
    """q [B, Hq, D]: one query per request over its context (within `window`) -> [B, Hq, D] in q's dtype."""
    B, Hq, D = q.shape
    H = kv.ov_k.shape[2]
    k, v = context(kv, ctx, ws)
    qg = q.float().view(B, H, Hq // H, D).transpose(0, 1)  # [H, B, g, D]: query head i reads KV head i // g
    s = torch.matmul(qg, k.transpose(-1, -2)) * sm_scale  # [H, B, g, T]
    s.masked_fill_(~visible(ctx, window)[None, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v).transpose(0, 1).reshape(B, Hq, D).to(q.dtype)
