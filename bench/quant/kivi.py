"""Sequence-level KIVI on K/V [T, H, D], built on the page format of kivi_page (the pool's base).

Split of a length-T sequence, as the pool holds it:
    [0, n_q)   complete pages outside the window: quantized (keys per channel over each page of G tokens,
               values per token in groups of VG channels), n_q = G * max(0, T // G - R // G)
    [n_q, T)   fp16: the R // G most recent complete pages ("window pages") plus the open page (T % G tokens)
So R must be a multiple of G, and the fp16 tokens number R + T % G once T >= R + G (all T before that). This is
the pool's overlay: "open page + R/G window pages" (KVQConfig.ring_pages).
"""

from __future__ import annotations

import torch

from sgl_kvq.quant import kivi_page
from sgl_kvq.quant.compressed import CompressedKV, check_kv, fp16


def quantized_len(T: int, group_size: int, residual: int) -> int:
    if residual % group_size:
        raise ValueError(f"residual window R={residual} must be a multiple of G={group_size}")
    return group_size * max(0, T // group_size - residual // group_size)


def quantize_span(k: torch.Tensor, v: torch.Tensor, bits: int, group_size: int, value_group: int, *,
                  specache_one_bit: bool = True) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """k, v [n, H, D] with n a multiple of G -> (k_hat, v_hat, stored) of the KIVI pages."""
    n, H, D = k.shape
    vg = min(value_group, D)
    pages = kivi_page.pack_pages(k.reshape(n // group_size, group_size, H, D),
                                 v.reshape(n // group_size, group_size, H, D), bits, vg,
                                 specache_one_bit=specache_one_bit)
    k_hat, v_hat = kivi_page.dequantize_pages(pages, bits)
    stored = {"k.codes": pages.k_codes, "k.scale": pages.k_scale, "k.zero": pages.k_zero,
              "v.codes": pages.v_codes, "v.scale": pages.v_scale, "v.zero": pages.v_zero}
    return k_hat.reshape(n, H, D), v_hat.reshape(n, H, D), stored


def kivi(k: torch.Tensor, v: torch.Tensor, *, bits: int = 2, group_size: int = 64, value_group: int = 64,
         residual: int = 64, specache_one_bit: bool = True) -> CompressedKV:
    """KIVI at `bits` in {1, 2, 3, 4}. 1-bit uses SpeCache's zero/scale unless specache_one_bit=False (plain
    min/max)."""
    T, H, D = check_kv(k, v)
    n_q = quantized_len(T, group_size, residual)
    k_q, v_q, stored = quantize_span(k[:n_q], v[:n_q], bits, group_size, value_group,
                                     specache_one_bit=specache_one_bit)
    stored["k.fp16"] = k[n_q:].to(torch.float16)
    stored["v.fp16"] = v[n_q:].to(torch.float16)
    kept = torch.zeros(T, H, dtype=torch.bool)
    kept[n_q:] = True
    return CompressedKV(torch.cat([k_q, stored["k.fp16"].float()]), torch.cat([v_q, stored["v.fp16"].float()]),
                        stored, kept)


def fp16_baseline(k: torch.Tensor, v: torch.Tensor) -> CompressedKV:
    """The reference every format is compared against: K/V as an fp16 cache stores them."""
    T, H, _ = check_kv(k, v)
    stored = {"k.fp16": k.to(torch.float16), "v.fp16": v.to(torch.float16)}
    return CompressedKV(fp16(k), fp16(v), stored, torch.ones(T, H, dtype=torch.bool))
