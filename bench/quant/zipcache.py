"""ZipCache over a whole [T, H, D] sequence, as the pool stores it: the served zipcache2 page format
(sgl_kvq/formats/zipcache/codec.py) on every complete page outside the fp16 window, KIVI's fp16 window and open page
after.

Per page of G tokens and KV head: the NS = round(ratio * G) tokens with the highest normalized attention score from
the page's own queries (each query attends causally within its page) are kept at 4 bit, the rest at 2 bit (KIVI's
page with the salient rows filled, so the key scales span the non-salient class); values channel-separable
token-wise (V / c quantized per token, c = sqrt(max |V|) per page and channel).

How this differs from the paper (ZipCache, He et al. 2024): the paper decides saliency once at prefill over the
whole prompt, from probe queries (5% most recent + 5% random), each attending over the whole context, and picks the
top share of all tokens. Here every query of a page is a probe and attends only within its page, and each page keeps
a fixed share: a page is then compressed from its own contents and queries alone, identically in an extend and token
by token in decode and for every request that shares it through the radix tree, and the layout stays static.
The fp16 window and open page are KIVI's, so zipcache vs kivi compares only the mixed precision and the formats.
"""

from __future__ import annotations

import torch

from sgl_kvq.quant.compressed import CompressedKV, check_kv
from bench.quant.kivi import quantized_len
from sgl_kvq.formats.zipcache.codec import (dequantize_zipcache_pages, normalize, pack_zipcache_pages,
                                         received_attention, salient_count, select_salient)


def page_scores(q: torch.Tensor, k: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [N, G, Hq, D], k [N, G, H, D] complete pages -> [N, G, H] normalized score from every query of the page."""
    present = torch.ones(q.shape[:2], dtype=torch.bool, device=q.device)
    return normalize(received_attention(q, present, k, sm_scale), q.shape[2] // k.shape[2])


def zipcache(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, sm_scale: float | None = None, *,
             salient_ratio: float = 0.4, bits: int = 2, group_size: int = 64, value_group: int = 64,
             residual: int = 64, specache_one_bit: bool = True) -> CompressedKV:
    """q [T, Hq, D]: the real queries (post-RoPE). Defaults are the served zipcache2's (sgl_kvq.config)."""
    T, H, D = check_kv(k, v)
    G = group_size
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    n_q = quantized_len(T, G, residual)
    n = n_q // G
    kp, vp = k[:n_q].reshape(n, G, H, D), v[:n_q].reshape(n, G, H, D)
    idx = select_salient(page_scores(q[:n_q].reshape(n, G, *q.shape[1:]), kp, sm_scale),
                         salient_count(salient_ratio, G))
    base, sal = pack_zipcache_pages(kp, vp, idx, bits, min(value_group, D), specache_one_bit=specache_one_bit)
    k_q, v_q = dequantize_zipcache_pages(base, sal, bits)
    stored = {"k.codes": base.k_codes, "k.scale": base.k_scale, "k.zero": base.k_zero,
              "v.codes": base.v_codes, "v.scale": base.v_scale, "v.zero": base.v_zero,
              "v.chan_scale": sal.v_chan, "k.salient_idx": sal.s_idx,
              "k.salient_codes": sal.s_k_codes, "k.salient_scale": sal.s_k_scale, "k.salient_zero": sal.s_k_zero,
              "v.salient_codes": sal.s_v_codes, "v.salient_scale": sal.s_v_scale, "v.salient_zero": sal.s_v_zero,
              "k.fp16": k[n_q:].to(torch.float16), "v.fp16": v[n_q:].to(torch.float16)}
    kept = torch.zeros(T, H, dtype=torch.bool)
    kept[n_q:] = True
    if n:
        kept[:n_q].view(n, G, H).scatter_(1, idx.transpose(1, 2), True)
    return CompressedKV(torch.cat([k_q.reshape(n_q, H, D), stored["k.fp16"].float()]),
                        torch.cat([v_q.reshape(n_q, H, D), stored["v.fp16"].float()]), stored, kept)
