"""KVQ_PREFILL=paged in one attention per request: what the page-by-page steps compute (sgl_kvq/metadata/forward.py),
for formats whose pages are KIVI's plain codes, scales and zeros (Format.plain_pages).

A paged extend's step for page P attends to everything before it as decode will read it: the pages of P's fp16
window (the `ring` pages ending at P, where the request's frames hold them) in fp16, every earlier page quantized,
its own page's tokens in fp16, causally. Run step by step, each step re-reads the whole context and the number of
steps grows with the extend: a cold 1,088-token prefill is 17 steps, each dequantizing the pages before it, in every
layer. The same result in one attention: every key position is present once quantized (the base pages, and the
quantized copies of the pages the request holds in fp16 or completes in this extend: a KIVI page's codes are a
function of its own tokens, so the copy is what the store will pack) and once in fp16 (frames and new tokens), and
query i's mask picks the copy its step would have read. The writes follow, step by step as before.

Its oracle is the step-by-step extend (tests/unit/test_paged_prefill.py: both equal decoding token by token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_kvq.attention_ref import visible_from
from sgl_kvq.formats.base import PageWrite
from sgl_kvq.formats.registry import of_extras
from sgl_kvq.plan import LayerKV, PagedPlan
from sgl_kvq.quant import kivi_page


def supports(fmt) -> bool:
    """Whether a format's pages can be re-quantized here (KIVI's plain pages: codes a function of the page alone)."""
    return fmt.plain_pages


def quantized_copies(fmt, kv: LayerKV, cfg, value_group: int, k: torch.Tensor, v: torch.Tensor):
    """Complete pages k, v [N, G, H, D] (the frames' dtype) -> [N, G, H, D] fp32 as the pool will read them once
    packed: the format's own pack, then the base's dequantizing read (Format.read_pages' arithmetic)."""
    packed, _ = fmt.pack(cfg, value_group, k, v, PageWrite(pages=torch.empty(0, dtype=torch.int64)), {})
    return kivi_page.dequantize_pages(packed, kv.bits)


def key_choice_mask(n: int, p: int, nb: int, n_quantized: int, ring: int, G: int, window: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For new tokens at positions p .. p + n - 1, with the quantized copies of positions 0 .. n_quantized - 1 and
    the fp16 rows of positions nb .. p + n - 1 as keys, in that order: -> (mask [n, n_quantized + p + n - nb] bool,
    the key rows' positions). Query i (page Pi) reads a position j <= i within its sliding window in fp16 where j has
    an fp16 row (j >= nb) in the window's pages (page >= Pi - ring + 1), else its quantized copy."""
    qpos = torch.arange(p, p + n, device=device)[:, None]
    win_page = qpos // G - ring + 1
    pos_q = torch.arange(n_quantized, device=device)
    pos_f = torch.arange(nb, p + n, device=device)
    pos = torch.cat([pos_q, pos_f])[None, :]
    fp16 = torch.cat([torch.zeros_like(pos_q, dtype=torch.bool), torch.ones_like(pos_f, dtype=torch.bool)])[None, :]
    in_window = (pos // G) >= win_page
    reads = torch.where(in_window & (pos >= nb), fp16, ~fp16)
    visible = (pos <= qpos) & (pos >= visible_from(qpos, window))
    return reads & visible, pos[0]


def extend_paged(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, qo_indptr: list[int], kv: LayerKV,
                 plan: PagedPlan, sm_scale: float, ring: int, cfg, value_group: int,
                 window: int = -1) -> torch.Tensor:
    """q [N, Hq, D], k_new/v_new [N, H, D]: request b's new tokens are rows qo_indptr[b]:qo_indptr[b+1], after the
    context `plan` gives it before the extend (its first step's plan) -> [N, Hq, Dv] in q's dtype, computed in fp32.
    ring: the fp16 window's pages (KVQConfig.ring_pages); a sliding `window` hides what lies before it."""
    G, H, D = kv.G, kv.ov_k.shape[2], kv.ov_k.shape[3]
    fmt = of_extras(kv.extras)
    out = torch.empty(q.shape[0], q.shape[1], v_new.shape[-1], dtype=q.dtype, device=q.device)
    for b in range(plan.batch_size):
        lo, hi = qo_indptr[b], qo_indptr[b + 1]
        n = hi - lo
        if n == 0:
            continue
        nb, no = plan.base_len(b, G), plan.overlay_len(b, G)
        p = nb + no
        pages = plan.kv_indices[plan.kv_indptr[b]:plan.kv_indptr[b + 1]].long()
        kq, vq = fmt.read_pages(kv, pages)
        kq, vq = kq.reshape(-1, H, D)[:nb], vq.reshape(-1, H, D)[:nb]
        frames = plan.ov_indices[plan.ov_indptr[b]:plan.ov_indptr[b + 1]].long()
        # positions nb .. p + n - 1 as the frames store them: the prefix's held window, then the new tokens
        raw_k = torch.cat([kv.ov_k[frames].reshape(-1, H, D)[:no], k_new[lo:hi].to(kv.ov_k.dtype)])
        raw_v = torch.cat([kv.ov_v[frames].reshape(-1, H, D)[:no], v_new[lo:hi].to(kv.ov_v.dtype)])
        done = (p + n) // G * G - nb  # of those, the tokens of pages complete by the end of the extend
        if done > 0:
            ck, cv = quantized_copies(fmt, kv, cfg, value_group, raw_k[:done].reshape(-1, G, H, D),
                                      raw_v[:done].reshape(-1, G, H, D))
            kq, vq = torch.cat([kq, ck.reshape(-1, H, D)]), torch.cat([vq, cv.reshape(-1, H, D)])
        fk, fv = fmt.read_overlay(raw_k, raw_v)
        mask, pos = key_choice_mask(n, p, nb, kq.shape[0], ring, G, window, q.device)
        keys, values = torch.cat([kq, fk]), torch.cat([vq, fv])
        if window >= 0:  # rows before the first query's window are never read
            keep = pos >= visible_from(p, window)
            mask, keys, values = mask[:, keep], keys[keep], values[keep]
        # [1, heads, tokens, D]: torch's CPU flash kernel takes 4-d inputs only (sgl_kvq/attention_extend.py)
        o = F.scaled_dot_product_attention(q[lo:hi].float().transpose(0, 1)[None], keys.transpose(0, 1)[None],
                                           values.transpose(0, 1)[None], attn_mask=mask, scale=sm_scale,
                                           enable_gqa=True)
        out[lo:hi] = o[0].transpose(0, 1)
    return out
