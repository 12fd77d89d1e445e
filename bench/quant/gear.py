"""GEAR and GEAR-L over a whole [T, H, D] sequence, as the pool stores it: the served page format
(sgl_kvq/formats/gear/codec.py) on every complete page outside the fp16 window, KIVI's fp16 window and open page after.

    X ~= D + L (+ S) per page of G tokens and KV head
D is KIVI's page of the outlier-filled page, L a rank-r approximation of its residual, S (GEAR only) each row's
sparse fp16 outliers: keys per channel over the page's tokens, values per token over the channels.

Which variant where (GEAR paper, Kang et al. 2024): the accuracy tables report both GEAR (s = 2%) and GEAR-L (no
outliers); the system/throughput numbers come from GEAR-L on KIVI's kernels, since the official code only simulates
the sparse part. The official code counts outliers per token over all H * D entries (2 * int(s * H * D / 2)); here
a row is one KV head's channels, so every page and head has the same count and the layout stays static.
The fp16 window and open page are KIVI's (they play GEAR's streaming buffer), so gear vs kivi compares only what
GEAR adds.
"""

from __future__ import annotations

import torch

from sgl_kvq.quant.compressed import CompressedKV, check_kv
from sgl_kvq.formats.gear.codec import dequantize_gear_pages, outliers_per_row, pack_gear_pages
from bench.quant.kivi import quantized_len


def gear(k: torch.Tensor, v: torch.Tensor, *, bits: int = 2, group_size: int = 64, value_group: int = 64,
         residual: int = 64, rank: int = 2, iters: int = 3, outlier_ratio: float = 0.02,
         specache_one_bit: bool = True) -> CompressedKV:
    """GEAR; outlier_ratio=0 gives GEAR-L (see gear_l). Defaults are the served gear2's (sgl_kvq.config)."""
    T, H, D = check_kv(k, v)
    G = group_size
    n_q = quantized_len(T, G, residual)
    n = n_q // G
    base, corr = pack_gear_pages(k[:n_q].reshape(n, G, H, D), v[:n_q].reshape(n, G, H, D), bits,
                                 min(value_group, D), rank, iters, outliers_per_row(outlier_ratio, G),
                                 outliers_per_row(outlier_ratio, D), specache_one_bit=specache_one_bit)
    k_q, v_q = dequantize_gear_pages(base, corr, bits)
    stored = {"k.codes": base.k_codes, "k.scale": base.k_scale, "k.zero": base.k_zero,
              "v.codes": base.v_codes, "v.scale": base.v_scale, "v.zero": base.v_zero,
              "k.lowrank_u": corr.k_u, "k.lowrank_w": corr.k_w, "v.lowrank_u": corr.v_u, "v.lowrank_w": corr.v_w}
    if outlier_ratio > 0:
        stored.update({"k.outlier_val": corr.k_out_val, "k.outlier_idx": corr.k_out_idx,
                       "v.outlier_val": corr.v_out_val, "v.outlier_idx": corr.v_out_idx})
    stored["k.fp16"] = k[n_q:].to(torch.float16)
    stored["v.fp16"] = v[n_q:].to(torch.float16)
    kept = torch.zeros(T, H, dtype=torch.bool)
    kept[n_q:] = True
    return CompressedKV(torch.cat([k_q.reshape(n_q, H, D), stored["k.fp16"].float()]),
                        torch.cat([v_q.reshape(n_q, H, D), stored["v.fp16"].float()]), stored, kept)


def gear_l(k: torch.Tensor, v: torch.Tensor, **kw) -> CompressedKV:
    """GEAR-L: quantized backbone + low-rank residual, no sparse outliers."""
    return gear(k, v, outlier_ratio=0.0, **kw)
